"""The algebra of the order diagnostics (:meth:`precise_bn.estimator.PopulationStats.order`):
what a group of calls keeps of the order in which they ran.

Per call ``i``, in order, let ``z_i = n_i (1, q_i, p_i)`` with ``q_i = m_i - c`` and
``p_i = v_i + q_i^2`` around the layer's centre ``c`` (as in :mod:`precise_bn.se_spread`). The
deviations behind both standard errors are linear in it, ``e_i = b . z_i``, so a group keeps,
per channel, ``sum z_i z_{i+1}^T`` over consecutive calls (lag-1 products), its first and last
call's ``z`` (two groups merged add the pair across their boundary), ``sum t_i z_i`` with ``t_i``
the call's index, and ``sum n_i t_i^2`` (:data:`ROWS` rows in all). A move of the centre by ``d``
maps every ``z`` by ``(z0, z1 + d z0, z2 + 2 d z1 + d^2 z0)``, and a later group's indices move by
its offset: both exact, so merges of blocks, devices and ranks in order give the sums of the
whole stream. ``docs/precision.md`` derives the statistics built on them.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

#: Rows: lag-1 products (3x3, row-major), first call's z, last call's z, sum t z, sum n t^2.
LAG, FIRST, LAST, TREND, TIME2 = slice(0, 9), slice(9, 12), slice(12, 15), slice(15, 18), 18
ROWS = 19


def block(n: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The order sums (:data:`ROWS`, C) of k calls in order: counts ``n`` (k,), ``q`` and ``p`` (k, C)."""
    z = torch.stack([torch.ones_like(q), q, p]) * n[:, None]  # (3, k, C)
    lag = (z[:, None, :-1] * z[None, :, 1:]).sum(2).view(9, -1)
    t = torch.arange(len(n), dtype=n.dtype, device=n.device)
    time2 = torch.matmul(t * t, z[0]).unsqueeze(0)
    return torch.cat([lag, z[:, 0], z[:, -1], torch.matmul(t, z), time2])


def _move_z(z: Sequence[torch.Tensor], d: torch.Tensor) -> List[torch.Tensor]:
    return [z[0], z[1] + d * z[0], z[2] + 2.0 * d * z[1] + d * d * z[0]]


def move(order: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The order sums of a group whose centre moves by ``d`` per channel (``q' = q + d``)."""
    lag = order[LAG].view(3, 3, -1)
    rows = [torch.stack(_move_z(lag[:, b], d)) for b in range(3)]  # each (3, C): column b moved
    moved = torch.stack([torch.stack(_move_z([rows[0][a], rows[1][a], rows[2][a]], d)) for a in range(3)])
    vectors = [torch.stack(_move_z(order[part], d)) for part in (FIRST, LAST, TREND)]
    return torch.cat([moved.reshape(9, -1)] + vectors + [order[TIME2:]])


def shift(times: torch.Tensor, offset: int, totals: torch.Tensor) -> torch.Tensor:
    """The index sums (rows ``TREND`` and ``TIME2``, (4, C)) of a group whose call indices move by
    ``offset``; ``totals`` is its ``sum z_i`` (3, C)."""
    return torch.cat([times[:3] + float(offset) * totals,
                      times[3:] + (2.0 * offset) * times[:1] + float(offset) ** 2 * totals[:1]])


def join(mine: torch.Tensor, theirs: torch.Tensor, offset: int, totals: torch.Tensor) -> None:
    """Merge into ``mine`` the order sums of a group that ran right after its ``offset`` calls, on
    the same centre (``totals``: the group's ``sum z_i``)."""
    mine[LAG] += theirs[LAG] + (mine[LAST, None] * theirs[None, FIRST]).view(9, -1)
    mine[LAST] = theirs[LAST]
    mine[TREND.start:] += shift(theirs[TREND.start:], offset, totals)
