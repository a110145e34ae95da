"""The ``precise-bn`` command line: its sub-commands and arguments."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict

from .._version import __version__
from .demo import DEFAULT_STEPS
from .job import DEFAULT_ITERS

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a positive integer, got {!r}".format(text))
    if value <= 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got {}".format(value))
    return value


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("not valid JSON ({}): {!r}".format(exc, text))
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object such as '{{\"depth\": 18}}', got {!r}".format(text))
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precise-bn", description="Exact population BatchNorm statistics for saved checkpoints."
    )
    parser.add_argument("--version", action="version", version="precise-bn " + __version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors, no progress bar")

    def add_loading(p: argparse.ArgumentParser) -> None:
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

    rec = sub.add_parser("recompute", parents=[common], help="recalibrate a checkpoint's BN stats on training data")
    rec.add_argument("checkpoint", help=".pt/.pth/.ckpt (PyTorch, Lightning), .safetensors or Caffe2 .pkl")
    rec.add_argument("--model", required=True, help="package.module:callable, torchvision:NAME or timm:NAME")
    rec.add_argument("--data", required=True, help="package.module:callable, imagefolder:DIR or npz:FILE[:KEY]")
    rec.add_argument("--model-kwargs", type=_json_object, default={}, metavar="JSON")
    rec.add_argument("--data-kwargs", type=_json_object, default={}, metavar="JSON")
    budget = rec.add_mutually_exclusive_group()
    budget.add_argument("--num-batches", "--num-iters", dest="num_batches", type=_positive_int,
                        help="batches to use (default {} when neither budget nor --rtol is given)".format(DEFAULT_ITERS))
    budget.add_argument("--num-samples", type=_positive_int, help="samples to use (a batch is never cut)")
    rec.add_argument("--batch-size", type=_positive_int, help="for the built-in data specs (default 32)")
    rec.add_argument("--device", help="cpu, cuda, cuda:1, ... (default cpu)")
    rec.add_argument("--exact", action="store_true", help="measure each BN input in float64 (slower)")
    rec.add_argument("--rtol", type=float, help="stop once every channel's relative standard error is below this "
                     "(mean: stderr/std, variance: stderr/var); the budget still applies")
    rec.add_argument("--min-batches", type=_positive_int, help="batches read before --rtol may stop the pass")
    where = rec.add_mutually_exclusive_group()
    where.add_argument("--output", help="file to write (default: NAME.precise_bn.EXT next to the input)")
    where.add_argument("--in-place", action="store_true", help="replace the input file (atomically)")
    rec.add_argument("--report", metavar="FILE.json", help="write the per-layer drift as JSON")
    rec.add_argument("--prefix", help="the model's key prefix in the state dict (default: found by matching)")
    add_loading(rec)

    ins = sub.add_parser("inspect", parents=[common], help="list BN layers and their stats, or the drift against another file")
    ins.add_argument("checkpoint")
    ins.add_argument("--against", metavar="OTHER", help="a second checkpoint: per-layer drift from CHECKPOINT to OTHER")
    ins.add_argument("--plot", metavar="FILE.png", help="draw the drift per layer (needs --against and matplotlib)")
    add_loading(ins)

    con = sub.add_parser("convert", parents=[common], help="Caffe2 .pkl <-> PyTorch .pt / .safetensors (by extension)")
    con.add_argument("input")
    con.add_argument("output")
    con.add_argument("--strip-prefix", default="", help="drop this prefix from the keys (e.g. module.)")
    add_loading(con)

    demo = sub.add_parser("demo", parents=[common], help="train a small BN network on handwritten digits and recalibrate it")
    demo.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS, help="training steps (default %(default)s)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--workdir", help="keep the demo's files here (default: a temporary folder)")
    return parser
