"""A thin layer over ``torch.distributed``: who am I, and the exact cross-rank merge.

Everything here is the identity on a single process (no process group, or a torch build
without distributed support), so callers never branch on it.

Why gather-then-merge instead of ``all_reduce(SUM)`` of moments: a floating-point all-reduce
sums in an order the backend chooses (ring, tree), which can differ between ranks and runs, so
ranks could end with stats that differ in the last bits. Gathering every rank's
``(count, mean, M2)`` and merging them in rank order with Chan's formula performs the very same
float64 operations on every rank: the results are bit-identical and weighted by true counts.
The payload is a few numbers per channel, so one gather per pass costs nothing.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .errors import DistributedError
from .estimator import PopulationStats


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
    """The device collectives of ``group`` run on: the current GPU for NCCL, else the CPU."""
    if is_distributed() and _dist().get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Average ``tensor`` over the ranks of ``group`` in place and return it.

    The Caffe2-era utility: identity on one process. Use it for values that are fine to average
    with equal weight per rank; population statistics go through :func:`merge_stats` instead.
    """
    world = get_world_size(group)
    if world == 1:
        return tensor
    device = collective_device(group)
    buf = tensor.detach().to(device)
    _dist().all_reduce(buf, group=group)
    tensor.copy_(buf.div_(world))
    return tensor


def _all_gather(tensor: torch.Tensor, group=None) -> List[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(get_world_size(group))]
    _dist().all_gather(parts, tensor, group=group)
    return parts


def merge_stats(
    stats: Sequence[PopulationStats], batches: int, group=None
) -> Tuple[List[PopulationStats], int]:
    """Merge every rank's per-layer estimators; return the merged ones and the total batches.

    Every rank must pass the same layers in the same order (same channel counts); ranks may
    have seen different numbers of batches, zero included. Two collectives: a header that
    checks the layouts agree (so a mismatch raises on every rank instead of hanging or mixing
    numbers), then one gather of all layers' ``(count, mean, M2)`` packed in one vector.
    """
    world = get_world_size(group)
    if world == 1:
        return list(stats), batches
    device = collective_device(group)
    header = torch.tensor(
        [len(stats), sum(s.num_channels for s in stats), batches], dtype=torch.float64, device=device
    )
    headers = [h.cpu() for h in _all_gather(header, group)]
    layouts = {(int(h[0]), int(h[1])) for h in headers}
    if len(layouts) != 1:
        raise DistributedError(
            "ranks disagree on the BatchNorm layers to merge: (layers, channels) per rank = {}; "
            "every rank must recalibrate the same model".format(
                [(int(h[0]), int(h[1])) for h in headers]
            )
        )
    total_batches = int(sum(int(h[2]) for h in headers))
    calls = torch.tensor([float(s.calls) for s in stats], dtype=torch.float64)
    payload = torch.cat([s.state().to(device) for s in stats] + [calls.to(device)])
    gathered = [p.cpu() for p in _all_gather(payload, group)]
    merged = []
    offset = 0
    for index, local in enumerate(stats):
        width = 1 + 2 * local.num_channels
        total = PopulationStats(local.num_channels, name=local.name, device=torch.device("cpu"))
        for rank_payload in gathered:
            rank_calls = int(rank_payload[len(rank_payload) - len(stats) + index].item())
            part = PopulationStats.from_state(
                rank_payload[offset : offset + width], name=local.name, calls=rank_calls
            )
            total.merge(part)
        total.clamped = local.clamped
        merged.append(_to_device(total, local.device))
        offset += width
    return merged, total_batches


def _to_device(stats: PopulationStats, device: torch.device) -> PopulationStats:
    stats.mean = stats.mean.to(device)
    stats.m2 = stats.m2.to(device)
    return stats


def resolve_sync(sync: Optional[bool]) -> bool:
    """``sync=None`` means: merge across ranks whenever a process group is initialised."""
    return get_world_size() > 1 if sync is None else bool(sync) and get_world_size() > 1
