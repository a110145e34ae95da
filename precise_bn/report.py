"""What a recalibration did: per layer, what it saw and how far the stats moved."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch


@dataclass
class LayerReport:
    """One BN layer's outcome. Stats are float64 CPU tensors; ``new_*`` is None if it never ran."""

    name: str
    elements: int
    calls: int
    old_mean: torch.Tensor
    old_var: torch.Tensor
    new_mean: Optional[torch.Tensor]
    new_var: Optional[torch.Tensor]
    eps: float = 1e-5
    clamped: int = 0

    @property
    def ran(self) -> bool:
        return self.new_mean is not None

    @property
    def mean_drift(self) -> float:
        """Largest shift of a channel's mean, in units of its new std: ``|dm| / sqrt(v + eps)``."""
        if not self.ran:
            return 0.0
        std = (self.new_var + self.eps).sqrt()
        return float(((self.new_mean - self.old_mean).abs() / std).max()) if std.numel() else 0.0

    @property
    def var_drift(self) -> float:
        """Largest relative change of a channel's variance: ``|dv| / (v + eps)``."""
        if not self.ran:
            return 0.0
        rel = (self.new_var - self.old_var).abs() / (self.new_var + self.eps)
        return float(rel.max()) if rel.numel() else 0.0

    def to_dict(self, with_stats: bool = False) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "name": self.name,
            "ran": self.ran,
            "elements": self.elements,
            "calls": self.calls,
            "mean_drift": self.mean_drift,
            "var_drift": self.var_drift,
            "clamped": self.clamped,
        }
        if with_stats:
            for key in ("old_mean", "old_var", "new_mean", "new_var"):
                value = getattr(self, key)
                out[key] = None if value is None else value.tolist()
        return out


@dataclass
class BNReport:
    """The result of one recalibration; ``str(report)`` is a readable table."""

    layers: List[LayerReport] = field(default_factory=list)
    batches: int = 0
    samples: int = 0
    world_size: int = 1
    estimator: str = "kernel"
    seconds: float = 0.0

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

    def to_dict(self, with_stats: bool = False) -> Dict[str, Any]:
        return {
            "batches": self.batches,
            "samples": self.samples,
            "world_size": self.world_size,
            "estimator": self.estimator,
            "seconds": self.seconds,
            "unused": self.unused,
            "layers": [layer.to_dict(with_stats) for layer in self.layers],
        }

    def __str__(self) -> str:
        head = "precise-bn: {} layers, {} batches, {} samples, world size {}, {} estimator, {:.2f} s".format(
            len(self.layers), self.batches, self.samples, self.world_size, self.estimator, self.seconds
        )
        width = max([len("layer")] + [len(layer.name) for layer in self.layers])
        rows = [head, "{:<{w}}  {:>6}  {:>12}  {:>11}  {:>10}".format(
            "layer", "calls", "elements", "mean drift", "var drift", w=width)]
        for layer in self.layers:
            if layer.ran:
                rows.append("{:<{w}}  {:>6}  {:>12}  {:>11.4g}  {:>10.4g}".format(
                    layer.name, layer.calls, layer.elements, layer.mean_drift, layer.var_drift, w=width))
            else:
                rows.append("{:<{w}}  {:>6}  {:>12}  {:>23}".format(
                    layer.name, 0, 0, "never ran: stats kept", w=width))
        return "\n".join(rows)
