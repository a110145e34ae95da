"""A thin layer over ``torch.distributed``: who am I, and rounds in which ranks agree or fail together.

Everything here is the identity on a single process (no process group, or a torch build
without distributed support), so callers never branch on it.

Why a process group of our own: collectives are matched by order alone within a group. A
model's own collectives (FSDP's all-gathers, ZeRO's) issued on the user's group while one rank
has run out of data would pair with that rank's round: gloo aborts on the size mismatch, or,
worse, a shard the size of a header is read as one. The rounds therefore run on a
``new_group`` over the same ranks, made once per default group and reused
(:func:`channel_for`). A group the user passes as ``group=`` is used as it is: making a group
of our own from it would need every process of the job to take part. Every header also
carries a tag (which round) and a sequence number, so ranks out of step raise
:class:`DistributedError` naming both sides instead of mixing rounds.

Why rounds of fixed-size headers: ``all_gather`` needs equal sizes on every rank. Each round
starts with every rank's header (tag, sequence, status, batches and samples so far, layout
fingerprint), so every rank sees the same facts and takes the same decision: go on, merge, or
raise the same :class:`DistributedError`. A rank that fails, at any point of its call, answers
the round the others are in with a FAILED header (:meth:`Ranks.abort`); a rank that died or
hangs is given up after ``timeout`` seconds, and the error says which. After a timeout the
group of our own is dropped (an abandoned collective may still be pending in it) and the next
call makes a new one; the user's group is untouched and stays usable.

Why a merge in rank order instead of ``all_reduce(SUM)`` of moments: a floating-point
all-reduce sums in an order the backend chooses, which can differ between ranks and runs.
Merging every rank's :class:`~precise_bn.estimator.PopulationStats` in rank order performs the
very same float64 operations on every rank: the results, and every decision taken from them,
are bit-identical. The merge is sliced by channel (:mod:`precise_bn.slices`), so that what a
rank receives does not grow with the number of ranks; a decision that needs only a maximum
per layer (the ``rtol`` stop) exchanges only that (:meth:`Ranks.worst`).
"""
from __future__ import annotations

import datetime
import math
import zlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import slices
from .errors import DistributedError
from .estimator import PopulationStats
from .options import DEFAULT_TIMEOUT

ACTIVE, DONE, FAILED = 0, 1, 2
#: The rounds' tags, in the order a call plays them; ``abort`` answers any round.
ROUNDS = ("start", "pass", "end", "abort")
_HEADER = 8
#: Waits at least this long are no limit (``timedelta`` cannot hold much more).
NO_LIMIT_S = 10 * 365 * 86400.0


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


def wait_limit(seconds: float) -> Optional[datetime.timedelta]:
    """``seconds`` as a wait: None (no limit) from :data:`NO_LIMIT_S` up, else at least one
    millisecond (backends count in milliseconds, and 0 would mean no limit)."""
    if seconds >= NO_LIMIT_S:
        return None
    return datetime.timedelta(milliseconds=max(1, math.ceil(seconds * 1000.0)))


class Channel:
    """The group the rounds run on, and the sequence number of its next round."""

    def __init__(self, group: Any, own: bool):
        self.group = group
        self.own = own
        self.seq = 0


_channels: Dict[Any, Channel] = {}


def channel_for(group: Any = None) -> Channel:
    """The rounds' channel for ``group``: for the default group, a group of our own over the
    same ranks, made on first use (a collective of every rank) and reused; any other group as
    it is."""
    dist = _dist()
    world = dist.group.WORLD
    key = world if group is None or group is world else group
    channel = _channels.get(key)
    if channel is None:
        if key is world:
            own = dist.new_group(timeout=datetime.timedelta(seconds=NO_LIMIT_S))
            channel = Channel(own, own=True)
        else:
            channel = Channel(group, own=False)
        _channels[key] = channel
    return channel


def forget_channel(channel: Channel) -> None:
    """Drop a channel whose group may hold an abandoned collective; the next call makes anew."""
    for key, value in list(_channels.items()):
        if value is channel:
            del _channels[key]


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
    tag: int = 0
    seq: int = 0


class Part(NamedTuple):
    """This rank's slice of the channels, merged over every rank (see :meth:`Ranks.merge_part`)."""

    stats: List[PopulationStats]
    segments: List[slices.Segment]
    plan: List[List[slices.Segment]]
    size: int
    local: List[PopulationStats]


class Ranks:
    """The rounds of one call across the ranks of ``group`` (the identity on one process).

    Every rank runs the same sequence of rounds; :meth:`exchange` raises
    :class:`DistributedError` on every rank alike when any rank reported a failure, the ranks
    are out of step, or they disagree on the layout. After a rank raised, :meth:`abort` sends
    no more rounds. ``received`` counts the bytes this rank's collectives received from the
    other ranks.
    """

    def __init__(self, enabled: bool, group: Any = None, timeout: float = DEFAULT_TIMEOUT):
        self.world = get_world_size(group) if enabled else 1
        self.group = group
        self.timeout = timeout
        self.finished = self.world == 1
        self.received = 0
        self.rank = get_rank(group) if self.world > 1 else 0
        self.channel = channel_for(group) if self.world > 1 else None
        self.device = collective_device(group) if self.world > 1 else torch.device("cpu")

    def finish(self) -> None:
        """This rank played its last round of the call: :meth:`abort` sends nothing any more."""
        self.finished = True

    def _run(self, start: Callable[[Any], Any], out: torch.Tensor, what: str) -> torch.Tensor:
        """Start a collective on the channel's group, wait for it within the timeout, and return
        ``out`` on the CPU."""
        assert self.channel is not None
        try:
            work = start(self.channel.group)
            limit = wait_limit(self.timeout)
            work.wait() if limit is None else work.wait(timeout=limit)
        except RuntimeError as exc:
            self.finished = True  # no rank can be waited for again on this group
            forget_channel(self.channel)
            raise DistributedError(
                "rank {}: the {} with the other ranks failed or waited more than {:g} s (a rank "
                "died, hangs, or left early; timeout= sets the wait): {}".format(
                    self.rank, what, self.timeout, str(exc).splitlines()[0] if str(exc) else exc)
            ) from exc
        self.received += out.numel() * out.element_size() * (self.world - 1) // self.world
        return out.cpu()

    def _gather(self, tensor: torch.Tensor, what: str) -> List[torch.Tensor]:
        tensor = tensor.to(self.device)
        out = torch.empty(self.world * tensor.numel(), dtype=tensor.dtype, device=self.device)
        parts = list(out.chunk(self.world))
        out = self._run(lambda g: _dist().all_gather(parts, tensor, group=g, async_op=True), out, what)
        return list(out.view(self.world, -1))

    def exchange(self, status: int, batches: int = 0, samples: int = 0,
                 layout_: Tuple[int, int, int] = (0, 0, 0), round_: str = "pass") -> List[Header]:
        """One round of headers; returns every rank's, in rank order."""
        tag = ROUNDS.index(round_)
        if self.world == 1:
            return [Header(status, batches, samples, layout_, tag)]
        assert self.channel is not None
        seq = self.channel.seq
        self.channel.seq += 1
        mine = torch.tensor([status, batches, samples, *layout_, tag, seq], dtype=torch.float64)
        assert mine.numel() == _HEADER
        headers = [Header(int(h[0]), int(h[1]), int(h[2]), (int(h[3]), int(h[4]), int(h[5])), int(h[6]), int(h[7]))
                   for h in (part.tolist() for part in self._gather(mine, "exchange of status"))]
        failed = [rank for rank, h in enumerate(headers) if h.status == FAILED]
        if failed:
            self.finished = True
            raise DistributedError(
                "rank(s) {} failed (their own error says why); no rank changed its model".format(failed))
        astray = [(rank, h) for rank, h in enumerate(headers) if (h.tag, h.seq) != (tag, seq)]
        if astray:
            self.finished = True
            forget_channel(self.channel)
            rank, other = astray[0]
            raise DistributedError(
                "ranks out of step: rank {} is at round {} ({}) but rank {} sent round {} ({}); every "
                "rank must make the same precise-bn calls with the same options, in the same "
                "order".format(self.rank, seq, round_, rank, other.seq, _round_name(other.tag)))
        layouts = {h.layout for h in headers if h.layout != (0, 0, 0)}
        if len(layouts) > 1:
            self.finished = True
            raise DistributedError(
                "ranks disagree on the BatchNorm layers to merge: (layers, channels, checksum of names "
                "and widths) per rank = {}; every rank must recalibrate the same layers of the same "
                "model".format([h.layout for h in headers]))
        return headers

    def merge_part(self, stats: Sequence[PopulationStats]) -> Part:
        """This rank's slice of the channels, merged over every rank in rank order (see
        :mod:`precise_bn.slices`): each rank receives one chunk from every rank, about its own
        payload in all, whatever the number of ranks."""
        names = [s.name for s in stats]
        plan = slices.plan([s.num_channels for s in stats], self.world)
        if self.world == 1:
            return Part(list(stats), plan[0], plan, 0, list(stats))
        size = slices.chunk_size(plan)
        states = [s.state().cpu() for s in stats]
        send = torch.cat([slices.pack(states, segments, size) for segments in plan]).to(self.device)
        out = torch.empty_like(send)
        chunks = self._run(lambda g: _dist().all_to_all_single(out, send, group=g, async_op=True), out,
                           "merge of statistics").view(self.world, size)
        segments = plan[self.rank]
        return Part(slices.merge_in_rank_order(list(chunks), segments, names), segments, plan, size, list(stats))

    def worst(self, part: Part, score: Callable[[PopulationStats], float]) -> List[float]:
        """Per layer, the largest ``score`` of any rank's merged piece of it (``-inf`` for a
        layer no piece holds): the same floats on every rank, since a maximum has no rounding."""
        values = torch.full((len(part.local),), -math.inf, dtype=torch.float64)
        for seg, piece in zip(part.segments, part.stats):
            values[seg.layer] = max(float(values[seg.layer]), float(score(piece)))
        if self.world > 1:
            values = values.to(self.device)
            values = self._run(lambda g: _dist().all_reduce(values, op=_dist().ReduceOp.MAX, group=g, async_op=True),
                               values, "exchange of the precision check")
        return values.tolist()

    def assemble(self, part: Part) -> List[PopulationStats]:
        """Every layer, merged over every rank: the merged slices gathered. Identical bits on
        every rank, equal to one process merging every rank's statistics in rank order."""
        if self.world == 1:
            return part.local
        mine = torch.cat([torch.zeros(0, dtype=torch.float64)] + [s.state().cpu() for s in part.stats])
        padded = torch.zeros(part.size, dtype=torch.float64)
        padded[: mine.numel()] = mine
        return slices.join(self._gather(padded, "merge of statistics"), part.plan, [s.name for s in part.local])

    def gather_stats(self, stats: Sequence[PopulationStats]) -> List[PopulationStats]:
        """Every rank's stats merged in rank order, on the CPU: identical bits on every rank."""
        return self.assemble(self.merge_part(stats))

    def abort(self) -> None:
        """Answer the round the other ranks are in with a failure, unless this rank is past its
        last round or the group is broken; never raises (the caller re-raises its own error)."""
        if self.finished:
            return
        self.finished = True
        try:
            self.exchange(FAILED, round_="abort")
        except DistributedError:
            pass


def _round_name(tag: int) -> str:
    return ROUNDS[tag] if 0 <= tag < len(ROUNDS) else "unknown tag {}".format(tag)
