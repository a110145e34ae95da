"""The precision stop: what ``rtol`` promises, the per-channel test that keeps it, the channels
whose standard errors cannot be trusted, and the warnings when it cannot be met.

What ``rtol`` promises: with ``rtol=r``, about 95% of channels end within ``r`` of the
population value (the mean in units of the std, the variance relative to itself). The pass stops
once ``t_{0.975, k-1}`` standard errors, each taken one of its own standard deviations high, are
within ``r`` for every channel of every layer, a channel of variance 0 has been read on at least
``12 / r^2`` samples (the rule of three at ``(r/2)^2``), and no channel is flagged (:data:`FLAGS`):
the statistics the pass merges show that its batches are not independent draws, or that its
standard errors rest on too few of them. Every condition is a per-channel ratio that is at most 1
when met (:func:`rtol_ratios`), a pure function of one layer's merged statistics, so that ranks
may combine per-layer maxima. ``docs/precision.md`` derives each test and what it cannot see.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import warn
from .estimator import PopulationStats
from .options import Options

#: Why a channel's standard errors are not trusted, in plain words (a short label, then what it
#: means), in the order a channel is named by: the first that holds.
FLAGS = {
    "repeated": ("the same batch repeated",
                 "every batch has the same means and variances, bit for bit (the same batch read again and "
                 "again)"),
    "concentrated": ("a few batches hold most elements",
                     "a few batches hold most of the elements, so the standard errors rest on a few draws"),
    "tails": ("heavy tails",
              "a few batches carry most of the spread behind the standard errors (heavy tails, rare outliers or "
              "rare activity)"),
    "drift": ("drift along the data",
              "the mean or variance moves along the data: early and late batches disagree beyond their standard "
              "errors (data read in order, not shuffled)"),
    "correlated": ("consecutive batches alike",
                   "consecutive batches resemble each other, so they say less than as many independent ones (data "
                   "read in order, clips of a few videos, sequential shards)"),
}
#: A standard error whose square has a relative spread above this
#: (:meth:`~precise_bn.estimator.PopulationStats.tail_spread`) is not trusted: it may itself be
#: off by a quarter or more.
TAIL_LIMIT = 0.5
#: Calls whose means and second moments spread less than this relative to the channel's
#: magnitude (their count²-weighted standard deviation, the standard error times
#: ``sqrt((N^2 - sum n^2) / sum n^2)``) are the same batch read again, bit for bit: the float64
#: merge's own rounding. A looser test takes for repeats what legitimately spreads little
#: (``docs/precision.md``).
REPEATED = 1e-12
#: Fewer effective calls than this, ``2 / TAIL_LIMIT^2``, leave the squared standard error of normal
#: data a relative spread above :data:`TAIL_LIMIT`; flagged when also under half the calls.
CONCENTRATED = 2.0 / TAIL_LIMIT ** 2
#: A trend of the deviations along the calls beyond this many of its standard deviations is a drift.
DRIFT_Z = 5.0
#: A lag-1 correlation above ``SERIAL + SERIAL_Z / sqrt(k)`` is flagged: beyond SERIAL, two standard
#: errors of an AR(1) stream would cover under 90%; SERIAL_Z standard deviations of the statistic
#: keep false alarms rare on independent batches.
SERIAL, SERIAL_Z = 0.2, 3.5


def _diagnostics(stats: PopulationStats) -> Tuple[torch.Tensor, ...]:
    """The ratios of :data:`FLAGS` (rows in that order, each above 1 when it holds), then the
    standard errors and the tail spreads of the mean and the variance; needs two calls holding
    elements."""
    out = torch.zeros(len(FLAGS), stats.num_channels, dtype=torch.float64, device=stats.device)
    spreads = stats.spreads()
    mean_se, var_se = stats.stderr(spreads=spreads)
    mean_r, var_r = stats.tail_spread(spreads)
    var = stats.m2 / stats.count
    live = (var > 0) & torch.isfinite(var) & torch.isfinite(stats.mean)
    calls = math.sqrt((stats.count ** 2 - stats.weight) / stats.weight)  # the calls' spread over the standard error
    spread = torch.max(mean_se * calls / (stats.mean * stats.mean + var).sqrt(), var_se * calls / var)
    lag_mean, lag_var, trend_mean, trend_var = stats.order_stats(spreads)
    k, k_eff = stats.calls, stats.effective_calls()
    inf = torch.full_like(var, float("inf"))
    out[0] = torch.where(spread > 0, REPEATED / spread, inf)
    out[1] = min(CONCENTRATED, k / 2.0) / k_eff
    out[2] = torch.max(mean_r, var_r) / TAIL_LIMIT
    out[3] = torch.max(trend_mean.abs(), trend_var.abs()) / DRIFT_Z
    out[4] = torch.max(lag_mean, lag_var) / (SERIAL + SERIAL_Z / math.sqrt(k))
    return torch.where(live, out, torch.zeros_like(out)), mean_se, var_se, mean_r, var_r


def flags(stats: PopulationStats) -> Dict[str, List[int]]:
    """The channels whose standard errors cannot be trusted, by the first reason of :data:`FLAGS`
    that holds (reasons without a channel left out)."""
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


def t975(dof: int) -> float:
    """The 97.5% quantile of Student's t with ``dof`` degrees of freedom: exact for 1 and 2,
    else the Cornish-Fisher expansion around the normal 1.96 (within 0.8% at 3, 0.03% from 7)."""
    if dof <= 2:
        return math.tan(math.pi * 0.475) if dof == 1 else 0.95 * math.sqrt(2.0 / (4 * 0.975 * 0.025))
    z = 1.959963984540054
    terms = ((z ** 3 + z) / 4, (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96,
             (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384)
    return z + sum(term / dof ** (i + 1) for i, term in enumerate(terms))


#: The conditions of :func:`rtol_ratios`, in the order of its rows.
RTOL_CONDITIONS = ("mean", "variance", "dead") + tuple(FLAGS)


def rtol_ratios(stats: PopulationStats, rtol: float, samples: int) -> torch.Tensor:
    """Per condition of :data:`RTOL_CONDITIONS` and channel, a ratio that is at most 1 when
    ``rtol`` holds (see the module docstring), float64 ``(8, C)``:

    * ``mean``: ``t * (1 + r/2) * mean_stderr / (rtol * std)``; ``variance``:
      ``t * (1 + r/2) * var_stderr / (rtol * var)``, ``t`` the 97.5% quantile of Student's t
      with ``calls - 1`` degrees of freedom, ``r`` the standard error's :meth:`tail spread
      <precise_bn.estimator.PopulationStats.tail_spread>`, so that ``(1 + r/2)`` lifts the
      standard error by one of its own standard deviations;
    * ``dead``: for a channel of variance 0, ``sqrt(3 / samples) / (rtol / 2)``;
    * the flags of :data:`FLAGS`, each above 1 when it holds.

    A layer that never ran gives zeros; one with fewer than two calls holding elements, ``inf``
    (no standard error yet). ``samples`` counts the samples read over all ranks. A pure function
    of the layer's merged statistics, so ranks can combine per-layer maxima.
    """
    out = torch.zeros(len(RTOL_CONDITIONS), stats.num_channels, dtype=torch.float64, device=stats.device)
    if stats.count == 0:
        return out
    if stats.count ** 2 <= stats.weight:
        return out.fill_(float("inf"))
    var = stats.m2 / stats.count
    live = var > 0
    # The standard errors relative to the variance: the same with Bessel's correction.
    out[3:], mean_se, var_se, mean_r, var_r = _diagnostics(stats)
    scale = t975(stats.calls - 1) / rtol
    out[0] = torch.where(live, mean_se * (1.0 + 0.5 * mean_r) * scale / var.sqrt(), out[0])
    out[1] = torch.where(live, var_se * (1.0 + 0.5 * var_r) * scale / var, out[1])
    out[2] = torch.where(live, out[2], (3.0 / max(samples, 1)) ** 0.5 / (rtol / 2.0))
    return out


def worst_ratio(stats: PopulationStats, rtol: float, samples: int) -> float:
    """The largest of a layer's :func:`rtol_ratios` (0 for a layer without channels or calls).
    When every layer's is at most 1, about 95% of channels are within ``rtol`` of the population
    value; the driver takes the largest over layers and ranks. ``samples``: read over all ranks."""
    ratios = rtol_ratios(stats, rtol, samples)
    return float(ratios.max()) if ratios.numel() else 0.0


def warn_if_rtol_unreachable(opts: Options, planned: Optional[int], batch_size: Any, world: int) -> None:
    """Before the pass: a :class:`PreciseBNWarning` when ``rtol`` is given but the budget (or
    the data's length) allows fewer than ``min_batches`` batches over all ranks, so that
    ``rtol`` is never checked. ``batch_size``: the loader's, if it says, to count ``num_samples``."""
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


def _named(names: Sequence[str], reasons: Sequence[Dict[str, List[int]]], skip: Sequence[str] = ()) -> str:
    """The flagged channels of every layer in plain words, by reason; empty when there are none."""
    parts = []
    for reason, (_, words) in FLAGS.items():
        where = [(name, layer[reason]) for name, layer in zip(names, reasons) if reason in layer]
        if reason in skip or not where:
            continue
        shown = "; ".join("layer {!r}, channel{} {}{}".format(
            name, "" if len(channels) == 1 else "s", ", ".join(map(str, channels[:6])),
            ", ..." if len(channels) > 6 else "") for name, channels in where[:3])
        count = sum(len(channels) for _, channels in where)
        parts.append("in {} channel{} ({}{}): {}".format(
            count, "" if count == 1 else "s", shown, "; ..." if len(where) > 3 else "", words))
    return "; ".join(parts)


def _worst(rtol: float, stats: Sequence[PopulationStats], names: Sequence[str], batches: int, samples: int) -> str:
    """The layer and channel furthest from ``rtol`` (mean, variance or a dead channel), why, and
    about how many more batches the standard errors suggest; empty when every channel is within."""
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
    """After a pass (``stop``, having read ``batches`` and ``samples`` over all ranks; each
    layer's :func:`flags` in ``reasons``): a :class:`PreciseBNWarning` saying why, when ``rtol``
    was given and not reached: the flagged channels, and the worst layer and channel with about
    how many more batches the standard errors suggest. Without ``rtol``, one naming the channels
    flagged for what the loader did (every flag but heavy tails, which the report counts)."""
    if opts.rtol is None:
        named = _named(names, reasons, skip=("tails",))
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
            "rtol never stops while standard errors cannot be trusted, and they cannot " + named if named else "",
            "; besides, " if named and worst else "", worst))
