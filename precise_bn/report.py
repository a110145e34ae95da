"""What a recalibration did: per layer, what it saw, how far the stats moved, how sure they are."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

#: What the report's numbers mean; printed in the JSON report and the README.
DEFINITIONS = {
    "mean_drift": "largest |new mean - old mean| / sqrt(new var + eps) over the layer's channels: "
                  "how far the running mean moved, in units of the new std",
    "var_drift": "largest |new var - old var| / (new var + eps) over the layer's channels: the "
                 "relative change of the running variance",
    "mean_rel_stderr": "largest mean_stderr / sqrt(new var) over channels with a variance: the "
                       "sampling error of the written mean, in units of the std",
    "var_rel_stderr": "largest var_stderr / new var over channels with a variance: the relative "
                      "sampling error of the written variance",
    "se_untrusted": "channels whose standard errors cannot be trusted: a few calls carry most of their "
                    "spread (heavy tails, rare outliers or activity); rtol never stops on them",
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
    """One BN layer's outcome. Stats are float64 CPU tensors; ``new_*`` is None if it never ran.

    ``mean_stderr`` and ``var_stderr`` are per-channel standard errors of ``new_mean`` and
    ``new_var`` (units of ``running_mean`` and ``running_var``), estimated from the spread
    between calls (see :mod:`precise_bn.estimator`); NaN after a single call. ``untrusted``
    lists channels whose float32 kernel statistics could not be trusted (Caffe2 path).
    ``se_untrusted`` lists channels whose standard errors cannot be trusted (heavy tails, or a
    few calls carrying most of the spread: see
    :meth:`~precise_bn.estimator.PopulationStats.tail_spread`); ``rtol`` never stops on them.
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
    untrusted: List[int] = field(default_factory=list)
    se_untrusted: List[int] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        return self.new_mean is not None

    @property
    def mean_drift(self) -> float:
        """See :data:`DEFINITIONS`."""
        if not self.ran:
            return 0.0
        std = (self.new_var + self.eps).sqrt()
        return _max((self.new_mean - self.old_mean).abs() / std)

    @property
    def var_drift(self) -> float:
        """See :data:`DEFINITIONS`."""
        if not self.ran:
            return 0.0
        return _max((self.new_var - self.old_var).abs() / (self.new_var + self.eps))

    @property
    def mean_rel_stderr(self) -> Optional[float]:
        """See :data:`DEFINITIONS`; None when the layer never ran."""
        return _relative(self.mean_stderr, None if self.new_var is None else self.new_var.sqrt())

    @property
    def var_rel_stderr(self) -> Optional[float]:
        """See :data:`DEFINITIONS`; None when the layer never ran."""
        return _relative(self.var_stderr, self.new_var)

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
            "untrusted": list(self.untrusted),
            "se_untrusted": list(self.se_untrusted),
        }
        keys = ("old_mean", "old_var", "new_mean", "new_var", "mean_stderr", "var_stderr")
        for key in keys if with_stats else keys[-2:]:
            value = getattr(self, key)
            out[key] = None if value is None else value.tolist()
        return out


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else "{:.3g}".format(value)


@dataclass
class BNReport:
    """The result of one recalibration; ``str(report)`` is a readable table.

    ``stop`` says why the pass ended (see :data:`STOP_REASONS`); ``batches`` and ``samples``
    count what was read, summed over ranks.
    """

    layers: List[LayerReport] = field(default_factory=list)
    batches: int = 0
    samples: int = 0
    world_size: int = 1
    estimator: str = "kernel"
    seconds: float = 0.0
    stop: str = "data"
    rtol: Optional[float] = None

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
        """The largest value of a per-layer number (``"mean_rel_stderr"``, ...) over layers that ran."""
        values = [getattr(layer, key) for layer in self.layers if layer.ran]
        values = [v for v in values if v is not None]
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
            "definitions": dict(DEFINITIONS),
            "layers": [layer.to_dict(with_stats) for layer in self.layers],
        }

    def summary(self) -> str:
        """The first line of the table: what was read, why it stopped, the worst standard errors,
        and how many channels' standard errors cannot be trusted."""
        count = len(self.layers)
        heavy = [len(layer.se_untrusted) for layer in self.layers if layer.se_untrusted]
        return ("precise-bn: {} BatchNorm layer{}, {} batch{} ({} samples), world size {}, {} estimator, "
                "{:.2f} s; stopped: {}; worst relative standard error: mean {}, var {}{}").format(
            count, "" if count == 1 else "s", self.batches, "" if self.batches == 1 else "es", self.samples,
            self.world_size, self.estimator, self.seconds,
            "rtol={:g} reached".format(self.rtol) if self.stop == "rtol" else STOP_REASONS[self.stop],
            _cell(self.worst("mean_rel_stderr")), _cell(self.worst("var_rel_stderr")),
            "; standard errors not trusted (heavy tails) in {} channel{} of {} layer{}".format(
                sum(heavy), "" if sum(heavy) == 1 else "s", len(heavy), "" if len(heavy) == 1 else "s")
            if heavy else "")

    def __str__(self) -> str:
        width = max([len("layer")] + [len(layer.name) for layer in self.layers])
        line = "{:<{w}}  {:>6}  {:>12}  {:>10}  {:>10}  {:>12}  {:>12}"
        rows = [self.summary(), line.format("layer", "calls", "elements", "mean drift", "var drift",
                                            "mean se/std", "var se/var", w=width)]
        for layer in self.layers:
            if layer.ran:
                rows.append(line.format(layer.name, layer.calls, layer.elements, "{:.4g}".format(layer.mean_drift),
                                        "{:.4g}".format(layer.var_drift), _cell(layer.mean_rel_stderr),
                                        _cell(layer.var_rel_stderr), w=width))
            else:
                rows.append("{:<{w}}  {:>6}  {:>12}  {}".format(layer.name, 0, 0, "never ran: stats kept", w=width))
        return "\n".join(rows)
