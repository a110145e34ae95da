"""ExactPreciseBNHook in a real mmengine Runner on the CPU: validation and checkpoints get the
population statistics of the weights they are taken with, over the whole training set."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import HOOKS
from mmengine.runner import Runner
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from precise_bn import ConfigError
from precise_bn.mmengine import ExactPreciseBNHook, mm_forward
from reference import assert_close_exact, float64_reference

pytestmark = pytest.mark.main_env

SAMPLES = 48


class Net(BaseModel):
    def __init__(self, data_preprocessor=None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3),
                                 nn.BatchNorm1d(3))
        self.validated = []  # BN stats each validation ran with

    def forward(self, inputs, data_samples=None, mode="tensor"):
        out = self.net(inputs)
        if mode == "loss":
            return {"loss": F.cross_entropy(out, data_samples)}
        if mode == "predict":
            return [(out, data_samples)]
        return out


class Shifted(Dataset):
    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(SAMPLES, 3, 6, 6, generator=gen) * 2 + 3
        self.y = torch.randint(0, 3, (SAMPLES,), generator=gen)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"inputs": self.x[i], "data_samples": self.y[i]}


class Accuracy(BaseMetric):
    default_prefix = "test"

    def __init__(self, model: Net):
        super().__init__()
        self.model = model

    def process(self, data_batch, data_samples):
        self.results.append(float((data_samples[0][0].argmax(1) == data_samples[0][1]).float().mean()))

    def compute_metrics(self, results):
        self.model.validated.append({k: v.clone() for k, v in self.model.state_dict().items() if "running" in k})
        return {"accuracy": sum(results) / len(results)}


def _runner(tmp_path, hook: dict, model: Net) -> Runner:
    return Runner(
        model=model, work_dir=str(tmp_path),
        train_dataloader=DataLoader(Shifted(0), batch_size=8),
        val_dataloader=DataLoader(Shifted(1), batch_size=16),
        val_evaluator=[Accuracy(model)],
        train_cfg=dict(by_epoch=True, max_epochs=2, val_interval=1),
        val_cfg=dict(),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
        custom_hooks=[hook],
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1), logger=dict(type="LoggerHook")),
        log_level=logging.WARNING, experiment_name="precise-bn-{}".format(id(model)),
    )


def _reference(state: dict):
    """The float64 population statistics of the whole training set, under ``state``'s weights,
    in the loader's batches (a layer's input depends on the batch statistics of those before)."""
    model = Net()
    model.load_state_dict(state)
    return float64_reference(model.net, Shifted(0).x.split(8))


def test_the_hook_recomputes_before_validation_and_checkpoints_in_a_real_runner(tmp_path):
    assert HOOKS.get("ExactPreciseBNHook") is ExactPreciseBNHook
    model = Net()
    runner = _runner(tmp_path, dict(type="ExactPreciseBNHook", num_samples=SAMPLES, interval=1), model)
    runner.train()
    assert len(model.validated) == 2
    for epoch, validated in enumerate(model.validated, start=1):
        saved = torch.load(str(tmp_path / "epoch_{}.pth".format(epoch)), map_location="cpu", weights_only=False)
        state = saved["state_dict"]
        ref = _reference(state)
        for name in ("1", "5"):
            mean, var = state["net.{}.running_mean".format(name)], state["net.{}.running_var".format(name)]
            assert_close_exact(mean, var, ref[name][0], ref[name][1], "epoch {} layer {}".format(epoch, name))
            assert torch.equal(validated["net.{}.running_mean".format(name)], mean)
            assert torch.equal(validated["net.{}.running_var".format(name)], var)


def test_interval_counts_epochs_and_validation_alone_changes_nothing(tmp_path):
    model = Net()
    runner = _runner(tmp_path, dict(type="ExactPreciseBNHook", num_samples=SAMPLES, interval=2), model)
    runner.train()
    first = torch.load(str(tmp_path / "epoch_1.pth"), map_location="cpu", weights_only=False)["state_dict"]
    ref = _reference(first)
    assert not torch.allclose(first["net.1.running_var"], ref["1"][1].float(), rtol=1e-3)  # epoch 1: not due
    second = torch.load(str(tmp_path / "epoch_2.pth"), map_location="cpu", weights_only=False)["state_dict"]
    ref = _reference(second)
    assert_close_exact(second["net.1.running_mean"], second["net.1.running_var"], ref["1"][0], ref["1"][1])
    fresh = Net()
    fresh.load_state_dict(first)
    before = copy.deepcopy(fresh.state_dict())
    _runner(tmp_path / "val", dict(type="ExactPreciseBNHook", num_samples=SAMPLES), fresh).val()
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


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
