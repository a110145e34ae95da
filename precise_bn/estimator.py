"""Per-layer population statistics merged exactly in float64 (Chan's formula: every term
non-negative, never ``E[x^2] - E[x]^2``), and the between-call moments behind their standard
errors, the heavy-tails test (:mod:`precise_bn.se_spread`) and the order tests
(:mod:`precise_bn.order`). Derivations: ``docs/numerics.md``, ``docs/precision.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from . import order as order_sums
from .errors import NonFiniteStatsError
from .se_spread import POWERS, affine, power_sums, spread_of_squares

Spreads = Tuple[torch.Tensor, torch.Tensor]
_PAIRS = ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2))
#: Per-channel rows of a packed :meth:`PopulationStats.state`.
STATE_ROWS = 12 + len(POWERS) + order_sums.ROWS


@dataclass
class CallGroup:
    """Calls combined, as :meth:`PopulationStats.add` merges them: ``weight`` = sum of the squared
    per-call counts; around ``center``, the count²-weighted mean ``u`` and co-moments ``cov`` of
    ``(m_i - c, v_i, (m_i - c)^2)``, the tails test's ``sums`` and the ``order`` sums."""

    count: int
    calls: int
    weight: int
    mean: torch.Tensor
    m2: torch.Tensor
    center: torch.Tensor
    u: torch.Tensor
    cov: torch.Tensor
    sums: torch.Tensor
    order: torch.Tensor

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return self.mean, self.m2, self.center, self.u, self.cov, self.sums, self.order

    def split(self, widths: Sequence[int]) -> List["CallGroup"]:
        """The group's channels cut into consecutive parts (several layers merged at once)."""
        parts = zip(*(t.split(list(widths), dim=-1) for t in self.tensors()))
        return [CallGroup(self.count, self.calls, self.weight, *part) for part in parts]


def combine_calls(
    means: torch.Tensor,
    variances: torch.Tensor,
    counts: Sequence[int],
    center: torch.Tensor,
    unbiased: bool = False,
) -> CallGroup:
    """Combine k calls in the order they ran, float64 ``(k, C)`` ``means`` and ``variances``
    (both **overwritten**; ``unbiased``: with Bessel's correction), into one :class:`CallGroup`
    around ``center``, by matrix products over the calls."""
    total = sum(counts)
    n = torch.tensor(counts, dtype=torch.float64, device=means.device)
    if unbiased:
        variances.mul_(((n - 1.0) / n).unsqueeze(1))
    w = n * n
    weight = sum(c * c for c in counts)
    u1 = means.sub_(center)
    shift = torch.matmul(n, u1).div_(total)
    deviation = u1 - shift
    m2 = torch.matmul(n, variances).add_(torch.matmul(n, deviation.square_()))
    rows = (u1, variances, u1.square())
    u = torch.matmul(w, torch.stack(rows)).div_(weight)
    centred = [row - u[j] for j, row in enumerate(rows)]
    cov = torch.matmul(w, torch.stack([centred[a] * centred[b] for a, b in _PAIRS]))
    second = variances + rows[2]
    sums = power_sums(w * w, second, u1)
    order = order_sums.block(n, u1, second)
    return CallGroup(total, len(counts), weight, shift.add_(center), m2, center, u, cov, sums, order)


def _recentre(group: CallGroup, center: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``u`` and ``cov`` of ``group`` around another centre: ``u`` moves affinely in the centre."""
    d = group.center - center
    u1, u2, u3 = group.u
    c11, c12, c13, c22, c23, c33 = group.cov
    u = torch.stack([u1 + d, u2, u3 + 2 * d * u1 + d * d])
    cov = torch.stack([c11, c12, c13 + 2 * d * c11, c22, c23 + 2 * d * c12, c33 + 4 * d * c13 + 4 * d * d * c11])
    return u, cov


class PopulationStats:
    """Running (count, mean, M2) per channel of one BN layer, and the between-call moments;
    ``count``, ``calls`` and ``weight`` are Python ints, exact and free to read on a GPU."""

    def __init__(self, num_channels: int, name: str = "", device: Optional[torch.device] = None):
        self.name = name
        self.num_channels = int(num_channels)
        self.count = 0
        self.calls = 0
        self.weight = 0
        zeros = dict(dtype=torch.float64, device=device)
        self.mean = torch.zeros(self.num_channels, **zeros)
        self.m2 = torch.zeros(self.num_channels, **zeros)
        self.center = torch.zeros(self.num_channels, **zeros)
        self.u = torch.zeros(3, self.num_channels, **zeros)
        self.cov = torch.zeros(6, self.num_channels, **zeros)
        self.sums = torch.zeros(len(POWERS), self.num_channels, **zeros)
        self.order = torch.zeros(order_sums.ROWS, self.num_channels, **zeros)

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def __repr__(self) -> str:
        return "PopulationStats(name={!r}, channels={}, count={}, calls={})".format(
            self.name, self.num_channels, self.count, self.calls
        )

    def add_call(self, mean: torch.Tensor, var: torch.Tensor, count: int, unbiased: bool = False) -> None:
        """Add one call's mean and variance over ``count`` elements per channel."""
        if count <= 0:
            return
        means = mean.to(self.device, torch.float64).reshape(1, -1).clone()
        variances = var.to(self.device, torch.float64).reshape(1, -1).clone()
        self.add(combine_calls(means, variances, [count], self.center_for(means[0]), unbiased))

    def center_for(self, first_means: torch.Tensor) -> torch.Tensor:
        """The layer's centre, set from a first group's ``first_means`` while it has seen nothing."""
        if self.count == 0:
            self.center.copy_(first_means)
        return self.center

    def add(self, group: CallGroup, owned: bool = False) -> None:
        """Merge a group of calls (another block, device, rank or pass); ``owned``: its tensors
        are no one else's, so a first group is kept rather than copied."""
        if group.count <= 0:
            self.calls += group.calls
            return
        if self.count == 0:
            if owned:
                self.mean, self.m2, self.center, self.u, self.cov, self.sums, self.order = group.tensors()
            else:
                for mine, theirs in zip(self.as_group().tensors(), group.tensors()):
                    mine.copy_(theirs)
            if self.calls:  # groups without elements came first: this one's indices start after them
                times = self.order[order_sums.TREND.start:]
                times.copy_(order_sums.shift(times, self.calls, self._totals(group, self.center)))
        else:
            n_a, n_b = self.count, group.count
            delta = group.mean - self.mean
            self.mean.add_(delta, alpha=n_b / (n_a + n_b))
            self.m2.add_(group.m2).addcmul_(delta, delta, value=n_a * n_b / (n_a + n_b))
            u, cov = _recentre(group, self.center)
            w_a, w_b = float(self.weight), float(group.weight)
            du = u - self.u
            self.u.add_(du, alpha=w_b / (w_a + w_b))
            outer = torch.stack([du[a] * du[b] for a, b in _PAIRS])
            self.cov.add_(cov).add_(outer, alpha=w_a * w_b / (w_a + w_b))
            if group.center is self.center or torch.equal(group.center, self.center):
                self.sums.add_(group.sums)
                theirs = group.order
            else:  # another rank's centre: q = m - c moves by d, p = v + q^2 by 2 d q + d^2
                d = group.center - self.center
                self.sums.add_(affine(group.sums, 2.0 * d, d * d, d))
                theirs = order_sums.move(group.order, d)
            order_sums.join(self.order, theirs, self.calls, self._totals(group, self.center))
        self.count += group.count
        self.calls += group.calls
        self.weight += group.weight

    @staticmethod
    def _totals(group: CallGroup, center: torch.Tensor) -> torch.Tensor:
        """``sum z_i`` of a group's calls around ``center`` (:mod:`precise_bn.order`)."""
        d = group.mean - center
        count = float(group.count)
        return torch.stack([torch.full_like(d, count), d * count, group.m2 + d * d * count])

    def merge(self, other: "PopulationStats") -> None:
        """Merge another estimator of the same layer."""
        if other.num_channels != self.num_channels:
            raise ValueError("cannot merge {} channels of {!r} into {} channels of {!r}".format(
                other.num_channels, other.name, self.num_channels, self.name))
        self.add(other.as_group())

    def as_group(self) -> CallGroup:
        return CallGroup(self.count, self.calls, self.weight, self.mean, self.m2, self.center, self.u, self.cov,
                         self.sums, self.order)

    def finalize(self, unbiased: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Float64 ``(mean, var)``, the variance biased unless ``unbiased``; raises
        NonFiniteStatsError naming the layer when a channel is NaN or Inf."""
        if self.count == 0:
            raise ValueError("layer {!r} saw no element; nothing to finalize".format(self.name))
        # One sum screens every channel; only a non-finite total pays for the search.
        if not math.isfinite(float(self.mean.sum() + self.m2.sum())):
            self._raise_if_non_finite()
        return self.mean.clone(), self.m2 / float(self._denominator(unbiased))

    def _denominator(self, unbiased: bool) -> int:
        return self.count - 1 if unbiased and self.count > 1 else self.count

    def _undefined(self, count: int = 2) -> Tuple[torch.Tensor, ...]:
        """NaN per channel: the spread between calls until two calls hold elements."""
        return tuple(torch.full_like(self.mean, float("nan")) for _ in range(count))

    def stderr(self, unbiased: bool = False,
               spreads: Optional[Spreads] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Standard errors of :meth:`finalize`'s mean and variance per channel; NaN until two
        calls hold elements."""
        if self.count ** 2 <= self.weight:
            return self._undefined()
        spread_mean, spread_var = spreads or self.spreads()
        factor = 1.0 / float(self.count ** 2 - self.weight)
        scale = self.count / self._denominator(unbiased)
        return (spread_mean * factor).clamp_(min=0).sqrt_(), (spread_var * factor).clamp_(min=0).sqrt_() * scale

    def effective_calls(self) -> float:
        """``N^2 / sum n_i^2``: as many equal calls would weigh the same (0 empty)."""
        return self.count ** 2 / self.weight if self.weight else 0.0

    def order_stats(self, spreads: Optional[Spreads] = None) -> Tuple[torch.Tensor, ...]:
        """Lag-1 correlations (mean, variance) of the deviations behind the standard errors, then
        their trends' z-scores along the calls; 0 without spread, NaN until two calls."""
        if self.count ** 2 <= self.weight:
            return self._undefined(4)
        n = float(self.count)
        d = self.mean - self.center
        one, zero = torch.ones_like(d), torch.zeros_like(d)
        b = torch.stack([torch.stack([-d, one, zero]), torch.stack([d * d - self.m2 / n, -2.0 * d, one])])
        lag = order_sums.lag_matrix(self.order)
        trend = self.order[order_sums.TREND]
        serial = ((b.unsqueeze(2) * lag).sum(1) * b).sum(1)  # b^T L b, for the mean and the variance
        drift = (b * trend).sum(1)
        spread = torch.stack(spreads or self.spreads())
        time_var = (self.order[order_sums.TIME2] - trend[0] * trend[0] / n).clamp_(min=0)
        noise = (time_var * spread / (n - self.weight / n)).sqrt_()
        lagged = torch.where(spread > 0, serial / spread, torch.zeros_like(spread))
        trended = torch.where((spread > 0) & (noise > 0), drift / noise, torch.zeros_like(spread))
        return lagged[0], lagged[1], trended[0], trended[1]

    def spreads(self) -> Spreads:
        """``sum n_i^2 (m_i - mu)^2`` and ``sum n_i^2 (y_i - s2)^2`` over the calls, per channel."""
        w = float(self.weight)
        shift = self.mean - self.center
        var = self.m2 / float(self.count)
        # n-weighted mean of u . a, from mu, s2 and c; then sum n_i^2 (a . (u_i - ubar))^2.
        a = (-2.0 * shift, torch.ones_like(shift), torch.ones_like(shift))
        a_ubar_n = var - shift * shift
        a_u = a[0] * self.u[0] + self.u[1] + self.u[2]
        a_cov_a = sum(
            (1.0 if i == j else 2.0) * a[i] * a[j] * self.cov[p] for p, (i, j) in enumerate(_PAIRS)
        )
        spread_var = a_cov_a + w * (a_u - a_ubar_n).square()
        spread_mean = self.cov[0] + w * (self.u[0] - shift).square()
        return spread_mean.clamp_(min=0), spread_var.clamp_(min=0)

    def tail_spread(self, spreads: Optional[Spreads] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per channel, ``r = sqrt(sum e_i^4 / (sum e_i^2)^2 - 1/k)`` of the mean's and the
        variance's deviations ``e_i`` (``docs/precision.md``): about ``sqrt(2/k)`` on normal calls."""
        if self.count ** 2 <= self.weight:
            return self._undefined()
        return spread_of_squares(self.sums, self.mean - self.center, self.m2 / float(self.count),
                                 spreads or self.spreads(), self.calls)

    def _raise_if_non_finite(self) -> None:
        bad = ~(torch.isfinite(self.mean) & torch.isfinite(self.m2))
        if bool(bad.any()):
            channels = bad.nonzero().reshape(-1).tolist()
            raise NonFiniteStatsError(
                "BatchNorm layer {!r}: non-finite statistics in {} of {} channels (first: {}) "
                "after {} calls; a batch or an activation contains NaN or Inf".format(
                    self.name, len(channels), self.num_channels, channels[:5], self.calls
                )
            )

    def state(self) -> torch.Tensor:
        """``[count, calls, weight]`` and every tensor of :meth:`as_group`, in one float64 vector
        (for collectives); counts above 2**53 would lose bits."""
        head = torch.tensor([float(self.count), float(self.calls), float(self.weight)], dtype=torch.float64,
                            device=self.device)
        return torch.cat([head] + [t.reshape(-1) for t in self.as_group().tensors()])

    @staticmethod
    def state_size(num_channels: int) -> int:
        return 3 + STATE_ROWS * num_channels

    @classmethod
    def from_state(cls, packed: torch.Tensor, name: str = "") -> "PopulationStats":
        """Inverse of :meth:`state`."""
        channels = (packed.numel() - 3) // STATE_ROWS
        stats = cls(channels, name=name, device=packed.device)
        head = packed[:3].tolist()
        stats.count, stats.calls, stats.weight = (int(v) for v in head)
        mine = stats.as_group().tensors()
        for tensor, part in zip(mine, packed[3:].split([t.numel() for t in mine])):
            tensor.copy_(part.view_as(tensor))
        return stats


def add_side_by_side(members: Sequence[PopulationStats], group: CallGroup, widths: Sequence[int]) -> None:
    """Add ``group``, the channels of ``members`` side by side, to them: in one merge over their
    joined state when they have seen the same calls around the group's centre (each channel's
    operations are then those of its own :meth:`PopulationStats.add`)."""
    first = members[0]
    history = (first.count, first.calls, first.weight)
    joined = PopulationStats(0)
    if first.count and all((m.count, m.calls, m.weight) == history for m in members):
        tensors = [torch.cat(parts, dim=-1) for parts in zip(*(m.as_group().tensors() for m in members))]
        joined.mean, joined.m2, joined.center, joined.u, joined.cov, joined.sums, joined.order = tensors
    if not torch.equal(joined.center, group.center):
        for stats, part in zip(members, group.split(widths)):
            stats.add(part)
        return
    joined.count, joined.calls, joined.weight = history
    joined.add(group)
    for stats, part in zip(members, joined.as_group().split(widths)):
        for mine, theirs in zip(stats.as_group().tensors(), part.tensors()):
            mine.copy_(theirs)
        stats.count, stats.calls, stats.weight = joined.count, joined.calls, joined.weight


def pool_with_prior(source: Tuple[torch.Tensor, torch.Tensor], target: Tuple[torch.Tensor, torch.Tensor],
                    prior: float, samples: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The source statistics, counted as ``prior`` samples, and the target's, measured on
    ``samples``, pooled per channel as one population (Chan's merge with the source as one more
    call). Its last term, the spread between the two means, is what ``prior * var_s + (1 - prior)
    * var_t`` leaves out: a mixture is wider than either part when the domain moved."""
    mu_t, var_t = target
    mu_s, var_s = (t.to(mu_t.device, torch.float64) for t in source)
    total = prior + samples
    delta = mu_t - mu_s
    mean = mu_s + delta * (samples / total)
    var = (var_s * prior + var_t * samples) / total + delta.square() * (prior * samples / (total * total))
    return mean, var
