"""The package's exception types (every error a user can act on derives from PreciseBNError), its
warning type, and :func:`warn`, which names the user's line."""
from __future__ import annotations

import os
import sys
import warnings


class PreciseBNError(Exception):
    """Base class of every error raised by precise-bn."""


class ConfigError(PreciseBNError, ValueError):
    """An argument or configuration value is invalid; the message names it."""


class EmptyDataError(PreciseBNError):
    """The data source gave no batch at all (on every rank), so there is nothing to measure."""


class BatchError(PreciseBNError, TypeError):
    """The model could not take a batch the way it was handed over; the message shows the
    batch's structure and the options (``forward_fn``, ``input_key``) that fix it."""


class NonFiniteStatsError(PreciseBNError, FloatingPointError):
    """A layer's batch statistics contain NaN or Inf; the message names the layer."""


class LayerError(PreciseBNError):
    """A BatchNorm layer cannot be recalibrated as asked (unmaterialised, not tracking stats, ...)."""


class DistributedError(PreciseBNError):
    """Another rank failed, timed out or disagrees on what is merged; no rank changed its model."""


class UndoError(PreciseBNError):
    """``report.undo()`` would overwrite statistics changed since the call (or undo twice); nothing was undone."""


class CheckpointError(PreciseBNError):
    """A checkpoint cannot be read, matched to the model, or written; the message names file and key."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint would need to run code to load, and it was not marked as trusted."""


class BackendUnavailableError(PreciseBNError, ImportError):
    """An optional backend or integration is not installed; the message says how to get it."""


class PreciseBNWarning(UserWarning):
    """Something the user should know but that does not stop the job (short data, unused layers)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn(message: str) -> None:
    """Issue a :class:`PreciseBNWarning` that points at the user's line: the first frame, going
    outwards, whose code is not the package's (however deep in the package the warning arose)."""
    frame = sys._getframe(1)
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame = frame.f_back
        level += 1
    warnings.warn(message, PreciseBNWarning, stacklevel=level)
