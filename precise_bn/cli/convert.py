"""``precise-bn convert``: Caffe2 ``.pkl`` to and from PyTorch ``.pt`` / ``.safetensors``; a name
the rules do not map fails unless kept or dropped on request (docs/caffe2.md)."""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from ..caffe2.checkpoint import read_caffe2_pickle
from ..caffe2.names import ConversionReport, caffe2_to_torch
from ..checkpoint.formats import check_key, detect_format, format_of, load_checkpoint, save_state_dict
from ..checkpoint.paths import check_output
from ..checkpoint.state import wrapper_prefix
from ..errors import CheckpointError, ConfigError, Fix
from .failures import as_flag
from .inspect_cmd import rules_of


def convert_checkpoint(input: str, output: str, *, rules: Any = None, unmapped: str = "error",
                       strip_prefix: str = "", key: Optional[str] = None, trust: bool = False,
                       break_hardlinks: bool = False, overwrite: bool = False) -> ConversionReport:
    """Convert ``input`` to ``output`` (formats from the suffixes), atomically; return what became of
    every tensor. ``rules`` map names (default: the model-zoo ResNet's); ``unmapped`` is
    ``"error"`` (raise before writing), ``"keep"`` or ``"drop"``; ``strip_prefix`` leaves every
    PyTorch key; the other arguments are ``recompute_checkpoint``'s."""
    input, output = os.fspath(input), os.fspath(output)
    check_output(input, output, in_place=False, break_hardlinks=break_hardlinks, overwrite=overwrite)
    fmt_in, fmt_out = detect_format(input), detect_format(output)
    if fmt_in == fmt_out:
        raise ConfigError("convert: {} and {} are both {} files; give OUT another extension (.pt, .safetensors, "
                          ".pkl)".format(input, output, fmt_in))
    check_key(input, format_of(input), key)
    if fmt_in == "caffe2":
        state, report = caffe2_to_torch(read_caffe2_pickle(input)[1], rules, source=input, unmapped=unmapped)
    else:
        state = load_checkpoint(input, key=key, trust=trust).state_dict
        report = ConversionReport(mapped={name: name for name in state})
    if strip_prefix and not all(k.startswith(strip_prefix) for k in state):
        raise CheckpointError("{}: not every key starts with the prefix to strip, {!r}".format(input, strip_prefix))
    state = {k[len(strip_prefix):]: v for k, v in state.items()}
    report.mapped = {source: name[len(strip_prefix):] for source, name in report.mapped.items()}
    try:
        written = save_state_dict(state, output, fmt_out, rules, unmapped)
    except CheckpointError as exc:
        leftover = wrapper_prefix(state)
        if not leftover:
            raise
        raise CheckpointError(exc.message, *exc.fixes, _strip(strip_prefix + leftover)) from exc
    return written if written is not None else report


def _strip(prefix: str) -> Fix:
    return Fix("strip_prefix", prefix, "(every key starts with {!r}, the prefix a wrapper adds)".format(prefix))


def run(args: argparse.Namespace) -> None:
    """``precise-bn convert ARGS``."""
    unmapped = "keep" if args.keep_unmapped else "drop" if args.drop_unmapped else "error"
    report = convert_checkpoint(args.input, args.output, rules=rules_of(args), unmapped=unmapped,
                                strip_prefix=args.strip_prefix, key=args.key, trust=args.trust_checkpoint,
                                break_hardlinks=args.break_hardlinks, overwrite=args.overwrite)
    print("wrote {} ({} tensors, {} -> {})".format(args.output, len(report.mapped), detect_format(args.input),
                                                    detect_format(args.output)))
    for title, names in (("kept under their own names", report.kept), ("dropped (--drop-unmapped)", report.dropped),
                         ("left out, not model state", report.skipped)):
        if names:
            print("  {} {}: {}".format(len(names), title, ", ".join(names)))
    leftover = wrapper_prefix(report.mapped.values()) if detect_format(args.output) != "caffe2" else ""
    if leftover:
        print("  hint: pass {} {}".format(as_flag(_strip(args.strip_prefix + leftover)), _strip(leftover).why))
