"""The precision stop: what ``rtol`` promises, the per-channel test that keeps it, and the
warnings when it cannot be met.

What ``rtol`` promises: with ``rtol=r``, about 95% of channels end within ``r`` of the
population value (the mean in units of the std, the variance relative to itself). Each
channel's standard errors come from k calls, so its error over its standard error follows
Student's t with k - 1 degrees of freedom more than a normal law; the pass stops once
``t_{0.975, k-1}`` standard errors (2.13 at k = 16, 2.04 at k = 32) are within ``r`` for every
channel of every layer, each standard error taken one of its own standard deviations high
(about 12% at k = 32 on normal data, more on skewed data: stopping when the standard errors
happen to come out small is what optional stopping punishes), and only on channels whose
standard errors can be trusted:

* heavy tails (:meth:`~precise_bn.estimator.PopulationStats.tail_spread`): a channel whose
  standard errors are themselves uncertain by a quarter or more blocks the stop; that spread
  falls as ``1/sqrt(k)`` for a finite fourth moment and never for a channel whose variance
  rests on a few calls;
* a channel of variance 0 so far is dead only once the samples read bound its activity: no
  activity in ``N`` samples bounds the rate at ``3/N`` (the rule of three, 95%), and we ask
  ``3/N <= (r/2)^2``, i.e. ``N >= 12/r^2`` samples (4,800 at ``r = 0.05``), the margin two
  standard errors ask of a measured variance: a channel active on 1 sample in 2,000 is then
  seen with 92% probability before it could be written as dead.

Every such condition is a per-channel ratio that is at most 1 when met (:func:`rtol_ratios`);
its square falls as ``1/k``, so ``k (ratio^2 - 1)`` estimates how many more batches a pass
that ran out before ``rtol`` needed.

The test is a pure function of one layer's merged statistics (:func:`worst_ratio`), so the
ranks may combine per-layer maxima.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from .errors import warn
from .estimator import PopulationStats
from .options import Options

#: A standard error whose square has a relative spread above this
#: (:meth:`~precise_bn.estimator.PopulationStats.tail_spread`) is not trusted: it may itself be
#: off by a quarter or more. Normal data reaches it in 0.5% of channels after 32 batches of 32
#: (``benchmarks/CALIBRATION.md``), and more often with fewer calls: 0.35 is typical at 16.
TAIL_LIMIT = 0.5


def untrusted_stderr(stats: PopulationStats) -> torch.Tensor:
    """Channels (bool) whose standard error of the mean or the variance cannot be trusted:
    a :meth:`~precise_bn.estimator.PopulationStats.tail_spread` above :data:`TAIL_LIMIT`
    (heavy tails, or a few calls carrying most of the spread). All False with fewer than two
    calls, whose standard errors are NaN anyway."""
    mean_r, var_r = stats.tail_spread()
    return (mean_r > TAIL_LIMIT) | (var_r > TAIL_LIMIT)


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
RTOL_CONDITIONS = ("mean", "variance", "tails", "dead")


def rtol_ratios(stats: PopulationStats, rtol: float, samples: int) -> torch.Tensor:
    """Per condition of :data:`RTOL_CONDITIONS` and channel, a ratio that is at most 1 when
    ``rtol`` holds (see the module docstring), float64 ``(4, C)``:

    * ``mean``: ``t * (1 + r/2) * mean_stderr / (rtol * std)``; ``variance``:
      ``t * (1 + r/2) * var_stderr / (rtol * var)``, ``t`` the 97.5% quantile of Student's t
      with ``calls - 1`` degrees of freedom, ``r`` the standard error's :meth:`tail spread
      <precise_bn.estimator.PopulationStats.tail_spread>`, so that ``(1 + r/2)`` lifts the
      standard error by one of its own standard deviations;
    * ``tails``: :meth:`~precise_bn.estimator.PopulationStats.tail_spread` over its limit;
    * ``dead``: for a channel of variance 0, ``sqrt(3 / samples) / (rtol / 2)``.

    A layer that never ran gives zeros; one with fewer than two calls, ``inf`` (no standard
    error yet). ``samples`` counts the samples read over all ranks. A pure function of the
    layer's merged statistics, so ranks can combine per-layer maxima instead of statistics.
    """
    out = torch.zeros(len(RTOL_CONDITIONS), stats.num_channels, dtype=torch.float64, device=stats.device)
    if stats.count == 0:
        return out
    if stats.calls < 2:
        return out.fill_(float("inf"))
    var = stats.m2 / stats.count
    live = var > 0
    mean_se, var_se = stats.stderr()  # relative to the variance, the same with Bessel's correction
    mean_r, var_r = stats.tail_spread()
    scale = t975(stats.calls - 1) / rtol
    out[0] = torch.where(live, mean_se * (1.0 + 0.5 * mean_r) * scale / var.sqrt(), out[0])
    out[1] = torch.where(live, var_se * (1.0 + 0.5 * var_r) * scale / var, out[1])
    out[2] = torch.max(mean_r, var_r) / TAIL_LIMIT
    out[3] = torch.where(live, out[3], (3.0 / max(samples, 1)) ** 0.5 / (rtol / 2.0))
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


def warn_if_imprecise(opts: Options, stats: Sequence[PopulationStats], names: Sequence[str], batches: int,
                      samples: int, stop: str) -> None:
    """After a pass with ``rtol`` that did not stop on it (``stop``, having read ``batches``
    and ``samples`` over all ranks): a :class:`PreciseBNWarning` naming the worst layer and
    channel, why, and about how many more batches the standard errors suggest."""
    if opts.rtol is None or stop == "rtol":
        return
    if batches < opts.min_batches:
        warn("rtol={:g} was not checked: {} batches were read, fewer than min_batches={}".format(
            opts.rtol, batches, opts.min_batches))
        return
    worst = (0.0, "", 0, 0)
    for name, layer in zip(names, stats):
        ratios = rtol_ratios(layer, opts.rtol, samples)
        if ratios.numel() and float(ratios.max()) > worst[0]:
            flat = int(ratios.argmax())
            worst = (float(ratios.max()), name, flat // layer.num_channels, flat % layer.num_channels)
    ratio, name, condition, channel = worst
    if ratio <= 1.0:
        return
    why = {
        "mean": "the mean's 95% error bound (t x standard error) is {:.3g} times rtol, in units of the std",
        "variance": "the variance's 95% error bound (t x standard error) is {:.3g} times rtol",
        "tails": "its standard errors cannot be trusted yet: heavy tails, their own spread is {:.3g} times the limit",
        "dead": "its variance is 0 so far, and {:.3g} times the samples read are needed to rule out a rare activity",
    }[RTOL_CONDITIONS[condition]].format(ratio * ratio if RTOL_CONDITIONS[condition] == "dead" else ratio)
    more = "" if math.isinf(ratio) else "; about {} more batches would reach it".format(
        max(1, math.ceil(batches * (ratio * ratio - 1.0))))
    warn("rtol={:g} not reached after {} batches (stopped: {}): layer {!r}, channel {}: {}{}".format(
        opts.rtol, batches, stop, name, channel, why, more))
