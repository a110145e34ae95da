"""precise-bn: exact population BatchNorm statistics for PyTorch and Caffe2 models.

    from precise_bn import update_bn_stats
    report = update_bn_stats(model, train_loader, num_iters=200)
    print(report)
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    DistributedError,
    EmptyDataError,
    LayerError,
    NonFiniteStatsError,
    PreciseBNError,
    PreciseBNWarning,
    UnsafeCheckpointError,
)
from .estimator import PopulationStats
from .helper import BatchNormHelper
from .hooks import PreciseBNHook
from .report import BNReport, LayerReport
from .torch_backend import get_bn_modules, select_layers, update_bn, update_bn_stats

__all__ = [
    "BNReport",
    "BackendUnavailableError",
    "BatchNormHelper",
    "CheckpointError",
    "ConfigError",
    "DistributedError",
    "EmptyDataError",
    "LayerError",
    "LayerReport",
    "NonFiniteStatsError",
    "PopulationStats",
    "PreciseBNError",
    "PreciseBNHook",
    "PreciseBNWarning",
    "UnsafeCheckpointError",
    "get_bn_modules",
    "select_layers",
    "update_bn",
    "update_bn_stats",
]
