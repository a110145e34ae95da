"""``precise-bn convert``: Caffe2 ``.pkl`` to and from PyTorch ``.pt`` / ``.safetensors``."""
from __future__ import annotations

import argparse

from ..checkpoint.formats import check_output, detect_format, load_checkpoint, save_state_dict
from ..errors import CheckpointError, ConfigError
from .inspect import rules_of

def run(args: argparse.Namespace) -> None:
    """``precise-bn convert ARGS``."""
    check_output(args.input, args.output, in_place=False)
    fmt_in, fmt_out = detect_format(args.input), detect_format(args.output)
    if fmt_in == fmt_out:
        raise ConfigError(
            "convert: {} and {} are both {} files; give OUT another extension (.pt, .safetensors, .pkl)".format(
                args.input, args.output, fmt_in
            )
        )
    rules = rules_of(args)
    ckpt = load_checkpoint(args.input, key=args.key, trust=args.trust_checkpoint, rules=rules)
    strip = args.strip_prefix
    if strip and not all(k.startswith(strip) for k in ckpt.state_dict):
        raise CheckpointError("{}: not every key starts with --strip-prefix {!r}".format(args.input, strip))
    state = {k[len(strip):]: v for k, v in ckpt.state_dict.items()}
    save_state_dict(state, args.output, fmt_out, rules)
    print("wrote {} ({} tensors, {} -> {})".format(args.output, len(state), fmt_in, fmt_out))
