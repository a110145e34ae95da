"""The float64 measurement of a Caffe2 SpatialBN input (numpy only: runs in both environments),
against a float64 two-pass reference, on every way the input is cut into chunks."""
from __future__ import annotations

import numpy as np
import pytest

from precise_bn.caffe2 import stats


def two_pass(x, axis):
    rows = np.moveaxis(x.astype(np.float64), axis, 0).reshape(x.shape[axis], -1)
    mean = rows.mean(axis=1)
    return mean, ((rows - mean[:, None]) ** 2).mean(axis=1)


def far(rng, shape, axis):
    """Channel means of +-1e4 std, stds from 1e-3 to 1e3, and a channel constant at 3.7."""
    channels = shape[axis]
    view = [1] * len(shape)
    view[axis] = channels
    std = 10.0 ** rng.uniform(-3, 3, channels)
    std[channels // 2] = 0.0
    mean = np.where(std > 0, 1e4 * std * rng.choice([-1.0, 1.0], channels), 3.7)
    return (rng.randn(*shape) * std.reshape(view) + mean.reshape(view)).astype(np.float32)


@pytest.mark.parametrize("chunk", [stats.CHUNK, 64, 7])
@pytest.mark.parametrize("shape,axis", [
    ((5, 6, 4, 3), 1),      # NCHW: several samples a chunk, or channels of one sample, or part of a channel
    ((3, 4, 2, 5, 3), 1),   # NCHW video
    ((4, 3, 5, 6), -1),     # NHWC: several rows a chunk, or part of a row
    ((9, 5), 1),            # (N, C)
    ((1, 200), -1),         # more channels than a chunk
])
def test_measure_input_is_the_two_pass_float64_statistics_at_mean_over_std_1e4(monkeypatch, chunk, shape, axis):
    monkeypatch.setattr(stats, "CHUNK", chunk)
    rng = np.random.RandomState(sum(shape) + chunk)
    x = far(rng, shape, axis)
    channels = shape[axis]
    out = (np.full(channels, np.nan), np.full(channels, np.nan))
    count = stats.measure_input(x, axis, out, np.full(chunk, np.nan))
    mean, var = two_pass(x, axis)
    assert count == x.size // channels
    std = np.sqrt(var)
    assert np.all(np.abs(out[0] - mean) <= 1e-12 * np.maximum(std, 1e-8 * np.abs(mean)))
    assert np.all(np.abs(out[1] - var) <= 1e-12 * var)
    assert var[channels // 2] == 0.0 and np.all(out[1][var == 0] == 0.0)  # the constant channel: exactly 0


@pytest.mark.parametrize("far", [stats.FAR, float("inf")])
def test_a_first_value_far_in_the_tail_is_measured_again_around_the_mean(monkeypatch, far):
    """Two channels of 2 million values at mean/std 1e4 whose first value is a spike 2000 stds
    out: around that value the float64 sums lose 7e-8 of the variance (``FAR`` disabled); the
    call measured again around its mean keeps it to 1e-12."""
    monkeypatch.setattr(stats, "FAR", far)
    rng = np.random.RandomState(8)
    x = (1e4 + rng.randn(16, 2, 125000)).astype(np.float32)
    x[0, :, 0] += 2000.0
    out = (np.empty(2), np.empty(2))
    stats.measure_input(x, 1, out, np.empty(stats.CHUNK))
    mean, var = two_pass(x, 1)
    error = np.max(np.abs(out[1] / var - 1))
    assert error <= 1e-12 if far < float("inf") else error > 1e-9
    assert np.all(np.abs(out[0] - mean) <= 1e-9 * np.sqrt(var))


def test_an_empty_input_counts_nothing_and_leaves_out_alone():
    out = (np.full(3, 5.0), np.full(3, 6.0))
    assert stats.measure_input(np.zeros((0, 3, 4, 4), np.float32), 1, out, np.empty(stats.CHUNK)) == 0
    assert out[0].tolist() == [5.0] * 3 and out[1].tolist() == [6.0] * 3
