"""A thin layer over ``torch.distributed`` (the identity on one process): rounds in which ranks agree
or fail together, on a group of our own with bounded waits, and the merge in rank order
(:mod:`.slices`), so every rank takes the same decisions on the same bits (docs/distributed.md)."""
from __future__ import annotations

import datetime
import hashlib
import json
import math
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from . import slices
from ._version import __version__
from .errors import DistributedError
from .estimator import PopulationStats
from .options import DEFAULT_TIMEOUT, Options

ACTIVE, DONE, FAILED = 0, 1, 2
#: The rounds' tags, in the order a call plays them; ``abort`` answers any round.
ROUNDS = ("start", "pass", "end", "abort")
#: The options every rank of a call must share: they shape the result or the rounds.
AGREED_OPTIONS = ("num_batches", "num_samples", "rtol", "min_batches", "unbiased", "prior", "sync",
                  "autocast")
#: The round after differing digests: fingerprint fields at most, bytes each (digest, then text).
_SLOTS, _SLOT_BYTES = 16, 256
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
    """``seconds`` as a wait: None from :data:`NO_LIMIT_S` up, else at least 1 ms (0 is no limit)."""
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


def channel_for(group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> Channel:
    """The rounds' channel: for the default group, a gloo group of our own over its ranks, made on
    first use and reused; any other group as it is."""
    dist = _dist()
    world = dist.group.WORLD
    key = world if group is None or group is world else group
    channel = _channels.get(key)
    if channel is None and key is world:
        # gloo where it can meet (MPI has no store): a gloo wait that times out raises, where
        # NCCL's watchdog would end the process
        backend = "gloo" if dist.is_gloo_available() and dist.get_backend() != "mpi" else None
        try:
            channel = Channel(dist.new_group(timeout=group_timeout(timeout), backend=backend), own=True)
        except RuntimeError as exc:
            raise _gave_up(get_rank(), "creation of precise-bn's process group", timeout, exc) from exc
    elif channel is None:
        channel = Channel(group, own=False)
    elif channel.own and hasattr(dist, "set_timeout"):  # older torch: the timeout it was made with
        dist.set_timeout(group_timeout(timeout), channel.group)
    _channels[key] = channel
    return channel


def group_timeout(seconds: float) -> datetime.timedelta:
    """``seconds`` as a process group's timeout (a duration, :data:`NO_LIMIT_S` for no limit)."""
    return wait_limit(seconds) or datetime.timedelta(seconds=NO_LIMIT_S)


def _gave_up(rank: int, what: str, timeout: float, exc: BaseException) -> DistributedError:
    return DistributedError(
        "rank {}: the {} with the other ranks failed or waited more than {:g} s (a rank died, hangs, or "
        "left early or never made this call; timeout= sets the wait): {}".format(
            rank, what, timeout, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))


def forget_channel(channel: Channel) -> None:
    """Drop a channel whose group may hold an abandoned collective; the next call makes anew."""
    for key, value in list(_channels.items()):
        if value is channel:
            del _channels[key]


def fingerprint(opts: Options, stats: Sequence[PopulationStats]) -> Dict[str, str]:
    """What every rank must share, as text by name: layers and widths, options, version."""
    widths = ", ".join("{}:{}".format(s.name, s.num_channels) for s in stats)
    fields = {"layers": "{} layer(s), {} channels ({})".format(len(stats), sum(s.num_channels for s in stats),
                                                                 widths or "none")}
    fields.update((name, repr(getattr(opts, name))) for name in AGREED_OPTIONS)
    fields["precise-bn version"] = __version__
    return fields


def _digest(text: str, size: int) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=size).digest()


class Header(NamedTuple):
    """One rank's header in a round (``fingerprint``: a digest below 2**48, exact in float64)."""

    status: int
    batches: int
    samples: int
    fingerprint: int = 0
    tag: int = 0
    seq: int = 0


class MergedSlice(NamedTuple):
    """This rank's slice of the channels merged over every rank, with what assembling needs."""

    stats: List[PopulationStats]
    segments: List[slices.Segment]
    plan: List[List[slices.Segment]]
    size: int
    local: List[PopulationStats]


class Ranks:
    """The rounds of one call across the ranks of ``group``: each raises :class:`DistributedError`
    on every rank alike when a rank failed or disagrees; ``received`` counts bytes received."""

    def __init__(self, enabled: bool, group: Any = None, timeout: float = DEFAULT_TIMEOUT):
        self.world = get_world_size(group) if enabled else 1
        self.timeout = timeout
        self.finished = self.world == 1
        self.received = 0
        self.rank = get_rank(group) if self.world > 1 else 0
        self.channel = channel_for(group, timeout) if self.world > 1 else None
        self.device = collective_device(self.channel.group) if self.channel else torch.device("cpu")

    def finish(self) -> None:
        """This rank played its last round of the call: :meth:`abort` sends nothing any more."""
        self.finished = True

    def _run(self, start: Callable[[Any], Any], out: torch.Tensor, what: str) -> torch.Tensor:
        """A collective on the channel's group, waited for within the timeout; ``out`` on the CPU."""
        assert self.channel is not None
        try:
            work = start(self.channel.group)
            limit = wait_limit(self.timeout)
            work.wait() if limit is None else work.wait(timeout=limit)
        except RuntimeError as exc:
            self.finished = True  # no rank can be waited for again on this group
            forget_channel(self.channel)
            raise _gave_up(self.rank, what, self.timeout, exc) from exc
        self.received += out.numel() * out.element_size() * (self.world - 1) // self.world
        return out.cpu()

    def _gather(self, tensor: torch.Tensor, what: str) -> List[torch.Tensor]:
        tensor = tensor.to(self.device)
        out = torch.empty(self.world * tensor.numel(), dtype=tensor.dtype, device=self.device)
        parts = list(out.chunk(self.world))
        out = self._run(lambda g: _dist().all_gather(parts, tensor, group=g, async_op=True), out, what)
        return list(out.view(self.world, -1))

    def exchange(self, status: int, batches: int = 0, samples: int = 0, round_: str = "pass",
                 fingerprint_: int = 0) -> List[Header]:
        """One round of headers; returns every rank's, in rank order."""
        mine = Header(status, batches, samples, fingerprint_, ROUNDS.index(round_))
        if self.channel is None:  # one process
            return [mine]
        mine = mine._replace(seq=self.channel.seq)
        self.channel.seq += 1
        sent = torch.tensor(mine, dtype=torch.float64)
        headers = [Header(*map(int, part.tolist())) for part in self._gather(sent, "exchange of status")]
        failed = [rank for rank, h in enumerate(headers) if h.status == FAILED]
        if failed:
            self.finished = True
            raise DistributedError(
                "rank(s) {} failed (their own error says why); no rank changed its model".format(failed))
        astray = [(rank, h) for rank, h in enumerate(headers) if (h.tag, h.seq) != (mine.tag, mine.seq)]
        if astray:
            self.finished = True
            forget_channel(self.channel)
            rank, other = astray[0]
            raise DistributedError(
                "ranks out of step: rank {} is at round {} ({}) but rank {} sent round {} ({}); every "
                "rank must make the same precise-bn calls with the same options, in the same "
                "order".format(self.rank, mine.seq, round_, rank, other.seq, _round_name(other.tag)))
        return headers

    def start(self, fields: Mapping[str, str]) -> None:
        """The first round; also raises when the ranks' ``fields`` differ, naming each rank's values."""
        digest = int.from_bytes(_digest(json.dumps(list(fields.items())), 6), "big")
        headers = self.exchange(ACTIVE, round_="start", fingerprint_=digest)
        if len({h.fingerprint for h in headers}) == 1:
            return
        self.finished = True
        table = [_decode(part) for part in self._gather(_encode(fields), "exchange of the call's options")]
        names = list(dict.fromkeys(name for fields_ in table for name in fields_))
        differ = []
        for name in names:
            values = [fields_.get(name, (b"", "(none)")) for fields_ in table]
            if len({digest for digest, _ in values}) > 1:
                differ.append("{} ({})".format(name, _by_value(values)))
        raise DistributedError(
            "ranks disagree on {}; every rank must make the same call: the same options on the same BatchNorm "
            "layers, with the same precise-bn version".format("; ".join(differ)))

    def merge_part(self, stats: Sequence[PopulationStats]) -> MergedSlice:
        """This rank's slice of the channels, merged over every rank in rank order."""
        names = [s.name for s in stats]
        plan = slices.plan([s.num_channels for s in stats], self.world)
        if self.world == 1:
            return MergedSlice(list(stats), plan[0], plan, 0, list(stats))
        size = slices.chunk_size(plan)
        states = [s.state().cpu() for s in stats]
        send = torch.cat([slices.pack(states, segments, size) for segments in plan]).to(self.device)
        out = torch.empty_like(send)
        chunks = self._run(lambda g: _dist().all_to_all_single(out, send, group=g, async_op=True), out,
                           "merge of statistics").view(self.world, size)
        segments = plan[self.rank]
        return MergedSlice(slices.merge_in_rank_order(list(chunks), segments, names), segments, plan, size, list(stats))

    def worst(self, part: MergedSlice, score: Callable[[PopulationStats], float]) -> List[float]:
        """Per layer, the largest ``score`` of any rank's piece (``-inf`` if none): the same on every rank."""
        values = torch.full((len(part.local),), -math.inf, dtype=torch.float64)
        for seg, piece in zip(part.segments, part.stats):
            values[seg.layer] = max(float(values[seg.layer]), float(score(piece)))
        if self.world > 1:
            values = values.to(self.device)
            values = self._run(lambda g: _dist().all_reduce(values, op=_dist().ReduceOp.MAX, group=g, async_op=True),
                               values, "exchange of the precision check")
        return values.tolist()

    def assemble(self, part: MergedSlice) -> List[PopulationStats]:
        """Every layer merged over every rank: the same bits everywhere, as one process merging them."""
        if self.world == 1:
            return part.local
        mine = torch.cat([torch.zeros(0, dtype=torch.float64)] + [s.state().cpu() for s in part.stats])
        padded = torch.nn.functional.pad(mine, (0, part.size - mine.numel()))
        return slices.join(self._gather(padded, "merge of statistics"), part.plan, [s.name for s in part.local])

    def abort(self) -> None:
        """Answer the others' round with a failure (unless past the last round); never raises."""
        if self.finished:
            return
        self.finished = True
        try:
            self.exchange(FAILED, round_="abort")
        except DistributedError:
            pass


def _encode(fields: Mapping[str, str]) -> torch.Tensor:
    """``fields`` in :data:`_SLOTS` slots: each one's digest, then as much of its text as fits."""
    assert len(fields) <= _SLOTS
    out = torch.zeros(_SLOTS, _SLOT_BYTES, dtype=torch.uint8)
    for slot, (name, value) in zip(out, fields.items()):
        text = "{}\0{}".format(name, value)
        data = _digest(text, 8) + text.encode("utf-8")[: _SLOT_BYTES - 8]
        slot[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return out.reshape(-1)


def _decode(part: torch.Tensor) -> Dict[str, Tuple[bytes, str]]:
    """One rank's :func:`_encode`: name -> (digest, value as far as it fitted)."""
    fields = {}
    for slot in part.view(_SLOTS, _SLOT_BYTES).tolist():
        body = bytes(slot[8:]).rstrip(b"\0")
        if body:
            name, _, value = body.decode("utf-8", errors="ignore").partition("\0")
            fields[name] = (bytes(slot[:8]), value + ("..." if len(body) == _SLOT_BYTES - 8 else ""))
    return fields


def _by_value(values: Sequence[Tuple[bytes, str]]) -> str:
    """``value on ranks 0-2, 5; other on rank 3`` (values cut alike told apart by digests)."""
    ranks: Dict[bytes, List[int]] = {}
    for rank, (digest, _) in enumerate(values):
        ranks.setdefault(digest, []).append(rank)
    shown = dict(values)
    alike = len(set(shown.values())) < len(shown)
    return "; ".join("{}{} on {}".format(shown[digest], " (digest {})".format(digest.hex()) if alike else "",
                                         _ranks_text(members)) for digest, members in ranks.items())


def _ranks_text(ranks: Sequence[int]) -> str:
    runs: List[List[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else "{}-{}".format(a, b) for a, b in runs)
    return "rank{} {}".format("s" if len(ranks) > 1 else "", text)


def _round_name(tag: int) -> str:
    return ROUNDS[tag] if 0 <= tag < len(ROUNDS) else "unknown tag {}".format(tag)
