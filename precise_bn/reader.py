"""A DataLoader read through one of our own (same dataset, batches and workers; samplers copied
with generators of their own), so that a recomputation never changes what training reads:
persistent workers, stream samplers and buckets share state across iterators (docs/integrations.md)."""
from __future__ import annotations

import collections.abc
import copy
from typing import Any, Callable, Dict, Iterable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from .errors import ConfigError


class StreamShare(Sampler):
    """``range(size)``, a new permutation each pass (``set_epoch``; in order without ``shuffle``),
    strided by rank: what replaces a sampler that keeps one stream for all its iterators."""

    def __init__(self, size: int, shuffle: bool, rank: int, world: int, seed: int):
        self.size, self.shuffle, self.rank, self.world, self.seed = size, shuffle, rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed((self.seed + self.epoch) % 2 ** 63)
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        return iter(order[self.rank::self.world].tolist())

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world))


def _private_sampler(sampler: Any, size: int, seed: int) -> Any:
    if any(isinstance(value, collections.abc.Iterator) for value in getattr(sampler, "__dict__", {}).values()):
        world = getattr(sampler, "world_size", getattr(sampler, "num_replicas", 1))
        return StreamShare(size, bool(getattr(sampler, "shuffle", True)), int(getattr(sampler, "rank", 0)), int(world),
                           int(getattr(sampler, "seed", seed)))
    own = copy.copy(sampler)
    if hasattr(own, "generator") and (own.generator is None or isinstance(own.generator, torch.Generator)):
        own.generator = torch.Generator().manual_seed(seed)
    return own


def private_loader(loader: DataLoader, seed: int) -> DataLoader:
    """A DataLoader of its own read the way ``loader`` reads, seeded by ``seed``; a ConfigError for
    a batch sampler that cannot be rebuilt around another sampler."""
    settings: Dict[str, Any] = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                                    pin_memory=loader.pin_memory, timeout=loader.timeout,
                                    worker_init_fn=loader.worker_init_fn, generator=torch.Generator().manual_seed(seed),
                                    persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        settings.update(prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context)
    for name in ("pin_memory_device", "in_order"):  # newer torch versions
        if hasattr(loader, name):
            settings[name] = getattr(loader, name)
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **settings)
    size = len(dataset)  # type: ignore[arg-type]
    batches = loader.batch_sampler
    if batches is None or loader.batch_size is not None:
        sampler = _private_sampler(loader.sampler, size, seed)
        return DataLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, sampler=sampler,
                          **settings)
    try:
        own = type(batches)(_private_sampler(batches.sampler, size, seed), batches.batch_size, batches.drop_last)
    except (AttributeError, TypeError) as error:
        raise ConfigError("the DataLoader's batch sampler, a {}, cannot be rebuilt around a sampler of precise-bn's "
                          "own ({}): reading it could change what training reads; pass data=... (a DataLoader "
                          "of its own)".format(type(batches).__name__, error)) from error
    return DataLoader(dataset, batch_sampler=own, **settings)


def _sampler_of(loader: DataLoader) -> Any:
    batches = loader.batch_sampler
    return loader.sampler if batches is None or loader.batch_size is not None else getattr(batches, "sampler", None)


class PrivateReader:
    """The DataLoader ``current()`` returns at each pass (the last one while it returns None), read
    through :func:`private_loader`."""

    def __init__(self, current: Callable[[], Optional[DataLoader]]):
        self.current = current
        self._for: Optional[DataLoader] = None
        self._own: Optional[DataLoader] = None
        self.passes = 0

    def __iter__(self) -> Iterator[Any]:
        loader = self.current()
        if loader is not None and loader is not self._for:
            self._for, self._own = loader, private_loader(loader, torch.initial_seed())
        if self._own is None:
            raise ConfigError("no training DataLoader to read: pass data=...")
        sampler = _sampler_of(self._own)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.passes)
        self.passes += 1
        return iter(self._own)


def read_privately(data: Iterable[Any]) -> Iterable[Any]:
    """A DataLoader through a :class:`PrivateReader`; a wrapper holding one as ``loader`` (timm's
    ``PrefetchLoader``) as a shallow copy around one, its own work kept; anything else as it is."""
    if isinstance(data, DataLoader):
        return PrivateReader(lambda: data)
    if isinstance(getattr(data, "loader", None), DataLoader):
        own = copy.copy(data)
        try:
            own.loader = PrivateReader(lambda: data.loader)  # type: ignore[attr-defined]
        except AttributeError:  # a read-only property: nothing to redirect
            return data
        return own
    return data
