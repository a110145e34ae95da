"""PopulationStats against float64 two-pass references."""
from __future__ import annotations

import pytest
import torch

from precise_bn import NonFiniteStatsError, PopulationStats
from precise_bn.estimator import add_side_by_side, combine_calls
from precise_bn.precision import flags


def _moments(x: torch.Tensor):
    x = x.double()
    return x.mean(1), ((x - x.mean(1, keepdim=True)) ** 2).mean(1)


def test_chan_merge_matches_two_pass_for_ragged_batches():
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(4, n, generator=gen, dtype=torch.float64) * 3 + 1e4 for n in (1, 7, 64, 2, 33)]
    stats = PopulationStats(4, name="layer")
    for chunk in chunks:
        mean, var = _moments(chunk)
        stats.add_call(mean, var, chunk.shape[1])
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
        stats.add_call(chunk.mean(1), chunk.var(1, unbiased=True), chunk.shape[1], unbiased=True)
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
        whole.add_call(mean, var, chunk.shape[1])
        (left if i % 2 else right).add_call(mean, var, chunk.shape[1])
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
        stats.add_call(*_moments(x), n)
    _, var = stats.finalize()
    assert var[0].item() == 0.0
    assert var[1].item() > 0


def test_nan_raises_with_layer_name():
    stats = PopulationStats(3, "backbone.bn1")
    stats.add_call(torch.tensor([0.0, float("nan"), 1.0]), torch.ones(3), 4)
    with pytest.raises(NonFiniteStatsError, match="backbone.bn1"):
        stats.finalize()


def test_state_round_trip():
    stats = PopulationStats(4, "x")
    stats.add_call(torch.arange(4.0), torch.ones(4), 6)
    stats.add_call(torch.arange(4.0) * 2, torch.ones(4) * 3, 5)
    back = PopulationStats.from_state(stats.state(), name="x")
    for key in ("count", "calls", "weight"):
        assert getattr(back, key) == getattr(stats, key)
    for key in ("mean", "m2", "center", "u", "cov", "sums"):
        assert torch.equal(getattr(back, key), getattr(stats, key))


def _brute_force(chunks):
    """Per-call moments kept whole, in order: the ratio-estimator standard errors written out
    directly (``sum e^2 / (N^2 - sum n^2)``, unbiased for independent elements whatever the
    counts), the relative spread of their squares, ``sqrt(sum e^4 / (sum e^2)^2 - 1/k)``, the
    lag-1 correlation of the ``e`` and the z-score of their trend along the calls
    (``docs/precision.md``)."""
    n = torch.tensor([c.shape[1] for c in chunks], dtype=torch.float64)
    total, k = n.sum(), len(chunks)
    means = torch.stack([c.mean(1) for c in chunks])
    variances = torch.stack([((c - c.mean(1, keepdim=True)) ** 2).mean(1) for c in chunks])
    mu = (n[:, None] * means).sum(0) / total
    s2 = (n[:, None] * (variances + (means - mu) ** 2)).sum(0) / total
    y = variances + (means - mu) ** 2
    least = total - (n * n).sum() / total
    t = torch.arange(k, dtype=torch.float64)
    time_var = (n * t * t).sum() - (n * t).sum() ** 2 / total
    out = {}
    for key, e in (("mean", n[:, None] * (means - mu)), ("var", n[:, None] * (y - s2))):
        square = (e ** 2).sum(0)
        out[key] = {"stderr": (square / (total ** 2 - (n * n).sum())).sqrt(),
                    "tail": ((e ** 4).sum(0) / square ** 2 - 1.0 / k).sqrt(),
                    "lag": (e[:-1] * e[1:]).sum(0) / square,
                    "trend": (t[:, None] * e).sum(0) / (time_var * square / least).sqrt()}
    return out


def test_stderr_and_diagnostics_match_per_call_formulas_through_blocks_and_merges():
    """Blocks of calls, streams merged in order and a state round trip (another rank, another
    centre) give the standard errors of the per-call formula, their spread (from power sums moved
    between centres) and the order diagnostics of the calls in merge order (from lag-1 products
    and index sums moved between centres and offsets), also for a channel whose mean is 1e4 times
    its std. Three channels drift along the calls, so that their lag and trend are far from 0."""
    gen = torch.Generator().manual_seed(5)
    scale = torch.tensor([[1.0], [2.0], [1e-3], [0.5]], dtype=torch.float64)
    shift = torch.tensor([[0.0], [1e4], [1e2], [-3.0]], dtype=torch.float64)
    drift = torch.tensor([[0.03], [0.03], [0.0], [0.03]], dtype=torch.float64)
    chunks = [(torch.randn(4, int(n), generator=gen, dtype=torch.float64) + drift * i) * scale + shift
              for i, n in enumerate(torch.randint(3, 60, (37,), generator=gen))]
    halves = [PopulationStats(4, "a"), PopulationStats(4, "a")]
    order = [[], []]
    position = 0
    while position < len(chunks):
        block = chunks[position: position + 1 + position % 6]
        side = position % 2
        stats = halves[side]
        means = torch.stack([c.mean(1) for c in block])
        variances = torch.stack([c.var(1, unbiased=True) for c in block])
        stats.add(combine_calls(means.clone(), variances.clone(), [c.shape[1] for c in block],
                                stats.center_for(means[0]), unbiased=True))
        order[side] += block
        position += len(block)
    whole = halves[0]
    whole.merge(PopulationStats.from_state(halves[1].state(), name="a"))
    ref = _brute_force(order[0] + order[1])
    lag_mean, lag_var, trend_mean, trend_var = whole.order_stats()
    got = {"mean": {"stderr": whole.stderr()[0], "tail": whole.tail_spread()[0], "lag": lag_mean, "trend": trend_mean},
           "var": {"stderr": whole.stderr()[1], "tail": whole.tail_spread()[1], "lag": lag_var, "trend": trend_var}}
    for key in ("mean", "var"):
        for name, value in got[key].items():
            torch.testing.assert_close(value, ref[key][name], rtol=1e-8, atol=0, msg=lambda m: key + name + m)
    assert float(ref["mean"]["lag"][[0, 1, 3]].min()) > 0.3 and float(ref["mean"]["trend"][[0, 1, 3]].min()) > 3
    mean, var = whole.finalize()
    ref_mean, ref_var = _moments(torch.cat(chunks, 1))
    torch.testing.assert_close(var, ref_var, rtol=1e-12, atol=0)


def test_stderr_is_nan_after_one_call_and_zero_for_a_dead_channel():
    stats = PopulationStats(2)
    x = torch.stack([torch.full((10,), 3.0, dtype=torch.float64), torch.arange(10, dtype=torch.float64)])
    stats.add_call(*_moments(x), 10)
    assert torch.isnan(stats.stderr()[0]).all() and torch.isnan(stats.stderr()[1]).all()
    stats.add_call(*_moments(x + 1), 10)
    mean_se, var_se = stats.stderr()
    assert var_se[0].item() == 0.0 and var_se[1].item() == 0.0 and mean_se[0].item() > 0


def test_a_call_carrying_the_spread_marks_its_channel_and_normal_calls_do_not():
    """The spread of the squared standard error: about sqrt(2/k) for normal calls, near 1 when
    one call (an outlier) carries the spread; only the latter is marked."""
    gen = torch.Generator().manual_seed(2)
    chunks = [torch.randn(3, 32, generator=gen, dtype=torch.float64) for _ in range(64)]
    chunks[10][1, 0] = 200.0  # one sample 200 std out, in channel 1
    chunks[20][2] *= 0.0  # channel 2: a call without spread is no tail
    stats = PopulationStats(3)
    for chunk in chunks:
        stats.add_call(*_moments(chunk), 32)
    mean_r, var_r = stats.tail_spread()
    assert 0.5 * (2 / 64) ** 0.5 < float(var_r[0]) < 2 * (2 / 64) ** 0.5
    assert float(var_r[1]) > 0.9 and float(mean_r[1]) > 0.9
    assert flags(stats) == {"tails": [1]}
    single = PopulationStats(1)
    single.add_call(torch.zeros(1), torch.ones(1), 4)
    assert torch.isnan(single.tail_spread()[1]).all() and flags(single) == {}


def _block(gen, k, widths, count):
    means = torch.randn(k, sum(widths), generator=gen, dtype=torch.float64) * 5 + 100
    return means, torch.rand(k, sum(widths), generator=gen, dtype=torch.float64) * 3, [count] * k


@pytest.mark.parametrize("histories, nan", [((2, 2, 2), False), ((2, 2, 2), True), ((2, 3, 2), False),
                                            ((0, 0, 0), False), ((1, 0, 1), False)])
def test_side_by_side_add_is_bit_for_bit_one_add_per_layer(histories, nan):
    gen = torch.Generator().manual_seed(7)
    widths = [3, 8, 5]
    together, alone = ([PopulationStats(w, name=str(i)) for i, w in enumerate(widths)] for _ in range(2))
    for layer, blocks in enumerate(histories):  # a layer's earlier blocks, the same on both sides
        for _ in range(blocks):
            means, variances, counts = _block(gen, 4, widths[layer:layer + 1], 6)
            means[0, 0] = float("nan") if nan and layer == 1 else means[0, 0]  # a NaN centre: no joined merge
            for stats in (together[layer], alone[layer]):
                stats.add(combine_calls(means.clone(), variances.clone(), counts, stats.center_for(means[0])))
    means, variances, counts = _block(gen, 5, widths, 9)
    centers = [s.center_for(part[0]) for s, part in zip(alone, means.split(widths, dim=1))]
    for stats, group in zip(alone, combine_calls(means.clone(), variances.clone(), counts, torch.cat(centers)).split(widths)):
        stats.add(group)
    centers = [s.center_for(part[0]) for s, part in zip(together, means.split(widths, dim=1))]
    add_side_by_side(together, combine_calls(means.clone(), variances.clone(), counts, torch.cat(centers)), widths)
    for mine, reference in zip(together, alone):
        assert (mine.count, mine.calls, mine.weight) == (reference.count, reference.calls, reference.weight)
        torch.testing.assert_close(mine.state(), reference.state(), rtol=0, atol=0, equal_nan=True)


def test_an_owned_first_group_is_kept_and_a_merged_estimator_is_not_shared():
    gen = torch.Generator().manual_seed(8)
    means, variances, counts = _block(gen, 3, [4], 5)
    group = combine_calls(means, variances, counts, means[0].clone())
    owner = PopulationStats(4)
    owner.add(group, owned=True)
    assert owner.mean is group.mean and owner.order is group.order
    copy = PopulationStats(4)
    copy.merge(owner)
    before = copy.state().clone()
    owner.add(combine_calls(*_block(gen, 2, [4], 5), owner.center))
    assert copy.mean is not owner.mean and torch.equal(copy.state(), before)
