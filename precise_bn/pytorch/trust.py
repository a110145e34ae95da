"""How far a BN kernel's own float32 statistics can be from the exact ones: a worst-case bound.

The default path merges, per call, the float32 batch mean and unbiased variance the kernel
wrote. This module bounds, per channel and from the merged statistics alone, how far the
written variance can then be from the float64 two-pass value, so that the channels where it may
miss :data:`~precise_bn.report.UNTRUSTED_RTOL` are named (``LayerReport.untrusted``) and a
warning suggests ``exact=True``, which measures every call in float64 instead.

The argument is worst-case: it holds for any data, any loader order, any call count. Write a
call's exact mean and variance ``m_i``, ``v_i`` (``n_i`` elements, sum of squared deviations
``S_i``), and the kernel's mean ``m_i + d_i``. The merge sees each call as centred on
``m_i + d_i`` with ``S_i + n_i d_i^2`` (what the kernel's sum around its own mean is), times
``1 + e_i`` for the rounding of that sum. Against ``M2 = sum S_i + sum n_i (m_i - mu)^2`` the
merged value is off by::

    sum S_i e_i  +  2 sum n_i (m_i - mu) d_i  +  sum n_i d_i^2 (1 + e_i)  +  sum n_i (d_i - dbar)^2

With ``|e_i| <= E`` and ``|d_i| <= g * sqrt(m_i^2 + v_i)`` (see below), Cauchy-Schwarz and
``sum n_i (m_i - mu)^2 <= M2``, ``sum n_i (m_i^2 + v_i) = N (mu^2 + var)`` give, relative to the
variance::

    error <= E + 2 g rho + 2 (g rho)^2,    rho = sqrt(mu^2 + var) / std

which needs only the merged mean and variance. ``rho`` is about ``|mean| / std``: the error
grows with it, which is the whole difficulty of BN statistics in float32.

The kernels, with ``u = 2**-24`` (half a float32 ulp, relative):

* PyTorch's CPU kernel on a float32 input that is contiguous, not channels-last, with a
  spatial size above 1 (:func:`double_accumulated`) sums each channel in double and rounds the
  mean once: ``g = u``; the squares ``(x - m^)^2`` are formed in float32 (at most ``3u`` each),
  summed in double and stored twice in float32 (``u`` each): ``E = 6u``.
* Every other call (CPU channels-last and ``(N, C)`` inputs, CUDA, a subclass's own forward)
  is taken to sum in float32, in any order: a float32 sum of ``n`` terms is off by at most
  ``gamma_n = n u / (1 - n u)`` of the sum of their magnitudes, so ``g = gamma_n + u`` and
  ``E = gamma_n + 5u``, with ``n`` the most elements per channel of any call. This is the
  textbook bound for any summation order; real kernels usually do far better, but a channel
  whose mean is 1e4 stds does reach thousands of ulps on the CPU's channels-last kernel.

``exact=True`` needs none of this: every call is measured in float64
(:func:`~precise_bn.estimator.shifted_moments`), whose error is of order ``log2(n) * 2**-53``,
because no per-call check made before the input is gone can keep the kernel's statistics
within 1e-7 in the worst case: the two float32 stores of a call's variance alone may cost
``2u = 1.2e-7``, the same way on every call of a repeated batch.
"""
from __future__ import annotations

import torch

from ..estimator import PopulationStats

#: Half a float32 ulp, relative: the rounding of a float32 store.
UNIT_ROUNDOFF = 2.0 ** -24
#: Above this many elements per channel, a double sum of float32 values may be off by more
#: than a small part of a float32 ulp.
MAX_DOUBLE_SUM = 1 << 26
#: Rounding of a double-accumulated call's variance: squares formed in float32, two stores.
DOUBLE_SUM_VAR_ROUNDING = 6 * UNIT_ROUNDOFF


def double_accumulated(x: torch.Tensor) -> bool:
    """True when the BN kernel sums ``x``'s channels in double and rounds the mean once (see
    the module docstring): float32 on the CPU, contiguous, spatial size > 1. Checked on every
    call, so only cheap attributes: a contiguous tensor with more than one channel and a
    spatial size above 1 cannot also be channels-last, and a single channel, where the two
    layouts coincide, counts as summed in float32."""
    return (x.device.type == "cpu" and x.dtype is torch.float32 and x.dim() >= 3 and x.is_contiguous()
            and x.stride(1) != 1 and x.shape[1] > 1 and x.numel() // x.shape[1] <= MAX_DOUBLE_SUM)


def float32_sum_error(elements: int) -> float:
    """``gamma_n``: the largest relative error of a float32 sum of ``elements`` terms, in any
    order, against the sum of their magnitudes (infinite where no bound exists)."""
    nu = elements * UNIT_ROUNDOFF
    return nu / (1.0 - nu) if nu < 1.0 else float("inf")


def variance_error_bound(stats: PopulationStats, float32_elements: int) -> torch.Tensor:
    """Per channel, the worst-case relative error of the variance merged from kernel statistics
    (module docstring). ``float32_elements`` is the most elements per channel of any call the
    kernel may have summed in float32, 0 when every call was summed in double. A channel whose
    merged variance is exactly 0 is exact: the kernel found every value equal to its mean."""
    if float32_elements:
        gamma = float32_sum_error(float32_elements)
        slope, floor = gamma + UNIT_ROUNDOFF, gamma + 5 * UNIT_ROUNDOFF
    else:
        slope, floor = UNIT_ROUNDOFF, DOUBLE_SUM_VAR_ROUNDING
    var = (stats.m2 / max(stats.count, 1)).cpu()
    live = var > 0
    rho = ((stats.mean.cpu().square() + var) / torch.where(live, var, torch.ones_like(var))).sqrt()
    g_rho = slope * rho
    bound = floor + 2.0 * g_rho + 2.0 * g_rho * g_rho
    return torch.where(live, bound, torch.zeros_like(bound))
