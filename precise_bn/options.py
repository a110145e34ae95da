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
import inspect
import math
import numbers
import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .errors import ConfigError

ForwardFn = Callable[[nn.Module, Any], Any]
LayerSpec = Union[None, str, Sequence[Union[str, nn.Module]]]

#: Seconds a rank waits in a collective before it gives up on the others.
DEFAULT_TIMEOUT = 300.0
#: Batches between two log lines when there is no progress bar.
DEFAULT_LOG_PERIOD = 20
#: Batches read before a precision-driven stop may happen (see ``rtol``).
DEFAULT_MIN_BATCHES = 16
#: Options that no longer do anything, with why: accepted (so old calls run), ignored, warned about.
RETIRED = {"exact": "every call of every layer is measured in float64 since 0.2.0, whatever it says"}


def positive_int(name: str, value: Any, allow_none: bool = True) -> None:
    """Raise ConfigError naming ``name`` unless ``value`` is a positive integer (or None, if allowed)."""
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


def as_device(value: Any) -> Optional[torch.device]:
    """``value`` as a ``torch.device`` (None stays None); a ConfigError says why it cannot be one."""
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


def check_layers(value: Any) -> None:
    """Raise ConfigError unless ``value`` is a valid ``layers`` option (see :class:`Options`)."""
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


def _group(group: Any, sync: Optional[bool]) -> None:
    """Unless ``sync`` is False, refuse a ``group`` that does not contain this process
    (``new_group`` returns a placeholder on the ranks it leaves out), naming it."""
    if group is None or sync is False:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    outside = dist.GroupMember.NON_GROUP_MEMBER
    try:
        inside = group is not outside and dist.get_rank(group) >= 0
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConfigError("group={!r} is not a process group of this job: {}".format(group, exc)) from exc
    if not inside:
        raise ConfigError(
            "group={} does not contain this process (rank {} of the default group): new_group returns it on the "
            "ranks it leaves out; pass sync=False on those ranks, or a group that contains this one".format(
                "GroupMember.NON_GROUP_MEMBER" if group is outside else repr(group), dist.get_rank()))


def _timeout(value: Any) -> float:
    """Seconds; ``None`` and ``float("inf")`` are no limit (``math.inf``). A positive value is
    never rounded down to 0, which backends read as no limit."""
    if value is None:
        return math.inf
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not seconds > 0 or seconds != seconds:
        raise ConfigError("timeout must be a positive number of seconds, a timedelta, or None (no limit), "
                          "got {!r}".format(value))
    return float(seconds)


def _option(default: Any, meaning: str) -> Any:
    """A field of :class:`Options` with its meaning: the one text the README's option table, the
    command's ``--help`` and the hooks' documentation all show (``tests/test_options_agree.py``)."""
    return dataclasses.field(default=default, metadata={"help": meaning})


@dataclasses.dataclass(frozen=True)
class Options:
    """How one recalibration runs; each field's meaning is in its metadata (:func:`option_help`)."""

    num_batches: Optional[int] = _option(
        None, "read at most this many batches; with neither budget, the whole of `data` (or until `rtol` is met)")
    num_samples: Optional[int] = _option(None, "stop once this many samples were read (a batch is never cut)")
    forward_fn: Optional[ForwardFn] = _option(
        None, "`forward_fn(model, batch)`, any calling convention; by default a tensor is `model(batch)`, "
        "`(input, target, ...)` is `model(batch[0])`, `{\"input\": x, ...}` is `model(x)`, anything else "
        "`model(batch)`")
    device: Optional[torch.device] = _option(None, "move every tensor nested in a batch there first")
    layers: LayerSpec = _option(
        None, "`None`: BN layers in training mode (all of them if the whole model is in eval mode); `\"all\"`; "
        "or a list of modules / qualified names")
    autocast: Union[None, bool, torch.dtype] = _option(
        None, "run the forward under `torch.autocast` (`True` or a dtype); BN stays float32")
    sync: Optional[bool] = _option(
        None, "merge across ranks (`None`: whenever a process group spans several processes)")
    group: Any = _option(None, "the process group to merge over (`None`: the default group)")
    unbiased: bool = _option(False, "write `M2 / (n - 1)` instead of the population variance `M2 / n`")
    progress: Optional[bool] = _option(
        None, "a progress bar on stderr (`None`: when stderr is a terminal); its total is what will really be read")
    rtol: Optional[float] = _option(
        None, "stop early once about 95% of channels are within `rtol` of the population value (mean in std "
        "units, variance relative; docs/precision.md)")
    min_batches: int = _option(DEFAULT_MIN_BATCHES, "batches read, over all ranks, before `rtol` may stop the pass")
    timeout: float = _option(
        DEFAULT_TIMEOUT, "seconds a rank waits for the others before raising `DistributedError` "
        "(`None` or `inf`: no limit)")
    log_period: Optional[int] = _option(
        DEFAULT_LOG_PERIOD, "without a bar, a log line (logger `precise_bn`) every this many batches (`None`: none)")
    prior: float = _option(
        0.0, "test-time adaptation: pool the current running statistics, counted as this many samples, with "
        "the data's (`0`: the data alone; see docs/recalibration.md)")

    def __post_init__(self) -> None:
        positive_int("num_batches", self.num_batches)
        positive_int("num_samples", self.num_samples)
        if self.num_samples is not None and not isinstance(self.num_samples, int):
            object.__setattr__(self, "num_samples", int(self.num_samples))
        if self.forward_fn is not None and not callable(self.forward_fn):
            raise ConfigError("forward_fn must be callable as forward_fn(model, batch), got {!r}".format(
                self.forward_fn))
        object.__setattr__(self, "device", as_device(self.device))
        check_layers(self.layers)
        _autocast(self.autocast)
        _flag("sync", self.sync, allow_none=True)
        _group(self.group, self.sync)
        _flag("unbiased", self.unbiased)
        _flag("progress", self.progress, allow_none=True)
        if self.rtol is not None:
            if isinstance(self.rtol, bool) or not isinstance(self.rtol, numbers.Real) or not 0 < self.rtol < 1:
                raise ConfigError("rtol must be a number in (0, 1) or None, got {!r}".format(self.rtol))
            object.__setattr__(self, "rtol", float(self.rtol))
        positive_int("min_batches", self.min_batches, allow_none=False)
        positive_int("log_period", self.log_period)
        object.__setattr__(self, "timeout", _timeout(self.timeout))
        if isinstance(self.prior, bool) or not isinstance(self.prior, numbers.Real) or not 0 <= self.prior < float("inf"):
            raise ConfigError("prior must be a number of samples >= 0 (0: the target data alone), got {!r}".format(
                self.prior))
        object.__setattr__(self, "prior", float(self.prior))

    @classmethod
    def build(cls, where: str, *, also_known: Sequence[str] = (), **kwargs: Any) -> "Options":
        """``Options(**kwargs)``, but an unknown name raises ``TypeError`` naming ``where`` and
        the closest name ``where`` takes, as a misspelt keyword argument of a function would:
        ``also_known`` are the caller's own arguments, offered as hints with the options."""
        kwargs = drop_retired(where, kwargs)
        check_names(where, kwargs, [f.name for f in dataclasses.fields(cls)], also_known)
        return cls(**kwargs)

    def as_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments that build this object again."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "Options":
        """A copy with ``changes`` (checked like :meth:`build`)."""
        changes = drop_retired("Options.replace", changes)
        check_names("Options.replace", changes, [f.name for f in dataclasses.fields(self)])
        return dataclasses.replace(self, **changes)


def check_names(where: str, given: Any, known: Sequence[str], hints_too: Sequence[str] = ()) -> None:
    """Raise ``TypeError`` for the first name of ``given`` not in ``known``, suggesting the
    closest of ``known`` and ``hints_too`` (names ``where`` takes, but not in ``given``)."""
    for name in given:
        if name not in known and name not in RETIRED:
            close = difflib.get_close_matches(name, list(known) + list(hints_too), n=1)
            hint = "; did you mean {!r}?".format(close[0]) if close else ""
            raise TypeError("{}() got an unexpected keyword argument {!r}{}".format(where, name, hint))


def drop_retired(where: str, given: Dict[str, Any]) -> Dict[str, Any]:
    """``given`` without the :data:`RETIRED` options, each still checked and warned about."""
    kept = dict(given)
    for name, why in RETIRED.items():
        if name in kept:
            _flag(name, kept.pop(name))
            warnings.warn("{}: {} is deprecated and ignored: {}; drop it".format(where, name, why),
                          DeprecationWarning, stacklevel=3)
    return kept


def own_arguments(function: Callable[..., Any]) -> Tuple[str, ...]:
    """The named parameters of ``function`` but ``self``: what a hook's constructor takes
    besides the options, for :meth:`Options.build`'s ``also_known``."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name, p in inspect.signature(function).parameters.items()
                 if p.kind in kinds and name != "self")


def option_help(name: str) -> str:
    """The meaning of option ``name``, as every entry point documents it."""
    return OPTION_FIELDS[name].metadata["help"]


def options_table() -> str:
    """The README's table of options: name, default and meaning, one row each."""
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for name, f in OPTION_FIELDS.items():
        rows.append("| `{}` | `{!r}` | {} |".format(name, f.default, f.metadata["help"]))
    return "\n".join(rows)


OPTION_FIELDS = {f.name: f for f in dataclasses.fields(Options)}


if __name__ == "__main__":  # python -m precise_bn.options: the README's table, to paste
    print(options_table())
