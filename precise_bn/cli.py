"""The ``precise-bn`` command: recalibrate, inspect and convert saved checkpoints.

    precise-bn recompute ckpt.pt --model torchvision:resnet50 --data imagefolder:/data/train
    precise-bn inspect ckpt.pt --against ckpt.precise_bn.pt
    precise-bn convert model_final.pkl model_final.pt
    precise-bn demo

Exit status: 0 on success, 2 on a usage error, 1 on a failure (the message names the file, key
or layer at fault). Under ``torchrun`` every rank measures its shard, the stats are merged
exactly, and rank 0 alone writes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import __version__, distributed
from .checkpoint import (
    Checkpoint,
    apply_bn_stats,
    bn_layers,
    bn_stats_of,
    check_output,
    detect_format,
    load_checkpoint,
    load_into_model,
    match_model,
    prefix_counts,
    provenance,
    save_checkpoint,
    save_state_dict,
    set_provenance,
    write_file,
)
from .demo import DEFAULT_STEPS, run_demo
from .errors import BackendUnavailableError, CheckpointError, ConfigError, LayerError, PreciseBNError
from .report import BNReport, LayerReport
from .specs import load_object, resolve_data, resolve_model
from .torch_backend import select_layers, update_bn_stats

logger = logging.getLogger("precise_bn")

DEFAULT_ITERS = 200


def default_output(checkpoint: str) -> str:
    """``ckpt.pt`` -> ``ckpt.precise_bn.pt``: next to the input, same extension, same format."""
    root, ext = os.path.splitext(checkpoint)
    return root + ".precise_bn" + ext


def recompute(
    checkpoint: str,
    model: Union[str, nn.Module],
    data: Union[str, Iterable[Any]],
    *,
    model_kwargs: Optional[Mapping[str, Any]] = None,
    data_kwargs: Optional[Mapping[str, Any]] = None,
    num_iters: Optional[int] = None,
    num_samples: Optional[int] = None,
    batch_size: Optional[int] = None,
    device: Optional[str] = None,
    exact: bool = False,
    output: Optional[str] = None,
    in_place: bool = False,
    report_path: Optional[str] = None,
    key: Optional[str] = None,
    prefix: Optional[str] = None,
    trust: bool = False,
    caffe2_rules: Any = None,
    progress: bool = True,
) -> Tuple[BNReport, str]:
    """Recalibrate the BN stats of a checkpoint file; return the report and the file written.

    ``model``/``data`` are specs (see :mod:`precise_bn.specs`) or a module / an iterable.
    ``caffe2_rules`` map a Caffe2 ``.pkl``'s layer names to the model's module names; the new
    stats go back into the very blobs they were read from.
    Without a budget, ``num_iters=200`` batches as in fvcore. ``output`` defaults to
    :func:`default_output`; ``in_place`` replaces the input atomically. Only BN
    ``running_mean``/``running_var`` change in the file written (see :mod:`precise_bn.checkpoint`).
    Under ``torch.distributed`` every rank measures and merges, rank 0 writes, all wait for it.
    """
    out = checkpoint if in_place else (output or default_output(checkpoint))
    check_output(checkpoint, out, in_place)
    if num_iters is None and num_samples is None:
        num_iters = DEFAULT_ITERS
    ckpt = load_checkpoint(checkpoint, key=key, trust=trust, rules=caffe2_rules)
    logger.info("%s", ckpt.describe())
    net = model if isinstance(model, nn.Module) else resolve_model(model, model_kwargs)
    prefix = match_model(ckpt, net.state_dict(), prefix)
    if prefix:
        logger.info("the model's keys sit under the prefix %r", prefix)
    load_into_model(net, ckpt, prefix)
    if not select_layers(net):
        raise LayerError(
            "the model has no BatchNorm layer that tracks running stats: nothing to recompute in {}".format(checkpoint)
        )
    try:
        target = torch.device(device if device is not None else "cpu")
    except RuntimeError as exc:
        raise ConfigError("--device {!r}: {}".format(device, exc)) from exc
    net.to(target)
    batches = data if not isinstance(data, str) else resolve_data(data, data_kwargs, batch_size)
    report = update_bn_stats(
        net,
        batches,
        num_iters=num_iters,
        num_samples=num_samples,
        progress=progress and distributed.is_main_process(),
        device=target,
        exact=exact,
    )
    try:
        if distributed.is_main_process():
            apply_bn_stats(ckpt, prefix, bn_stats_of(net, report))
            set_provenance(ckpt, provenance(report))
            save_checkpoint(ckpt, out, in_place=in_place)
            if report_path:
                write_report(report_path, report, ckpt, out, prefix)
    finally:
        distributed.barrier()
    return report, out


def write_report(path: str, report: BNReport, ckpt: Checkpoint, output: str, prefix: str) -> None:
    """The ``--report`` JSON: the files, then :meth:`BNReport.to_dict` (per-layer drift)."""
    body = {"checkpoint": ckpt.path, "output": output, "format": ckpt.format, "prefix": prefix}
    body.update(report.to_dict())
    text = json.dumps(body, indent=2).encode("utf-8")
    write_file(path, lambda handle: handle.write(text))


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
    budget.add_argument("--num-iters", type=_positive_int, help="batches to use (default {})".format(DEFAULT_ITERS))
    budget.add_argument("--num-samples", type=_positive_int, help="samples to use (a batch is never cut)")
    rec.add_argument("--batch-size", type=_positive_int, help="for the built-in data specs (default 32)")
    rec.add_argument("--device", help="cpu, cuda, cuda:1, ... (default cpu)")
    rec.add_argument("--exact", action="store_true", help="measure each BN input in float64 (slower)")
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


def _rules(args: argparse.Namespace) -> Any:
    return load_object(args.caffe2_rules, "--caffe2-rules") if args.caffe2_rules else None


def _cmd_recompute(args: argparse.Namespace) -> None:
    report, out = recompute(
        args.checkpoint,
        args.model,
        args.data,
        model_kwargs=args.model_kwargs,
        data_kwargs=args.data_kwargs,
        num_iters=args.num_iters,
        num_samples=args.num_samples,
        batch_size=args.batch_size,
        device=_rank_device(args.device),
        exact=args.exact,
        output=args.output,
        in_place=args.in_place,
        report_path=args.report,
        key=args.key,
        prefix=args.prefix,
        trust=args.trust_checkpoint,
        caffe2_rules=_rules(args),
        progress=not args.quiet,
    )
    if distributed.is_main_process():
        print(report)
        print("wrote {}".format(out))


def _stat_range(t: torch.Tensor) -> str:
    t = t.double()
    return "{:.4g} .. {:.4g}".format(float(t.min()), float(t.max())) if t.numel() else "-"


def _table(rows: List[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    )


def drift_layers(old: Checkpoint, new: Checkpoint) -> Tuple[List[LayerReport], List[str], List[str]]:
    """Pair the BN layers of two checkpoints (a module prefix on either side is allowed) and
    return their drift as :class:`LayerReport` (eps 1e-5: checkpoints do not store it), plus
    the layers found only in ``old`` and only in ``new`` (or with another channel count)."""
    a, b = bn_layers(old.state_dict), bn_layers(new.state_dict)
    pairs: List[Tuple[str, str]] = []
    for outer, inner, flip in ((a, b, False), (b, a, True)):
        counts = prefix_counts(outer, inner)
        if counts:
            p = counts.most_common(1)[0][0]
            found = [(p + n, n) for n in inner if p + n in outer and outer[p + n][0].shape == inner[n][0].shape]
            if len(found) > len(pairs):
                pairs = [(y, x) for x, y in found] if flip else found
    order = {name: i for i, name in enumerate(a)}
    pairs.sort(key=lambda pair: order[pair[0]])
    layers = [
        LayerReport(
            name=na, elements=0, calls=0,
            old_mean=a[na][0].double(), old_var=a[na][1].double(),
            new_mean=b[nb][0].double(), new_var=b[nb][1].double(),
        )
        for na, nb in pairs
    ]
    return layers, [n for n in a if n not in {x for x, _ in pairs}], [n for n in b if n not in {y for _, y in pairs}]


def plot_drift(layers: Sequence[LayerReport], path: str, title: str) -> None:
    """Bar charts of the mean and variance drift per layer, written to ``path``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise BackendUnavailableError("--plot needs matplotlib: pip install precise-bn[plot]") from exc
    fig = Figure(figsize=(max(6.0, 0.25 * len(layers) + 2), 6.0), constrained_layout=True)
    axes = fig.subplots(2, 1, sharex=True)
    x = list(range(len(layers)))
    for ax, values, label in (
        (axes[0], [l.mean_drift for l in layers], "mean drift (|dm| / new std)"),
        (axes[1], [l.var_drift for l in layers], "variance drift (|dv| / new var)"),
    ):
        ax.bar(x, values)
        ax.set_ylabel(label)
    axes[0].set_title(title)
    axes[1].set_xticks(x)
    axes[1].set_xticklabels([l.name for l in layers], rotation=90, fontsize=6)
    try:
        fig.savefig(path)
    except OSError as exc:
        raise CheckpointError("{}: cannot write the plot: {}".format(path, exc)) from exc


def _cmd_inspect(args: argparse.Namespace) -> None:
    ckpt = load_checkpoint(args.checkpoint, key=args.key, trust=args.trust_checkpoint, rules=_rules(args))
    print(ckpt.describe())
    if ckpt.provenance is not None:
        print("precise_bn entry: " + json.dumps(ckpt.provenance, sort_keys=True))
    if args.against is None:
        layers = bn_layers(ckpt.state_dict)
        rows = [("layer", "channels", "running_mean min .. max", "running_var min .. max", "batches")]
        for name, (mean, var) in layers.items():
            tracked = ckpt.state_dict.get(name + ".num_batches_tracked" if name else "num_batches_tracked")
            rows.append(
                (name, str(mean.numel()), _stat_range(mean), _stat_range(var), "-" if tracked is None else str(int(tracked)))
            )
        print("{} BatchNorm layers".format(len(layers)))
        if layers:
            print(_table(rows))
        return
    other = load_checkpoint(args.against, key=args.key, trust=args.trust_checkpoint, rules=_rules(args))
    layers, only_old, only_new = drift_layers(ckpt, other)
    print("drift from {} to {}: {} BatchNorm layers in both".format(ckpt.path, other.path, len(layers)))
    rows = [("layer", "channels", "mean drift", "var drift")]
    rows += [(l.name, str(l.old_mean.numel()), "{:.4g}".format(l.mean_drift), "{:.4g}".format(l.var_drift)) for l in layers]
    if layers:
        print(_table(rows))
    for path, names in ((ckpt.path, only_old), (other.path, only_new)):
        if names:
            print("only in {} ({}): {}".format(path, len(names), ", ".join(names)))
    if args.plot:
        plot_drift(layers, args.plot, "BN drift: {} -> {}".format(os.path.basename(ckpt.path), os.path.basename(other.path)))
        print("wrote {}".format(args.plot))


def _cmd_convert(args: argparse.Namespace) -> None:
    check_output(args.input, args.output, in_place=False)
    fmt_in, fmt_out = detect_format(args.input), detect_format(args.output)
    if fmt_in == fmt_out:
        raise ConfigError(
            "convert: {} and {} are both {} files; give OUT another extension (.pt, .safetensors, .pkl)".format(
                args.input, args.output, fmt_in
            )
        )
    rules = _rules(args)
    ckpt = load_checkpoint(args.input, key=args.key, trust=args.trust_checkpoint, rules=rules)
    strip = args.strip_prefix
    if strip and not all(k.startswith(strip) for k in ckpt.state_dict):
        raise CheckpointError("{}: not every key starts with --strip-prefix {!r}".format(args.input, strip))
    state = {k[len(strip):]: v for k, v in ckpt.state_dict.items()}
    save_state_dict(state, args.output, fmt_out, rules)
    print("wrote {} ({} tensors, {} -> {})".format(args.output, len(state), fmt_in, fmt_out))


def _cmd_demo(args: argparse.Namespace) -> None:
    run_demo(steps=args.steps, seed=args.seed, workdir=args.workdir, progress=not args.quiet)


def _rank_device(device: Optional[str]) -> Optional[str]:
    """Under torchrun, a bare ``cuda`` means this rank's GPU (``LOCAL_RANK``)."""
    if device == "cuda" and distributed.get_world_size() > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return "cuda:{}".format(local)
    return device


def _init_distributed(device: Optional[str]) -> bool:
    """Join the process group torchrun describes in the environment; False when not launched so."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or distributed.is_distributed():
        return False
    import torch.distributed as dist

    dist.init_process_group("nccl" if device and device.startswith("cuda") else "gloo")
    return True


@contextlib.contextmanager
def _logging_to_stderr(quiet: bool) -> Iterator[None]:
    """Show the package's log records on stderr for one command; restore the logger after."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING if quiet or not distributed.is_main_process() else logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    logger.warning("%s: %s", category.__name__, message)


COMMANDS = {"recompute": _cmd_recompute, "inspect": _cmd_inspect, "convert": _cmd_convert, "demo": _cmd_demo}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "inspect" and args.plot and not args.against:
            parser.error("inspect: --plot draws the drift between two checkpoints and needs --against")
    except SystemExit as exc:
        return int(exc.code or 0)
    joined = _init_distributed(getattr(args, "device", None)) if args.command == "recompute" else False
    try:
        with _logging_to_stderr(args.quiet), warnings.catch_warnings():
            warnings.showwarning = _show_warning
            COMMANDS[args.command](args)
    except PreciseBNError as exc:
        print("precise-bn: error: {}".format(exc), file=sys.stderr)
        return 1
    finally:
        if joined:
            torch.distributed.destroy_process_group()
    return 0
