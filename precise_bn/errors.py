"""The package's exception types (every error a user can act on derives from PreciseBNError), its
warning type, and :func:`warn`, which names the user's line."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, NamedTuple, Sequence


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


class ConcurrentPassError(PreciseBNError, RuntimeError):
    """Another pass is running on the model (or on a module it shares with the model), in another
    thread or further up this one's stack; nothing was changed. Passes on one model cannot
    overlap: each would put back the other's half-done state."""


class ParameterChangedError(PreciseBNError):
    """The model's forward wrote a parameter in place on a later batch of a pass whose first batch
    wrote none, so that its copy of the parameters was already released; the message names it. No
    statistics were written and every buffer was put back; that parameter holds what the forward
    wrote. (A parameter written on the first batch is put back, and the pass completes: see
    ``BNReport.changed_parameters``.)"""

    #: What to do about a forward that writes parameters, for this error and the pass's warning.
    advice = ("A statistics pass should not change weights: move that change out of forward (into the "
              "training step), or skip it when torch.is_grad_enabled() is False")


class DistributedError(PreciseBNError):
    """Another rank failed, timed out or disagrees on what is merged; no rank changed its model."""


class Fix(NamedTuple):
    """One way out of a :class:`CheckpointError`: call again with the keyword argument ``option``
    set to ``value`` (``why`` says what that does). The command line shows the same advice as
    its flag (``key`` -> ``--key``, ``trust`` -> ``--trust-checkpoint``)."""

    option: str
    value: Any
    why: str = ""


class UndoError(PreciseBNError):
    """``report.undo()`` would overwrite statistics changed since the call (or undo twice); nothing was undone."""


class CheckpointError(PreciseBNError):
    """A checkpoint cannot be read, matched to the model, or written; the message names file and key.

    ``message`` is the problem alone; ``fixes`` the arguments that would solve it, as fields
    (so that a caller can act on them, and the command line can name its own flags). ``str()``
    gives both, the fixes as Python keyword arguments.
    """

    def __init__(self, message: str, *fixes: Fix):
        super().__init__(message, *fixes)
        self.message = message
        self.fixes = fixes

    def __str__(self) -> str:
        return join_fixes(self.message, ["{}={!r}".format(f.option, f.value) for f in self.fixes], self.fixes)


def join_fixes(message: str, arguments: Sequence[str], fixes: Sequence[Fix]) -> str:
    """``message`` followed by each fix (``arguments`` spell each one's setting): after "; " on a
    one-line message, one line each under a longer one."""
    parts = ["pass {}{}".format(a, " " + f.why if f.why else "") for a, f in zip(arguments, fixes)]
    if "\n" in message:
        return "\n".join([message] + ["  likely fix: " + p for p in parts])
    return "; ".join([message] + parts)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint would need to run code to load, and it was not marked as trusted."""


class BackendUnavailableError(PreciseBNError, ImportError):
    """An optional backend or integration is not installed; the message says how to get it."""


class PreciseBNWarning(UserWarning):
    """Something the user should know but that does not stop the job (short data, unused layers)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: ``with recalibrated(...)`` enters the package through contextlib's ``__enter__``.
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def _passed_through(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR + os.sep) or path == _CONTEXTLIB


def warn(message: str) -> None:
    """Issue a :class:`PreciseBNWarning` that points at the user's line: the first frame, going
    outwards, whose code is neither the package's (however deep in it the warning arose) nor
    contextlib's."""
    frame = sys._getframe(1)
    level = 2
    while frame is not None and _passed_through(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, PreciseBNWarning, stacklevel=level)
