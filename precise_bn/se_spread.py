"""The power sums ``sum n_i^4 p_i^a q_i^b`` (``a + b <= 4``) of the heavy-tails test and their
exact affine maps, after which they add (``docs/precision.md``, "Derivations")."""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

#: The exponents (a, b), in storage order.
POWERS = tuple((a, b) for a in range(5) for b in range(5 - a))
INDEX = {pair: i for i, pair in enumerate(POWERS)}
_P_ROWS = tuple(INDEX[(a, 0)] for a in range(1, 5))
_Q_ROWS = tuple(INDEX[(0, b)] for b in range(1, 5))
# p^a times q^1 .. q^(4-a), written to consecutive rows.
_PRODUCTS = tuple((INDEX[(a, 0)], slice(INDEX[(0, 1)], INDEX[(0, 5 - a)]), slice(INDEX[(a, 1)], INDEX[(a, 1)] + 4 - a))
                  for a in range(1, 4))


@functools.lru_cache(maxsize=None)
def _affine_terms(device: torch.device, target: Optional[int]) -> Tuple[torch.Tensor, ...]:
    """Per term of ``(p + alpha q + gamma)^a (q + delta)^b``: rows, coefficient, powers."""
    rows = []
    for a, b in POWERS if target is None else [POWERS[target]]:
        for i in range(a + 1):
            for j in range(a - i + 1):
                multinomial = math.factorial(a) // (math.factorial(i) * math.factorial(j) * math.factorial(a - i - j))
                for m in range(b + 1):
                    rows.append((INDEX[(a, b)] if target is None else 0, INDEX[(i, j + m)],
                                 multinomial * math.comb(b, m), j, a - i - j, b - m))
    dst, src, coef, *powers = zip(*rows)
    return (torch.tensor(dst, device=device), torch.tensor(src, device=device),
            torch.tensor(coef, dtype=torch.float64, device=device).unsqueeze(1),
            *(torch.tensor(p, device=device) for p in powers))


def _powers(base: torch.Tensor) -> torch.Tensor:
    """``base^0 .. base^4`` (5, C), by multiplication."""
    square = base * base
    return torch.stack([torch.ones_like(base), base, square, square * base, square * square])


def affine(sums: torch.Tensor, alpha: torch.Tensor, gamma: torch.Tensor, delta: torch.Tensor,
           target: Optional[int] = None) -> torch.Tensor:
    """The power sums of ``(p + alpha q + gamma, q + delta)`` from those of ``(p, q)``, all rows or
    row ``target`` only; exact, as each power maps to a polynomial of the same degree."""
    dst, src, coef, pa, pg, pd = _affine_terms(sums.device, target)
    factors = _powers(alpha)[pa].mul_(_powers(gamma)[pg]).mul_(_powers(delta)[pd]).mul_(coef)
    rows = len(POWERS) if target is None else 1
    return sums.new_zeros(rows, sums.shape[1]).index_add_(0, dst, factors.mul_(sums[src]))


def power_sums(weights: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum_i weights_i p_i^a q_i^b`` for every ``(a, b)`` of :data:`POWERS` over k rows (k, C)."""
    rows = p.new_empty((len(POWERS),) + tuple(p.shape))
    row = rows.unbind(0)
    row[0].fill_(1.0)
    for base, (one, two, three, four) in ((p, _P_ROWS), (q, _Q_ROWS)):
        row[one].copy_(base)
        torch.mul(base, base, out=row[two])
        torch.mul(row[two], base, out=row[three])
        torch.square(row[two], out=row[four])
    for p_row, q_rows, out in _PRODUCTS:
        torch.mul(row[p_row], rows[q_rows], out=rows[out])
    return torch.matmul(weights, rows)


def spread_of_squares(sums: torch.Tensor, shift: torch.Tensor, var: torch.Tensor,
                      squares: Tuple[torch.Tensor, torch.Tensor], calls: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``r = sqrt(sum e_i^4 / (sum e_i^2)^2 - 1/k)`` of the mean and the variance (``shift = mu - c``,
    ``squares`` the two ``sum e_i^2``); 0 where a ``sum e_i^2`` is 0."""
    zero = torch.zeros_like(shift)
    fourth_mean = affine(sums, zero, zero, -shift, INDEX[(0, 4)])[0]
    fourth_var = affine(sums, -2.0 * shift, shift * shift - var, zero, INDEX[(4, 0)])[0]
    out = []
    for fourth, second in zip((fourth_mean, fourth_var), squares):
        ratio = (fourth / second.square() - 1.0 / calls).clamp_(min=0).sqrt_()
        out.append(torch.where(second > 0, ratio, zero))
    return out[0], out[1]
