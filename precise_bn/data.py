"""How batches reach the model: calling conventions, device moves, sample counts, budgets."""
from __future__ import annotations

import collections.abc
from typing import Any, Iterable, Iterator, Mapping, Optional, Tuple

import torch
from torch import nn

from .errors import EmptyDataError, warn
from .options import ForwardFn
from .reader import read_privately


def smart_forward(model: nn.Module, batch: Any) -> Any:
    """The default forward: a tensor ``model(batch)``, ``(input, target, ...)`` ``model(batch[0])``,
    ``{"input": x, ...}`` ``model(x)`` (ClassyVision), anything else ``model(batch)``."""
    return model(_smart_input(batch)[0])


def _smart_input(batch: Any) -> Tuple[Any, bool]:
    """What :func:`smart_forward` hands the model, and whether one of its rules knew the batch."""
    if torch.is_tensor(batch):
        return batch, True
    if isinstance(batch, (list, tuple)) and batch and torch.is_tensor(batch[0]):
        return batch[0], True
    if isinstance(batch, Mapping) and "input" in batch:
        return batch["input"], True
    return batch, False


def recognised(batch: Any) -> bool:
    """True when :func:`smart_forward` knows what part of ``batch`` is the input."""
    return _smart_input(batch)[1]


def whole_batch_forward(model: nn.Module, batch: Any) -> Any:
    """fvcore's convention: ``model(batch)``, whatever the batch is."""
    return model(batch)


def input_key_forward(key: str) -> ForwardFn:
    """``model(batch[key])``: for mappings whose input sits under another key than ``"input"``."""

    def forward(model: nn.Module, batch: Any) -> Any:
        return model(batch[key])

    forward.__qualname__ = "input_key_forward({!r})".format(key)
    return forward


def describe(batch: Any, depth: int = 0) -> str:
    """A one-line picture of a batch's structure: types, keys and tensor shapes."""
    if torch.is_tensor(batch):
        return "Tensor[{}] {}".format(", ".join(str(s) for s in batch.shape), str(batch.dtype).replace("torch.", ""))
    if depth >= 2:
        return type(batch).__name__
    if isinstance(batch, Mapping):
        items = ["{!r}: {}".format(k, describe(v, depth + 1)) for k, v in list(batch.items())[:8]]
        more = ", ..." if len(batch) > 8 else ""
        return "{}{{{}{}}}".format("" if type(batch) is dict else type(batch).__name__, ", ".join(items), more)
    if isinstance(batch, (list, tuple)):
        items = [describe(v, depth + 1) for v in list(batch)[:4]]
        more = ", ... ({} items)".format(len(batch)) if len(batch) > 4 else ""
        left, right = ("[", "]") if isinstance(batch, list) else ("(", ")")
        return "{}{}{}{}".format(left, ", ".join(items), more, right)
    return type(batch).__name__


def move_to_device(batch: Any, device: Optional[torch.device]) -> Any:
    """Move every tensor nested in lists, tuples and mappings to ``device``."""
    if device is None:
        return batch
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)((k, move_to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def count_samples(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor, else its length."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        if "input" in batch:
            return count_samples(batch["input"])
        return count_samples(next(iter(batch.values()))) if batch else 0
    if isinstance(batch, (list, tuple)):
        return count_samples(batch[0]) if batch and torch.is_tensor(batch[0]) else len(batch)
    return 1


class DefaultBudget(int):
    """A batch budget the caller did not choose, so that a short pass does not say it was asked for."""


#: fvcore's default ``num_iters``, the batches ``update_bn_stats`` and the command read without a budget.
DEFAULT_ITERS = DefaultBudget(200)


def planned_batches(data: Iterable[Any], num_batches: Optional[int]) -> Optional[int]:
    """The batches a pass will read, if known before it starts: the budget capped by the data's length."""
    try:
        length: Optional[int] = len(data)  # type: ignore[arg-type]
    except TypeError:
        length = None
    if num_batches is None:
        return length
    return num_batches if length is None else min(num_batches, length)


def batches_for_samples(done: int, samples: int, num_samples: int, cap: Optional[int]) -> Optional[int]:
    """How many batches a ``num_samples`` budget reads in all, once ``done`` batches held
    ``samples``: a batch is never cut, so the last one takes the count past the budget (60
    samples in batches of 16 read 4 batches, 64 samples); the batches to come are taken to be
    as large as those so far, on average. ``cap``: a limit known beforehand (the data's length,
    a batch budget). None while nothing tells."""
    if samples >= num_samples:
        total: Optional[int] = done
    elif samples > 0:
        total = done + -(-(num_samples - samples) * done // samples)  # ceiling division, in integers
    else:
        total = None
    return cap if total is None else total if cap is None else min(total, cap)


_END = object()


class CyclingBatches:
    """An endless iterator over a re-iterable source, kept across a hook's calls so that each sees
    fresh batches and never fewer than asked (a DataLoader read privately, :mod:`.reader`). A
    single-pass source gets a warning, then an ``EmptyDataError`` when it runs out."""

    def __init__(self, data: Iterable[Any]):
        self.data = read_privately(data)
        self.passes = 0
        self.read = 0
        self._it: Optional[Iterator[Any]] = None
        self.single_pass = isinstance(data, collections.abc.Iterator)
        if self.single_pass:
            warn("the data is a single-pass {} that cannot start again: recomputations after it runs "
                 "out will fail; pass a list of batches or a DataLoader".format(type(data).__name__))

    def __iter__(self) -> "CyclingBatches":
        return self

    def __next__(self) -> Any:
        batch = _END if self._it is None else next(self._it, _END)
        if batch is _END:
            if self.single_pass and self._it is not None:
                raise EmptyDataError(
                    "the data, a single-pass {}, ran out after {} batches and cannot start again: "
                    "pass a list of batches or a DataLoader (anything iter() restarts)".format(
                        type(self.data).__name__, self.read))
            self._it = iter(self.data)
            self.passes += 1
            batch = next(self._it)
        self.read += 1
        return batch

