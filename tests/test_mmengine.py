"""ExactPreciseBNHook in a real mmengine Runner on the CPU: when it acts (due points counted from
iterations, validation and checkpoints sharing a pass, resume), what validation used and what
the files hold (against a float64 reference over the very batches each pass read), EMAHook's two
sets of weights, the run's log, training left bit for bit as it is without the hook, and two
ranks (mmpretrain's own tests: test_mmpretrain_precise_bn_hook.py)."""
from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from mmengine.evaluator import BaseMetric
from mmengine.hooks import EMAHook
from mmengine.model import BaseModel
from mmengine.registry import HOOKS
from mmengine.runner import Runner
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import dist_workers as W
from precise_bn import ConfigError
from precise_bn.mmengine import ExactPreciseBNHook, mm_forward
from factories import tiny_net
from reference import assert_close_exact, float64_reference

pytestmark = pytest.mark.main_env

SAMPLES = 48
BATCH = 8  # 6 iterations an epoch
LAYERS = ("net.1", "net.5")
SPAWN_TIMEOUT_S = 900.0  # a hang guard: the spawn takes seconds
_RUNS = itertools.count()


class Net(BaseModel):
    """Dropout after the last BN layer: training draws from the generators, BN inputs do not."""

    def __init__(self, data_preprocessor=None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.net = nn.Sequential(*tiny_net(), nn.Dropout(0.3))
        self.steps = 0  # training forwards so far
        self.trained: List[List[int]] = []  # the sample indices of each training batch
        self.validated: Dict[int, Dict[str, torch.Tensor]] = {}  # steps -> the BN stats validation ran with

    def forward(self, inputs, data_samples=None, mode="tensor"):
        out = self.net(inputs)
        if mode == "loss":
            self.steps += 1
            self.trained.append(data_samples[:, 1].tolist())
            return {"loss": F.cross_entropy(out, data_samples[:, 0])}
        if mode == "predict":
            return [(out, data_samples)]
        return out


class Samples(Dataset):
    """Shifted inputs; each sample's target carries its index, to see what training read."""

    def __init__(self, seed: int, n: int = SAMPLES):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 6, 6, generator=gen) * 2 + 3
        self.y = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"inputs": self.x[i], "data_samples": torch.tensor([int(self.y[i]), i])}


def bn_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "running" in k}


class Validated(BaseMetric):
    """Keeps the BN statistics the model runs validation with."""

    def __init__(self, model: Net):
        super().__init__()
        self.model = model

    def process(self, data_batch, data_samples):
        self.results.append(0.0)

    def compute_metrics(self, results):
        self.model.validated[self.model.steps] = bn_state(self.model)
        return {"batches": float(len(results))}


class Recorder:
    """A forward_fn that keeps the batches of each pass, by the training iterations done before it."""

    def __init__(self, net: Net):
        self.net = net
        self.passes: Dict[int, List[Any]] = {}

    def __call__(self, model, batch):
        if model is self.net:
            self.passes.setdefault(self.net.steps, []).append(batch)
        return mm_forward(model, batch)


def make_runner(work_dir: Path, model: Net, hooks: list, train_cfg: dict, checkpoint: dict = None,
                train_loader: Any = None, **kwargs) -> Runner:
    settings = dict(
        model=model, work_dir=str(work_dir),
        train_dataloader=train_loader if train_loader is not None else DataLoader(Samples(0), batch_size=BATCH),
        val_dataloader=DataLoader(Samples(1, 16), batch_size=16), val_evaluator=[Validated(model)], val_cfg=dict(),
        train_cfg=train_cfg, optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)), custom_hooks=hooks,
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", **(checkpoint or dict(interval=1))),
                           logger=dict(type="LoggerHook")),
        randomness=dict(seed=0), log_level=logging.WARNING, experiment_name="precise-bn-{}".format(next(_RUNS)))
    settings.update(kwargs)
    return Runner(**settings)


def sampled(sampler: str, n: int = SAMPLES) -> dict:
    """A training dataloader config with one of mmengine's samplers, shuffled."""
    return dict(dataset=Samples(0, n), sampler=dict(type=sampler, shuffle=True, seed=3), batch_size=BATCH,
                collate_fn=dict(type="default_collate"))


def load(path: Path) -> Dict[str, Any]:
    return torch.load(str(path), map_location="cpu", weights_only=False)


def stats_of(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running_mean" in k or "running_var" in k}


def assert_same_stats(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str = "") -> None:
    a, b = stats_of(a), stats_of(b)
    assert a.keys() == b.keys() and a, what
    for key in a:
        assert torch.equal(a[key], b[key]), (what, key)


def assert_precise(state: Dict[str, torch.Tensor], batches: List[Any], what: str = "") -> None:
    """``state``'s BN statistics are the float64 population statistics of ``batches`` under its weights."""
    model = Net()
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    ref = float64_reference(model, batches, forward_fn=mm_forward)
    for name in LAYERS:
        assert_close_exact(state[name + ".running_mean"], state[name + ".running_var"], ref[name][0], ref[name][1],
                             "{} {}".format(what, name))


def test_an_interval_in_epochs_counts_them_from_iterations_and_the_file_holds_what_validation_used(tmp_path):
    """The issue's setup: 2 epochs of 6 iterations, a checkpoint every 6 iterations, interval=2."""
    model = Net()
    record = Recorder(model)
    hook = ExactPreciseBNHook(num_samples=SAMPLES, interval=2, forward_fn=record)
    make_runner(tmp_path, model, [hook], dict(by_epoch=True, max_epochs=2, val_interval=1),
                checkpoint=dict(interval=6, by_epoch=False)).train()
    assert sorted(record.passes) == [12] and hook.hook.recomputations == 1  # iteration 6 ends epoch 1: not due
    assert sorted(model.validated) == [6, 12]
    first, second = load(tmp_path / "iter_6.pth")["state_dict"], load(tmp_path / "iter_12.pth")["state_dict"]
    assert_same_stats(first, model.validated[6], "iter_6, not due: training's running averages")
    assert_precise(second, record.passes[12], "iter_12")
    assert_same_stats(second, model.validated[12], "iter_12 and the validation after the same iteration")


def test_epoch_checkpoints_and_validation_share_each_pass(tmp_path):
    model = Net()
    record = Recorder(model)
    hook = HOOKS.build(dict(type="ExactPreciseBNHook", num_samples=SAMPLES, interval=1, forward_fn=record))
    make_runner(tmp_path, model, [hook], dict(by_epoch=True, max_epochs=2, val_interval=1)).train()
    assert sorted(record.passes) == [6, 12] and hook.hook.recomputations == 2
    for epoch, steps in ((1, 6), (2, 12)):
        saved = load(tmp_path / "epoch_{}.pth".format(epoch))["state_dict"]
        assert_precise(saved, record.passes[steps], "epoch {}".format(epoch))
        assert_same_stats(saved, model.validated[steps], "epoch {}".format(epoch))


def test_iteration_loop_with_its_own_validation_and_checkpoint_intervals(tmp_path):
    """Validation every 3 iterations, checkpoints every 2: a pass at each distinct iteration,
    shared at 6 and 12; mmengine's InfiniteSampler, its standard for iteration loops."""
    model = Net()
    record = Recorder(model)
    hook = ExactPreciseBNHook(num_samples=16, interval=1, forward_fn=record)
    make_runner(tmp_path, model, [hook], dict(by_epoch=False, max_iters=12, val_interval=3),
                checkpoint=dict(interval=2, by_epoch=False), train_loader=sampled("InfiniteSampler")).train()
    assert sorted(record.passes) == [2, 3, 4, 6, 8, 9, 10, 12] and hook.hook.recomputations == 8
    assert all(len(batches) == 2 for batches in record.passes.values())  # 16 samples in batches of 8
    assert sorted(model.validated) == [3, 6, 9, 12]
    for steps in (2, 4, 6, 8, 10, 12):
        saved = load(tmp_path / "iter_{}.pth".format(steps))["state_dict"]
        assert_precise(saved, record.passes[steps], "iter_{}".format(steps))
        if steps in model.validated:
            assert_same_stats(saved, model.validated[steps], "iter_{}".format(steps))


def test_an_interval_in_iterations(tmp_path):
    model = Net()
    record = Recorder(model)
    hook = ExactPreciseBNHook(num_samples=16, interval=4, forward_fn=record)
    make_runner(tmp_path, model, [hook], dict(by_epoch=False, max_iters=6, val_interval=2),
                checkpoint=dict(interval=3, by_epoch=False), train_loader=sampled("InfiniteSampler")).train()
    assert sorted(record.passes) == [4]  # validation at 2, 4, 6 and checkpoints at 3, 6: only 4 is due
    assert_same_stats(load(tmp_path / "iter_6.pth")["state_dict"], model.validated[6])


def test_a_resumed_run_counts_the_iterations_it_resumed_from(tmp_path, monkeypatch):
    # mmengine 0.10 resumes with torch.load's default, which torch 2.6 and later limit to weights.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    make_runner(tmp_path, Net(), [], dict(by_epoch=True, max_epochs=1)).train()
    model = Net()
    record = Recorder(model)
    hook = ExactPreciseBNHook(num_samples=SAMPLES, interval=2, forward_fn=record)
    make_runner(tmp_path, model, [hook], dict(by_epoch=True, max_epochs=3, val_interval=1),
                load_from=str(tmp_path / "epoch_1.pth"), resume=True).train()
    assert sorted(record.passes) == [6]  # 6 iterations after the resume: epoch 2, iteration 12
    assert sorted(model.validated) == [6, 12]  # epochs 2 and 3
    second = load(tmp_path / "epoch_2.pth")
    assert second["meta"]["iter"] == 12
    assert_precise(second["state_dict"], record.passes[6], "epoch 2")
    assert_same_stats(second["state_dict"], model.validated[6])
    assert_same_stats(load(tmp_path / "epoch_3.pth")["state_dict"], model.validated[12])  # not due: untouched


@pytest.mark.parametrize("by_epoch", [True, False], ids=["epoch-checkpoints", "iteration-checkpoints"])
@pytest.mark.parametrize("update_buffers", [False, True])
def test_ema_weights_are_validated_and_saved_with_their_own_statistics(tmp_path, update_buffers, by_epoch):
    """EMAHook updates its copy after each iteration, swaps the weights (and with update_buffers
    the buffers) in for validation and the two state dicts in checkpoints."""
    model = Net()
    record = Recorder(model)
    ema = EMAHook(momentum=0.5, update_buffers=update_buffers)
    runner = make_runner(tmp_path, model, [ExactPreciseBNHook(num_samples=SAMPLES, forward_fn=record), ema],
                         dict(by_epoch=True, max_epochs=2, val_interval=1),
                         checkpoint=dict(interval=1, save_best="batches", rule="greater") if by_epoch else
                         dict(interval=6, by_epoch=False))
    runner.train()
    if by_epoch:  # save_best's file, written after the validation, rank 0 alone: what validation used
        best = load(tmp_path / "best_batches_epoch_1.pth")
        assert_same_stats(best["state_dict"], model.validated[6], "best, EMA weights")
        assert_same_stats(best["ema_state_dict"], load(tmp_path / "epoch_1.pth")["ema_state_dict"], "best, trained")
    for epoch, steps in ((1, 6), (2, 12)):
        saved = load(tmp_path / ("epoch_{}.pth".format(epoch) if by_epoch else "iter_{}.pth".format(steps)))
        averaged = saved["state_dict"]  # EMAHook saves the EMA weights there, the trained ones aside
        trained = {k[len("module."):]: v for k, v in saved["ema_state_dict"].items() if k.startswith("module.")}
        assert not torch.equal(averaged["net.0.weight"], trained["net.0.weight"])
        assert_precise(averaged, record.passes[steps], "EMA weights, epoch {}".format(epoch))
        assert_precise(trained, record.passes[steps], "trained weights, epoch {}".format(epoch))
        assert_same_stats(averaged, model.validated[steps], "validation ran the EMA weights, epoch {}".format(epoch))
    assert_same_stats(bn_state(model), trained, "the model keeps its own statistics")
    assert_same_stats(bn_state(ema.ema_model.module), averaged, "the EMA copy keeps its own")
    assert torch.equal(model.state_dict()["net.0.weight"], trained["net.0.weight"])


def test_the_run_log_says_what_was_done_how_many_samples_and_how_long(tmp_path):
    runner = make_runner(tmp_path, Net(), [ExactPreciseBNHook(num_samples=SAMPLES)],
                         dict(by_epoch=True, max_epochs=1, val_interval=1), log_level=logging.INFO)
    runner.train()
    (log,) = Path(runner.log_dir).glob("*.log")
    text = log.read_text()
    assert "precise-bn: 2 BatchNorm layers, 6 batches (48 samples), world size 1" in text
    assert "; for the checkpoint at step 6" in text and " s; stopped: num_samples samples were read" in text
    assert "precise-bn: the evaluation at step 6 gets the statistics recomputed for that step" in text


def test_a_model_without_bn_is_named_in_the_run_log(tmp_path):
    class Plain(Net):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))

    runner = make_runner(tmp_path, Plain(), [ExactPreciseBNHook(num_samples=SAMPLES)], dict(by_epoch=True, max_epochs=1))
    runner.train()
    (log,) = Path(runner.log_dir).glob("*.log")
    assert "precise-bn: Plain has no BatchNorm layer; the hook is off" in log.read_text()


def trained_with(tmp_path: Path, sampler: str, by_epoch: bool, hooks: list):
    torch.manual_seed(0)
    model = Net()
    train_cfg = dict(by_epoch=True, max_epochs=2, val_interval=1) if by_epoch else \
        dict(by_epoch=False, max_iters=9, val_interval=4)
    make_runner(tmp_path, model, hooks, train_cfg, checkpoint=dict(interval=3, by_epoch=False),
                train_loader=sampled(sampler)).train()
    return model.trained, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("sampler, by_epoch", [("DefaultSampler", True), ("DefaultSampler", False),
                                               ("InfiniteSampler", False)])
def test_training_is_unchanged_by_the_hook(tmp_path, sampler, by_epoch):
    """The same batches in the same order, the same dropout masks, the same weights, bit for bit
    (an iteration loop over DefaultSampler starts a second epoch: the sampler's set_epoch)."""
    hook = ExactPreciseBNHook(num_samples=16)
    with_hook = trained_with(tmp_path / "with", sampler, by_epoch, [hook])
    without = trained_with(tmp_path / "without", sampler, by_epoch, [])
    assert hook.hook.recomputations >= 2
    assert with_hook[0] == without[0] and len(without[0]) == (12 if by_epoch else 9)
    assert with_hook[1].keys() == without[1].keys()
    for name in without[1]:
        assert torch.equal(with_hook[1][name], without[1][name]), name


def test_two_ranks_read_num_samples_between_them_and_hold_the_merged_statistics(tmp_path):
    """Two gloo ranks under DDP: num_samples=16 is one batch of 8 on each; the file (mmengine
    calls before_save_checkpoint on rank 0 alone: the pass ran before it, on both) and both
    ranks hold the float64 statistics of the union of their batches. A checkpoint of new
    weights that rank 0 writes alone is left as it is, with a warning, instead of a pass that
    would wait for rank 1."""
    results = W.spawn_ranks(2, str(tmp_path), SPAWN_TIMEOUT_S, table="mmengine_workers")
    assert results[0]["_finished"]
    ranks = [r["runner"] for r in results]
    for rank, result in enumerate(ranks):
        assert "error" not in result, result
        assert sorted(result["passes"]) == [2] and len(result["passes"][2]) == 1, rank
        assert result["report"] == (16, 2, 2), rank  # samples and batches over both ranks, world size
    assert_same_stats(ranks[0]["stats"], ranks[1]["stats"], "both ranks")
    saved = ranks[0]["file"]
    assert_precise(saved, ranks[0]["passes"][2] + ranks[1]["passes"][2], "merged")
    assert_same_stats(saved, ranks[0]["validated"][2], "file and validation")
    assert_same_stats(saved, ranks[0]["stats"], "file and model")
    (late,) = ranks[0]["late"]  # said, and no pass that would wait for rank 1
    assert "iteration 2" in late and "keeps the statistics mmengine collected" in late
    assert_same_stats(ranks[0]["late_file"], saved, "late checkpoint, left as it was")


def test_mm_forward_goes_through_the_data_preprocessor():
    model = Net(dict(type="ImgDataPreprocessor", mean=[1.0, 1.0, 1.0], std=[2.0, 2.0, 2.0])).eval()
    images = [torch.randn(3, 6, 6) for _ in range(2)]
    out = mm_forward(model, {"inputs": images, "data_samples": [0, 1]})
    assert torch.equal(out, model.net((torch.stack(images) - 1.0) / 2.0))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(rtoll=0.1), TypeError, "ExactPreciseBNHook.*'rtoll'.*rtol"),
    (dict(interval=0), ConfigError, "interval must be a positive integer"),
    (dict(num_samples=0), ConfigError, "num_samples"),
    (dict(num_samples=None), ConfigError, "all None"),
    (dict(prior=-2), ConfigError, "prior"),
])
def test_options_are_checked_when_the_hook_is_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        HOOKS.build(dict(type="ExactPreciseBNHook", **kwargs))


@pytest.mark.parametrize("priority, match", [("ABOVE_NORMAL", "runs before EMAHook"),
                                             ("LOWEST", "runs after CheckpointHook")])
def test_a_priority_before_ema_or_after_checkpoints_is_refused_before_training(tmp_path, priority, match):
    model = Net()
    hook = dict(type="ExactPreciseBNHook", num_samples=SAMPLES, priority=priority)
    runner = make_runner(tmp_path, model, [hook, EMAHook()], dict(by_epoch=True, max_epochs=1))
    with pytest.raises(ConfigError, match=match):
        runner.train()
    assert model.steps == 0


def test_two_ema_hooks_are_refused(tmp_path):
    runner = make_runner(tmp_path, Net(), [ExactPreciseBNHook(num_samples=SAMPLES), EMAHook(), EMAHook()],
                         dict(by_epoch=True, max_epochs=1))
    with pytest.raises(ConfigError, match="2 EMAHooks"):
        runner.train()

