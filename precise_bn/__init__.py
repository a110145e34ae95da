"""precise-bn: exact population BatchNorm statistics for PyTorch and Caffe2 models.

    from precise_bn import recompute
    report = recompute(model, train_loader, num_batches=200)
    print(report)
"""
from __future__ import annotations

from ._version import __version__
from .api import recalibrated, recompute, update_bn, update_bn_stats
from .errors import (
    BackendUnavailableError,
    BatchError,
    CheckpointError,
    ConfigError,
    DistributedError,
    EmptyDataError,
    LayerError,
    NonFiniteStatsError,
    PreciseBNError,
    PreciseBNWarning,
    UndoError,
    UnsafeCheckpointError,
)
from .estimator import PopulationStats
from .helper import BatchNormHelper
from .hooks import PreciseBNHook
from .options import Options
from .pytorch.layers import get_bn_modules, select_layers
from .report import BNReport, LayerReport

__all__ = [
    "BNReport",
    "BackendUnavailableError",
    "BatchError",
    "BatchNormHelper",
    "CheckpointError",
    "ConfigError",
    "DistributedError",
    "EmptyDataError",
    "LayerError",
    "LayerReport",
    "NonFiniteStatsError",
    "Options",
    "PopulationStats",
    "PreciseBNError",
    "PreciseBNHook",
    "PreciseBNWarning",
    "UndoError",
    "UnsafeCheckpointError",
    "__version__",
    "get_bn_modules",
    "recalibrated",
    "recompute",
    "select_layers",
    "update_bn",
    "update_bn_stats",
]
