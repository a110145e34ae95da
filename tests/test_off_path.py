"""Models off the plain path: two passes at once on one model (refused, never a deadlock), passes
on different models in parallel threads, TorchScript modules (refused with the fix), frozen BN
(named in the message), and split BN (SlowFast's SubBatchNorm3d, timm's SplitBatchNorm2d)."""
from __future__ import annotations

import copy
import logging
import threading
import warnings
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch import nn

from factories import batches, small_net
from precise_bn import ConcurrentPassError, LayerError, PreciseBNWarning, recompute
from precise_bn.pytorch.layers import no_layer_message
from reference import assert_close_exact, float64_reference

#: Far beyond what any wait here takes (a pass of a few milliseconds): only a hang reaches it.
HANG_GUARD_S = 60.0


def run_threads(*jobs: Callable[[], Any]) -> List[Dict[str, Any]]:
    """Run each job in a daemon thread; per job, what it returned or raised. Fails if any is
    still running after the hang guard (a deadlock)."""
    outcomes: List[Dict[str, Any]] = [{} for _ in jobs]

    def run(job: Callable[[], Any], out: Dict[str, Any]) -> None:
        try:
            out["result"] = job()
        except BaseException as exc:  # the test inspects it
            out["error"] = exc

    threads = [threading.Thread(target=run, args=(job, out), daemon=True) for job, out in zip(jobs, outcomes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads), "a pass is still running after {} s: deadlock".format(HANG_GUARD_S)
    return outcomes


def bn_layers(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def shares_layer(model: nn.Module) -> nn.Module:
    """Another model holding ``model``'s first BN layer."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), model[1], nn.ReLU())


@pytest.mark.parametrize("second", ["same model", "a model sharing a BN layer"])
def test_a_second_pass_while_one_runs_is_refused_and_the_first_completes(second):
    """Thread A's pass waits inside its first forward until thread B's call has returned: B is
    refused at once with ConcurrentPassError naming the model, A's pass completes exactly,
    and the model is left with its own classes and momentum; the next call works."""
    torch.manual_seed(0)
    model = small_net()
    for layer in bn_layers(model):
        layer.momentum = 0.3
    classes = [type(m) for m in bn_layers(model)]
    other = model if second == "same model" else shares_layer(model)
    data = batches()
    reference = float64_reference(model, data)
    inside, refused = threading.Event(), threading.Event()

    def held_forward(net: nn.Module, batch: Any) -> Any:
        inside.set()
        assert refused.wait(HANG_GUARD_S)
        return net(batch[0])

    def second_pass() -> Any:
        assert inside.wait(HANG_GUARD_S)
        try:
            return recompute(other, data)
        finally:
            refused.set()

    first, then = run_threads(lambda: recompute(model, data, forward_fn=held_forward), second_pass)
    assert "error" not in first, first
    assert isinstance(then.get("error"), ConcurrentPassError), then
    message = str(then["error"])
    assert "another precise-bn pass is running on " + type(other).__name__ in message, message
    assert "in thread " in message and "own copy" in message, message
    assert [type(m) for m in bn_layers(model)] == classes
    assert all(m.momentum == 0.3 and m.training for m in bn_layers(model))
    modules = dict(model.named_modules())
    for name, (mean, var, _) in reference.items():
        assert_close_exact(modules[name].running_mean, modules[name].running_var, mean, var, name)
    again = recompute(other, batches(seed=1))
    assert len(again.layers) == len(bn_layers(other))


def test_a_pass_started_inside_a_pass_on_the_same_model_is_refused_not_deadlocked():
    """A forward_fn that recomputes the model it runs in: the inner call is refused (it names
    this thread's own stack), the outer call fails with it and leaves the model unchanged."""
    torch.manual_seed(0)
    model = small_net()
    before = copy.deepcopy(model.state_dict())

    def nested(net: nn.Module, batch: Any) -> Any:
        recompute(net, [batch])
        return net(batch[0])

    outcome, = run_threads(lambda: recompute(model, batches(), forward_fn=nested))
    assert isinstance(outcome.get("error"), ConcurrentPassError), outcome
    assert "further up this thread's stack" in str(outcome["error"])
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert [type(m) for m in bn_layers(model)] == [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d]


def test_passes_on_two_models_run_in_parallel_threads():
    """Both passes are inside their forwards at once (a barrier in the first batch) and both
    give the exact statistics."""
    torch.manual_seed(0)
    models = [small_net(), small_net()]
    data = [batches(seed=0), batches(seed=1)]
    references = [float64_reference(m, d) for m, d in zip(models, data)]
    together = threading.Barrier(2, timeout=HANG_GUARD_S)
    first_batch = [True, True]

    def job(index: int) -> Callable[[], Any]:
        def forward(net: nn.Module, batch: Any) -> Any:
            if first_batch[index]:
                first_batch[index] = False
                together.wait()
            return net(batch[0])
        return lambda: recompute(models[index], data[index], forward_fn=forward)

    outcomes = run_threads(job(0), job(1))
    assert all("error" not in out for out in outcomes), outcomes
    for model, reference in zip(models, references):
        modules = dict(model.named_modules())
        for name, (mean, var, _) in reference.items():
            assert_close_exact(modules[name].running_mean, modules[name].running_var, mean, var, name)


@pytest.mark.parametrize("compile_", ["script", "trace"])
def test_a_torchscript_model_is_refused_with_the_fix(compile_):
    torch.manual_seed(0)
    model = small_net().eval()
    data = batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.x deprecates torch.jit
        scripted = torch.jit.script(model) if compile_ == "script" else torch.jit.trace(model, data[0][0])
    before = copy.deepcopy(scripted.state_dict())
    with pytest.raises(LayerError) as caught:
        recompute(scripted, data)
    message = str(caught.value)
    assert message.startswith("Sequential is a TorchScript module (")
    assert "none of its 3 BatchNorm layer(s) can be measured" in message, message
    assert "Use the Python module, as it was before torch.jit.script" in message, message
    assert "nothing to recompute" not in message
    after = scripted.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_a_scripted_submodule_is_refused_naming_it():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(torch.jit.script(block), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    for layers in (None, ["3"]):
        with pytest.raises(LayerError, match=r"module '0' of Sequential is a TorchScript module \(Sequential "
                                             r"RecursiveScriptModule\).*none of its 1 BatchNorm layer\(s\) can be "
                                             r"measured\. Use the Python module"):
            recompute(model, batches(), layers=layers)


@pytest.mark.main_env
def test_frozen_bn_is_named_with_its_count_not_as_missing_bn(caplog):
    from torchvision.models import resnet18
    from torchvision.ops.misc import FrozenBatchNorm2d

    model = resnet18(norm_layer=FrozenBatchNorm2d)
    with caplog.at_level(logging.WARNING, logger="precise_bn"):
        report = recompute(model, [torch.randn(2, 3, 32, 32)])
    assert not report.layers
    expected = "ResNet has no BatchNorm layer; its 20 FrozenBatchNorm2d layers hold fixed statistics, " \
               "no running statistics to recompute"
    assert expected in caplog.text
    assert no_layer_message(nn.Sequential(FrozenBatchNorm2d(3))).endswith("its 1 FrozenBatchNorm2d layer holds "
                                                                          "fixed statistics, no running statistics "
                                                                          "to recompute")


def test_a_module_with_running_stats_that_is_not_bn_is_named():
    class FunctionalBN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("running_mean", torch.zeros(3))
            self.register_buffer("running_var", torch.ones(3))

    message = no_layer_message(nn.Sequential(FunctionalBN(), FunctionalBN()))
    assert message == ("Sequential has no BatchNorm layer; its 2 FunctionalBN layers hold running_mean and running_var "
                       "but not as BatchNorm layers (subclasses of torch.nn.modules.batchnorm._BatchNorm, the only "
                       "layers precise-bn captures)")
    assert no_layer_message(nn.Sequential(nn.Linear(2, 2))) == "Sequential has no BatchNorm layer"
