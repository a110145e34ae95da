"""The precision stop, Student's t, and the flags on standard errors that cannot be trusted.

``rtol=r`` promises about 95% of channels within ``r`` of the population value; every condition
of its stop is a per-layer pure function of the merged statistics, so ranks combine maxima. Each
flag is a test with a stated false-alarm rate on independent normal calls, run from the calls at
which it can fire (:func:`runs_from`); ``docs/precision.md`` derives them and gives the rates.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import warn
from .estimator import PopulationStats
from .options import Options

#: Why standard errors are not trusted (label, what was seen); a channel is named by the first.
FLAGS = {
    "identical": ("identical batch statistics",
                  "every batch gave the same means and variances, bit for bit: one batch read again and again, "
                  "or values rounded so coarsely (bfloat16) that every batch rounds to the same statistics"),
    "concentrated": ("a few batches hold most elements",
                     "a few batches hold most of the elements, so the standard errors rest on a few draws"),
    "drift": ("drift along the data",
              "the mean or variance moves along the data: early and late batches disagree beyond their standard "
              "errors (data read in order, not shuffled)"),
    "correlated": ("consecutive batches alike",
                   "consecutive batches resemble each other, so they say less than as many independent ones (data "
                   "read in order, clips of a few videos, sequential shards)"),
    "tails": ("heavy tails",
              "the calls' deviations are heavier-tailed than normal calls give at this number of calls (a rare "
              "outlier, rare activity, one batch unlike the others)"),
}
#: A spread between calls below this, relative to the channel's magnitude, is the merge's rounding.
REPEATED = 1e-12
#: Fewer equal calls' weight than this (and than half the calls) is concentrated.
CONCENTRATED = 8
#: The chance that the tails test flags any channel of a layer of independent normal calls.
FALSE_ALARM = 0.01
#: A trend of the deviations along the calls beyond this many of its standard deviations is a drift.
DRIFT_Z = 5.0
#: A lag-1 correlation above ``SERIAL + SERIAL_Z / sqrt(k)`` is flagged.
SERIAL, SERIAL_Z = 0.2, 3.5
#: What the loader did, first in :data:`FLAGS`: ``rtol`` waits on these (heavy tails widen its bound).
LOADER_FLAGS = ("identical", "concentrated", "drift", "correlated")


#: Student's t beyond this many degrees of freedom uses this many: slightly heavier tails, a bounded cost.
MAX_DOF = 100000.0


def _continued_fraction(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The incomplete beta's continued fraction (modified Lentz), for ``x < (a + 1) / (a + b + 2)``."""
    tiny = 1e-300
    c = torch.ones_like(x)
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / torch.where(d.abs() < tiny, torch.full_like(d, tiny), d)
    h = d.clone()
    for m in range(1, 10000):
        for coefficient in (m * (b - m) * x / ((a - 1.0 + 2 * m) * (a + 2 * m)),
                            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1.0 + 2 * m))):
            d = 1.0 + coefficient * d
            d = 1.0 / torch.where(d.abs() < tiny, torch.full_like(d, tiny), d)
            c = 1.0 + coefficient / c
            c = torch.where(c.abs() < tiny, torch.full_like(c, tiny), c)
            step = d * c
            h = h * step
        if not bool(((step - 1.0).abs() > 1e-12).any()):
            break
    return h


def t_tail(t: torch.Tensor, dof: torch.Tensor) -> torch.Tensor:
    """``P(T > t)`` for Student's t with ``dof`` (at most :data:`MAX_DOF`) degrees of freedom,
    float64, accurate far into the tail: ``I_x(dof/2, 1/2) / 2`` with ``x = dof / (dof + t^2)``."""
    t, dof = torch.broadcast_tensors(t.double(), dof.double().clamp(max=MAX_DOF))
    square = t * t
    x = dof / (dof + square)
    rest = 1.0 / (1.0 + dof / square)  # 1 - x without cancellation, 1 at t = +-inf
    a, b = dof / 2.0, torch.full_like(dof, 0.5)
    swap = x > (a + 1.0) / (a + b + 2.0)
    p, q = torch.where(swap, b, a), torch.where(swap, a, b)
    u, v = torch.where(swap, rest, x), torch.where(swap, x, rest)
    log_front = torch.lgamma(p + q) - torch.lgamma(p) - torch.lgamma(q) + p * torch.log(u) + q * torch.log(v)
    part = torch.exp(log_front) * _continued_fraction(p, q, u) / p
    half = 0.5 * torch.where(swap, 1.0 - part, part)
    return torch.where(t >= 0, half, 1.0 - half)


@functools.lru_cache(maxsize=None)
def t975(dof: int) -> float:
    """Student's 97.5% quantile: Newton's steps on :func:`t_tail` from the normal's, below it."""
    nu = min(float(dof), MAX_DOF)
    log_density = math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi)
    t = 1.959963984540054
    for _ in range(100):
        excess = float(t_tail(torch.tensor(t), torch.tensor(nu))) - 0.025
        step = excess / math.exp(log_density - (nu + 1) / 2 * math.log1p(t * t / nu))
        t += step
        if step < 1e-13 * t:
            break
    return t


def _kurtosis_p(b2: torch.Tensor, k: int) -> torch.Tensor:
    """The chance that k independent normal draws show a kurtosis ``b2`` or more, by Anscombe and
    Glynn's (1983) normal score (1 where it is undefined: ``b2`` far below normal)."""
    mean = 3.0 * (k - 1) / (k + 1)
    sd = math.sqrt(24.0 * k * (k - 2) * (k - 3) / ((k + 1) ** 2 * (k + 3) * (k + 5)))
    skew = 6.0 * (k * k - 5 * k + 2) / ((k + 7) * (k + 9)) * math.sqrt(
        6.0 * (k + 3) * (k + 5) / (k * (k - 2) * (k - 3)))
    a = 6.0 + 8.0 / skew * (2.0 / skew + math.sqrt(1.0 + 4.0 / skew ** 2))
    below = 1.0 + (b2 - mean) / sd * math.sqrt(2.0 / (a - 4.0))
    root = ((1.0 - 2.0 / a) / below.clamp(min=1e-300)).pow(1.0 / 3.0)
    z = (1.0 - 2.0 / (9.0 * a) - root) / math.sqrt(2.0 / (9.0 * a))
    return torch.where(below > 0, 0.5 * torch.erfc(z / math.sqrt(2.0)), torch.ones_like(z))


def _as_normal(b2: torch.Tensor, k: int, shape: float) -> torch.Tensor:
    """The kurtosis ``b2`` of k gamma draws of ``shape`` (a call's second moment over ``2 shape``
    normal elements) moved to the normal law's scale, its mean and large-k variance matched."""
    a = max(shape, 1.0)
    m3, m4, m5 = 2 * a, 3 * a * a + 6 * a, 20 * a * a + 24 * a
    m6 = 15 * a ** 3 + 130 * a * a + 120 * a
    m8 = 105 * a ** 4 + 2380 * a ** 3 + 7308 * a * a + 5040 * a
    spread = (m8 / a ** 4 - 4 * m6 * m4 / a ** 5 - 8 * m5 * m3 / a ** 4 + 4 * m4 ** 3 / a ** 6 - m4 * m4 / a ** 4
              + 16 * m4 * m3 * m3 / a ** 5 + 16 * m3 * m3 / a ** 3)
    normal = 3.0 * (k - 1) / (k + 1)
    return normal + (b2 - normal * m4 / (3 * a * a)) * math.sqrt(24.0 / spread)


def tails_level(channels: int) -> float:
    """Each tails test's level: :data:`FALSE_ALARM` shared over a layer's channels, mean and variance."""
    return FALSE_ALARM / (2.0 * max(channels, 1))


@functools.lru_cache(maxsize=None)
def runs_from(reason: str, channels: int = 1) -> int:
    """The fewest calls at which ``reason`` can flag a channel of a layer of ``channels``: below,
    it is not run. A trend's z-score is at most ``sqrt(k - 1)``, a lag-1 correlation below 1, and
    the kurtosis of k calls at most ``k - 2 + 1 / (k - 1)`` (one call carrying all the spread)."""
    if reason == "drift":
        return int(DRIFT_Z ** 2) + 2
    if reason == "correlated":
        return int((SERIAL_Z / (1.0 - SERIAL)) ** 2) + 1
    if reason != "tails":
        return 2
    k = CONCENTRATED
    while float(_kurtosis_p(torch.tensor(k - 2.0 + 1.0 / (k - 1)), k)) >= tails_level(channels):
        k += 1
    return k


def not_run(calls: int, channels: int) -> List[str]:
    """The flags a layer of ``channels`` run ``calls`` times could not test."""
    return [reason for reason in FLAGS if calls < runs_from(reason, channels)] if calls >= 2 else []


def _diagnostics(stats: PopulationStats) -> Tuple[torch.Tensor, ...]:
    """Rows of :data:`FLAGS`, above 1 where one holds; the standard errors and tail spreads."""
    channels, k = stats.num_channels, stats.calls
    out = torch.zeros(len(FLAGS), channels, dtype=torch.float64, device=stats.device)
    spreads = stats.spreads()
    mean_se, var_se = stats.stderr(spreads=spreads)
    mean_r, var_r = stats.tail_spread(spreads)
    var = stats.m2 / stats.count
    live = (var > 0) & torch.isfinite(var) & torch.isfinite(stats.mean)
    calls = math.sqrt((stats.count ** 2 - stats.weight) / stats.weight)  # the calls' spread over the standard error
    spread = torch.max(mean_se * calls / (stats.mean * stats.mean + var).sqrt(), var_se * calls / var)
    inf = torch.full_like(var, float("inf"))
    out[0] = torch.where(spread > 0, REPEATED / spread, inf)
    out[1] = min(CONCENTRATED, k / 2.0) / stats.effective_calls()
    if k >= runs_from("tails", channels):
        mix = stats.effective_calls()  # b2 * k_eff / k: calls of unequal counts are a normal mixture
        p = torch.min(_kurtosis_p((k * mean_r.square() + 1.0) * (mix / k), k),
                      _kurtosis_p(_as_normal((k * var_r.square() + 1.0) * (mix / k), k, stats.count / (2.0 * k)), k))
        out[4] = torch.where(p > 0, tails_level(channels) / p, inf)
    if k >= min(runs_from("drift"), runs_from("correlated")):
        lag_mean, lag_var, trend_mean, trend_var = stats.order_stats(spreads)
        out[2] = torch.max(trend_mean.abs(), trend_var.abs()) / DRIFT_Z
        out[3] = torch.max(lag_mean, lag_var) / (SERIAL + SERIAL_Z / math.sqrt(k))
    return torch.where(live, out, torch.zeros_like(out)), mean_se, var_se, mean_r, var_r


def flags(stats: PopulationStats) -> Dict[str, List[int]]:
    """The channels whose standard errors cannot be trusted, under the first reason that holds."""
    out: Dict[str, List[int]] = {}
    if stats.count ** 2 <= stats.weight:
        return out
    ratios = _diagnostics(stats)[0]
    free = torch.ones(stats.num_channels, dtype=torch.bool, device=stats.device)
    for reason, row in zip(FLAGS, ratios):
        hit = free & (row > 1.0)
        if bool(hit.any()):
            out[reason] = hit.nonzero().reshape(-1).tolist()
            free &= ~hit
    return out


RTOL_CONDITIONS = ("mean", "variance", "dead") + LOADER_FLAGS


def rtol_ratios(stats: PopulationStats, rtol: float, samples: int) -> torch.Tensor:
    """Per condition of ``RTOL_CONDITIONS`` and channel, a ratio at most 1 when met: ``t (1 + r/2)``
    standard errors over ``rtol`` times the std (mean) or the variance, ``t`` Student's 97.5%
    quantile, ``r`` the tail spread (one of the standard error's own deviations higher); ``sqrt(3 /
    samples) / (rtol / 2)`` for a channel of variance 0; the loader's flags. ``inf`` until two calls."""
    out = torch.zeros(len(RTOL_CONDITIONS), stats.num_channels, dtype=torch.float64, device=stats.device)
    if stats.count == 0:
        return out
    if stats.count ** 2 <= stats.weight:
        return out.fill_(float("inf"))
    var = stats.m2 / stats.count
    live = var > 0
    ratios, mean_se, var_se, mean_r, var_r = _diagnostics(stats)
    out[3:] = ratios[:len(LOADER_FLAGS)]
    scale = t975(stats.calls - 1) / rtol
    out[0] = torch.where(live, mean_se * (1.0 + 0.5 * mean_r) * scale / var.sqrt(), out[0])
    out[1] = torch.where(live, var_se * (1.0 + 0.5 * var_r) * scale / var, out[1])
    out[2] = torch.where(live, out[2], (3.0 / max(samples, 1)) ** 0.5 / (rtol / 2.0))
    return out


def worst_ratio(stats: PopulationStats, rtol: float, samples: int) -> float:
    """The largest of a layer's :func:`rtol_ratios` (0 without channels or calls)."""
    ratios = rtol_ratios(stats, rtol, samples)
    return float(ratios.max()) if ratios.numel() else 0.0


def warn_if_rtol_unreachable(opts: Options, planned: Optional[int], batch_size: Any, world: int) -> None:
    """Before the pass: a :class:`PreciseBNWarning` when the budget or the data allow fewer than
    ``min_batches`` batches over all ranks, so that ``rtol`` would never be checked."""
    if opts.rtol is None:
        return
    limits = []
    if planned is not None:
        limits.append((planned, "num_batches={}".format(planned) if planned == opts.num_batches else "the data"))
    if opts.num_samples is not None and isinstance(batch_size, int) and batch_size > 0:
        limits.append((-(-opts.num_samples // batch_size),
                       "num_samples={} in batches of {}".format(opts.num_samples, batch_size)))
    if limits and min(limits)[0] * world < opts.min_batches:
        batches, what = min(limits)
        warn("rtol={:g} will never be checked: {} gives {} batches{}, fewer than min_batches={}; "
             "read more or lower min_batches".format(
                 opts.rtol, what, batches * world, " over {} ranks".format(world) if world > 1 else "",
                 opts.min_batches))


def _named(names: Sequence[str], reasons: Sequence[Dict[str, List[int]]]) -> str:
    """The channels flagged for what the loader did, in plain words by reason; empty when none."""
    parts = []
    for reason in LOADER_FLAGS:
        words = FLAGS[reason][1]
        where = [(name, layer[reason]) for name, layer in zip(names, reasons) if reason in layer]
        if not where:
            continue
        shown = "; ".join("layer {!r}, channel{} {}{}".format(
            name, "" if len(channels) == 1 else "s", ", ".join(map(str, channels[:6])),
            ", ..." if len(channels) > 6 else "") for name, channels in where[:3])
        count = sum(len(channels) for _, channels in where)
        parts.append("in {} channel{} ({}{}): {}".format(
            count, "" if count == 1 else "s", shown, "; ..." if len(where) > 3 else "", words))
    return "; ".join(parts)


def _worst(rtol: float, stats: Sequence[PopulationStats], names: Sequence[str], batches: int, samples: int) -> str:
    """The channel furthest from ``rtol``, why, and about how many more batches; empty if none."""
    worst = (0.0, "", 0, 0)
    for name, layer in zip(names, stats):
        ratios = rtol_ratios(layer, rtol, samples)[:3]
        if ratios.numel() and float(ratios.max()) > worst[0]:
            flat = int(ratios.argmax())
            worst = (float(ratios.max()), name, flat // layer.num_channels, flat % layer.num_channels)
    ratio, name, condition, channel = worst
    if ratio <= 1.0:
        return ""
    why = {
        "mean": "the mean's 95% error bound (t x standard error) is {:.3g} times rtol, in units of the std",
        "variance": "the variance's 95% error bound (t x standard error) is {:.3g} times rtol",
        "dead": "its variance is 0 so far, and {:.3g} times the samples read are needed to rule out a rare activity",
    }[RTOL_CONDITIONS[condition]].format(ratio * ratio if RTOL_CONDITIONS[condition] == "dead" else ratio)
    more = "" if math.isinf(ratio) else "; about {} more batches would reach it".format(
        max(1, math.ceil(batches * (ratio * ratio - 1.0))))
    return "layer {!r}, channel {}: {}{}".format(name, channel, why, more)


def warn_if_imprecise(opts: Options, stats: Sequence[PopulationStats], names: Sequence[str],
                      reasons: Sequence[Dict[str, List[int]]], batches: int, samples: int, stop: str) -> None:
    """After a pass: a :class:`PreciseBNWarning` naming the channels flagged for what the loader
    did, and, if ``rtol`` was not reached, the worst channel and the batches it would need."""
    if opts.rtol is None:
        named = _named(names, reasons)
        if named:
            warn("the standard errors cannot be trusted {} (the report's se_reasons lists them)".format(named))
        return
    if stop == "rtol":
        return
    if batches < opts.min_batches:
        warn("rtol={:g} was not checked: {} batches were read, fewer than min_batches={}".format(
            opts.rtol, batches, opts.min_batches))
        return
    named = _named(names, reasons)
    worst = _worst(opts.rtol, stats, names, batches, samples)
    if named or worst:
        warn("rtol={:g} not reached after {} batches (stopped: {}): {}{}{}".format(
            opts.rtol, batches, stop,
            "rtol never stops while standard errors cannot be trusted for what the loader did, and they "
            "cannot " + named if named else "",
            "; besides, " if named and worst else "", worst))
