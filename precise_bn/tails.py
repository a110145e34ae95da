"""The algebra of the tail diagnostic (:meth:`precise_bn.estimator.PopulationStats.tail_spread`):
count⁴-weighted power sums of the calls' moments, and their exact affine maps.

The spread of a standard error needs ``sum e_i^4`` over the calls, with ``e_i = n_i (y_i - s2)``
for the variance and ``n_i (m_i - mu)`` for the mean (see :mod:`precise_bn.estimator`). Per
channel we keep ``S_ab = sum n_i^4 p_i^a q_i^b`` for ``a + b <= 4`` (15 sums), of
``q_i = m_i - c`` and ``p_i = v_i + q_i^2 - c_v`` around the layer's centre ``c`` and ``c_v``
(the variance of a group's first call), so that the sums stay of the order of the spread and not
of the mean or the variance themselves. With ``d = mu - c``,
``y_i - s2 = p_i - 2 d q_i + (c_v + d^2 - s2)`` and ``m_i - mu = q_i - d``: both are affine in
``(p_i, q_i)``, and the power sums of an affine image ``(p + alpha q + gamma, q + delta)`` are an
exact linear map of ``S``, the multinomial expansion of each power (:func:`affine`); a degree
never grows, so 15 sums are closed under it. Merging two groups moves one onto the other's
centres by such a map (``q' = q + d``, ``p' = p + 2 d q + d^2 + c_v - c_v'`` for centres ``d``
apart), after which power sums simply add.
"""
from __future__ import annotations

import functools
import math
from typing import Tuple

import torch

#: The exponents (a, b) of the power sums ``sum n_i^4 p_i^a q_i^b``, in storage order.
POWERS = tuple((a, b) for a in range(5) for b in range(5 - a))
#: The storage row of each exponent pair.
INDEX = {pair: i for i, pair in enumerate(POWERS)}


@functools.lru_cache(maxsize=None)
def _affine_terms(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expansion of ``sum w (p + alpha q + gamma)^a (q + delta)^b`` over the power sums of
    ``(p, q)``: per term its destination and source entries, its multinomial coefficient, and
    its powers of ``(alpha, gamma, delta)``."""
    rows = []
    for a, b in POWERS:
        for i in range(a + 1):
            for j in range(a - i + 1):
                multinomial = math.factorial(a) // (math.factorial(i) * math.factorial(j) * math.factorial(a - i - j))
                for m in range(b + 1):
                    rows.append((INDEX[(a, b)], INDEX[(i, j + m)], multinomial * math.comb(b, m), j, a - i - j, b - m))
    dst, src, coef, *powers = zip(*rows)
    return (torch.tensor(dst, device=device), torch.tensor(src, device=device),
            torch.tensor(coef, dtype=torch.float64, device=device),
            torch.tensor(powers, dtype=torch.float64, device=device).unsqueeze(-1))


def affine(sums: torch.Tensor, alpha: torch.Tensor, gamma: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The power sums (15, C) of ``p' = p + alpha q + gamma`` and ``q' = q + delta`` from
    ``sums``, those of ``(p, q)``; ``alpha``, ``gamma``, ``delta`` per channel. Exact: the
    affine map sends each power to a polynomial of the same degree."""
    dst, src, coef, powers = _affine_terms(sums.device)
    factors = torch.stack([alpha, gamma, delta]).unsqueeze(1).pow(powers).prod(0).mul_(coef.unsqueeze(1))
    return torch.zeros_like(sums).index_add_(0, dst, factors.mul_(sums[src]))


def power_sums(weights: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum_i weights_i p_i^a q_i^b`` for every ``(a, b)`` of :data:`POWERS`, over the k rows."""
    p_powers = torch.stack([torch.ones_like(p), p, p * p, p * p * p, (p * p).square()])
    q_powers = torch.stack([torch.ones_like(q), q, q * q, q * q * q, (q * q).square()])
    a, b = zip(*POWERS)
    return torch.einsum("k,tkc->tc", weights, p_powers[list(a)] * q_powers[list(b)])


def spread_of_squares(sums: torch.Tensor, shift: torch.Tensor, vcenter: torch.Tensor, var: torch.Tensor,
                      squares: Tuple[torch.Tensor, torch.Tensor], calls: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``r = sqrt(sum e_i^4 / (sum e_i^2)^2 - 1/k)`` for the mean and the variance, per channel,
    from the power sums, ``shift = mu - c``, ``vcenter``, the variance ``s2`` and ``squares``,
    the two ``sum e_i^2``; 0 where a ``sum e_i^2`` is 0."""
    zero = torch.zeros_like(shift)
    fourth_mean = affine(sums, zero, zero, -shift)[INDEX[(0, 4)]]
    fourth_var = affine(sums, -2.0 * shift, shift * shift + vcenter - var, zero)[INDEX[(4, 0)]]
    out = []
    for fourth, second in zip((fourth_mean, fourth_var), squares):
        ratio = (fourth / second.square() - 1.0 / calls).clamp_(min=0).sqrt_()
        out.append(torch.where(second > 0, ratio, zero))
    return out[0], out[1]
