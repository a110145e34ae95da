"""One Caffe2 SpatialBN call's statistics: decoded from what the kernel saved, measured from its
input, and whether the kernel's can be trusted.

Caffe2's CPU kernel forms a call's variance as ``E[x^2] - E[x]^2`` in float32 and saves
``1 / sqrt(var + eps)``. These functions need numpy and torch only, never Caffe2.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import numpy as np
import torch

from ..estimator import PopulationStats, shifted_moments

#: Relative error of a written variance above which a channel is named untrusted.
UNTRUSTED_RTOL = 1e-3

# float32 carries 24 significant bits: a saved inverse std is only known to 2**-24 relative.
_FLOAT32_REL = 2.0 ** -24



def decode_saved_stats(sm: np.ndarray, siv: np.ndarray, eps: float) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """A SpatialBN call's float64 ``(mean, biased var)`` from its saved mean and inverse std,
    and how many channels came out negative.

    ``var = 1 / siv^2 - eps`` in float64. Anything below the resolution of a float32 ``siv``
    (two float32 ulps of ``var + eps``) cannot be told apart from zero: a dead channel comes
    back as exactly 0 instead of a tiny signed residue, and a negative value is clamped.
    """
    mean = torch.as_tensor(np.asarray(sm, dtype=np.float64)).reshape(-1)
    inv = torch.as_tensor(np.asarray(siv, dtype=np.float64)).reshape(-1)
    var_eps = 1.0 / (inv * inv)
    var = var_eps - float(eps)
    negative = int((var < 0).sum())
    var = torch.where(var < var_eps * (4.0 * _FLOAT32_REL), torch.zeros_like(var), var)
    return mean, var, negative


def measure_input(x: np.ndarray, shift32: np.ndarray, axis: int, buffer: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Float64 ``(mean, biased var, elements per channel)`` of a SpatialBN input ``x`` whose
    channels lie on ``axis``, measured around ``shift32``, the kernel's float32 batch mean (see
    :func:`~precise_bn.estimator.shifted_moments`; ``buffer`` holds at least
    :func:`~precise_bn.estimator.shift_buffer_size` float64 values for ``x`` with ``axis`` moved
    first, and is overwritten)."""
    t = torch.from_numpy(np.ascontiguousarray(x)).movedim(axis, 0)
    shift = torch.from_numpy(np.asarray(shift32, dtype=np.float64)).reshape(-1)
    mean, var = shifted_moments(t, shift, buffer)
    return mean, var, t.numel() // max(t.shape[0], 1)


def untrusted_channels(stats: PopulationStats) -> List[int]:
    """Channels whose variance, from the float32 kernel's ``E[x^2] - E[x]^2``, may be off by more
    than :data:`UNTRUSTED_RTOL` of itself.

    The kernel reduces ``x^2`` over a call's n elements in float32, in a tree: each level rounds
    partial sums of size about ``n E_i[x^2]`` by up to ``2**-24`` of themselves, so
    ``E_i[x^2] = m_i^2 + v_i`` comes out with a relative error up to about
    ``log2(n) * 2**-24``, and subtracting ``m_i^2`` leaves that absolute error on ``v_i``. The
    written variance is the count-weighted mean of ``v_i + (m_i - mu)^2``, so its error is at
    most the count-weighted mean of the calls' errors, and
    ``sum n_i (m_i^2 + v_i) / N = mu^2 + var`` exactly: the error is about
    ``log2(n) * 2**-24 * (mu^2 + var) / var`` relative, from the written mean and variance
    (which the saved means and inverse stds gave) and the count-weighted mean elements per
    call. On Caffe2 1.10's CPU kernel, n = 1e3 to 2e5 and mean/std = 1 to 300, the error
    reached up to 0.85 of that; twice it is the bound used (``tests/test_caffe2_backend.py``
    checks the kernel against it). The inputs are the statistics merged over ranks, so every
    rank names the same channels. A dead channel (mean and variance 0) is exact.
    """
    if stats.count == 0:
        return []
    per_call = stats.weight / stats.count
    var = stats.m2 / stats.count
    bound = 2.0 * math.log2(max(per_call, 2.0)) * _FLOAT32_REL * (stats.mean * stats.mean + var)
    return torch.nonzero(bound > UNTRUSTED_RTOL * var).reshape(-1).tolist()
