"""What calls ``z_i = n_i (1, q_i, p_i)`` keep of their order (``L + L^T`` of ``L = sum z_i
z_{i+1}^T``, first and last ``z``, ``sum t_i z_i``, ``sum n_i t_i^2``), merged exactly in order
(``docs/precision.md``); the tests read ``b^T L b``, which the symmetric part gives."""
from __future__ import annotations

from typing import List, Sequence

import torch

LAG, FIRST, LAST, TREND, TIME2 = slice(0, 6), slice(6, 9), slice(9, 12), slice(12, 15), 15
ROWS = 16
_PAIRS = ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2))


def _pack(full: torch.Tensor) -> torch.Tensor:
    return torch.stack([full[a, b] + full[b, a] for a, b in _PAIRS])


def lag_matrix(order: torch.Tensor) -> torch.Tensor:
    """The symmetric part of ``L`` (3, 3, C)."""
    rows = [[order[0]] * 3 for _ in range(3)]
    for row, (a, b) in zip(order[LAG], _PAIRS):
        rows[a][b] = rows[b][a] = row * 0.5
    return torch.stack([torch.stack(row) for row in rows])


def block(n: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The order sums (ROWS, C) of k calls: counts ``n`` (k,), ``q`` and ``p`` (k, C)."""
    z = torch.stack([torch.ones_like(q), q, p]) * n[:, None]  # (3, k, C)
    # One row of z at a time: the (3, 3, k - 1, C) product at once is a large fresh allocation.
    lag = _pack(torch.stack([(z[a, None, :-1] * z[:, 1:]).sum(1) for a in range(3)]))
    t = torch.arange(len(n), dtype=n.dtype, device=n.device)
    time2 = torch.matmul(t * t, z[0]).unsqueeze(0)
    return torch.cat([lag, z[:, 0], z[:, -1], torch.matmul(t, z), time2])


def _move_z(z: Sequence[torch.Tensor], d: torch.Tensor) -> List[torch.Tensor]:
    return [z[0], z[1] + d * z[0], z[2] + 2.0 * d * z[1] + d * d * z[0]]


def move(order: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The order sums of a group whose centre moves by ``d`` (``q' = q + d``)."""
    lag = lag_matrix(order)
    rows = [torch.stack(_move_z(lag[:, b], d)) for b in range(3)]  # each (3, C): column b moved
    moved = torch.stack([torch.stack(_move_z([rows[0][a], rows[1][a], rows[2][a]], d)) for a in range(3)])
    vectors = [torch.stack(_move_z(order[part], d)) for part in (FIRST, LAST, TREND)]
    return torch.cat([_pack(moved)] + vectors + [order[TIME2:]])


def shift(times: torch.Tensor, offset: int, totals: torch.Tensor) -> torch.Tensor:
    """Rows ``TREND`` and ``TIME2`` of a group whose indices move by ``offset`` (``totals``: ``sum z_i``)."""
    return torch.cat([times[:3] + float(offset) * totals,
                      times[3:] + (2.0 * offset) * times[:1] + float(offset) ** 2 * totals[:1]])


def join(mine: torch.Tensor, theirs: torch.Tensor, offset: int, totals: torch.Tensor) -> None:
    """Merge in a group that ran after ``mine``'s ``offset`` calls, on the same centre."""
    mine[LAG] += theirs[LAG] + _pack(mine[LAST, None] * theirs[None, FIRST])
    mine[LAST] = theirs[LAST]
    mine[TREND.start:] += shift(theirs[TREND.start:], offset, totals)
