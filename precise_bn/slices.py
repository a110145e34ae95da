"""The merge sliced by channel: rank ``r`` merges slice ``r`` of all layers' channels, in rank order,
then the slices are gathered. Pure functions, so a test plays every rank (docs/distributed.md)."""
from __future__ import annotations

from typing import List, NamedTuple, Sequence

import torch

from .estimator import STATE_ROWS, PopulationStats



class Segment(NamedTuple):
    """Channels ``lo:hi`` of layer ``layer``."""

    layer: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return 3 + STATE_ROWS * (self.hi - self.lo)


def plan(widths: Sequence[int], world: int) -> List[List[Segment]]:
    """Each rank's slice of the layers' concatenated channels: contiguous, widths within one."""
    total = sum(widths)
    bounds = [total * rank // world for rank in range(world + 1)]
    slices: List[List[Segment]] = []
    for rank in range(world):
        lo, hi = bounds[rank], bounds[rank + 1]
        segments, start = [], 0
        for layer, width in enumerate(widths):
            if start < hi and lo < start + width:
                segments.append(Segment(layer, max(lo, start) - start, min(hi, start + width) - start))
            start += width
        slices.append(segments)
    return slices


def chunk_size(slices: Sequence[Sequence[Segment]]) -> int:
    """The float64 length every rank's chunk is padded to (collectives want equal sizes)."""
    return max(sum(seg.size for seg in segments) for segments in slices)


def cut(state: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Channels ``lo:hi`` of a packed :meth:`PopulationStats.state`, packed the same way."""
    channels = (state.numel() - 3) // STATE_ROWS
    return torch.cat([state[:3], state[3:].view(STATE_ROWS, channels)[:, lo:hi].reshape(-1)])


def pack(states: Sequence[torch.Tensor], segments: Sequence[Segment], size: int) -> torch.Tensor:
    """The segments of the layers' packed ``states`` one after the other, zero-padded to ``size``."""
    out = torch.zeros(size, dtype=torch.float64)
    offset = 0
    for seg in segments:
        out[offset: offset + seg.size] = cut(states[seg.layer], seg.lo, seg.hi)
        offset += seg.size
    return out


def unpack(chunk: torch.Tensor, segments: Sequence[Segment]) -> List[torch.Tensor]:
    """Inverse of :func:`pack`: one packed state per segment."""
    states, offset = [], 0
    for seg in segments:
        states.append(chunk[offset: offset + seg.size])
        offset += seg.size
    return states


def merge_in_rank_order(chunks: Sequence[torch.Tensor], segments: Sequence[Segment],
                        names: Sequence[str]) -> List[PopulationStats]:
    """Every rank's part of one slice (``chunks[rank]``), merged in rank order per segment."""
    parts = [unpack(chunk, segments) for chunk in chunks]
    merged = []
    for index, seg in enumerate(segments):
        total = PopulationStats(seg.hi - seg.lo, name=names[seg.layer], device=torch.device("cpu"))
        for rank_parts in parts:
            total.merge(PopulationStats.from_state(rank_parts[index], name=names[seg.layer]))
        merged.append(total)
    return merged


def join(merged_chunks: Sequence[torch.Tensor], slices: Sequence[Sequence[Segment]],
         names: Sequence[str]) -> List[PopulationStats]:
    """Whole layers from every rank's merged slice (``merged_chunks[rank]``, packed)."""
    heads: List[torch.Tensor] = [torch.zeros(0)] * len(names)
    rows: List[List[torch.Tensor]] = [[] for _ in names]
    for chunk, segments in zip(merged_chunks, slices):
        for seg, state in zip(segments, unpack(chunk, segments)):
            if not rows[seg.layer]:
                heads[seg.layer] = state[:3]
            rows[seg.layer].append(state[3:].view(STATE_ROWS, seg.hi - seg.lo))
    return [PopulationStats.from_state(torch.cat([head, torch.cat(parts, dim=1).reshape(-1)]), name=name)
            for head, parts, name in zip(heads, rows, names)]
