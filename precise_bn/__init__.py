"""precise-bn: exact population BatchNorm statistics for PyTorch and Caffe2 models.

    from precise_bn import recompute
    report = recompute(model, train_loader, num_batches=200)
    print(report)
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    BackendUnavailableError,
    BatchError,
    CheckpointError,
    ConcurrentPassError,
    ConfigError,
    DistributedError,
    EmptyDataError,
    LayerError,
    NonFiniteStatsError,
    ParameterChangedError,
    PreciseBNError,
    PreciseBNWarning,
    UndoError,
    UnsafeCheckpointError,
)

#: Names imported on first use, by module: ``import precise_bn`` (and so the ``precise-bn``
#: command's start) does not wait for torch until something needs it.
_LAZY = {
    "recompute": ".api", "recalibrated": ".api", "update_bn": ".api", "update_bn_stats": ".api", "check": ".api",
    "PopulationStats": ".estimator", "BatchNormHelper": ".bn_helper", "PreciseBNHook": ".hooks",
    "Options": ".options", "get_bn_modules": ".pytorch.layers", "select_layers": ".pytorch.layers",
    "BNReport": ".report", "LayerReport": ".report", "CheckReport": ".staleness",
}

if TYPE_CHECKING:
    from .api import check, recalibrated, recompute, update_bn, update_bn_stats
    from .bn_helper import BatchNormHelper
    from .estimator import PopulationStats
    from .hooks import PreciseBNHook
    from .options import Options
    from .pytorch.layers import get_bn_modules, select_layers
    from .report import BNReport, LayerReport
    from .staleness import CheckReport


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError("module 'precise_bn' has no attribute {!r}".format(name))
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> Any:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "BNReport",
    "BackendUnavailableError",
    "BatchError",
    "BatchNormHelper",
    "CheckReport",
    "CheckpointError",
    "ConcurrentPassError",
    "ConfigError",
    "DistributedError",
    "EmptyDataError",
    "LayerError",
    "LayerReport",
    "NonFiniteStatsError",
    "Options",
    "ParameterChangedError",
    "PopulationStats",
    "PreciseBNError",
    "PreciseBNHook",
    "PreciseBNWarning",
    "UndoError",
    "UnsafeCheckpointError",
    "__version__",
    "check",
    "get_bn_modules",
    "recalibrated",
    "recompute",
    "select_layers",
    "update_bn",
    "update_bn_stats",
]
