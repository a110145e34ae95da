"""The package's exception types (all derive from PreciseBNError), its warning and :func:`warn`."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, NamedTuple, Sequence


class PreciseBNError(Exception):
    pass


class ConfigError(PreciseBNError, ValueError):
    """An argument or configuration value is invalid; the message names it."""


class EmptyDataError(PreciseBNError):
    """The data source gave no batch at all (on every rank), so there is nothing to measure."""


class BatchError(PreciseBNError, TypeError):
    """The model refused a batch as handed over; the message shows it and the ``forward_fn`` that fixes it."""


class NonFiniteStatsError(PreciseBNError, FloatingPointError):
    """A layer's batch statistics contain NaN or Inf; the message names the layer."""


class LayerError(PreciseBNError):
    """A BatchNorm layer cannot be recalibrated as asked (unmaterialised, not tracking stats, ...)."""


class ConcurrentPassError(PreciseBNError, RuntimeError):
    """Another pass runs on a module of the model (each would put back the other's half-done state)."""


class ParameterChangedError(PreciseBNError):
    """The forward wrote a parameter in place after a first batch that wrote none (docs/interrupts.md)."""

    advice = ("A statistics pass should not change weights: move that change out of forward (into the "
              "training step), or skip it when torch.is_grad_enabled() is False")


class DistributedError(PreciseBNError):
    """Another rank failed, timed out or disagrees on what is merged; no rank changed its model."""


class Fix(NamedTuple):
    """One way out of a :class:`CheckpointError`: call again with ``option=value``."""

    option: str
    value: Any
    why: str = ""


class UndoError(PreciseBNError):
    """``report.undo()`` would overwrite statistics changed since the call (or undo twice); nothing was undone."""


class CheckpointError(PreciseBNError):
    """A checkpoint cannot be read, matched or written: ``message`` says why, ``fixes`` what solves it."""

    def __init__(self, message: str, *fixes: Fix):
        super().__init__(message, *fixes)
        self.message = message
        self.fixes = fixes

    def __str__(self) -> str:
        return join_fixes(self.message, ["{}={!r}".format(f.option, f.value) for f in self.fixes], self.fixes)


def join_fixes(message: str, arguments: Sequence[str], fixes: Sequence[Fix]) -> str:
    parts = ["pass {}{}".format(a, " " + f.why if f.why else "") for a, f in zip(arguments, fixes)]
    if "\n" in message:
        return "\n".join([message] + ["  likely fix: " + p for p in parts])
    return "; ".join([message] + parts)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint would need to run code to load, and it was not marked as trusted."""


class BackendUnavailableError(PreciseBNError, ImportError):
    """An optional backend or integration is not installed; the message says how to get it."""


class PreciseBNWarning(UserWarning):
    """Something to know that does not stop the job (short data, unused layers)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def _passed_through(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR + os.sep) or path == _CONTEXTLIB


def warn(message: str) -> None:
    """A :class:`PreciseBNWarning` at the first frame outside the package and contextlib (``with``)."""
    frame = sys._getframe(1)
    level = 2
    while frame is not None and _passed_through(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, PreciseBNWarning, stacklevel=level)
