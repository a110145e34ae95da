"""Every option of a recalibration in one object, checked once, when it is given.

Hooks and callbacks recompute hours into training; a typo or a bad value must fail when they
are built, not then. So every entry point turns its keyword arguments into :class:`Options`
at once (:meth:`Options.build` rejects unknown names with a ``TypeError`` naming them, and each
value is checked in ``__post_init__``), and the same object travels down to the pass.
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import numbers
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch
from torch import nn

from .errors import ConfigError

ForwardFn = Callable[[nn.Module, Any], Any]
LayerSpec = Union[None, str, Sequence[Union[str, nn.Module]]]

#: Seconds a rank waits in a collective before it gives up on the others.
DEFAULT_TIMEOUT = 300.0
#: Batches read before a precision-driven stop may happen (see ``rtol``).
DEFAULT_MIN_BATCHES = 16


def _positive_int(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ConfigError("{} must be a positive integer{}, got {!r}".format(
            name, " or None" if allow_none else "", value))


def _flag(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        raise ConfigError("{} must be True or False{}, got {!r}".format(
            name, " (or None)" if allow_none else "", value))


def _device(value: Any) -> Optional[torch.device]:
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("device {!r} is not a device: {}".format(value, exc)) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device {!r}: this machine or torch build has no CUDA device "
                              "(torch.cuda.is_available() is False); use 'cpu'".format(str(value)))
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError("device {!r}: there are only {} CUDA device(s), numbered from 0".format(
                str(value), torch.cuda.device_count()))
    return device


def _layers(value: Any) -> None:
    if value is None or value == "all":
        return
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError("layers must be None, 'all' or a list of modules or qualified names, "
                          "got {!r}".format(value))
    for item in value:
        if not isinstance(item, (str, nn.Module)):
            raise ConfigError("layers: {!r} is neither a module nor a qualified name".format(item))


def _autocast(value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if value not in (torch.float16, torch.bfloat16):
        raise ConfigError("autocast must be None, True/False, torch.float16 or torch.bfloat16, "
                          "got {!r}".format(value))


def _timeout(value: Any) -> float:
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not seconds > 0:
        raise ConfigError("timeout must be a positive number of seconds or a timedelta, "
                          "got {!r}".format(value))
    return float(seconds)


@dataclasses.dataclass(frozen=True)
class Options:
    """How one recalibration runs. See :func:`precise_bn.recompute` for each field's meaning."""

    num_batches: Optional[int] = None
    num_samples: Optional[int] = None
    forward_fn: Optional[ForwardFn] = None
    device: Optional[torch.device] = None
    layers: LayerSpec = None
    exact: bool = False
    autocast: Union[None, bool, torch.dtype] = None
    sync: Optional[bool] = None
    group: Any = None
    unbiased: bool = False
    progress: Optional[bool] = None
    rtol: Optional[float] = None
    min_batches: int = DEFAULT_MIN_BATCHES
    log_period: Optional[int] = 20
    timeout: float = DEFAULT_TIMEOUT
    prior: float = 0.0

    def __post_init__(self) -> None:
        _positive_int("num_batches", self.num_batches)
        _positive_int("num_samples", self.num_samples)
        if self.num_samples is not None and not isinstance(self.num_samples, int):
            object.__setattr__(self, "num_samples", int(self.num_samples))
        if self.forward_fn is not None and not callable(self.forward_fn):
            raise ConfigError("forward_fn must be callable as forward_fn(model, batch), got {!r}".format(
                self.forward_fn))
        object.__setattr__(self, "device", _device(self.device))
        _layers(self.layers)
        _flag("exact", self.exact)
        _autocast(self.autocast)
        _flag("sync", self.sync, allow_none=True)
        _flag("unbiased", self.unbiased)
        _flag("progress", self.progress, allow_none=True)
        if self.rtol is not None:
            if isinstance(self.rtol, bool) or not isinstance(self.rtol, numbers.Real) or not 0 < self.rtol < 1:
                raise ConfigError("rtol must be a number in (0, 1) or None, got {!r}".format(self.rtol))
            object.__setattr__(self, "rtol", float(self.rtol))
        _positive_int("min_batches", self.min_batches, allow_none=False)
        _positive_int("log_period", self.log_period)
        object.__setattr__(self, "timeout", _timeout(self.timeout))
        if isinstance(self.prior, bool) or not isinstance(self.prior, numbers.Real) or not 0 <= self.prior < float("inf"):
            raise ConfigError("prior must be a number of samples >= 0 (0: the target data alone), got {!r}".format(
                self.prior))
        object.__setattr__(self, "prior", float(self.prior))

    @classmethod
    def build(cls, where: str, **kwargs: Any) -> "Options":
        """``Options(**kwargs)``, but an unknown name raises ``TypeError`` naming ``where`` and
        the closest known option, as a misspelt keyword argument of a function would."""
        check_names(where, kwargs, [f.name for f in dataclasses.fields(cls)])
        return cls(**kwargs)

    def as_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments that build this object again."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "Options":
        """A copy with ``changes`` (checked like :meth:`build`)."""
        check_names("Options.replace", changes, [f.name for f in dataclasses.fields(self)])
        return dataclasses.replace(self, **changes)


def check_names(where: str, given: Any, known: Sequence[str]) -> None:
    """Raise ``TypeError`` for the first name of ``given`` not in ``known``, with a suggestion."""
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = "; did you mean {!r}?".format(close[0]) if close else ""
            raise TypeError("{}() got an unexpected keyword argument {!r}{}".format(where, name, hint))
