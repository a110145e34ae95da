"""One Caffe2 SpatialBN call's statistics, measured from its input in float64 around one of each
channel's own values (exact shift, cancellation bounded by :data:`FAR`; docs/caffe2.md)."""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

#: Float64 values of ``y`` formed at a time: the size of the buffer :func:`measure_input` needs.
CHUNK = 1 << 15
#: Stds from the mean a shift may lie before the call is measured again around its mean.
FAR = 32.0


def measure_input(x: np.ndarray, axis: int, out: Tuple[np.ndarray, np.ndarray], buffer: np.ndarray) -> int:
    """Write the float64 per-channel mean and biased variance of ``x`` (channels on ``axis``, 1 or -1)
    into ``out`` through ``buffer`` (``CHUNK`` values); return the elements per channel."""
    if x.size == 0:
        return 0
    channels = x.shape[axis]
    # (samples, channels, positions), the last axis contiguous: NCHW as (N, C, HW), NHWC (NHW, C, 1)
    blocks = x.reshape(x.shape[0], channels, -1) if axis == 1 else x.reshape(-1, channels, 1)
    if _moments(blocks, blocks[0, :, :1].astype(np.float64), out, buffer):
        _moments(blocks, out[0].astype(np.float32).astype(np.float64)[:, None], out, buffer)
    return x.size // channels


def _moments(blocks: np.ndarray, shift: np.ndarray, out: Tuple[np.ndarray, np.ndarray], buffer: np.ndarray) -> bool:
    """Mean and variance around ``shift`` into ``out``; whether the shift lay ``FAR`` stds out."""
    s1, s2 = _sums(blocks, shift, buffer)
    count = blocks.size // blocks.shape[1]
    mean, var = out
    np.divide(s1, count, out=mean)  # the mean's offset from the shift, for now
    np.multiply(s1, mean, out=var)
    np.subtract(s2, var, out=var)
    np.maximum(var, 0.0, out=var)
    var /= count
    far = bool(np.any(mean * mean > FAR * FAR * var))
    mean += shift[:, 0]
    return far


def _sums(blocks: np.ndarray, shift: np.ndarray, buffer: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per channel, the float64 sums of ``y = blocks - shift`` and of ``y^2``, over blocks of at
    most ``CHUNK``: whole samples, else some channels of one, else part of one channel."""
    samples, channels, positions = blocks.shape
    if blocks.size <= CHUNK:
        return _block_sums(blocks, torch.from_numpy(shift), buffer)
    q = min(positions, CHUNK)
    m = min(channels, CHUNK // q)
    k = max(1, CHUNK // (m * q)) if m == channels else 1
    s1, s2 = np.zeros(channels), np.zeros(channels)
    for first in range(0, channels, m):
        part = slice(first, first + m)
        offset = torch.from_numpy(shift[part])
        for start in range(0, samples, k):
            for position in range(0, positions, q):
                a, b = _block_sums(blocks[start:start + k, part, position:position + q], offset, buffer)
                s1[part] += a
                s2[part] += b
    return s1, s2


def _block_sums(block: np.ndarray, offset: torch.Tensor, buffer: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    y = buffer[:block.size].reshape(block.shape)
    np.copyto(y, block)  # the float64 cast; torch 1.10's is slower on the CPU
    torch.from_numpy(y).sub_(offset)  # numpy's broadcast along the last axis is slower
    return y.sum(axis=(0, 2)), np.einsum("kcp,kcp->c", y, y)
