"""How batches reach the model: the calling convention, device moves, sample counts, budgets."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Tuple

import torch

from .errors import ConfigError

ForwardFn = Callable[[torch.nn.Module, Any], Any]


def default_forward(model: torch.nn.Module, batch: Any) -> Any:
    """Run ``model`` on ``batch`` with the convention shared by fvcore and swa_utils.

    * a tensor: ``model(batch)``;
    * a list/tuple whose first item is a tensor, e.g. ``(input, target)``: ``model(batch[0])``
      (the ``torch.optim.swa_utils.update_bn`` convention);
    * a mapping with an ``"input"`` key (ClassyVision samples): ``model(batch["input"])``;
    * anything else, e.g. detectron2's list of dicts: ``model(batch)`` as fvcore does.
    Pass ``forward_fn(model, batch)`` for any other convention.
    """
    if isinstance(batch, (list, tuple)) and batch and torch.is_tensor(batch[0]):
        return model(batch[0])
    if isinstance(batch, Mapping) and "input" in batch:
        return model(batch["input"])
    return model(batch)


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
    """Samples in a batch: the leading size of the tensor the model gets, else its length."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        if "input" in batch:
            return count_samples(batch["input"])
        return count_samples(next(iter(batch.values()))) if batch else 0
    if isinstance(batch, (list, tuple)):
        return count_samples(batch[0]) if batch and torch.is_tensor(batch[0]) else len(batch)
    return 1


def check_budget(num_iters: Optional[int], num_samples: Optional[int]) -> None:
    """Validate the budget arguments: positive integers, or None for no limit."""
    for name, value in (("num_iters", num_iters), ("num_samples", num_samples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError("{} must be a positive integer, got {!r}".format(name, value))


def take_budget(
    batches: Iterator[Any], num_iters: Optional[int], num_samples: Optional[int]
) -> Iterator[Tuple[Any, int]]:
    """Yield ``(batch, samples)`` until ``num_iters`` batches or ``num_samples`` samples are seen.

    A batch is never cut: the one that crosses ``num_samples`` is used whole.
    """
    seen_iters = seen_samples = 0
    while (num_iters is None or seen_iters < num_iters) and (
        num_samples is None or seen_samples < num_samples
    ):
        try:
            batch = next(batches)
        except StopIteration:
            return
        samples = count_samples(batch)
        seen_iters += 1
        seen_samples += samples
        yield batch, samples


class CyclingBatches:
    """An endless iterator over a finite iterable that starts a new pass when one runs out.

    Kept across calls by the helper and the hooks so that successive recalibrations see fresh
    batches and never silently get fewer than asked. Raises ``StopIteration`` only when a whole
    new pass yields nothing (an empty data source).
    """

    def __init__(self, data: Iterable[Any]):
        self.data = data
        self.passes = 0
        self._it: Optional[Iterator[Any]] = None

    def __iter__(self) -> "CyclingBatches":
        return self

    def __next__(self) -> Any:
        if self._it is not None:
            try:
                return next(self._it)
            except StopIteration:
                pass
        self._it = iter(self.data)
        self.passes += 1
        return next(self._it)


def peek(batches: Iterator[Any]) -> Tuple[bool, Iterator[Any]]:
    """Tell whether ``batches`` has at least one item without losing it."""
    for first in batches:
        return True, itertools.chain([first], batches)
    return False, iter(())
