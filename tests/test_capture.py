"""The per-call capture: blocks that fill and merge, the grouped flush, subclasses."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from precise_bn.estimator import PopulationStats
from precise_bn.pytorch import trust
from precise_bn.pytorch.capture import CallCapture, calls_per_block, flush
from reference import assert_close_default, assert_close_exact, ulp32

C = 5


def _calls(count, seed=0):
    """Ragged 4-D inputs with a huge-mean channel and a dead one."""
    gen = torch.Generator().manual_seed(seed)
    means = torch.tensor([1e3, 2.0, -1.0, 0.0, 7.0]).view(1, C, 1, 1)
    stds = torch.tensor([1.0, 0.0, 0.5, 3.0, 1.0]).view(1, C, 1, 1)
    return [torch.randn(2 + i % 3, C, 3, 2 + i % 2, generator=gen) * stds + means for i in range(count)]


def _reference(inputs):
    x = torch.cat([t.double().transpose(0, 1).reshape(C, -1) for t in inputs], dim=1)
    return x.mean(1), x.var(1, unbiased=False), x.shape[1]


def _run(inputs, exact=False, block_calls=None, bn=None):
    bn = bn if bn is not None else nn.BatchNorm2d(inputs[0].shape[1])
    capture = CallCapture(PopulationStats(bn.num_features, name="bn"), exact=exact, block_calls=block_calls)
    capture.attach(bn)
    with torch.no_grad():
        for x in inputs:
            bn(x)
    capture.detach(bn)
    return capture, bn


def test_blocks_fill_and_merge_to_the_float64_reference():
    inputs = _calls(75)
    capture, _ = _run(inputs, block_calls=40)
    block = next(iter(capture._blocks.values()))
    assert block.store.shape[1] == 40 and len(block.counts) == 75 - 40
    stats = capture.flush()
    ref_mean, ref_var, count = _reference(inputs)
    assert (stats.count, stats.calls) == (count, 75)
    assert_close_default(*stats.finalize(), ref_mean, ref_var, "blocks")
    assert stats.finalize()[1][1].item() == 0.0


def test_memory_is_bounded_by_the_block_whatever_the_number_of_calls():
    capture, _ = _run(_calls(200), block_calls=8)
    block = next(iter(capture._blocks.values()))
    assert block.store.shape[1] == 8 and len(block.counts) == 0  # 200 = 25 full blocks
    assert capture.stats.calls == 200


def test_exact_capture_matches_reference_to_the_exact_bound():
    inputs = _calls(30)
    capture, _ = _run(inputs, exact=True, block_calls=16)
    ref_mean, ref_var, _ = _reference(inputs)
    assert_close_exact(*capture.flush().finalize(), ref_mean, ref_var, "exact")


def test_grouped_flush_equals_one_merge_per_layer():
    uniform = [torch.randn(4, C, 3, 3) + 10.0 for _ in range(7)]
    ragged = _calls(7, seed=1)
    grouped = [_run(uniform)[0], _run([t * 2 for t in uniform])[0], _run(ragged)[0]]
    alone = [_run(uniform)[0], _run([t * 2 for t in uniform])[0], _run(ragged)[0]]
    for one_by_one, together in zip([c.flush() for c in alone], flush(grouped)):
        assert (together.count, together.calls) == (one_by_one.count, one_by_one.calls)
        torch.testing.assert_close(together.mean, one_by_one.mean, rtol=1e-13, atol=0)
        torch.testing.assert_close(together.m2, one_by_one.m2, rtol=1e-12, atol=0)


class DoublingBN(nn.BatchNorm2d):
    """A subclass with its own forward: the capture must run it, not plain F.batch_norm."""

    def forward(self, x):
        return super().forward(2 * x)


def test_a_subclass_forward_runs_with_the_slot_as_its_buffers():
    inputs = _calls(20)
    capture, bn = _run(inputs, bn=DoublingBN(C))
    ref_mean, ref_var, _ = _reference([2 * x for x in inputs])
    assert_close_default(*capture.flush().finalize(), ref_mean, ref_var, "subclass")
    assert type(bn) is DoublingBN


class Renamed(nn.BatchNorm2d):
    """A subclass whose base is not the class a detach must restore."""


def test_attach_sets_momentum_and_mode_and_detach_restores_the_saved_class():
    bn = Renamed(C, momentum=0.3).eval()
    capture = CallCapture(PopulationStats(C))
    capture.attach(bn)
    assert isinstance(bn, Renamed) and type(bn) is not Renamed
    assert type(bn).__name__ == "Renamed" and "_precise_bn_capture" in vars(bn)
    assert bn.momentum == 1.0 and bn.training
    # Another swap on top (a second tool doing the same trick) must not confuse the restore.
    capture.detach(bn)
    assert type(bn) is Renamed and "_precise_bn_capture" not in vars(bn)
    assert bn.momentum == 0.3 and not bn.training
    capture.detach(bn)
    assert type(bn) is Renamed


def test_a_layer_copied_or_pickled_during_a_pass_is_the_plain_layer():
    import copy
    import pickle

    bn = nn.BatchNorm2d(C, momentum=0.2).eval()
    capture = CallCapture(PopulationStats(C))
    capture.attach(bn)
    with torch.no_grad():
        bn(torch.randn(4, C, 3, 3))
    for clone in (copy.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
        assert type(clone) is nn.BatchNorm2d and "_precise_bn_capture" not in vars(clone)
        assert clone.momentum == 0.2 and not clone.training
        assert torch.equal(clone.running_mean, torch.zeros(C))
        clone(torch.randn(2, C, 3, 3))
    capture.detach(bn)


def test_calls_per_block_shrinks_for_wide_layers():
    assert calls_per_block(64) == 64 and calls_per_block(2048) == 32 and calls_per_block(10 ** 6) == 16


# --- exact=True: the kernel's statistics where they meet the exact bound (precise_bn.pytorch.trust)

U = 2.0 ** -24


def _shifted_input(shape, ratios, seed=0):
    gen = torch.Generator().manual_seed(seed)
    view = [1, shape[1]] + [1] * (len(shape) - 2)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) + ratios.view(view)).float()


def _kernel_stats(x):
    mean, var = torch.zeros(x.shape[1]), torch.zeros(x.shape[1])
    torch.nn.functional.batch_norm(x, mean, var, None, None, True, 1.0, 1e-5)
    return mean, var


def test_the_cpu_kernel_rounds_the_mean_once_where_trust_says_it_sums_in_double():
    """The claim the bound rests on, against the CPU kernel: the mean within half an ulp, the
    unbiased variance within two roundings plus the centring bias (u r)^2, up to mean/std 1e4."""
    ratios = torch.logspace(-1, 4, 16, dtype=torch.float64)
    for shape in ((8, 16, 6, 6), (8, 16, 20), (4, 16, 2, 4, 4), (2, 16, 64, 64)):
        x = _shifted_input(shape, ratios)
        assert trust.double_accumulated(x), shape
        mean, var = _kernel_stats(x)
        rows = x.double().transpose(0, 1).reshape(16, -1)
        ref_mean, ref_var = rows.mean(1), rows.var(1)
        half_ulp = ulp32(mean.double()) / 2
        assert ((mean.double() - ref_mean).abs() <= half_ulp).all(), shape
        r = ref_mean.abs() / ref_var.sqrt()
        assert ((var.double() - ref_var).abs() / ref_var <= 2 * U + (U * r) ** 2).all(), shape


def test_layouts_the_kernel_sums_in_float32_are_not_trusted():
    x = torch.randn(8, 16, 6, 6)
    assert trust.double_accumulated(x)
    for other in (x.contiguous(memory_format=torch.channels_last), torch.randn(8, 16), torch.randn(8, 16, 1, 1),
                  torch.randn(8, 1, 6, 6), x.transpose(2, 3), x.double(), x.half(),
                  torch.randn(2, 16, 3, 4, 4).contiguous(memory_format=torch.channels_last_3d)):
        assert not trust.double_accumulated(other), other.shape


def _population_calls(r, spread, calls, channels=128, samples=8, side=16, seed=0):
    """Calls whose means spread by ``spread`` stds (per-sample effects plus element noise),
    every channel's mean ``r`` stds from 0."""
    gen = torch.Generator().manual_seed(seed)
    d2n = spread * spread * samples
    effect = ((d2n - 1.0 / side ** 2) / (1.0 - d2n)) ** 0.5
    std = (1.0 + effect ** 2) ** 0.5
    out = []
    for _ in range(calls):
        x = torch.randn(samples, channels, side, side, generator=gen, dtype=torch.float64)
        x += effect * torch.randn(samples, channels, 1, 1, generator=gen, dtype=torch.float64)
        out.append((x + r * std).float())
    return out


def _kernel_path(inputs):
    capture, _ = _run(inputs)
    mean, var = capture.flush().finalize()
    return mean.float(), var.float()


def test_rounded_means_stay_within_the_exact_bound_where_trusted_and_not_far_beyond():
    """Simulated through the kernel path: channels with r D = 0.5 (the threshold) meet the exact
    bound with two calls, the worst case, and with eight; at r D = 4 they do not, which is why
    such layers are measured in float64."""
    for r in (2.0, 10.0, 20.0):
        for calls in (2, 8):
            inputs = _population_calls(r, 0.5 / r, calls)
            ref_mean, ref_var, _ = _reference_of(inputs)
            assert_close_exact(*_kernel_path(inputs), ref_mean, ref_var, "r={} calls={}".format(r, calls))
    inputs = _population_calls(20.0, 0.2, 2)
    ref_mean, ref_var, _ = _reference_of(inputs)
    with pytest.raises(AssertionError, match="var error"):
        assert_close_exact(*_kernel_path(inputs), ref_mean, ref_var, "r D = 4")


def _reference_of(inputs):
    channels = inputs[0].shape[1]
    x = torch.cat([t.double().transpose(0, 1).reshape(channels, -1) for t in inputs], dim=1)
    return x.mean(1), x.var(1, unbiased=False), x.shape[1]


def test_the_first_call_decides_from_mean_over_std_and_the_spread_of_sample_means():
    near = _population_calls(2.0, 0.1, 1)[0]
    assert trust.first_call_within(near, *_kernel_stats(near))
    far = _population_calls(20.0, 0.2, 1)[0]
    assert not trust.first_call_within(far, *_kernel_stats(far))
    one_sample = far[:1]
    assert not trust.first_call_within(one_sample, *_kernel_stats(one_sample))
    dead = torch.full((4, 3, 5, 5), 7.0)
    assert trust.first_call_within(dead, *_kernel_stats(dead))


def test_the_spread_of_sample_means_is_capped_as_the_shortcut_assumes():
    """The first call skips the per-sample means when a layer passes even at D = 1/sqrt(N - 1);
    that cap (law of total variance) holds however much the samples differ, and the decision is
    the one the full computation gives."""
    gen = torch.Generator().manual_seed(3)
    for samples, effect, offset in ((2, 100.0, 0.0), (8, 10.0, 3.0), (16, 1.0, 1.5), (16, 0.01, 2.5),
                                    (32, 0.3, 30.0), (4, 1e3, 1e3)):
        x = torch.randn(samples, 6, 4, 4, generator=gen) + effect * torch.randn(samples, 6, 1, 1, generator=gen)
        x = (x + offset).float()
        mean, var = _kernel_stats(x)
        rows = x.double().transpose(0, 1).reshape(6, -1)
        per_sample = x.double().flatten(2).mean(2)
        spread = per_sample.std(0) / (rows.var(1, unbiased=False) * samples).sqrt()
        assert (spread <= (1 + 1e-9) / math.sqrt(samples - 1)).all(), (samples, effect)
        ratio = rows.mean(1).abs() / rows.var(1, unbiased=False).sqrt()
        full = bool(((trust.UNIT_ROUNDOFF * ratio) ** 2 + trust._CROSS * ratio * spread <= trust.EXACT_RTOL).all())
        assert trust.first_call_within(x, mean, var) == full, (samples, effect, offset)


def test_exact_keeps_the_kernel_stats_where_it_can_and_measures_where_it_must():
    plain = _population_calls(1.0, 0.05, 12, channels=8)
    capture, _ = _run(plain, exact=True, block_calls=5)
    assert capture.trusted and not capture._measured
    ref_mean, ref_var, _ = _reference_of(plain)
    assert_close_exact(*(t.float() for t in capture.flush().finalize()), ref_mean, ref_var, "kernel path")

    for inputs in (_calls(12), [x.contiguous(memory_format=torch.channels_last) for x in plain]):
        capture, _ = _run(inputs, exact=True, block_calls=5)
        assert capture.trusted is False and capture.stats.calls + sum(
            len(b.counts) for b in capture._measured.values()) == 12
        ref_mean, ref_var, _ = _reference_of(inputs)
        assert_close_exact(*capture.flush().finalize(), ref_mean, ref_var, "measured")


def test_a_block_that_fails_its_check_sends_later_calls_to_float64():
    drifting = _population_calls(1.0, 0.05, 4, channels=8) + _population_calls(3e3, 0.05, 10, channels=8, seed=1)
    capture, _ = _run(drifting, exact=True, block_calls=4)
    assert capture.trusted is False
    measured = next(iter(capture._measured.values()))
    # Two kernel blocks merged (the second one failed its check), then six calls in float64:
    # one float64 block merged and two calls pending.
    assert capture.stats.calls == 12 and len(measured.counts) == 2
