"""The ``precise-bn`` command line: its sub-commands and arguments."""
from __future__ import annotations

import argparse
import json
import re
from typing import Any, Callable, Dict, List, Optional, Sequence

from .._version import __version__
from ..data import DEFAULT_ITERS
from ..errors import ConfigError
from ..options import DEFAULT_TIMEOUT, Options, option_help
from ..staleness import DEFAULT_ALPHA, DEFAULT_TOLERANCE, Rule
from .data_specs import CROP_FRACTION, check_data_spec
from .demo import DEFAULT_STEPS
from .specs import check_model_spec, check_object_spec


def _number(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)``, refused with "expected ``expected``" unless ``ok``."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError("expected {}, got {!r}".format(expected, text))
        if not ok(value):
            raise argparse.ArgumentTypeError("expected {}, got {}".format(expected, text))
        return value
    return parse


_positive_int = _number(int, lambda v: v > 0, "a positive integer")
_positive_float = _number(float, lambda v: v > 0, "a positive number")
_fraction = _number(float, lambda v: 0 < v < 1, "a number between 0 and 1, such as 0.01")


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a ``%`` in a help text is a percent sign ("95% of channels"), not a format
    code: argparse expands help with ``%``, so one stray sign crashes ``--help``. Only
    ``%(name)s``-style references (``%(default)g``) are expanded."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = super()._get_help_string(action)
        return None if text is None else re.sub(r"%(?!\(\w+\)[a-z])", "%%", text)


class _Parser(argparse.ArgumentParser):
    """Every parser of the command, sub-commands' included (argparse makes them of the main
    parser's class), formats its help with :class:`_HelpFormatter`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("not valid JSON ({}): {!r}".format(exc, text))
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object such as '{{\"depth\": 18}}', got {!r}".format(text))
    return value


def _add_loading(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", help="where the state dict sits in a dict checkpoint (a/b when nested)")
    p.add_argument(
        "--trust-checkpoint", action="store_true",
        help="allow the file to run code while loading (only for files you trust)",
    )
    p.add_argument(
        "--caffe2-rules", metavar="MODULE:NAME",
        help="layer-name rules from the input's names to the output's (Caffe2 -> module names "
        "when reading a .pkl, module -> Caffe2 names when converting to one): a list of "
        "(regex, replacement) or a function (default: the model-zoo ResNet names)",
    )


def _add_writing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace output files that exist already (refused by default: they may hold work)")
    p.add_argument("--break-hardlinks", action="store_true",
                   help="replace an output file that has other hard links (the other names keep the old "
                   "content); refused by default")


DATA_HELP = (
    "package.module:callable (returns an iterable of batches), imagefolder:DIR or npz:FILE[:KEY]. "
    "imagefolder: reads DIR/CLASS/IMAGE files, or the images directly in DIR when it has no subfolder; "
    "each image is resized to size/{:g} on its shorter side, "
    "centre-cropped to size (224; --data-kwargs '{{\"size\": 160}}') and normalised with ImageNet's mean and "
    "std: no random transform, so a rerun reads the same pixels".format(CROP_FRACTION)
)
FORWARD_HELP = (
    "package.module:callable called as f(model, batch) for every batch. Default: a tensor -> model(batch); "
    "(input, target, ...) -> model(batch[0]); {'input': x, ...} -> model(x); anything else -> model(batch)"
)


def _add_data(rec: argparse.ArgumentParser) -> None:
    rec.add_argument("--data", required=True, help=DATA_HELP)
    rec.add_argument("--data-kwargs", type=_json_object, default={}, metavar="JSON")
    rec.add_argument("--batch-size", type=_positive_int, help="for the built-in data specs (default 32)")
    rec.add_argument("--seed", type=int, help="shuffles the built-in data and seeds --augment (default 0); "
                     "passed as seed= to a data factory that takes it")
    rec.add_argument("--augment", action="store_true",
                     help="imagefolder: the training transforms instead: a random resized crop of size "
                     "(scale 0.08-1) and a horizontal flip, drawn for each image from --seed and its index, "
                     "so a rerun still reads the same pixels")
    calling = rec.add_mutually_exclusive_group()
    calling.add_argument("--forward-fn", metavar="MODULE:CALLABLE", help=FORWARD_HELP)
    calling.add_argument("--input-key", metavar="NAME", help="batches are dicts whose input is batch[NAME]: "
                         "model(batch[NAME])")


def _add_pass(rec: argparse.ArgumentParser) -> None:
    """What ``recompute`` and ``check`` both take: the checkpoint, the model, the data, how to read it."""
    rec.add_argument("checkpoint", help=".pt/.pth/.ckpt (PyTorch, Lightning), .safetensors or Caffe2 .pkl")
    rec.add_argument("--model", required=True, help="package.module:callable, torchvision:NAME or timm:NAME")
    rec.add_argument("--model-kwargs", type=_json_object, default={}, metavar="JSON")
    _add_data(rec)
    budget = rec.add_mutually_exclusive_group()
    budget.add_argument("--num-batches", "--num-iters", dest="num_batches", type=_positive_int,
                        help=option_help("num_batches") + " (default here: {} when neither budget nor --rtol is "
                        "given)".format(DEFAULT_ITERS))
    budget.add_argument("--num-samples", type=_positive_int, help=option_help("num_samples"))
    rec.add_argument("--device", help=option_help("device") + ": cpu, cuda, cuda:1, ... (default cpu)")
    rec.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)  # retired: warns, changes nothing
    rec.add_argument("--rtol", type=_fraction, help=option_help("rtol"))
    rec.add_argument("--min-batches", type=_positive_int, help=option_help("min_batches"))
    rec.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                     help=option_help("timeout") + ", under torchrun (default %(default)g)")
    rec.add_argument("--prefix", help="the model's key prefix in the state dict (default: found by matching)")


def _add_recompute(sub: Any, common: argparse.ArgumentParser) -> None:
    rec = sub.add_parser("recompute", parents=[common], help="recalibrate a checkpoint's BN stats on training data")
    _add_pass(rec)
    rec.add_argument("--prior", type=float, default=0.0, metavar="N",
                     help=option_help("prior") + " (the checkpoint's running stats are the source)")
    where = rec.add_mutually_exclusive_group()
    where.add_argument("--output", help="file to write (default: NAME.precise_bn.EXT next to the input)")
    where.add_argument("--in-place", action="store_true",
                       help="replace the input file (atomically; through a symbolic link, its target)")
    rec.add_argument("--report", metavar="FILE.json", help="write the per-layer drift as JSON")
    _add_writing(rec)
    _add_loading(rec)
    rec.set_defaults(command_parser=rec)


def _add_check(sub: Any, common: argparse.ArgumentParser) -> None:
    chk = sub.add_parser("check", parents=[common],
                         help="exit 1 when a checkpoint's BN stats do not fit the data (writes nothing)")
    _add_pass(chk)
    chk.add_argument("--tolerance", type=float, nargs=2, default=list(DEFAULT_TOLERANCE), metavar=("MEAN", "VAR"),
                     help="drift allowed: the mean in units of the std, the variance relative to itself "
                     "(default {:g} {:g})".format(*DEFAULT_TOLERANCE))
    chk.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                     help="chance of naming a layer stale whose channels all drift within the tolerance, over "
                     "the whole model (default %(default)g)")
    chk.add_argument("--report", metavar="FILE.json", help="write the verdict, drifts and p-values as JSON")
    _add_writing(chk)
    _add_loading(chk)
    chk.set_defaults(command_parser=chk)


def shared_actions() -> List[argparse.Action]:
    """The arguments ``check`` shares with ``recompute``: those that go into the ``recompute``
    command a failed check prints."""
    scratch = argparse.ArgumentParser(add_help=False)
    _add_pass(scratch)
    _add_loading(scratch)
    return list(scratch._actions)


def _add_inspect(sub: Any, common: argparse.ArgumentParser) -> None:
    ins = sub.add_parser("inspect", parents=[common], help="list BN layers and their stats, or the drift against another file")
    ins.add_argument("checkpoint")
    ins.add_argument("--against", metavar="OTHER", help="a second checkpoint: per-layer drift from CHECKPOINT to OTHER")
    ins.add_argument("--plot", metavar="FILE.png", help="draw the drift per layer (needs --against and matplotlib)")
    _add_writing(ins)
    _add_loading(ins)
    ins.set_defaults(command_parser=ins)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="precise-bn", description="Exact population BatchNorm statistics for saved checkpoints."
    )
    parser.add_argument("--version", action="version", version="precise-bn " + __version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    common = _Parser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar, log lines or report table: the results, warnings and errors only")
    common.add_argument("--debug", action="store_true", help="on an error, show the whole traceback")
    add_loading = _add_loading

    _add_recompute(sub, common)
    _add_check(sub, common)
    _add_inspect(sub, common)

    con = sub.add_parser("convert", parents=[common], help="Caffe2 .pkl <-> PyTorch .pt / .safetensors (by extension)")
    con.add_argument("input")
    con.add_argument("output")
    con.add_argument("--strip-prefix", default="", help="drop this prefix from the keys (e.g. module.)")
    unmapped = con.add_mutually_exclusive_group()
    unmapped.add_argument("--keep-unmapped", action="store_true",
                          help="write tensors whose names the rules do not map under their own names "
                          "(default: fail and list them)")
    unmapped.add_argument("--drop-unmapped", action="store_true",
                          help="leave out tensors whose names the rules do not map (default: fail and list them)")
    add_loading(con)
    _add_writing(con)
    con.set_defaults(command_parser=con)

    demo = sub.add_parser("demo", parents=[common], help="train a small BN network on handwritten digits and recalibrate it")
    demo.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS, help="training steps (default %(default)s)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--workdir", help="keep the demo's files here (default: a temporary folder)")
    return parser


def _check_specs(args: argparse.Namespace) -> None:
    """The form of every spec given (``--model``, ``--data``, ``--forward-fn``, ``--caffe2-rules``),
    before any file is looked at: a malformed one is a usage error, not one run later."""
    if args.command in ("recompute", "check"):
        check_model_spec(args.model)
        check_data_spec(args.data, args.augment)
        if args.forward_fn:
            check_object_spec(args.forward_fn, "--forward-fn")
    if getattr(args, "caffe2_rules", None):
        check_object_spec(args.caffe2_rules, "--caffe2-rules")


#: ``recompute`` flags whose values :class:`~precise_bn.options.Options` checks, by its argument.
CHECKED_BY_OPTIONS = {"device": "--device"}


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The arguments of ``argv``, with the checks argparse cannot express; a usage error raises
    ``SystemExit(2)`` after printing the sub-command's usage. A malformed spec, and values that
    :class:`~precise_bn.options.Options` refuses, are usage errors too, naming the flag."""
    args = build_parser().parse_args(argv)
    try:
        _check_specs(args)
    except ConfigError as exc:
        args.command_parser.error(str(exc))
    if args.command == "inspect" and args.plot and not args.against:
        args.command_parser.error("--plot draws the drift between two checkpoints and needs --against OTHER")
    for name, flag in CHECKED_BY_OPTIONS.items() if args.command in ("recompute", "check") else ():
        if getattr(args, name) is not None:
            try:
                Options(**{name: getattr(args, name)})
            except ConfigError as exc:
                args.command_parser.error("argument {}: {}".format(flag, exc))
    for name, flag in (("tolerance", "--tolerance"), ("alpha", "--alpha")) if args.command == "check" else ():
        try:
            Rule(**{name: getattr(args, name)})
        except ConfigError as exc:
            args.command_parser.error("argument {}: {}".format(flag, exc))
    return args
