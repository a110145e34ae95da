"""``precise-bn inspect``: a checkpoint's BN layers, or their drift against another checkpoint."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, List, Sequence, Tuple

import torch

from ..checkpoint.formats import load_checkpoint
from ..checkpoint.state import Checkpoint, bn_layers, prefix_counts
from ..errors import BackendUnavailableError, CheckpointError
from ..report import LayerReport
from .specs import load_object

def rules_of(args: argparse.Namespace) -> Any:
    """The ``--caffe2-rules`` object, or None for the built-in ResNet rules."""
    return load_object(args.caffe2_rules, "--caffe2-rules") if args.caffe2_rules else None


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


def run(args: argparse.Namespace) -> None:
    """``precise-bn inspect ARGS``."""
    ckpt = load_checkpoint(args.checkpoint, key=args.key, trust=args.trust_checkpoint, rules=rules_of(args))
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
    other = load_checkpoint(args.against, key=args.key, trust=args.trust_checkpoint, rules=rules_of(args))
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
