"""The private reader: reading a DataLoader through it, in the middle of an epoch, never changes
what the loader itself yields next, whatever state its sampler, batch sampler or generators keep;
what it reads is what the loader would read (this rank's share, the same batches' shape)."""
from __future__ import annotations

import itertools
from typing import Iterator, List

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, \
    Sampler

from precise_bn import ConfigError
from precise_bn.reader import PrivateReader, StreamShare, private_loader

N = 24


class Indexed(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class OneStream(Sampler):
    """Like mmengine's InfiniteSampler: one index stream, made once, for every iterator."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1, seed: int = 5):
        self.size, self.rank, self.world_size, self.seed, self.shuffle = size, rank, world_size, seed, True
        self.indices = self._stream()

    def _stream(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield from itertools.islice(torch.randperm(self.size, generator=g).tolist(), self.rank, None,
                                        self.world_size)

    def __iter__(self) -> Iterator[int]:
        yield from self.indices

    def __len__(self) -> int:
        return self.size


class Buckets(BatchSampler):
    """Like mmdet's AspectRatioBatchSampler: even and odd indices batched apart, in buckets kept
    on the object between the indices it reads."""

    def __init__(self, sampler: Sampler, batch_size: int, drop_last: bool = False):
        super().__init__(sampler, batch_size, drop_last)
        self.buckets: List[List[int]] = [[], []]

    def __iter__(self):
        for i in self.sampler:
            bucket = self.buckets[i % 2]
            bucket.append(i)
            if len(bucket) == self.batch_size:
                yield bucket[:]
                del bucket[:]
        rest, self.buckets = self.buckets[0] + self.buckets[1], [[], []]
        if rest:
            yield rest


class Fixed(BatchSampler):
    """A batch sampler whose constructor is not BatchSampler's."""

    def __init__(self, batches: List[List[int]]):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def take(iterator, n: int) -> List[List[int]]:
    return [batch.tolist() for batch in itertools.islice(iterator, n)]


def yields_the_same_with_a_private_read_between(make_loader) -> List[List[int]]:
    """What the training loader yields, 6 batches, is the same with a private pass read after
    the first 2 (and one more private batch); returns the private batches."""
    alone = take(iter(make_loader()), 6)
    loader = make_loader()
    training = iter(loader)
    first = take(training, 2)
    reader = PrivateReader(lambda: loader)
    private = take(iter(reader), 4 * N) + take(iter(reader), 1)  # a pass (bounded, should it not end), and one
    assert first + take(training, 4) == alone
    return private


def test_a_sampler_that_keeps_one_stream_is_replaced_by_its_share_and_never_advanced():
    private = yields_the_same_with_a_private_read_between(
        lambda: DataLoader(Indexed(), batch_size=4, sampler=OneStream(N, rank=1, world_size=2)))
    first_pass = sorted(i for batch in private[:3] for i in batch)
    assert len(private) == 4 and len(first_pass) == 12 and len(set(first_pass)) == 12  # a pass: this rank's share
    own = StreamShare(N, True, 1, 2, 5)
    shares = []
    for epoch in (0, 1):
        own.set_epoch(epoch)
        shares.append(list(own))
    assert shares[0] != shares[1]  # a new order each pass
    union = set(shares[0]) | set(StreamShare(N, True, 0, 2, 5))
    assert union == set(range(N))  # the two ranks' shares of one pass: every index once


def test_a_batch_sampler_with_state_is_rebuilt_around_the_private_sampler():
    private = yields_the_same_with_a_private_read_between(
        lambda: DataLoader(Indexed(), batch_sampler=Buckets(RandomSampler(Indexed(), generator=torch.Generator()
                                                                          .manual_seed(1)), 3)))
    assert all(len({i % 2 for i in batch}) == 1 for batch in private[:-1])  # grouped as the original groups


def test_a_batch_sampler_that_cannot_be_rebuilt_is_named():
    loader = DataLoader(Indexed(), batch_sampler=Fixed([[0, 1], [2, 3]]))
    with pytest.raises(ConfigError, match="batch sampler, a Fixed, cannot be rebuilt.*pass data="):
        iter(PrivateReader(lambda: loader))


def test_a_distributed_sampler_is_read_for_this_rank_and_its_epoch_left_alone():
    sampler = DistributedSampler(Indexed(), num_replicas=2, rank=1, shuffle=True, seed=2)
    sampler.set_epoch(7)
    loader = DataLoader(Indexed(), batch_size=4, sampler=sampler)
    reader = PrivateReader(lambda: loader)
    passes = [sorted(int(i) for batch in reader for i in batch) for _ in range(2)]
    assert sampler.epoch == 7
    for epoch, read in enumerate(passes):
        shard = DistributedSampler(Indexed(), num_replicas=2, rank=1, shuffle=True, seed=2)
        shard.set_epoch(epoch)
        assert read == sorted(shard)  # rank 1's share of pass ``epoch``
    assert passes[0] != passes[1]


def test_the_loaders_generators_are_never_drawn_from():
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True, generator=generator)
    before = generator.get_state()
    reader = PrivateReader(lambda: loader)
    read = [[int(i) for i in batch] for _ in range(2) for batch in reader]
    assert torch.equal(generator.get_state(), before)
    again = PrivateReader(lambda: loader)
    assert read == [[int(i) for i in batch] for _ in range(2) for batch in again]  # its own seeds: reproducible
    assert sorted(i for batch in read[:6] for i in batch) == list(range(N))


def test_the_private_loader_reads_as_the_loader_does():
    def collate(samples):
        return torch.stack(samples) * 10

    loader = DataLoader(Indexed(), batch_size=5, drop_last=True, collate_fn=collate, timeout=0,
                        worker_init_fn=None, pin_memory=False)
    own = private_loader(loader, seed=0)
    assert own is not loader and own.sampler is not loader.sampler
    for name in ("dataset", "batch_size", "drop_last", "collate_fn", "num_workers", "pin_memory", "timeout",
                 "worker_init_fn", "persistent_workers"):
        assert getattr(own, name) == getattr(loader, name), name
    assert [b.tolist() for b in own] == [b.tolist() for b in loader]  # sequential stays sequential


def test_unbatched_and_iterable_loaders():
    assert [int(x) for x in PrivateReader(lambda: DataLoader(Indexed(), batch_size=None))] == list(range(N))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    assert [b.tolist() for b in PrivateReader(lambda: DataLoader(Stream(), batch_size=4))] == \
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_the_loader_is_looked_up_at_each_pass_and_the_last_one_read_when_there_is_none():
    current = [DataLoader(Indexed(), batch_size=N)]
    reader = PrivateReader(lambda: current[0])
    assert len(list(reader)) == 1
    current[0] = None  # a framework outside training
    assert len(list(reader)) == 1
    current[0] = DataLoader(Indexed(), batch_size=N // 2)  # rebuilt between epochs
    assert len(list(reader)) == 2
    with pytest.raises(ConfigError, match="no training DataLoader"):
        iter(PrivateReader(lambda: None))
