"""When ``exact=True`` may keep the BN kernel's own float32 statistics: the bound, and the checks.

``exact=True`` promises the exact bound: each written variance within 1e-7 relative of the
float64 two-pass value (plus the rounding of the float32 buffer it is stored in), each mean
within 1e-7 std or one float32 ulp. Measuring a call in float64 re-reads its input; the kernel's
statistics are free. So a layer keeps the kernel's statistics unless they could miss the bound,
decided from its first call and re-checked as later calls are merged.

Which kernels. PyTorch's CPU kernel for a float32 input that is contiguous, not channels-last,
with a spatial size above 1, sums each channel in double and rounds once: the call's mean
``m^ = m + d`` with ``|d| <= u |m|`` (``u = 2**-24``, half a float32 ulp), and it sums
``(x - m^)^2`` in double before rounding. Channels-last and ``(N, C)`` inputs on the CPU, and
CUDA, accumulate in float32, with errors that grow with the element count (tens of ulps of the
mean at a few thousand elements), and a subclass's forward may do anything: every call of those
is measured in float64, as before. (``tests/test_capture.py`` checks the half-ulp claim against
the CPU kernel at mean/std up to 1e4.)

What the rounded means cost. Merging k calls around ``m^_i`` instead of ``m_i`` changes M2 by
``sum n_i d_i^2 - 2 sum n_i (m_i - mu) d_i + ...``. With ``r = |m| / std`` and ``D`` the spread of
the call means in units of the std (``std_i(m_i) / std``):

* the first term is a bias of at most ``(u r)^2`` relative to the variance;
* the second, with ``d_i`` uniform over an ulp (``sd <= u |m| / sqrt(3)``) and independent of
  ``m_i - mu`` (the means spread over many ulps), is a zero-mean error with standard deviation
  ``2 u r D / sqrt(3 k)`` relative, largest with two calls: ``sqrt(2/3) u r D``.

A channel is trusted when ``(u r)^2 + 4 sqrt(2/3) u r D <= 1e-7``: four standard deviations of
the worst case within the bound, about ``r D <= 0.5``. The kernel also rounds each call's
variance to float32 twice (``<= 2u`` relative, averaging down over calls); that part does not
grow with ``r``, is what the default path carries everywhere, and fits within the bound's
allowance for the float32 buffer. Simulated through the capture on the CPU kernel (4096
channels per setting, k = 2 to 16 calls), channels at ``r D = 0.5`` reach at most three quarters
of the allowed error, at ``r D = 1`` the whole of it.

Where ``D`` comes from. On the first call, from the spread of its samples' own means:
``D^2 = var_s(per-sample mean) / (std^2 N)``, what the call means vary by when batches of N
samples are drawn at random; it counts the element noise (``1 / n``) too. Deeper layers see
inputs already normalised batch by batch, so their real spread is often smaller: the estimate
errs on the safe side. The law of total variance caps it: the sample means cannot spread by more
than the std, so ``D <= 1 / sqrt(N - 1)``, and a layer within the bound even at that cap is
trusted without computing its per-sample means. Every full block of calls is checked again with the spread of its own
call means and the largest ``r`` it saw; a layer that fails measures every later call in
float64 (the calls already merged keep the kernel's precision).
"""
from __future__ import annotations

import math

import numpy as np
import torch

#: Half a float32 ulp, relative: the rounding of a float32 store.
UNIT_ROUNDOFF = 2.0 ** -24
#: The exact bound on the relative error of a variance.
EXACT_RTOL = 1e-7
#: Standard deviations of the rounded means' error kept within the bound.
SPREAD_SDS = 4.0
#: Above this many elements per channel, a double sum of float32 values may be off by more
#: than a small part of a float32 ulp.
MAX_DOUBLE_SUM = 1 << 26

_CROSS = SPREAD_SDS * math.sqrt(2.0 / 3.0) * UNIT_ROUNDOFF


def double_accumulated(x: torch.Tensor) -> bool:
    """True when the BN kernel sums ``x``'s channels in double and rounds the mean once (see
    the module docstring): float32 on the CPU, contiguous, spatial size > 1. Checked on every
    call, so only cheap attributes: a contiguous tensor with more than one channel and a
    spatial size above 1 cannot also be channels-last, and a single channel, where the two
    layouts coincide, is left to the float64 path."""
    return (x.device.type == "cpu" and x.dtype is torch.float32 and x.dim() >= 3 and x.is_contiguous()
            and x.stride(1) != 1 and x.shape[1] > 1 and x.numel() // x.shape[1] <= MAX_DOUBLE_SUM)


def within_bound(ratio: np.ndarray, spread: np.ndarray) -> bool:
    """True when every channel's ``r = |mean| / std`` and ``D`` (call means' spread in stds)
    keep the rounded means' error within the exact bound. NaN fails."""
    ur = UNIT_ROUNDOFF * ratio
    risk = ur * ur + _CROSS * ratio * spread
    return bool((risk <= EXACT_RTOL).all())


def _float64(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.float64)


def _over(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den``, 0 where ``den`` is 0: a constant channel's mean is exact in the kernel
    (n equal values sum exactly), and its calls cannot spread."""
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def first_call_within(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> bool:
    """The first call's check: ``mean`` and unbiased ``var`` are the kernel's statistics of
    ``x`` (N, C, ...) on the CPU, ``D`` the spread of its samples' means (1 with a single
    sample). The arithmetic on per-channel vectors is done in numpy, whose small operations
    cost a fraction of torch's: this runs once per layer and pass."""
    samples = x.shape[0]
    n = x.numel() // x.shape[1]
    biased = _float64(var) * ((n - 1) / n)
    std = np.sqrt(biased)
    ratio = _over(np.abs(_float64(mean)), std)
    if samples < 2:
        return within_bound(ratio, np.ones_like(ratio))
    # By the law of total variance the sample means cannot spread by more than the std, so
    # D <= 1 / sqrt(N - 1): a layer within the bound even then needs no per-sample means.
    if within_bound(ratio, np.full_like(ratio, 1.0 / math.sqrt(samples - 1))):
        return True
    # Per-sample means in float32 (a tenth of the cost of a double sum): their rounding, a few
    # ulps of |mean|, only adds to the spread, on the safe side.
    per_sample = _float64(x.flatten(2).mean(2))
    return within_bound(ratio, _over(per_sample.std(0, ddof=1), std * np.sqrt(samples)))


def block_within(means: torch.Tensor, variances: torch.Tensor) -> bool:
    """The check of a block of k calls, ``(k, C)`` kernel means and unbiased variances: the
    largest ``r`` of any call, ``D`` from the spread of the call means."""
    if means.shape[0] < 2:
        return True
    call_means = _float64(means)
    std = np.sqrt(_float64(variances).mean(0))
    return within_bound(_over(np.abs(call_means).max(0), std), _over(call_means.std(0, ddof=1), std))
