"""What a recalibration did: per layer, what it saw, how far the stats moved, how sure they are."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import ParameterChangedError, UndoError
from .precision import FLAGS, LOADER_FLAGS, not_run, runs_from
from .signals import all_or_nothing
from .snapshot import Snapshot

#: What the report's numbers mean; printed in the JSON report and the README.
DEFINITIONS = {
    "mean_drift": "largest |new mean - old mean| / sqrt(new var + eps) over the layer's channels: "
                  "how far the running mean moved, in units of the new std (with a prior, new is the "
                  "target data's own statistics: how far the domain moved)",
    "var_drift": "largest |new var - old var| / (new var + eps) over the layer's channels: the "
                 "relative change of the running variance (with a prior, of the target data's own)",
    "mean_rel_stderr": "largest mean_stderr / sqrt(new var) over channels with a variance: the "
                       "sampling error of the written mean, in units of the std",
    "var_rel_stderr": "largest var_stderr / new var over channels with a variance: the relative "
                      "sampling error of the written variance",
    "se_untrusted": "channels whose standard errors cannot be trusted (why: se_reasons); rtol never stops "
                    "while a channel is flagged for what the loader did (every reason but heavy tails)",
    "se_not_run": "the reasons of se_reasons not tested: the layer ran fewer calls than the test needs to fire",
    "se_reasons": "the channels of se_untrusted by reason, each under the first that holds: " + "; ".join(
        "{}: {}".format(reason, words) for reason, (_, words) in FLAGS.items()),
}

#: Why a pass ended: what ran out, or ``rtol`` met.
STOP_REASONS = {
    "num_batches": "num_batches batches were read",
    "num_samples": "num_samples samples were read",
    "data": "the data ran out",
    "rtol": "every channel is within rtol at 95% confidence",
}


def _max(values: torch.Tensor) -> float:
    return float(values.max()) if values.numel() else 0.0


def _relative(stderr: Optional[torch.Tensor], scale: Optional[torch.Tensor]) -> Optional[float]:
    """Largest ``stderr / scale`` over channels whose scale is positive (dead channels are exact)."""
    if stderr is None or scale is None:
        return None
    live = scale > 0
    if not bool(live.any()):
        return 0.0
    ratio = stderr[live] / scale[live]
    return float("nan") if bool(torch.isnan(ratio).any()) else float(ratio.max())


@dataclass
class LayerReport:
    """One BN layer's outcome, float64 CPU tensors (``new_*`` None if it never ran, else before
    their rounding into the buffers). ``mean_stderr`` and ``var_stderr``: standard errors of
    ``new_*`` from the spread between calls, NaN after one call. With a ``prior``, ``new_*`` is
    what was written and ``target_*`` the target data's own statistics, which the drifts compare.
    ``se_reasons``: the channels of ``se_untrusted`` by reason (:data:`~precise_bn.precision.FLAGS`).
    """

    name: str
    elements: int
    calls: int
    old_mean: torch.Tensor
    old_var: torch.Tensor
    new_mean: Optional[torch.Tensor]
    new_var: Optional[torch.Tensor]
    mean_stderr: Optional[torch.Tensor] = None
    var_stderr: Optional[torch.Tensor] = None
    eps: float = 1e-5
    se_untrusted: List[int] = field(default_factory=list)
    se_reasons: Dict[str, List[int]] = field(default_factory=dict)
    target_mean: Optional[torch.Tensor] = None
    target_var: Optional[torch.Tensor] = None

    def _moved(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.target_mean is not None and self.target_var is not None:
            return self.target_mean, self.target_var
        assert self.new_mean is not None and self.new_var is not None
        return self.new_mean, self.new_var

    @property
    def ran(self) -> bool:
        return self.new_mean is not None

    @property
    def mean_drift(self) -> float:
        """See :data:`DEFINITIONS`."""
        if not self.ran:
            return 0.0
        mean, var = self._moved()
        return _max((mean - self.old_mean).abs() / (var + self.eps).sqrt())

    @property
    def var_drift(self) -> float:
        """See :data:`DEFINITIONS`."""
        if not self.ran:
            return 0.0
        var = self._moved()[1]
        return _max((var - self.old_var).abs() / (var + self.eps))

    @property
    def mean_rel_stderr(self) -> Optional[float]:
        """See :data:`DEFINITIONS`; None when the layer never ran."""
        return _relative(self.mean_stderr, None if self.new_var is None else self.new_var.sqrt())

    @property
    def var_rel_stderr(self) -> Optional[float]:
        """See :data:`DEFINITIONS`; None when the layer never ran."""
        return _relative(self.var_stderr, self.new_var)

    @property
    def se_not_run(self) -> List[str]:
        """See :data:`DEFINITIONS`."""
        return not_run(self.calls, self.old_mean.numel()) if self.ran else []

    def to_dict(self, with_stats: bool = False) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "name": self.name,
            "ran": self.ran,
            "elements": self.elements,
            "calls": self.calls,
            "mean_drift": self.mean_drift,
            "var_drift": self.var_drift,
            "mean_rel_stderr": self.mean_rel_stderr,
            "var_rel_stderr": self.var_rel_stderr,
            "se_untrusted": list(self.se_untrusted),
            "se_reasons": {reason: list(channels) for reason, channels in self.se_reasons.items()},
            "se_not_run": self.se_not_run,
        }
        keys = ("old_mean", "old_var", "new_mean", "new_var", "mean_stderr", "var_stderr")
        for key in keys if with_stats else keys[-2:]:
            value = getattr(self, key)
            out[key] = None if value is None else value.tolist()
        return out


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else "{:.3g}".format(value)


def _se_cell(value: Optional[float], why: str) -> str:
    """A relative standard error's cell: NaN (a layer whose elements all came in one call has no
    spread between calls to measure) is ``n/a (why)``."""
    return "n/a ({})".format(why) if value is not None and math.isnan(value) else _cell(value)


#: Column titles of the printed report, and the :data:`DEFINITIONS` entry of each.
COLUMNS = {"mean drift": "mean_drift", "var drift": "var_drift", "mean se/std": "mean_rel_stderr",
           "var se/var": "var_rel_stderr"}

#: A drift at least this large is marked in the printed report: the model was normalising with
#: statistics that did not fit its data (after SWA, pruning, fine-tuning, or on other data).
LARGE_DRIFT = 0.5
LARGE_MARK = "*"


def counted(count: int, noun: str, plural: str = "") -> str:
    """``1 batch``, ``43 batches``: ``plural`` (default ``noun + "s"``) unless ``count`` is 1."""
    return "{} {}".format(count, noun if count == 1 else plural or noun + "s")


def table(rows: Sequence[Sequence[str]]) -> str:
    """Rows as columns, the first left-aligned, the others right-aligned; a row shorter than the
    first ends with its last cell as written (a note over the remaining columns)."""
    full = len(rows[0])
    widths = [max(len(row[i]) for row in rows if len(row) == full) for i in range(full)]
    lines = []
    for row in rows:
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        if 1 < len(row) < full:
            cells[-1] = row[-1]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def glossary(pairs: Sequence[Tuple[str, str]]) -> str:
    """``(title, meaning)`` pairs, one line each, indented under a table."""
    width = max(len(title) for title, _ in pairs)
    return "\n".join("  {:<{w}}  {}".format(title, text, w=width) for title, text in pairs)


def legend(titles: List[str]) -> str:
    """What the columns ``titles`` of the printed report hold."""
    return glossary([(title, DEFINITIONS[COLUMNS[title]]) for title in titles])


def _drift_cell(value: float) -> str:
    return "{:.4g}{}".format(value, LARGE_MARK if value >= LARGE_DRIFT else " ")


@dataclass
class BNReport:
    """The result of one recalibration; ``str(report)`` is a table ending with what each column
    means. ``stop``: why the pass ended (:data:`STOP_REASONS`); ``batches`` and ``samples`` over
    all ranks. What the forwards changed besides the measured statistics, all put back:
    ``not_recomputed`` (modules whose statistics a functional ``batch_norm`` changed),
    ``changed_buffers``, ``changed_parameters`` (written in place; measured with what was written).
    """

    layers: List[LayerReport] = field(default_factory=list)
    batches: int = 0
    samples: int = 0
    world_size: int = 1
    estimator: str = "float64"
    seconds: float = 0.0
    stop: str = "data"
    rtol: Optional[float] = None
    not_recomputed: List[str] = field(default_factory=list)
    changed_buffers: List[str] = field(default_factory=list)
    changed_parameters: List[str] = field(default_factory=list)
    snapshot: Optional[Snapshot] = field(default=None, repr=False, compare=False)

    @all_or_nothing
    def undo(self) -> None:
        """Put the recomputed layers' buffers back as they were before the call, bit for bit and
        the same tensor objects, if nothing changed them since; else raise
        :class:`~precise_bn.UndoError` and change nothing (see :mod:`precise_bn.snapshot`)."""
        if self.snapshot is None:
            if not self.layers:
                return
            raise UndoError("undo(): this report keeps no snapshot (only PyTorch recalibrations can be undone)")
        self.snapshot.undo()

    @property
    def unused(self) -> List[str]:
        """Names of layers that never ran and kept their previous stats."""
        return [layer.name for layer in self.layers if not layer.ran]

    def __getitem__(self, name: str) -> LayerReport:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def __len__(self) -> int:
        return len(self.layers)

    def worst(self, key: str) -> Optional[float]:
        """The largest value of a per-layer number (``"mean_rel_stderr"``, ...) over layers that
        ran; NaN if one layer's is NaN (a standard error after one call: the worst is not known)."""
        values = [getattr(layer, key) for layer in self.layers if layer.ran]
        values = [v for v in values if v is not None]
        if any(math.isnan(v) for v in values):
            return float("nan")
        return max(values) if values else None

    def to_dict(self, with_stats: bool = False) -> Dict[str, Any]:
        return {
            "batches": self.batches,
            "samples": self.samples,
            "world_size": self.world_size,
            "estimator": self.estimator,
            "seconds": self.seconds,
            "stop": self.stop,
            "rtol": self.rtol,
            "unused": self.unused,
            "not_recomputed": list(self.not_recomputed),
            "changed_buffers": list(self.changed_buffers),
            "changed_parameters": list(self.changed_parameters),
            "definitions": dict(DEFINITIONS),
            "layers": [layer.to_dict(with_stats) for layer in self.layers],
        }

    def put_back_warning(self) -> str:
        """The one warning that names what the forwards changed besides the measured statistics
        (all put back), or "" when they changed nothing else."""
        parts = []
        if self.not_recomputed:
            parts.append(
                "not recomputed: {}: a functional batch_norm call changed their running statistics during the "
                "pass, which precise-bn does not measure, so they were put back as they were. A BatchNorm layer "
                "(torch.nn.BatchNorm1d/2d/3d or a subclass) in its place would be recomputed".format(
                    ", ".join(self.not_recomputed)))
        if self.changed_buffers:
            parts.append(
                "The forwards changed buffer(s) other than the BatchNorm layers' statistics: {}; they were put "
                "back as they were (if a functional batch_norm keeps statistics in them, those are not "
                "recomputed: a BatchNorm layer in its place would be)".format(", ".join(self.changed_buffers)))
        if self.changed_parameters:
            parts.append(
                "The forwards wrote parameter(s) in place: {}; the statistics were measured with what they "
                "wrote, and the parameters were put back as they were. {}".format(
                    ", ".join(self.changed_parameters), ParameterChangedError.advice))
        text = ". ".join(parts)
        return text[:1].lower() + text[1:]

    def summary(self) -> str:
        """The first line of the table: what was read, why it stopped, the worst standard errors,
        the flagged channels by reason, and the flags not run on so few calls."""
        count = len(self.layers)
        flagged = [len(layer.se_untrusted) for layer in self.layers if layer.se_untrusted]
        reasons = [layer.se_reasons for layer in self.layers]
        why = ", ".join("{}: {}".format(label, sum(len(layer.se_reasons.get(reason, ())) for layer in self.layers))
                        for reason, (label, _) in FLAGS.items()
                        if any(reason in layer.se_reasons for layer in self.layers))
        unknown = "one batch" if self.batches == 1 else "a layer ran once"
        untrusted = "; standard errors not trusted in {} of {} ({}){}".format(
            counted(sum(flagged), "channel"), counted(len(flagged), "layer"), why,
            ", so rtol={:g} could not stop the pass".format(self.rtol)
            if self.rtol is not None and any(r in layer for r in LOADER_FLAGS for layer in reasons) else "")
        first: Dict[str, int] = {}
        for layer in self.layers:
            for reason in layer.se_not_run:
                first[reason] = max(first.get(reason, 0), runs_from(reason, layer.old_mean.numel()))
        unrun = "; not tested on so few calls: {}".format(", ".join(
            "{} (from {} calls)".format(FLAGS[reason][0], calls) for reason, calls in first.items())) if first else ""
        return ("precise-bn: {}, {} ({}), world size {}, {} estimator, "
                "{:.2f} s; stopped: {}; worst relative standard error: mean {}, var {}{}{}").format(
            counted(count, "BatchNorm layer"), counted(self.batches, "batch", "batches"),
            counted(self.samples, "sample"), self.world_size, self.estimator, self.seconds,
            "rtol={:g} reached".format(self.rtol) if self.stop == "rtol" else STOP_REASONS[self.stop],
            _se_cell(self.worst("mean_rel_stderr"), unknown), _se_cell(self.worst("var_rel_stderr"), unknown),
            untrusted if flagged else "", unrun)

    def __str__(self) -> str:
        rows: List[Sequence[str]] = [["layer", "calls", "elements", "mean drift", "var drift", "mean se/std",
                                      "var se/var"]]
        for layer in self.layers:
            if layer.ran:
                rows.append([layer.name, str(layer.calls), str(layer.elements), _drift_cell(layer.mean_drift),
                             _drift_cell(layer.var_drift), _se_cell(layer.mean_rel_stderr, "1 call"),
                             _se_cell(layer.var_rel_stderr, "1 call")])
            else:
                rows.append([layer.name, "0", "0", "never ran: stats kept"])
        lines = [self.summary(), table(rows)]
        for label, names in (("not recomputed (a functional batch_norm, put back)", self.not_recomputed),
                             ("buffers the forwards changed (put back)", self.changed_buffers),
                             ("parameters the forwards wrote (put back)", self.changed_parameters)):
            if names:
                lines.append("{}: {}".format(label, ", ".join(names)))
        lines.append(legend(list(COLUMNS)))
        if any(layer.ran and max(layer.mean_drift, layer.var_drift) >= LARGE_DRIFT for layer in self.layers):
            lines.append("  {}  a drift of {:g} or more: the old running stats did not fit this data".format(
                LARGE_MARK, LARGE_DRIFT))
        return "\n".join(lines)
