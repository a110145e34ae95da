"""PreciseBNHook: the per-step cache, periods, data wrap-around, budgets, extra models, no-BN models."""
from __future__ import annotations

import copy
import logging
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from precise_bn import BatchError, ConfigError, EmptyDataError, PreciseBNWarning, recompute
from precise_bn.data import smart_forward as default_forward
from precise_bn.hooks import PreciseBNHook
from factories import bn_stats, tiny_net
from reference import assert_close_exact, float64_reference


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return tiny_net(classes=5)


def make_batches(n: int, size: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 6, 6, generator=g) * (1 + i) + i, torch.zeros(size)) for i in range(n)]


def assert_same_stats(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name][0], b[name][0]), name
        assert torch.equal(a[name][1], b[name][1]), name


def expected_stats(model: nn.Module, batches):
    """recompute on a copy with the same weights and batches, checked against float64."""
    ref = copy.deepcopy(model)
    recompute(ref, batches)
    stats = bn_stats(ref)
    for name, (mean, var, _) in float64_reference(model, batches).items():
        assert_close_exact(stats[name][0], stats[name][1], mean, var, what=name)
    return stats


class Recorder:
    """A forward_fn that remembers which batch each model got, in order."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, batch):
        self.calls.append((model, batch))
        return default_forward(model, batch)

    def batches_of(self, model):
        return [batch for m, batch in self.calls if m is model]


def count_forwards(model: nn.Module):
    """Count calls of ``model`` itself (deep copies carry the hook but are not counted)."""
    counter = [0]

    def hook(module, _inputs):
        counter[0] += module is model

    model.register_forward_pre_hook(hook)
    return counter


def test_same_step_reapplies_cached_stats_without_forward():
    model, batches = make_model(), make_batches(6)
    recorder = Recorder()
    hook = PreciseBNHook(model, batches, num_batches=3, forward_fn=recorder)
    forwards = count_forwards(model)

    report = hook.before_eval(10)
    assert report is not None and forwards[0] == 3 and hook.recomputations == 1
    evaluated = bn_stats(model)
    assert_same_stats(evaluated, expected_stats(model, batches[:3]))

    model.train()(torch.randn(4, 3, 6, 6) * 5)  # a training forward moves the running stats
    assert not torch.equal(bn_stats(model)["1"][0], evaluated["1"][0])
    assert hook.before_checkpoint(10) is report
    assert forwards[0] == 4 and hook.recomputations == 1  # only the training forward above
    assert_same_stats(bn_stats(model), evaluated)

    hook.before_checkpoint(11)
    assert forwards[0] == 7 and hook.recomputations == 2
    assert recorder.batches_of(model)[3:] == batches[3:6]
    assert_same_stats(bn_stats(model), expected_stats(model, batches[3:6]))


def test_periods_let_the_loop_call_every_step():
    model = make_model()
    hook = PreciseBNHook(model, make_batches(4), num_batches=2, eval_period=3, checkpoint_period=4)
    forwards = count_forwards(model)
    evaluated, saved = [], []
    for step in range(1, 13):
        if hook.before_eval(step) is not None:
            evaluated.append(step)
        if hook.before_checkpoint(step) is not None:
            saved.append(step)
    assert evaluated == [3, 6, 9, 12] and saved == [4, 8, 12]
    assert forwards[0] == 12 and hook.recomputations == 6  # step 12's checkpoint reused its evaluation


@pytest.mark.parametrize("kind", ["list", "dataloader"])
def test_wraps_around_a_short_finite_source(kind):
    model = make_model()
    batches = make_batches(3)
    if kind == "list":
        data = batches
    else:
        data = DataLoader(TensorDataset(torch.cat([x for x, _ in batches]), torch.zeros(12)), batch_size=4)
    recorder = Recorder()
    hook = PreciseBNHook(model, data, num_batches=5, forward_fn=recorder)
    hook.before_eval(1)
    first = bn_stats(model)
    hook.before_eval(2)
    used = [x for x, _ in recorder.batches_of(model)]
    order = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert len(used) == 10
    for got, index in zip(used, order):
        assert torch.equal(got, batches[index][0])
    assert_same_stats(first, expected_stats(model, [batches[i] for i in order[:5]]))
    assert_same_stats(bn_stats(model), expected_stats(model, [batches[i] for i in order[5:]]))


def test_num_samples_budget():
    model = make_model()
    hook = PreciseBNHook(model, make_batches(5, size=4), num_batches=None, num_samples=10)
    report = hook.before_eval(1)
    assert report.batches == 3 and report.samples == 12  # the batch crossing the budget is used whole


def test_model_without_bn_turns_the_hook_off(caplog):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    forwards = count_forwards(model)
    hook = PreciseBNHook(model, [torch.randn(2, 3)])
    with caplog.at_level(logging.INFO, logger="precise_bn"):
        assert hook.before_eval(1) is None
        assert hook.before_checkpoint(2) is None
        assert hook.before_eval(3) is None
    assert not hook.enabled and forwards[0] == 0
    assert len(caplog.records) == 1 and "no BatchNorm layer" in caplog.records[0].getMessage()


def test_extra_model_recomputed_on_the_same_batches():
    model, batches = make_model(), make_batches(5)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.9).add_(0.05)
    ema.eval()  # EMA copies usually stay in eval mode: all their BN layers are recomputed
    recorder = Recorder()
    hook = PreciseBNHook(model, batches, num_batches=3, extra_models=[ema], forward_fn=recorder)
    hook.before_eval(1)
    hook.before_eval(2)
    for seen in (recorder.batches_of(model), recorder.batches_of(ema)):
        assert len(seen) == 6 and all(a is b for a, b in zip(seen, batches + batches[:1]))
    assert_same_stats(bn_stats(model), expected_stats(model, batches[3:] + batches[:1]))
    assert_same_stats(bn_stats(ema), expected_stats(ema, batches[3:] + batches[:1]))
    assert not ema.training and not any(m.training for m in ema.modules())
    assert set(hook.cached_stats) == {"model.1", "model.5", "extra_0.1", "extra_0.5"}


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"eval_period": 0}, "eval_period"),
        ({"checkpoint_period": 1.5}, "checkpoint_period"),
        ({"num_batches": 0}, "num_batches"),
        ({"num_batches": None}, "num_samples"),
        ({"rtol": 0.0}, "rtol"),
        ({"device": "nowhere"}, "nowhere"),
    ],
)
def test_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        PreciseBNHook(make_model(), make_batches(1), **kwargs)


@pytest.mark.main_env
def test_example_training_script(tmp_path, monkeypatch, capsys):
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_with_precise_bn.py"
    args = ["--steps", "20", "--eval-every", "10", "--save-every", "10", "--bn-batches", "3", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [str(script)] + args)
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("test acc") == 2 and out.count("(evaluated stats)") == 2
    saved = torch.load(tmp_path / "step_20.pt", weights_only=True)
    assert saved["step"] == 20 and "1.running_var" in saved["ema"]


def test_named_layers_are_checked_when_the_hook_is_built():
    with pytest.raises(ConfigError, match="no module named '9'"):
        PreciseBNHook(make_model(), make_batches(1), layers=["9"])
    with pytest.raises(ConfigError, match="'4'.*not a BatchNorm"):
        PreciseBNHook(make_model(), make_batches(1), layers=["4"])


@pytest.mark.parametrize("extra", [False, True])
def test_a_dict_batch_without_forward_fn_is_a_batch_error(extra):
    model = make_model()
    before = bn_stats(model)
    batches = [{"image": x} for x, _ in make_batches(2)]
    hook = PreciseBNHook(model, batches, num_batches=2, extra_models=[copy.deepcopy(model)] if extra else ())
    with pytest.raises(BatchError, match="'image'.*forward_fn"):
        hook.before_eval(1)
    assert_same_stats(bn_stats(model), before)


def test_a_single_pass_source_is_warned_about_and_named_when_it_runs_out():
    model, batches = make_model(), make_batches(5)
    with pytest.warns(PreciseBNWarning, match="single-pass generator") as caught:
        hook = PreciseBNHook(model, (b for b in batches), num_batches=3)
    assert caught[0].filename == __file__  # the user's line
    hook.before_eval(1)
    after_first = bn_stats(model)
    with pytest.raises(EmptyDataError, match="single-pass generator, ran out after 5 batches.*cannot start again"):
        hook.before_eval(2)
    assert_same_stats(bn_stats(model), after_first)


def test_new_weights_at_the_same_step_are_recomputed():
    """A checkpoint loaded, or an optimizer step, between two calls at one step: the cached
    stats belong to other weights and are not written back."""
    model, batches = make_model(), make_batches(6)
    hook = PreciseBNHook(model, batches, num_batches=3)
    hook.before_eval(4)
    other = make_model(seed=1)
    model.load_state_dict(other.state_dict())
    hook.before_checkpoint(4)
    assert hook.recomputations == 2
    assert_same_stats(bn_stats(model), expected_stats(model, batches[3:6]))
    with torch.no_grad():
        model[0].weight.mul_(2)
    hook.before_checkpoint(4)
    assert hook.recomputations == 3
    assert_same_stats(bn_stats(model), expected_stats(model, batches[:3]))
    hook.before_eval(4)
    assert hook.recomputations == 3


def test_each_call_says_what_it_did_in_the_logger_it_was_given(caplog):
    batches = make_batches(3)
    hook = PreciseBNHook(make_model(), batches, num_batches=3, logger=logging.getLogger("some.framework"))
    silent = PreciseBNHook(make_model(), batches, num_batches=3, logger=None)
    with caplog.at_level(logging.INFO):
        hook.before_eval(5)
        hook.before_checkpoint(5)
        silent.before_eval(5)
    lines = [r.getMessage() for r in caplog.records if r.name == "some.framework"]
    assert len(lines) == 2 and not [r for r in caplog.records if r.name not in ("some.framework", "precise_bn")]
    assert lines[0].startswith("precise-bn: 2 BatchNorm layers, 3 batches (12 samples), world size 1")
    assert lines[0].endswith("; for the evaluation at step 5") and " s; stopped: num_batches" in lines[0]
    assert lines[1] == "precise-bn: the checkpoint at step 5 gets the statistics recomputed for that step and " \
                       "those weights"


def test_an_extra_models_stats_go_into_its_own_state_dict_and_can_be_lent():
    """What mmengine's EMAHook and Lightning's WeightAveraging need: each set of weights' stats
    written into its own dict, and the EMA copy's lent to the model while its weights are."""
    model, batches = make_model(), make_batches(4)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    hook = PreciseBNHook(model, batches, num_batches=4, extra_models=[ema])
    hook.before_checkpoint(1)
    own, averaged = bn_stats(model), bn_stats(ema)
    assert not torch.equal(own["1"][1], averaged["1"][1])
    assert hook.stats_of(0).keys() == hook.stats_of(1).keys() == {"1", "5"}
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    ema_state = {"module." + k: torch.zeros_like(v) for k, v in ema.state_dict().items()}
    assert hook.write_into(state) == [] and hook.write_into(ema_state, "module.", member=1) == []
    for name in ("1", "5"):
        assert torch.equal(state[name + ".running_var"], own[name][1])
        assert torch.equal(ema_state["module." + name + ".running_var"], averaged[name][1])
    assert hook.write_into({}, member=1) == ["1.running_mean", "1.running_var", "5.running_mean", "5.running_var"]
    hook.lend(1)
    assert_same_stats(bn_stats(model), averaged)
    assert_same_stats(bn_stats(ema), averaged)
    hook.take_back()
    assert_same_stats(bn_stats(model), own)
    with torch.no_grad():
        model[1].running_var.fill_(3.0)
    hook.take_back()  # nothing lent: nothing written
    assert bool((model[1].running_var == 3.0).all())


def test_forget_makes_the_same_step_and_weights_recompute():
    """A write through ``.data`` (how EMA and weight-averaging callbacks swap weights) leaves the
    version counters alone: the key cannot see it, and an integration that knows says forget()."""
    model, batches = make_model(), make_batches(4)
    hook = PreciseBNHook(model, batches, num_batches=2)
    hook.before_eval(1)
    model[0].weight.data.mul_(2.0)
    assert hook.cached_for(1)
    hook.before_checkpoint(1)
    assert hook.recomputations == 1
    hook.forget()
    assert not hook.cached_for(1)
    hook.before_checkpoint(1)
    assert hook.recomputations == 2
    assert_same_stats(bn_stats(model), expected_stats(model, batches[2:4]))


def test_a_hook_on_a_model_of_frozen_bn_says_so_and_turns_off(caplog):
    class FrozenBatchNorm2d(nn.Module):  # torchvision's, as far as the hook sees: fixed statistics as buffers
        def __init__(self, channels):
            super().__init__()
            for name in ("weight", "bias", "running_mean", "running_var"):
                self.register_buffer(name, torch.ones(channels))

        def forward(self, x):
            return x

    model = nn.Sequential(nn.Conv2d(3, 4, 3), FrozenBatchNorm2d(4))
    hook = PreciseBNHook(model, make_batches(2), num_batches=2, logger=logging.getLogger("some.framework"))
    with caplog.at_level(logging.WARNING):
        assert hook.before_eval(1) is None and hook.before_eval(2) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "some.framework"]
    assert len(lines) == 1 and lines[0].startswith("precise-bn: Sequential has no BatchNorm layer; its 1 "
                                                   "FrozenBatchNorm2d layer holds fixed statistics"), lines
    assert lines[0].endswith("; the hook is off") and not hook.enabled
