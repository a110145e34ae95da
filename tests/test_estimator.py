"""PopulationStats against float64 two-pass references."""
from __future__ import annotations

import pytest
import torch

from precise_bn import NonFiniteStatsError, PopulationStats


def _moments(x: torch.Tensor):
    x = x.double()
    return x.mean(1), ((x - x.mean(1, keepdim=True)) ** 2).mean(1)


def test_chan_merge_matches_two_pass_for_ragged_batches():
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(4, n, generator=gen, dtype=torch.float64) * 3 + 1e4 for n in (1, 7, 64, 2, 33)]
    stats = PopulationStats(4, name="layer")
    for chunk in chunks:
        mean, var = _moments(chunk)
        stats.add_batch(mean, var, chunk.shape[1])
    ref_mean, ref_var = _moments(torch.cat(chunks, 1))
    mean, var = stats.finalize()
    assert stats.count == sum(c.shape[1] for c in chunks)
    assert stats.calls == len(chunks)
    torch.testing.assert_close(mean, ref_mean, rtol=0, atol=1e-12 * 1e4)
    torch.testing.assert_close(var, ref_var, rtol=1e-12, atol=0)


def test_unbiased_input_is_converted_with_exact_bessel_factor():
    gen = torch.Generator().manual_seed(1)
    chunks = [torch.randn(3, n, generator=gen, dtype=torch.float64) for n in (2, 5, 9)]
    stats = PopulationStats(3)
    for chunk in chunks:
        stats.add_batch(chunk.mean(1), chunk.var(1, unbiased=True), chunk.shape[1], unbiased=True)
    ref_mean, ref_var = _moments(torch.cat(chunks, 1))
    mean, var = stats.finalize()
    torch.testing.assert_close(var, ref_var, rtol=1e-13, atol=0)
    _, var_unbiased = stats.finalize(unbiased=True)
    n = stats.count
    torch.testing.assert_close(var_unbiased, ref_var * n / (n - 1), rtol=1e-13, atol=0)


def test_merge_equals_single_estimator_and_ignores_empty():
    gen = torch.Generator().manual_seed(2)
    chunks = [torch.randn(5, n, generator=gen, dtype=torch.float64) + 7 for n in (3, 11, 4, 20)]
    whole, left, right = PopulationStats(5), PopulationStats(5), PopulationStats(5)
    for i, chunk in enumerate(chunks):
        mean, var = _moments(chunk)
        whole.add_batch(mean, var, chunk.shape[1])
        (left if i % 2 else right).add_batch(mean, var, chunk.shape[1])
    left.merge(PopulationStats(5))
    left.merge(right)
    assert left.count == whole.count and left.calls == whole.calls
    for a, b in zip(left.finalize(), whole.finalize()):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    empty = PopulationStats(5)
    empty.merge(whole)
    for a, b in zip(empty.finalize(), whole.finalize()):
        assert torch.equal(a, b)


def test_merge_rejects_other_channel_count():
    with pytest.raises(ValueError, match="channels"):
        PopulationStats(3, "a").merge(PopulationStats(4, "b"))


def test_dead_channel_is_exactly_zero_and_never_negative():
    stats = PopulationStats(2)
    for n in (3, 8):
        x = torch.stack([torch.full((n,), 2.5, dtype=torch.float64), torch.arange(n, dtype=torch.float64)])
        stats.add_batch(*_moments(x), n)
    _, var = stats.finalize()
    assert var[0].item() == 0.0
    assert var[1].item() > 0


def test_add_caffe2_recovers_variance_and_snaps_dead_channel():
    eps = 1e-5
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 50, generator=gen, dtype=torch.float64) * torch.tensor([[2.0], [0.01], [0.0]]) + 4
    mean, var = _moments(x)
    siv = (1.0 / torch.sqrt(var + eps)).float()
    stats = PopulationStats(3, "res2_0_branch2a_bn")
    stats.add_caffe2(mean.float().numpy(), siv.numpy(), eps, 50)
    got_mean, got_var = stats.finalize()
    assert got_var[2].item() == 0.0
    # siv carries a float32 rounding: var + eps is known to ~2 float32 ulps.
    tol = 4 * 2.0 ** -24 * (var + eps)
    assert ((got_var - var).abs() <= tol).all()
    assert stats.clamped == 0


def test_add_caffe2_clamps_and_counts_negative_variances():
    eps = 1e-3
    siv = torch.tensor([1.0 / (eps ** 0.5) * 1.01, 1.0], dtype=torch.float32)  # 1/siv^2 < eps
    stats = PopulationStats(2)
    stats.add_caffe2(torch.zeros(2), siv, eps, 10)
    _, var = stats.finalize()
    assert var[0].item() == 0.0 and stats.clamped == 1
    assert var[1].item() == pytest.approx(1.0 - eps)


def test_nan_raises_with_layer_name():
    stats = PopulationStats(3, "backbone.bn1")
    stats.add_batch(torch.tensor([0.0, float("nan"), 1.0]), torch.ones(3), 4)
    with pytest.raises(NonFiniteStatsError, match="backbone.bn1"):
        stats.finalize()


def test_state_round_trip():
    stats = PopulationStats(4, "x")
    stats.add_batch(torch.arange(4.0), torch.ones(4), 6)
    back = PopulationStats.from_state(stats.state(), name="x", calls=stats.calls)
    assert back.count == stats.count and torch.equal(back.mean, stats.mean) and torch.equal(back.m2, stats.m2)
