"""The per-call capture: every call measured in float64, blocks that fill and merge, the grouped flush,
subclasses."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from precise_bn.estimator import PopulationStats
from precise_bn.pytorch.capture import CallCapture, calls_per_block, flush, merge_due
from reference import assert_close_exact

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


def _run(inputs, block_calls=None, bn=None):
    """Each input a batch: the full blocks merged between batches, as a pass does."""
    bn = bn if bn is not None else nn.BatchNorm2d(inputs[0].shape[1])
    capture = CallCapture(PopulationStats(bn.num_features, name="bn"), block_calls=block_calls)
    capture.attach(bn)
    with torch.no_grad():
        for x in inputs:
            bn(x)
            merge_due([capture])
    capture.detach(bn)
    return capture, bn


def test_blocks_fill_and_merge_to_the_float64_reference():
    inputs = _calls(75)
    capture, _ = _run(inputs, block_calls=40)
    block = next(iter(capture._blocks.values()))
    assert len(block.calls) == 75 - 40 and capture.stats.calls == 40
    stats = capture.flush()
    ref_mean, ref_var, count = _reference(inputs)
    assert (stats.count, stats.calls) == (count, 75)
    assert_close_exact(*stats.finalize(), ref_mean, ref_var, "blocks")
    assert stats.finalize()[1][1].item() == 0.0


def test_memory_is_bounded_by_the_block_whatever_the_number_of_calls():
    capture, _ = _run(_calls(200), block_calls=8)
    block = next(iter(capture._blocks.values()))
    assert len(block.calls) == 0  # 200 = 25 full blocks
    assert capture.stats.calls == 200


def test_a_layer_called_many_times_in_one_batch_is_merged_after_it():
    bn = nn.BatchNorm2d(C)
    capture = CallCapture(PopulationStats(C, name="bn"), block_calls=8)
    capture.attach(bn)
    inputs = _calls(20)
    with torch.no_grad():
        for x in inputs:  # one batch, 20 calls of the layer
            bn(x)
        assert len(next(iter(capture._blocks.values())).calls) == 20 and capture.stats.calls == 0
        merge_due([capture])
    capture.detach(bn)
    assert capture.stats.calls == 20 and not capture.due()
    ref_mean, ref_var, _ = _reference(inputs)
    assert_close_exact(*capture.stats.finalize(), ref_mean, ref_var, "one batch")


def test_due_layers_merge_together_and_the_others_wait():
    full = CallCapture(PopulationStats(C, name="full"), block_calls=2)
    waiting = CallCapture(PopulationStats(C, name="waiting"), block_calls=4)
    layers = [nn.BatchNorm2d(C), nn.BatchNorm2d(C)]
    full.attach(layers[0])
    waiting.attach(layers[1])
    with torch.no_grad():
        for x in _calls(2):
            for layer in layers:
                layer(x)
    merge_due([full, waiting])
    assert (full.stats.calls, waiting.stats.calls) == (2, 0)
    assert len(next(iter(waiting._blocks.values())).calls) == 2


def test_grouped_flush_equals_one_merge_per_layer():
    uniform = [torch.randn(4, C, 3, 3) + 10.0 for _ in range(7)]
    ragged = _calls(7, seed=1)
    wider = [torch.cat([t, t[:, :2] * 3 - 1], dim=1) for t in uniform]  # another width, grouped too
    grouped = [_run(uniform)[0], _run(wider)[0], _run([t * 2 for t in uniform])[0], _run(ragged)[0]]
    alone = [_run(uniform)[0], _run(wider)[0], _run([t * 2 for t in uniform])[0], _run(ragged)[0]]
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
    assert_close_exact(*capture.flush().finalize(), ref_mean, ref_var, "subclass")
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


# --- every call measured in float64, whatever the kernel computes


def _reference_of(inputs):
    channels = inputs[0].shape[1]
    x = torch.cat([t.double().transpose(0, 1).reshape(channels, -1) for t in inputs], dim=1)
    return x.mean(1), x.var(1, unbiased=False), x.shape[1]


def _hostile_calls(layout, calls=12, channels=6, seed=0):
    """Calls built to hurt float32 statistics: means 1e4 stds away that jump from call to call,
    a channel dead on the first call and live later, a repeated batch, ragged sizes."""
    gen = torch.Generator().manual_seed(seed)
    first = None
    out = []
    for i in range(calls):
        x = torch.randn(3 + i % 4, channels, 5, 7, generator=gen, dtype=torch.float64)
        x[:, 0] += 1e4 + (i % 3)
        x[:, 1] = 0.0 if i == 0 else x[:, 1] * 0.01 + 300.0 * i
        x[:, 2] = x[:, 2] * 1e-3 + 5.0
        x = x.float()
        if i == 1:
            first = x
        if i == calls - 1:
            x = first
        out.append(layout(x))
    return out


LAYOUTS = {
    "contiguous": lambda x: x,
    "channels-last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "(N, C)": lambda x: x[:, :, 0, 0].contiguous(),
    "(N, C, L)": lambda x: x.flatten(2).contiguous(),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_call_is_measured_in_float64_whatever_the_calls(layout):
    inputs = _hostile_calls(LAYOUTS[layout])
    bn = nn.BatchNorm1d(6) if inputs[0].dim() < 4 else None
    capture, _ = _run(inputs, block_calls=5, bn=bn)
    ref_mean, ref_var, _ = _reference_of(inputs)
    assert_close_exact(*capture.flush().finalize(), ref_mean, ref_var, layout)


class _MomentumFromForward(nn.BatchNorm2d):
    """A subclass whose own forward sets the momentum it wants, as some code bases do."""

    def forward(self, x):
        self.momentum = 0.25
        return super().forward(x)


def test_a_subclass_that_changes_what_the_capture_relies_on_is_measured_from_its_input():
    inputs = _calls(9)
    capture, bn = _run(inputs, bn=_MomentumFromForward(C))
    ref_mean, ref_var, _ = _reference(inputs)
    assert_close_exact(*capture.flush().finalize(), ref_mean, ref_var, "momentum set in forward")
    assert bn.momentum == 0.1  # as before the pass, like everything else


@pytest.mark.main_env  # dispatch modes came with torch 2
def test_a_captured_call_off_the_cpu_never_waits_for_the_device(monkeypatch):
    """What runs per call where the device is not the host (a GPU), run here on the CPU with
    the far-shift check switched to the device path: no operator reads a value back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from precise_bn import moments

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.item,
                                       torch.ops.aten.is_nonzero, torch.ops.aten.equal):
                reads.append(func)
            return func(*args, **(kwargs or {}))

    class Scaled(nn.BatchNorm2d):  # a subclass with a formula of its own: measured through the slot
        def forward(self, x):
            return super().forward(x * 2.0)

    monkeypatch.setattr(moments, "HOST_DEVICES", ())
    layers = [nn.BatchNorm2d(C), nn.BatchNorm1d(C), Scaled(C)]
    captures = [CallCapture(PopulationStats(C, name=str(i)), block_calls=2) for i in range(3)]
    for capture, layer in zip(captures, layers):
        capture.attach(layer)
    inputs = _calls(5)
    with torch.no_grad():
        for x in inputs:
            with Reads():
                layers[0](x)
                layers[1](x.mean((2, 3)))
                layers[2](x.contiguous(memory_format=torch.channels_last))
                merge_due(captures)
    assert reads == []
    assert [c.flush().calls for c in captures] == [5, 5, 5]
    ref_mean, ref_var, _ = _reference(inputs)
    assert_close_exact(*captures[0].stats.finalize(), ref_mean, ref_var, "device path")
