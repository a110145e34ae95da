"""``precise-bn inspect``: a checkpoint's BN layers, or their drift against another checkpoint."""
from __future__ import annotations

import argparse
import importlib
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..checkpoint.formats import load_checkpoint
from ..checkpoint.paths import check_paths
from ..checkpoint.provenance import provenance_of
from ..checkpoint.serializers import write_file
from ..checkpoint.state import Checkpoint, bn_layers, prefix_counts, wrapper_prefix
from ..errors import BackendUnavailableError, ConfigError
from ..report import LayerReport, counted, legend, table
from .specs import load_object


def rules_of(args: argparse.Namespace) -> Any:
    """The ``--caffe2-rules`` object, or None for the built-in ResNet rules."""
    return load_object(args.caffe2_rules, "--caffe2-rules") if args.caffe2_rules else None


def _stat_range(t: torch.Tensor) -> str:
    t = t.double()
    return "{:.4g} .. {:.4g}".format(float(t.min()), float(t.max())) if t.numel() else "-"


def provenance_line(entry: Any) -> Optional[str]:
    """The ``precise_bn`` entry in one line; a file may hold anything there, so any object is
    shown, as is, when it is not the flat table of plain values precise-bn writes."""
    if entry is None:
        return None
    plain = (str, int, float, bool, type(None))
    if isinstance(entry, dict) and all(isinstance(k, str) and isinstance(v, plain) for k, v in entry.items()):
        return "precise_bn entry (the last recompute): " + ", ".join(
            "{}={}".format(k, entry[k]) for k in sorted(entry))
    text = repr(entry)
    return "precise_bn entry, not in the form precise-bn writes (damaged, or written by another tool): {}".format(
        text if len(text) <= 200 else text[:200] + "...")


def named_layers(ckpt: Checkpoint) -> Tuple[str, Dict[str, Tuple[torch.Tensor, torch.Tensor]]]:
    """The BN layers of ``ckpt`` (:func:`bn_layers`) named as ``recompute`` names them: without
    the wrapper prefix every one of them has (``model.`` of a LightningModule, DDP's
    ``module.``); and that prefix."""
    layers = bn_layers(ckpt.state_dict)
    prefix = wrapper_prefix(layers)
    return prefix, {name[len(prefix):]: stats for name, stats in layers.items()}


def _prefix_line(ckpt: Checkpoint, prefix: str) -> None:
    if prefix:
        print("{}: every BatchNorm layer sits under {!r}; named without it below, as recompute names them".format(
            ckpt.path, prefix))


def drift_layers(old: Checkpoint, new: Checkpoint) -> Tuple[List[LayerReport], List[str], List[str]]:
    """Pair the BN layers of two checkpoints (named as :func:`named_layers` names them; a module
    prefix on either side is allowed) and return their drift as :class:`LayerReport` (eps 1e-5:
    checkpoints do not store it), plus the layers found only in ``old`` and only in ``new`` (or
    with another channel count)."""
    a, b = named_layers(old)[1], named_layers(new)[1]
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


def _matplotlib(name: str) -> Any:
    try:
        return importlib.import_module("matplotlib." + name)
    except ImportError as exc:
        raise BackendUnavailableError("--plot needs matplotlib: pip install '.[plot]' (from a checkout)") from exc


def plot_format(path: str) -> str:
    """The image format ``path``'s extension names, if matplotlib writes it (checked before any work)."""
    fmt = os.path.splitext(path)[1][1:].lower()
    known = _matplotlib("figure").Figure().canvas.get_supported_filetypes()
    if fmt not in known:
        raise ConfigError("--plot {}: matplotlib writes {}; end the name with one of them".format(
            path, ", ".join("." + k for k in sorted(known))))
    return fmt


def drift_figure(layers: Sequence[LayerReport], title: str) -> Any:
    """Horizontal bars of the mean and variance drift per layer, on log scales: one layer whose
    stats moved a lot would flatten every other bar on a linear one, and names on the vertical
    axis stay readable at any count. A drift of exactly 0 has no bar on a log scale; it is
    written as "0" instead."""
    NullFormatter = _matplotlib("ticker").NullFormatter
    height = 1.8 + 0.24 * max(len(layers), 1)  # inches: 24 px a name at 100 dpi, for 8-point labels
    fig = _matplotlib("figure").Figure(figsize=(11.0, height), dpi=100, constrained_layout=True)
    axes = fig.subplots(1, 2, sharey=True)
    y = list(range(len(layers)))
    for ax, key, label in ((axes[0], "mean_drift", "mean drift: max |new mean - old mean| / new std"),
                           (axes[1], "var_drift", "variance drift: max |new var - old var| / new var")):
        values = [getattr(layer, key) for layer in layers]
        shown = [v for v in values if v > 0 and math.isfinite(v)]
        ax.barh(y, [v if v > 0 else math.nan for v in values], color="tab:blue")
        ax.set_xscale("log")
        if shown:  # whole decades, so that the labelled ticks are powers of ten and never crowd
            ax.set_xlim(10.0 ** math.floor(math.log10(min(shown))), 10.0 ** math.ceil(math.log10(max(shown)) + 1e-9))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(label, fontsize=9)
        ax.grid(axis="x", which="major", alpha=0.3)
        for row, value in zip(y, values):
            if not value > 0:
                ax.annotate("0", (0, row), xycoords=("axes fraction", "data"), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=8)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels([layer.name for layer in layers], fontsize=8)
    axes[0].set_ylim(len(layers) - 0.5, -0.5)  # the first layer at the top
    fig.suptitle(title, fontsize=10)
    return fig


def plot_drift(layers: Sequence[LayerReport], path: str, title: str) -> None:
    """:func:`drift_figure`, written to ``path`` atomically in the format its extension names."""
    fmt = plot_format(path)
    fig = drift_figure(layers, title)
    write_file(path, lambda handle: fig.savefig(handle, format=fmt))


def _list_layers(ckpt: Checkpoint) -> None:
    prefix, layers = named_layers(ckpt)
    print(counted(len(layers), "BatchNorm layer"))
    if not layers:
        return
    _prefix_line(ckpt, prefix)
    rows = [("layer", "channels", "running_mean min .. max", "running_var min .. max", "num_batches_tracked")]
    for name, (mean, var) in layers.items():
        key = prefix + name
        tracked = ckpt.state_dict.get(key + ".num_batches_tracked" if key else "num_batches_tracked")
        rows.append((name, str(mean.numel()), _stat_range(mean), _stat_range(var),
                     "-" if tracked is None else str(int(tracked))))
    print(table(rows))
    print("  num_batches_tracked counts training batches; precise-bn leaves it as it was")


def run(args: argparse.Namespace) -> None:
    """``precise-bn inspect ARGS``."""
    if args.plot:
        plot_format(args.plot)
        check_paths([("the checkpoint", args.checkpoint), ("--against", args.against)], [("--plot", args.plot)],
                    break_hardlinks=args.break_hardlinks, overwrite=args.overwrite)
    ckpt = load_checkpoint(args.checkpoint, key=args.key, trust=args.trust_checkpoint, rules=rules_of(args))
    print(ckpt.describe())
    line = provenance_line(provenance_of(ckpt))
    if line:
        print(line)
    if args.against is None:
        _list_layers(ckpt)
        return
    other = load_checkpoint(args.against, key=args.key, trust=args.trust_checkpoint, rules=rules_of(args))
    layers, only_old, only_new = drift_layers(ckpt, other)
    print("drift from {} to {}: {} in both".format(ckpt.path, other.path, counted(len(layers), "BatchNorm layer")))
    for each in (ckpt, other):
        _prefix_line(each, named_layers(each)[0])
    if layers:
        rows = [("layer", "channels", "mean drift", "var drift")]
        rows += [(l.name, str(l.old_mean.numel()), "{:.4g}".format(l.mean_drift), "{:.4g}".format(l.var_drift))
                 for l in layers]
        print(table(rows))
        print(legend(["mean drift", "var drift"]))
    for path, names in ((ckpt.path, only_old), (other.path, only_new)):
        if names:
            print("only in {} ({}): {}".format(path, len(names), ", ".join(names)))
    if args.plot:
        plot_drift(layers, args.plot, "BN drift: {} -> {}".format(os.path.basename(ckpt.path),
                                                                  os.path.basename(other.path)))
        print("wrote {}".format(args.plot))
