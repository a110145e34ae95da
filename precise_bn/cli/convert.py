"""``precise-bn convert``: Caffe2 ``.pkl`` to and from PyTorch ``.pt`` / ``.safetensors``.

A conversion never leaves a tensor out without being asked: a name the rules do not map fails
the command (exit 1, names listed) unless ``--keep-unmapped`` (written under its own name) or
``--drop-unmapped`` is given; :func:`convert_checkpoint` is the same in Python. Blobs that are
not model state by name (optimizer state, counters, saved batch stats) are left out and listed.
"""
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
    """Convert ``input`` to ``output`` (formats from the names: ``.pkl`` Caffe2, ``.safetensors``,
    else ``torch.save``), atomically, and return what became of every tensor.

    Args:
        rules: Caffe2 <-> module name rules (see :func:`precise_bn.caffe2.names.caffe2_to_torch`);
            default: the model-zoo ResNet names.
        unmapped: names the rules do not map: ``"error"`` raises CheckpointError listing them
            before anything is written, ``"keep"`` writes them under their own names, ``"drop"``
            leaves them out.
        strip_prefix: removed from every PyTorch key (all must start with it).
        key, trust: where the state dict sits in a ``torch.save`` file, and whether it may run
            code while loading (see :func:`precise_bn.checkpoint.formats.load_checkpoint`).
        overwrite: replace an ``output`` that exists; refused by default.
        break_hardlinks: replace an ``output`` that has other hard links (they keep the old
            content); refused by default.
    """
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
