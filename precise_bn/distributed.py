"""A thin layer over ``torch.distributed``: who am I, and rounds in which ranks agree or fail together.

Everything here is the identity on a single process (no process group, or a torch build
without distributed support), so callers never branch on it.

Why rounds of fixed-size headers: ``all_gather`` needs equal sizes on every rank and matches
calls by order only. Each round starts with every rank's header (status, batches and samples
so far, layout fingerprint), so every rank sees the same facts and takes the same decision:
go on, merge, or raise the same :class:`DistributedError`. A rank that fails, at any point of
its call, answers the round the others are in with a FAILED header (:meth:`Ranks.abort`); a
rank that died or hangs is given up after ``timeout`` seconds, and the error says which.

Why gather-then-merge instead of ``all_reduce(SUM)`` of moments: a floating-point all-reduce
sums in an order the backend chooses, which can differ between ranks and runs. Gathering every
rank's packed :class:`~precise_bn.estimator.PopulationStats` and merging them in rank order on
the CPU performs the very same float64 operations on every rank: the results, and every
decision taken from them, are bit-identical.
"""
from __future__ import annotations

import datetime
import zlib
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .errors import DistributedError
from .estimator import PopulationStats

ACTIVE, DONE, FAILED = 0, 1, 2
_HEADER = 6


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    try:
        dist = _dist()
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: Any = None) -> int:
    """Number of processes in ``group``; 1 without a process group."""
    return _dist().get_world_size(group) if is_distributed() else 1


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    return _dist().get_rank(group) if is_distributed() else 0


def is_main_process() -> bool:
    """True on rank 0, and on a single process: the one that writes files."""
    return get_rank() == 0


def barrier(group: Any = None) -> None:
    """Wait for every rank; a no-op on one process."""
    if get_world_size(group) > 1:
        _dist().barrier(group=group)


def resolve_sync(sync: Optional[bool], group: Any = None) -> bool:
    """Whether to merge: ``sync=None`` means whenever ``group`` spans more than one process."""
    spans = get_world_size(group) > 1
    return spans if sync is None else bool(sync) and spans


def collective_device(group: Any = None) -> torch.device:
    """The device collectives of ``group`` run on: the current GPU for NCCL alone, else the CPU."""
    if is_distributed():
        backend = str(_dist().get_backend(group)).lower()
        if "nccl" in backend and "gloo" not in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def layout(stats: Sequence[PopulationStats]) -> Tuple[int, int, int]:
    """(layers, channels, CRC32 of names and widths): equal on ranks that merge alike.

    A CRC32 is below 2**32, so it travels exactly in float64.
    """
    text = "|".join("{}:{}".format(s.name, s.num_channels) for s in stats)
    return len(stats), sum(s.num_channels for s in stats), zlib.crc32(text.encode("utf-8"))


class Header(NamedTuple):
    """One rank's header in a round."""

    status: int
    batches: int
    samples: int
    layout: Tuple[int, int, int]


class Ranks:
    """The rounds of one call across the ranks of ``group`` (the identity on one process).

    Every rank runs the same sequence of rounds; :meth:`exchange` raises
    :class:`DistributedError` on every rank alike when any rank reported a failure or the
    ranks disagree on the layout. After a rank raised, :meth:`abort` sends no more rounds.
    """

    def __init__(self, enabled: bool, group: Any = None, timeout: float = 300.0):
        self.world = get_world_size(group) if enabled else 1
        self.group = group
        self.timeout = timeout
        self.finished = self.world == 1
        self.device = collective_device(group) if self.world > 1 else torch.device("cpu")

    def _gather(self, tensor: torch.Tensor, what: str) -> List[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        try:
            work = _dist().all_gather(parts, tensor, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            self.finished = True  # the group is unusable now: no rank can be waited for again
            raise DistributedError(
                "rank {}: the {} with the other ranks failed or waited more than {:g} s (a rank "
                "died, hangs, or left early; timeout= sets the wait): {}".format(
                    get_rank(self.group), what, self.timeout, str(exc).splitlines()[0] if str(exc) else exc)
            ) from exc
        return [p.cpu() for p in parts]

    def exchange(self, status: int, batches: int = 0, samples: int = 0,
                 layout_: Tuple[int, int, int] = (0, 0, 0)) -> List[Header]:
        """One round of headers; returns every rank's, in rank order."""
        if self.world == 1:
            return [Header(status, batches, samples, layout_)]
        mine = torch.tensor([status, batches, samples, *layout_], dtype=torch.float64, device=self.device)
        assert mine.numel() == _HEADER
        headers = [Header(int(h[0]), int(h[1]), int(h[2]), tuple(int(v) for v in h[3:]))
                   for h in (part.tolist() for part in self._gather(mine, "exchange of status"))]
        failed = [rank for rank, h in enumerate(headers) if h.status == FAILED]
        if failed:
            self.finished = True
            raise DistributedError(
                "rank(s) {} failed (their own error says why); no rank changed its model".format(failed))
        layouts = {h.layout for h in headers if h.layout != (0, 0, 0)}
        if len(layouts) > 1:
            self.finished = True
            raise DistributedError(
                "ranks disagree on the BatchNorm layers to merge: (layers, channels, checksum of names "
                "and widths) per rank = {}; every rank must recalibrate the same layers of the same "
                "model".format([h.layout for h in headers]))
        return headers

    def gather_stats(self, stats: Sequence[PopulationStats]) -> List[PopulationStats]:
        """Every rank's stats merged in rank order, on the CPU: identical bits on every rank."""
        if self.world == 1:
            return list(stats)
        payload = torch.cat([torch.zeros(0, dtype=torch.float64)] + [s.state().cpu() for s in stats]).to(self.device)
        parts = self._gather(payload, "merge of statistics")
        merged = []
        offset = 0
        for local in stats:
            size = PopulationStats.state_size(local.num_channels)
            total = PopulationStats(local.num_channels, name=local.name, device=torch.device("cpu"))
            for part in parts:
                total.merge(PopulationStats.from_state(part[offset: offset + size], name=local.name))
            merged.append(total)
            offset += size
        return merged

    def abort(self) -> None:
        """Answer the round the other ranks are in with a failure, unless this rank is past its
        last round or the group is broken; never raises (the caller re-raises its own error)."""
        if self.finished:
            return
        self.finished = True
        try:
            self.exchange(FAILED)
        except DistributedError:
            pass
