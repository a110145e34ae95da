"""precise_bn.classy.PreciseBatchNormHook in a real ClassyVision ClassificationTask on CPU."""
from __future__ import annotations

import copy

import pytest
import torch
from classy_vision.dataset import ClassyDataset
from classy_vision.hooks import ClassyHook
from classy_vision.losses import build_loss
from classy_vision.models import ClassyModel
from classy_vision.optim import build_optimizer
from classy_vision.tasks import ClassificationTask
from classy_vision.trainer import LocalTrainer

from precise_bn import ConfigError, recompute
from precise_bn.classy import PreciseBatchNormHook
from factories import bn_stats, tiny_net
from reference import assert_close_exact, float64_reference

pytestmark = pytest.mark.main_env


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 6, 6, generator=g) * 2 + 1
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input": self.x[i], "target": self.y[i]}


def classy_dataset(samples: Samples) -> ClassyDataset:
    dataset = ClassyDataset(samples, batchsize_per_replica=8, shuffle=False, transform=None, num_samples=None)
    dataset.set_num_workers(0)
    return dataset


class SnapshotAfterTrainPhase(ClassyHook):
    """Keeps a copy of the base model at the end of each training phase (runs after ours)."""

    on_start = on_phase_start = on_step = on_end = ClassyHook._noop

    def __init__(self):
        super().__init__()
        self.models = []

    def on_phase_end(self, task) -> None:
        if task.train:
            self.models.append(copy.deepcopy(task.base_model))


@pytest.mark.parametrize("cache_samples", [False, True])
def test_stats_after_each_training_phase_match_recompute(cache_samples):
    torch.manual_seed(0)
    net = tiny_net()
    train = Samples(40, seed=1)
    snapshots = SnapshotAfterTrainPhase()
    optimizer = build_optimizer(
        {"name": "sgd", "num_epochs": 2, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False,
         "param_schedulers": {"lr": {"name": "constant", "value": 0.2}}}
    )
    task = (
        ClassificationTask()
        .set_model(ClassyModel.from_model(net))
        .set_loss(build_loss({"name": "CrossEntropyLoss"}))
        .set_optimizer(optimizer)
        .set_dataset(classy_dataset(train), "train")
        .set_dataset(classy_dataset(Samples(16, seed=2)), "test")
        .set_num_epochs(2)
        .set_use_gpu(False)
        .set_meters([])
        .set_hooks([PreciseBatchNormHook(num_samples=20, cache_samples=cache_samples), snapshots])
    )
    LocalTrainer().train(task)

    # 20 samples in batches of 8: the first three batches of the (unshuffled) training data
    inputs = [train.x[i : i + 8] for i in (0, 8, 16)]
    assert len(snapshots.models) == 2
    for phase, model in enumerate(snapshots.models):
        saved = bn_stats(model)
        replay = copy.deepcopy(model)
        recompute(replay, inputs)
        for name, (mean, var) in bn_stats(replay).items():
            assert torch.equal(saved[name][0], mean) and torch.equal(saved[name][1], var), (phase, name)
        for name, (mean, var, _) in float64_reference(model, inputs).items():
            assert_close_exact(saved[name][0], saved[name][1], mean, var, what="phase {} {}".format(phase, name))
    assert not torch.equal(bn_stats(snapshots.models[0])["model.1"][0], bn_stats(snapshots.models[1])["model.1"][0])


def train_with(hooks: list) -> dict:
    """Two shuffled training phases of a net with dropout, with ``hooks``; the weights it ends with."""
    torch.manual_seed(0)
    net = tiny_net(dropout=0.3)
    train = ClassyDataset(Samples(40, seed=1), batchsize_per_replica=8, shuffle=True, transform=None, num_samples=None)
    train.set_num_workers(0)
    optimizer = build_optimizer(
        {"name": "sgd", "num_epochs": 2, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False,
         "param_schedulers": {"lr": {"name": "constant", "value": 0.2}}}
    )
    task = (
        ClassificationTask().set_model(ClassyModel.from_model(net)).set_loss(build_loss({"name": "CrossEntropyLoss"}))
        .set_optimizer(optimizer).set_dataset(train, "train").set_dataset(classy_dataset(Samples(16, seed=2)), "test")
        .set_num_epochs(2).set_use_gpu(False).set_meters([]).set_hooks(hooks)
    )
    LocalTrainer().train(task)
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def test_the_next_phase_trains_as_without_the_hook():
    """The pass at a phase's end draws dropout masks (and would draw augmentations) from the
    global generators: they are put back. ClassyVision's own hook leaves them drawn from."""
    from classy_vision.hooks.precise_batch_norm_hook import PreciseBatchNormHook as ClassyOwnHook

    without = train_with([])
    ours = train_with([PreciseBatchNormHook(num_samples=16)])
    theirs = train_with([ClassyOwnHook(num_samples=16)])
    assert all(torch.equal(ours[name], without[name]) for name in without)
    assert not all(torch.equal(theirs[name], without[name]) for name in without)


def test_rejects_a_bad_sample_count():
    with pytest.raises(ConfigError, match="num_samples"):
        PreciseBatchNormHook(num_samples=0)


def test_built_from_a_task_config_through_the_registry():
    from classy_vision.hooks import build_hook
    from classy_vision.hooks.precise_batch_norm_hook import PreciseBatchNormHook as ClassyOwnHook

    with pytest.warns(DeprecationWarning, match="exact is deprecated and ignored"):
        hook = build_hook({"name": "exact_precise_bn", "num_samples": 10.0, "cache_samples": True, "exact": True})
    assert isinstance(hook, PreciseBatchNormHook) and hook.cache_samples and not hasattr(hook.options, "exact")
    assert hook.options.num_samples == 10
    assert isinstance(build_hook({"name": "precise_bn", "num_samples": 10}), ClassyOwnHook)


def test_bad_values_fail_at_construction():
    with pytest.raises(ConfigError, match="num_samples"):
        PreciseBatchNormHook.from_config({})
    with pytest.raises(ConfigError, match="rtol"):
        PreciseBatchNormHook(10, rtol=5)
