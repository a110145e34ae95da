"""A pass changes the chosen layers' running_mean / running_var and nothing else; a failure
changes nothing.

After a successful pass every ``state_dict()`` entry but those two per chosen layer is
bit-identical, held by the same tensor object, and no module gained or lost a buffer,
parameter, submodule or attribute; after a failure the whole state is bit-identical. Attacked
with models whose forwards change state on their own: QAT observers and fake-quantize modules
(fresh, which resize their buffers on first use, and after training steps), spectral norm and
weight norm, a forward that resizes a buffer, registers one, sets an attribute, rebinds or
clamps a parameter (on every batch, or only on a later one), or raises after changing state; BN
layers sharing running buffers; a functional ``batch_norm`` on a module's own buffers, under
their usual names or others. What the forwards changed besides the measured statistics is named
in the report and in one warning; an ordinary model draws none. Where the state was exported
with ``.numpy()``, torch leaves a refused resize half-made; that case runs in a subprocess, since
a write through such a tensor corrupts the heap.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from typing import Any, Callable, Dict, List, Sequence, Tuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from precise_bn import LayerError, ParameterChangedError, PreciseBNWarning, recalibrated, recompute
from precise_bn.pytorch.model_state import ModelState, module_names
from factories import batches as factory_batches, small_net
from reference import assert_close_exact, float64_reference

RUNNING = ("running_mean", "running_var")


# --------------------------------------------------------------------------------------------
# The whole state, and the promise


def _bits(t: torch.Tensor) -> bytes:
    # A copy first: ``.numpy()`` on the model's own tensor would make its storage unresizable.
    return t.detach().cpu().clone().numpy().tobytes()


def whole_state(model: nn.Module) -> Tuple[Dict[str, Tuple[Any, ...]], Dict[str, Tuple[Any, ...]]]:
    """Every state_dict entry (object, dtype, shape, bits) and every module's class, train flag
    and the names of its attributes, buffers, parameters and submodules."""
    entries = {k: (id(v), v.dtype, tuple(v.shape), _bits(v)) for k, v in model.state_dict(keep_vars=True).items()}
    modules = {name: (type(m), m.training, sorted(m.__dict__), list(m._buffers), list(m._parameters),
                      list(m._modules)) for name, m in model.named_modules()}
    return entries, modules


def assert_only_stats_changed(before, after, layers: Sequence[str]) -> None:
    """``layers``' running_mean / running_var are the same objects with new values; everything
    else is exactly as before."""
    stats = {"{}.{}".format(layer, key) for layer in layers for key in RUNNING}
    assert before[1] == after[1], first_module_difference(before[1], after[1])
    assert before[0].keys() == after[0].keys()
    for key, old in before[0].items():
        new = after[0][key]
        if key in stats:
            assert new[:3] == old[:3], key
            assert new[3] != old[3], "{}: not recomputed".format(key)
        else:
            assert new == old, "{} changed: {} -> {}".format(key, old[1:3], new[1:3])


def assert_unchanged(before, after) -> None:
    assert before[1] == after[1], first_module_difference(before[1], after[1])
    changed = [k for k in before[0] if before[0][k] != after[0].get(k)]
    assert not changed and before[0].keys() == after[0].keys(), changed


def first_module_difference(before, after) -> str:
    for name in before:
        if before[name] != after.get(name):
            return "module {!r}: {} -> {}".format(name, before[name], after.get(name))
    return "modules added: {}".format(sorted(set(after) - set(before)))


def put_back_warnings(call: Callable[[], Any]) -> Tuple[Any, List[str]]:
    """``call()``'s result and the PreciseBNWarnings it issued that name what the forwards
    changed besides the measured statistics (the report's ``put_back_warning``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    messages = [str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning)]
    return result, [m for m in messages if "put back" in m]


def batches(shape=(4, 3, 6, 6), count=3, seed=0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) * 2 + 0.5 for _ in range(count)]


def assert_matches(model: nn.Module, reference, layers: Sequence[str]) -> None:
    """The statistics of a pass, against the reference."""
    named = dict(model.named_modules())
    for layer in layers:
        mean, var, _ = reference[layer]
        assert_close_exact(named[layer].running_mean, named[layer].running_var, mean, var, layer)


# --------------------------------------------------------------------------------------------
# QAT: observers and fake-quantize state bit-identical, BN statistics as with observers frozen


def qat_model(seed: int = 0) -> nn.Module:
    """Conv-BN-ReLU and Conv-BN fused for QAT (ConvBnReLU2d, ConvBn2d), and a plain BN head."""
    tq = pytest.importorskip("torch.ao.quantization")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = tq.QuantStub()
            self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()
            self.conv2, self.bn2 = nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4)
            self.head = nn.BatchNorm1d(4)
            self.dequant = tq.DeQuantStub()

        def forward(self, x):
            x = self.quant(x)
            x = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
            return self.head(self.dequant(x).mean((2, 3)))

    torch.manual_seed(seed)
    net = Net().train()
    net.qconfig = tq.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation and reduce_range notices
        return tq.prepare_qat(tq.fuse_modules_qat(net, [["conv1", "bn1", "relu1"], ["conv2", "bn2"]]))


QAT_LAYERS = ["conv1.bn", "conv2.bn", "head"]


def frozen_reference(model: nn.Module, data) -> Dict[str, Any]:
    """The float64 reference with the observers frozen (torch's own ``disable_observer``) and
    BN running statistics held still (momentum 0), which the fused modules read to scale the
    weights: the forwards a pass runs."""
    from torch.ao.quantization import disable_observer

    ref = copy.deepcopy(model)
    ref.apply(disable_observer)
    for m in ref.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = 0.0
    return float64_reference(ref, data)


def train_steps(model: nn.Module, count: int = 3) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in batches(count=count, seed=9):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.main_env
@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "after-steps"])
def test_qat_changes_only_the_bn_statistics_measured_with_observers_frozen(trained):
    model = qat_model()
    if trained:
        train_steps(model)
    fake_quants = [n for n, b in model.named_buffers() if n.endswith("observer_enabled")]
    assert len(fake_quants) == 5  # input, two weights, two activations
    data = batches()
    reference = frozen_reference(model, data)
    before = whole_state(model)
    report, named = put_back_warnings(lambda: recompute(model, data, progress=False))
    assert_only_stats_changed(before, whole_state(model), QAT_LAYERS)
    assert_matches(model, reference, QAT_LAYERS)
    # The switches the pass itself turned off are not the forwards' change; a fresh fused
    # fake-quantize module replaces its placeholder ranges even then, and is named.
    assert not any(name.endswith(("observer_enabled", "static_enabled")) for name in report.changed_buffers)
    if trained:
        assert report.changed_buffers == [] and named == []
    else:
        assert "conv1.weight_fake_quant.scale" in report.changed_buffers and len(named) == 1


@pytest.mark.main_env
def test_qat_frozen_reference_is_not_what_learning_observers_would_give():
    """The attack's own check: with observers learning, the second layer's input differs."""
    model = qat_model()
    frozen = frozen_reference(model, batches())["conv2.bn"]
    learning = copy.deepcopy(model)
    for m in learning.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = 0.0
    learned = float64_reference(learning, batches())["conv2.bn"]
    assert not torch.allclose(frozen[1], learned[1], rtol=1e-3)


@pytest.mark.main_env
def test_qat_report_undo_puts_back_the_fresh_state():
    model = qat_model()
    before = whole_state(model)
    report = recompute(model, batches(), progress=False)
    report.undo()
    assert_unchanged(before, whole_state(model))


# --------------------------------------------------------------------------------------------
# Spectral norm and weight norm


def normed_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    conv, linear = nn.Conv2d(3, 6, 3), nn.Linear(6, 5)
    if kind == "spectral_norm":
        conv = torch.nn.utils.parametrizations.spectral_norm(conv)
        linear = torch.nn.utils.parametrizations.spectral_norm(linear, n_power_iterations=3)
    elif kind == "weight_norm":
        conv = torch.nn.utils.parametrizations.weight_norm(conv)
        linear = torch.nn.utils.parametrizations.weight_norm(linear)
    else:  # the older hooks, which set the weight as a plain attribute before every forward
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            norm = torch.nn.utils.spectral_norm if kind == "old_spectral_norm" else torch.nn.utils.weight_norm
            conv, linear = norm(conv), norm(linear)
    model = nn.Sequential(conv, nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), linear,
                          nn.BatchNorm1d(5)).train()
    with torch.no_grad():  # a model that has run: the older hooks' weights are then leaves (deep-copyable)
        model(batches(count=1, seed=3)[0])
    return model


# torch 1.10 cannot deep-copy a parametrized module (the reference runs a copy) and has no
# weight_norm parametrization: those two run in the main environment.
NORMS = [pytest.param("spectral_norm", marks=pytest.mark.main_env), "old_spectral_norm", "old_weight_norm",
         pytest.param("weight_norm", marks=pytest.mark.main_env)]


@pytest.mark.parametrize("kind", NORMS)
def test_norm_parametrizations_keep_their_buffers_and_the_stats_are_exact(kind):
    model = normed_model(kind)
    data = batches()
    reference = float64_reference(model, data)  # the same power iterations run in both
    before = whole_state(model)
    report = recompute(model, data, progress=False)
    assert_only_stats_changed(before, whole_state(model), ["1", "6"])
    assert_matches(model, reference, ["1", "6"])
    if "spectral" in kind:  # the power iteration's vectors: changed by every forward, put back, named
        vectors = [k for k in before[0] if k.endswith(("_u", "_v"))]
        assert vectors and sorted(report.changed_buffers) == sorted(vectors)
    else:
        assert report.changed_buffers == []


# --------------------------------------------------------------------------------------------
# Forwards that change state on their own


class Resizing(nn.Module):
    """What a per-channel observer does on first use: resize a buffer in place, then fill it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        self.scale.resize_(x.shape[1])
        self.scale.copy_(x.detach().abs().amax((0, 2, 3)))
        return x


class Busy(nn.Module):
    """Registers a buffer, sets an attribute, rebinds a parameter and counts its calls."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x):
        self.calls += 1
        if "seen" not in self._buffers:
            self.register_buffer("seen", x.detach().mean().reshape(1))
        self.last_shape = tuple(x.shape)
        self.gain = nn.Parameter(self.gain.detach() * 1)
        return x * self.gain.view(1, -1, 1, 1)


class Raising(nn.Module):
    """Changes a buffer, registers another, sets an attribute, then raises on the third batch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))
        self.batches = 0

    def forward(self, x):
        self.total += x.detach().sum((0, 2, 3))
        self.register_buffer("extra_{}".format(self.batches), torch.ones(1))
        self.batches += 1
        if self.batches == 3:
            raise RuntimeError("the forward failed")
        return x


class Clamping(nn.Module):
    """Clamps its own weight in place, as weight clipping does: under ``torch.no_grad()`` (which
    moves the weight's version counter) or through ``.data`` (which does not), from batch
    ``start`` (counted from 1) on."""

    def __init__(self, through_data: bool = False, start: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.through_data = through_data
        self.start = start
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls >= self.start:
            if self.through_data:
                self.conv.weight.data.clamp_(-0.1, 0.1)
            else:
                with torch.no_grad():
                    self.conv.weight.clamp_(-0.1, 0.1)
        return self.conv(x)


def with_bn(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(module, nn.BatchNorm2d(3)).train()


def test_a_resized_buffer_is_put_back_as_the_same_tensor_and_the_pass_succeeds():
    model = with_bn(Resizing())
    scale = model[0].scale
    before = whole_state(model)
    report = recompute(model, batches(), progress=False)
    assert_only_stats_changed(before, whole_state(model), ["1"])
    assert model[0].scale is scale and scale.shape == (1,)
    assert report.changed_buffers == ["0.scale"]


def test_registered_buffers_attributes_and_rebound_parameters_are_undone():
    model = with_bn(Busy())
    data = batches()
    reference = float64_reference(model, data)
    before = whole_state(model)
    report, named = put_back_warnings(lambda: recompute(model, data, progress=False))
    assert_only_stats_changed(before, whole_state(model), ["1"])
    assert "seen" not in model[0]._buffers and not hasattr(model[0], "last_shape")
    assert_matches(model, reference, ["1"])
    # The counter is named; the buffer the forward registered is removed, the parameter it
    # rebound bound back (the original was never written): neither is a change to a kept tensor.
    assert report.changed_buffers == ["0.calls"] and report.changed_parameters == []
    assert len(named) == 1 and "0.calls" in named[0]


def test_a_forward_that_raises_after_changing_state_leaves_everything_bit_identical():
    model = with_bn(Raising())
    before = whole_state(model)
    with pytest.raises(RuntimeError, match="the forward failed"):
        recompute(model, batches(count=5), progress=False)
    assert_unchanged(before, whole_state(model))
    assert model[0].batches == 0


@pytest.mark.parametrize("through_data", [False, True], ids=["no_grad", "data"])
def test_a_parameter_clamped_from_the_first_batch_is_put_back_and_named(through_data):
    """The first batch wrote the weight, so the copy of the parameters is kept for the whole
    pass: the pass completes, measured with the clamped weight, and puts it back bit for bit."""
    model = with_bn(Clamping(through_data))
    data = batches(count=4)
    reference = float64_reference(model, data)  # a copy: its forward clamps the same way
    assert model[0].conv.weight.abs().max() > 0.1  # so the clamp changes bits
    before = whole_state(model)
    report, named = put_back_warnings(lambda: recompute(model, data, progress=False))
    assert_only_stats_changed(before, whole_state(model), ["1"])
    assert_matches(model, reference, ["1"])
    assert report.changed_parameters == ["0.conv.weight"] and report.changed_buffers == []
    assert report.to_dict()["changed_parameters"] == ["0.conv.weight"]
    assert "parameters the forwards wrote (put back): 0.conv.weight" in str(report)
    assert len(named) == 1 and "0.conv.weight" in named[0], named


def test_once_the_first_batch_wrote_a_parameter_one_written_only_later_is_put_back_too():
    """The first batch's write keeps the copy of every parameter, not only of the one it wrote."""
    model = nn.Sequential(Clamping(), Clamping(start=3), nn.BatchNorm2d(3)).train()
    before = whole_state(model)
    report, named = put_back_warnings(lambda: recompute(model, batches(count=4), progress=False))
    assert_only_stats_changed(before, whole_state(model), ["2"])
    assert report.changed_parameters == ["0.conv.weight", "1.conv.weight"] and len(named) == 1


def test_a_parameter_clamped_by_a_pass_that_then_fails_is_put_back():
    model = nn.Sequential(Clamping(), Raising(), nn.BatchNorm2d(3)).train()
    before = whole_state(model)
    with pytest.raises(RuntimeError, match="the forward failed"):
        recompute(model, batches(count=5), progress=False)
    assert_unchanged(before, whole_state(model))


def test_a_parameter_written_only_on_a_later_batch_is_refused_naming_it_and_what_was_put_back():
    """The first batch wrote no parameter, so the copy was released: the weight written on the
    third batch cannot be put back. The call stops after that batch, names it and says so; every
    other entry of the state is as it was."""
    model = with_bn(Clamping(start=3))
    before = whole_state(model)
    forwards = []

    def forward(m, batch):
        forwards.append(1)
        return m(batch)

    with pytest.raises(ParameterChangedError, match=r"during batch 3 of the pass: 0\.conv\.weight\..*released "
                                                    r"its copy.*hold what the forward wrote"):
        recompute(model, batches(count=5), forward_fn=forward, progress=False)
    assert len(forwards) == 3
    after = whole_state(model)
    assert after[1] == before[1]
    changed = [k for k in before[0] if before[0][k] != after[0][k]]
    assert changed == ["0.conv.weight"]
    assert after[0]["0.conv.weight"][:3] == before[0]["0.conv.weight"][:3]


class Writing(nn.Module):
    """Writes its conv's weight during the first batch only, in one of the ways of ``WRITES``;
    ``channels_last`` gives the weight strides other than contiguous ones."""

    def __init__(self, how: str, channels_last: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        if channels_last:
            self.conv.to(memory_format=torch.channels_last)
        if how == "parametrization-data":
            torch.nn.utils.parametrize.register_parametrization(self.conv, "weight", nn.Identity())
        self.how = how
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            WRITES[self.how](self.conv)
        return self.conv(x)


def _last(weight: torch.Tensor) -> Tuple[int, ...]:
    return (-1,) * weight.dim()


def _set(conv: nn.Module) -> None:
    with torch.no_grad():
        conv.weight.set_(conv.weight.detach() * 2)


def _under_no_grad(write: Callable[[torch.Tensor], Any]) -> Callable[[nn.Module], None]:
    def run(conv: nn.Module) -> None:
        with torch.no_grad():
            write(conv.weight)
    return run


#: Writes that move the weight's version counter, and (the last element alone, so that only the
#: last chunk of a comparison differs) writes that do not.
WRITES: Dict[str, Callable[[nn.Module], None]] = {
    "view-no-grad": _under_no_grad(lambda w: w[-1].add_(1)),
    "copy-no-grad": _under_no_grad(lambda w: w.copy_(w * 2)),
    "init": lambda conv: nn.init.zeros_(conv.weight),
    "set": _set,
    "data": lambda conv: conv.weight.data[_last(conv.weight)].add_(1),
    "numpy": lambda conv: conv.weight.detach().numpy().__setitem__(_last(conv.weight), 7.0),
    "parametrization-data": lambda conv: conv.parametrizations.weight.original.data[_last(conv.weight)].add_(1),
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("how", list(WRITES))
def test_every_kind_of_parameter_write_in_the_first_batch_is_put_back_and_named(how, channels_last, monkeypatch):
    """Whatever way the forward writes a parameter, the weight is put back bit for bit, where its
    data lived, and named; compared in chunks of two elements (where an accelerator's parameters
    are compared with their copy in host memory, a chunk at a time)."""
    from precise_bn.pytorch import model_state
    monkeypatch.setattr(model_state, "_CHUNK_BYTES", 8)
    model = with_bn(Writing(how, channels_last))
    weight = model[0].conv.parametrizations.weight.original if how == "parametrization-data" else model[0].conv.weight
    where = (weight.data_ptr(), weight.stride())
    before = whole_state(model)
    report, named = put_back_warnings(lambda: recompute(model, batches(count=3), progress=False))
    assert_only_stats_changed(before, whole_state(model), ["1"])
    assert (weight.data_ptr(), weight.stride()) == where
    name = "0.conv.parametrizations.weight.original" if how == "parametrization-data" else "0.conv.weight"
    assert report.changed_parameters == [name] and len(named) == 1 and name in named[0], (report.changed_parameters, named)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.bool])
def test_the_parameters_copy_keeps_any_dtype_and_strides_bit_for_bit(dtype, monkeypatch):
    """The host copy holds each parameter with its own strides (a
    transposed one, one with a storage offset, an empty one) and finds a one-element write."""
    from precise_bn.pytorch import model_state
    monkeypatch.setattr(model_state, "_CHUNK_BYTES", 8)
    model = nn.Module()
    base = torch.randn(6, 5).to(dtype)
    model.t = nn.Parameter(base.t(), requires_grad=False)
    model.offset = nn.Parameter(torch.randn(40).to(dtype)[3:], requires_grad=False)
    model.empty = nn.Parameter(torch.empty(0, 4, dtype=dtype), requires_grad=False)
    state = ModelState(model, module_names(list(model.named_modules())))
    assert state.written_parameters() == []
    for p in state.parameters.values():
        assert p.copy is not None and p.copy.device.type == "cpu" and p.copy.stride() == p.tensor.stride()
        assert torch.equal(p.copy, p.tensor)
    before = [model.t.detach().clone(), model.offset.detach().clone()]
    model.t.data[-1, -1] = ~model.t.data[-1, -1] if dtype == torch.bool else model.t.data[-1, -1] + 1
    model.offset.data[-1] = ~model.offset.data[-1] if dtype == torch.bool else model.offset.data[-1] + 1
    assert state.written_parameters() == ["t", "offset"]
    state.restore()
    assert torch.equal(model.t, before[0]) and torch.equal(model.offset, before[1])


# --------------------------------------------------------------------------------------------
# Shared running buffers, functional batch_norm


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).train()


@pytest.mark.parametrize("how", ["same-tensor", "overlapping-views"])
def test_shared_running_buffers_are_refused_before_the_pass_naming_both_layers(how):
    model = two_layers()
    if how == "same-tensor":
        model[3]._buffers["running_var"] = model[1].running_var
    else:
        flat = torch.ones(6)
        model[1]._buffers["running_var"], model[3]._buffers["running_var"] = flat[:4], flat[2:]
    before = whole_state(model)
    forwards = []
    with pytest.raises(LayerError, match=r"'1' and BatchNorm layer '3' share memory"):
        recompute(model, batches(), forward_fn=lambda m, b: forwards.append(m(b)), progress=False)
    assert not forwards
    assert_unchanged(before, whole_state(model))


def test_running_buffers_that_are_disjoint_views_of_one_tensor_are_accepted():
    model = two_layers()
    flat = torch.ones(8)
    model[1]._buffers["running_var"], model[3]._buffers["running_var"] = flat[:4], flat[4:]
    data = batches()
    reference = float64_reference(model, data)
    recompute(model, data, progress=False)
    assert_matches(model, reference, ["1", "3"])
    assert torch.equal(flat, torch.cat([model[1].running_var, model[3].running_var]))


class FunctionalBN(nn.Module):
    """Batch norm by hand on its own buffers, named ``names``: no BN module for the pass to see."""

    def __init__(self, channels: int, names=("running_mean", "running_var")):
        super().__init__()
        self.names = names
        self.register_buffer(names[0], torch.zeros(channels))
        self.register_buffer(names[1], torch.ones(channels))

    def forward(self, x):
        mean, var = (getattr(self, name) for name in self.names)
        return F.batch_norm(x, mean, var, training=self.training)


def test_a_functional_batch_norm_is_named_in_one_warning_and_the_report_and_put_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), FunctionalBN(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).train()
    before = whole_state(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = recompute(model, batches(), progress=False)
    named = [str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning)
             and "not recomputed" in str(w.message)]
    assert len(named) == 1 and named[0].startswith("not recomputed: 1:"), named
    assert report.not_recomputed == ["1"] and report.to_dict()["not_recomputed"] == ["1"]
    assert "not recomputed" in str(report)
    assert_only_stats_changed(before, whole_state(model), ["3"])


def test_a_functional_batch_norm_on_buffers_named_otherwise_is_named_in_one_warning_and_the_report_and_put_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), FunctionalBN(4, ("fn_mean", "fn_var")), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).train()
    before = whole_state(model)
    report, named = put_back_warnings(lambda: recompute(model, batches(), progress=False))
    assert report.changed_buffers == ["1.fn_mean", "1.fn_var"] and report.not_recomputed == []
    assert report.to_dict()["changed_buffers"] == ["1.fn_mean", "1.fn_var"]
    assert "buffers the forwards changed (put back): 1.fn_mean, 1.fn_var" in str(report)
    assert len(named) == 1 and "1.fn_mean, 1.fn_var" in named[0], named
    assert_only_stats_changed(before, whole_state(model), ["3"])


def test_everything_the_forwards_changed_is_named_in_one_warning():
    torch.manual_seed(0)
    model = nn.Sequential(Clamping(), FunctionalBN(3), FunctionalBN(3, ("fn_mean", "fn_var")), Busy(), nn.BatchNorm2d(3)).train()
    before = whole_state(model)
    report, named = put_back_warnings(lambda: recompute(model, batches(), progress=False))
    assert (report.not_recomputed, report.changed_buffers, report.changed_parameters) == (
        ["1"], ["2.fn_mean", "2.fn_var", "3.calls"], ["0.conv.weight"])
    assert len(named) == 1 and named[0].startswith("not recomputed: 1:"), named
    assert all(name in named[0] for name in ("2.fn_mean", "3.calls", "0.conv.weight"))
    assert_only_stats_changed(before, whole_state(model), ["4"])


def test_a_pass_without_functional_batch_norm_names_nothing():
    report = recompute(two_layers(), batches(), progress=False)
    assert report.not_recomputed == [] and "not recomputed" not in str(report)


@pytest.mark.parametrize("layers", [None, ["1"]], ids=["all", "one-of-two"])
def test_an_ordinary_model_draws_no_warning(layers):
    """BN layers advance their ``num_batches_tracked``, and those left out of ``layers`` their
    statistics too: the BN layers' own, never named."""
    torch.manual_seed(0)
    model = small_net()
    data = [x for x, _ in factory_batches(n=12, batch_size=8)]
    before = whole_state(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = recompute(model, data, num_batches=len(data), layers=layers, progress=False)
    assert [str(w.message) for w in caught] == []
    assert (report.not_recomputed, report.changed_buffers, report.changed_parameters) == ([], [], [])
    assert_only_stats_changed(before, whole_state(model), ["1", "4", "9"] if layers is None else ["1"])


@pytest.mark.main_env
def test_a_torchvision_resnet_draws_no_warning():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 3, 32, 32, generator=gen) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = recompute(model, data, num_batches=len(data), progress=False)
    assert [str(w.message) for w in caught] == []
    assert (report.not_recomputed, report.changed_buffers, report.changed_parameters) == ([], [], [])


def _copied(values: Sequence[torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in values)


@pytest.mark.parametrize("clamping", [False, True], ids=["well-behaved", "clamping"])
def test_the_kept_state_copies_each_buffer_once_and_the_parameters_while_the_first_batch_runs(clamping):
    """The memory of a pass: the model's buffers once (a buffer held by two modules once), and
    the parameters once (a tied one once) until the first batch is checked; then released,
    unless that batch wrote a parameter. ``benchmarks/RESULTS.md`` measures it."""
    model = nn.Sequential(Clamping() if clamping else nn.Conv2d(3, 3, 1), Busy(), nn.BatchNorm2d(3)).train()
    model.extra = nn.Module()
    model.extra.register_buffer("alias", model[2].running_mean)
    model.tied = nn.Linear(3, 3)
    model.tied_again = nn.Linear(3, 3)
    model.tied_again.weight = model.tied.weight
    state = ModelState(model, module_names(list(model.named_modules())))
    assert _copied([b.value for b in state.buffers.values()]) == _copied(list(model.buffers()))
    copies = [p.copy for p in state.parameters.values()]
    assert _copied([c for c in copies if c is not None]) == _copied(list(model.parameters()))
    with torch.no_grad():
        model[:3](batches(count=1)[0])
    state.check_parameters()
    kept = [p.copy for p in state.parameters.values() if p.copy is not None]
    assert len(kept) == (len(list(model.parameters())) if clamping else 0)
    assert state.written_parameters() == (["0.conv.weight"] if clamping else [])


# --------------------------------------------------------------------------------------------
# State exported with .numpy(), then a resize that torch refuses half-way (in a subprocess)


def _exported_resize() -> None:
    """The forward's resize raises torch's own error, the tensor left with sizes its storage
    cannot hold; the call raises that error and the model is exactly as it was."""
    model = with_bn(Resizing())
    exported = {k: v.numpy() for k, v in model.state_dict().items()}
    before = whole_state(model)
    try:
        recompute(model, batches(), progress=False)
    except RuntimeError as exc:
        assert "not resizable" in str(exc), exc
    else:
        raise AssertionError("the resize was not refused")
    assert_unchanged(before, whole_state(model))
    assert exported["0.scale"].tolist() == [1.0]


def _exported_resize_in_a_block() -> None:
    """The same inside a ``recalibrated`` block, on a recomputed layer's own buffer: leaving
    the block puts it back without writing through the half-resized sizes."""
    model = with_bn(nn.Identity())
    before = whole_state(model)
    with recalibrated(model, batches(), progress=False):
        counter = model[1].num_batches_tracked
        exported = counter.numpy()
        try:
            counter.resize_(4096)
        except RuntimeError:
            pass
        assert counter.shape == (4096,)  # what torch leaves: sizes its 8 bytes cannot hold
    assert_unchanged(before, whole_state(model))
    assert int(exported) == 0


SUBPROCESS_CASES = {"exported-resize": _exported_resize, "exported-resize-in-a-block": _exported_resize_in_a_block}


@pytest.mark.parametrize("case", list(SUBPROCESS_CASES))
def test_a_half_made_resize_of_an_exported_buffer_is_never_written_through(case):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, "exit {}: {}".format(done.returncode, done.stderr[-3000:])
    assert done.stdout.strip().endswith("ok " + case)


if __name__ == "__main__":
    torch.set_num_threads(1)
    SUBPROCESS_CASES[sys.argv[1]]()
    print("ok " + sys.argv[1])
