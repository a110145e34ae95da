"""A thin layer over ``torch.distributed``: who am I, and the exact cross-rank merge.

Everything here is the identity on a single process (no process group, or a torch build
without distributed support), so callers never branch on it.

Why gather-then-merge instead of ``all_reduce(SUM)`` of moments: a floating-point all-reduce
sums in an order the backend chooses (ring, tree), which can differ between ranks and runs, so
ranks could end with stats that differ in the last bits. Gathering every rank's
``(count, mean, M2)`` and merging them in rank order with Chan's formula performs the very same
float64 operations on every rank: the results are bit-identical and weighted by true counts.
The payload is a few numbers per channel, so one gather per pass costs nothing.

Why a header round first: ``all_gather`` needs equal sizes on every rank and matches calls by
order only. Exchanging a fixed-size header (status, layout fingerprint, batch and sample
counts) before the payload lets every rank see the same facts and take the same decision:
merge, or raise the same error on every rank, so that no rank is ever left waiting.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .errors import ConfigError, DistributedError
from .estimator import PopulationStats

_OK, _FAILED = 0, 1


def _dist():
    import torch.distributed as dist

    return dist


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    try:
        dist = _dist()
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def get_world_size(group=None) -> int:
    """Number of processes in ``group``; 1 without a process group."""
    return _dist().get_world_size(group) if is_distributed() else 1


def get_rank(group=None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    return _dist().get_rank(group) if is_distributed() else 0


def is_main_process() -> bool:
    """True on rank 0, and on a single process: the one that writes files."""
    return get_rank() == 0


def barrier(group=None) -> None:
    """Wait for every rank; a no-op on one process."""
    if get_world_size(group) > 1:
        _dist().barrier(group=group)


def collective_device(group=None) -> torch.device:
    """The device collectives of ``group`` run on: the current GPU for NCCL alone, else the CPU."""
    if is_distributed():
        backend = str(_dist().get_backend(group)).lower()
        if "nccl" in backend and "gloo" not in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Average ``tensor`` over the ranks of ``group`` in place and return it.

    The Caffe2-era utility: identity on one process. Every rank counts once, whatever it saw,
    so use it for values that are fine to average with equal weight (losses, metrics);
    population statistics go through :func:`merge_ranks`, which weights by element counts.
    """
    if not tensor.is_floating_point():
        raise ConfigError(
            "all_reduce_mean needs a floating-point tensor, got {}: the mean of integers is "
            "not an integer".format(tensor.dtype)
        )
    world = get_world_size(group)
    if world == 1:
        return tensor
    with torch.no_grad():
        buf = tensor.detach().to(collective_device(group))
        _dist().all_reduce(buf, group=group)
        tensor.copy_(buf.div_(world))
    return tensor


def _all_gather(tensor: torch.Tensor, group=None) -> List[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(get_world_size(group))]
    _dist().all_gather(parts, tensor, group=group)
    return [p.cpu() for p in parts]


def _layout(stats: Sequence[PopulationStats]) -> Tuple[int, int, int]:
    """(layers, channels, fingerprint of names and widths): equal on ranks that merge alike.

    A CRC32 is below 2**32, so it travels exactly in float64.
    """
    text = "|".join("{}:{}".format(s.name, s.num_channels) for s in stats)
    return len(stats), sum(s.num_channels for s in stats), zlib.crc32(text.encode("utf-8"))


def _exchange_headers(
    status: int, layout: Tuple[int, int, int], batches: int, samples: int, group=None
) -> List[List[int]]:
    header = torch.tensor(
        [status, layout[0], layout[1], layout[2], batches, samples],
        dtype=torch.float64,
        device=collective_device(group),
    )
    return [[int(v) for v in h.tolist()] for h in _all_gather(header, group)]


def abort_merge(group=None) -> None:
    """Join the merge as a rank whose pass failed, so the others raise instead of waiting.

    Call it in place of :func:`merge_ranks` when this rank's pass raised, then re-raise the
    rank's own error. Every other rank's :func:`merge_ranks` raises :class:`DistributedError`
    naming the failed ranks. Identity on one process.
    """
    if get_world_size(group) > 1:
        _exchange_headers(_FAILED, (0, 0, 0), 0, 0, group)


@contextlib.contextmanager
def abort_merge_on_error(enabled: bool, group=None) -> Iterator[None]:
    """Around the part of a pass that may fail on one rank only (data loading, forwards).

    If the block raises an ``Exception`` and ``enabled``, call :func:`abort_merge` and re-raise:
    the failing rank leaves with its own error, the others with a :class:`DistributedError`.
    Leave :func:`merge_ranks` itself outside the block: a rank that merged must not also abort.
    """
    try:
        yield
    except Exception:
        if enabled:
            abort_merge(group)
        raise


class MergedStats(NamedTuple):
    """What :func:`merge_ranks` returns: merged per-layer estimators and the all-rank totals."""

    stats: List[PopulationStats]
    batches: int
    samples: int


def merge_ranks(
    stats: Sequence[PopulationStats], batches: int, samples: int, group=None
) -> MergedStats:
    """Merge every rank's per-layer estimators and sum the ranks' batch and sample counts.

    Every rank must pass the same layers (same names, same order, same channel counts); ranks
    may have seen different numbers of batches and samples, zero included. Two collectives per
    call, whatever the number of layers: the header round, then one gather of all layers'
    ``(count, mean, M2)``, calls and clamped counts packed in one float64 vector. Every rank
    merges the gathered parts on the CPU in rank order, so all end with identical bits.

    Raises:
        DistributedError: on every rank alike, when the ranks' layers differ or a rank
            reported a failed pass with :func:`abort_merge`.
    """
    world = get_world_size(group)
    if world == 1:
        return MergedStats(list(stats), batches, samples)
    headers = _exchange_headers(_OK, _layout(stats), batches, samples, group)
    failed = [rank for rank, h in enumerate(headers) if h[0] != _OK]
    if failed:
        raise DistributedError(
            "rank(s) {} failed during the BatchNorm pass (their own error says why); no rank "
            "merged any stats".format(failed)
        )
    if len({tuple(h[1:4]) for h in headers}) != 1:
        raise DistributedError(
            "ranks disagree on the BatchNorm layers to merge: (layers, channels, checksum of "
            "names and widths) per rank = {}; every rank must recalibrate the same layers of the "
            "same model".format([tuple(h[1:4]) for h in headers])
        )
    total_batches = sum(h[4] for h in headers)
    total_samples = sum(h[5] for h in headers)
    device = collective_device(group)
    tallies = torch.tensor(
        [float(v) for s in stats for v in (s.calls, s.clamped)], dtype=torch.float64
    )
    payload = torch.cat([s.state().to(device) for s in stats] + [tallies.to(device)])
    tally_start = payload.numel() - 2 * len(stats)
    gathered = [(part, part[tally_start:].tolist()) for part in _all_gather(payload, group)]
    merged = []
    offset = 0
    for index, local in enumerate(stats):
        width = 1 + 2 * local.num_channels
        total = PopulationStats(local.num_channels, name=local.name, device=torch.device("cpu"))
        for part, rank_tallies in gathered:
            rank_stats = PopulationStats.from_state(
                part[offset : offset + width], name=local.name, calls=int(rank_tallies[2 * index])
            )
            rank_stats.clamped = int(rank_tallies[2 * index + 1])
            total.merge(rank_stats)
        merged.append(_to_device(total, local.device))
        offset += width
    return MergedStats(merged, total_batches, total_samples)


def _to_device(stats: PopulationStats, device: torch.device) -> PopulationStats:
    stats.mean = stats.mean.to(device)
    stats.m2 = stats.m2.to(device)
    return stats


def resolve_sync(sync: Optional[bool], group=None) -> bool:
    """Whether to merge: ``sync=None`` means whenever ``group`` spans more than one process."""
    spans = get_world_size(group) > 1
    return spans if sync is None else bool(sync) and spans
