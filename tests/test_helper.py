"""BatchNormHelper on the torch backend: settings, the aux view and the per-iteration cache."""
from __future__ import annotations

import copy

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from precise_bn import BatchError, BatchNormHelper, ConfigError
from reference import assert_close_exact, float64_reference


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.calls: list = []  # appended to, never rebound: a pass puts rebound attributes back

    @property
    def forwards(self) -> int:
        return len(self.calls)

    def forward(self, x):
        self.calls.append(x.shape[0])
        return self.bn(self.conv(x))


def _data(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 4, 4, generator=gen) * 2 + 1 for _ in range(n)]


def test_settings_from_config_object_and_keywords():
    cfg = SimpleNamespace(
        TRAIN=SimpleNamespace(ITER_COMPUTE_PRECISE_BN=7),
        MODEL=SimpleNamespace(BN_EPSILON=1e-4),
        NUM_GPUS=2,
        ROOT_GPU_ID=1,
        LOG_PERIOD=3,
    )
    helper = BatchNormHelper(cfg)
    assert helper.iters == 7
    assert helper.settings["bn_epsilon"] == 1e-4 and helper.settings["num_gpus"] == 2
    assert helper.settings["root_gpu_id"] == 1 and helper.settings["log_period"] == 3
    nested = {"TRAIN": {"ITER_COMPUTE_PRECISE_BN": 5}}
    assert BatchNormHelper(nested, iters=9).iters == 9
    assert BatchNormHelper(nested).iters == 5
    with pytest.raises(ConfigError, match="ITER_COMPUTE_PRECISE_BN"):
        BatchNormHelper(iters=0)
    with pytest.raises(ConfigError, match="backend"):
        BatchNormHelper(backend="tf")
    with pytest.raises(ConfigError, match="create_bn_aux_model"):
        BatchNormHelper().compute_and_update_bn_stats()


def test_cache_same_iteration_reapplies_without_forward():
    torch.manual_seed(0)
    model = Counting()
    data = _data(5)
    helper = BatchNormHelper(iters=3)
    aux = helper.create_bn_aux_model(model, data)
    assert aux.net is model  # the very module: no weight copy

    ref_mean, ref_var, _ = float64_reference(model, data[:3])["bn"]
    helper.compute_and_update_bn_stats(curr_iter=100)
    assert model.forwards == 3
    assert_close_exact(model.bn.running_mean, model.bn.running_var, ref_mean, ref_var)
    stats = (model.bn.running_mean.clone(), model.bn.running_var.clone())

    with torch.no_grad():
        model.bn.running_mean.add_(5)
        model.bn.running_var.mul_(3)
    helper.compute_and_update_bn_stats(curr_iter=100)
    assert model.forwards == 3 and helper.recomputations == 1
    assert torch.equal(model.bn.running_mean, stats[0]) and torch.equal(model.bn.running_var, stats[1])

    # A new iteration recomputes on the next batches: the source wraps around after batch 5.
    wrapped = data[3:] + data[:1]
    ref_mean, ref_var, _ = float64_reference(model, wrapped)["bn"]
    helper.compute_and_update_bn_stats(curr_iter=200)
    assert model.forwards == 6 and helper.recomputations == 2
    assert_close_exact(model.bn.running_mean, model.bn.running_var, ref_mean, ref_var)
    helper.compute_and_update_bn_stats()
    assert helper.recomputations == 3


def test_options_pass_through_to_update_bn_stats():
    model = Counting()
    helper = BatchNormHelper(iters=2, unbiased=True)
    helper.create_bn_aux_model(model, [(x, 0) for x in _data(2)])
    ref_mean, ref_var, count = float64_reference(copy.deepcopy(model), _data(2))["bn"]
    report = helper.compute_and_update_bn_stats(1)
    assert report.batches == 2
    assert_close_exact(report["bn"].new_mean, report["bn"].new_var, ref_mean, ref_var * count / (count - 1))
    with pytest.raises(ConfigError, match="data"):
        helper.create_bn_aux_model(model)


def _original_config_module(monkeypatch, iters):
    ns = SimpleNamespace
    module = types.ModuleType("core.config")
    module.config = ns(TRAIN=ns(ITER_COMPUTE_PRECISE_BN=iters), MODEL=ns(BN_EPSILON=1e-3), NUM_GPUS=4,
                       ROOT_GPU_ID=2, LOG_PERIOD=5)
    monkeypatch.setitem(sys.modules, "core.config", module)


def test_original_calls_without_its_modules_fail_at_once_with_the_replacement_line(monkeypatch):
    from precise_bn import bn_helper, helper
    from precise_bn.caffe2.original import REPLACEMENT

    monkeypatch.delitem(sys.modules, "models.model_builder_video", raising=False)
    assert helper.BatchNormHelper is bn_helper.BatchNormHelper  # the earlier import path still works
    bn_aux = bn_helper.BatchNormHelper()
    with pytest.raises(ConfigError) as info:
        bn_aux.create_bn_aux_model(node_id=0)
    message = str(info.value)
    assert "\n    " + REPLACEMENT + "\n" in message and "models.model_builder_video" in message
    assert REPLACEMENT == "bn_aux.create_bn_aux_model(train_model)"
    with pytest.raises(ConfigError, match="node_id"):
        bn_aux.create_bn_aux_model(Counting(), _data(1), node_id=0)


def test_original_global_config_is_read_when_its_module_is_loaded(monkeypatch):
    _original_config_module(monkeypatch, iters=2)
    helper = BatchNormHelper()
    assert helper.iters == 2 and helper.settings["num_gpus"] == 4 and helper.settings["bn_epsilon"] == 1e-3
    assert BatchNormHelper(iters=3).iters == 3
    model = Counting()
    helper.create_bn_aux_model(model, _data(4))
    assert helper.compute_and_update_bn_stats(0).batches == 2 and model.forwards == 2
    monkeypatch.setattr(sys.modules["core.config"], "config", SimpleNamespace(TRAIN=SimpleNamespace()))
    assert BatchNormHelper().iters == 200  # a module of that name without the original's keys is not read


def test_options_are_checked_when_the_helper_is_built():
    with pytest.raises(TypeError, match="BatchNormHelper.*'exatc'"):
        BatchNormHelper(exatc=True)
    with pytest.raises(ConfigError, match="iters"):
        BatchNormHelper(iters=0)


def test_misspelt_settings_get_the_hint_among_the_helper_settings():
    with pytest.raises(TypeError, match="BatchNormHelper.*'iter'; did you mean 'iters'"):
        BatchNormHelper(iter=3)


def test_a_dict_batch_without_forward_fn_is_a_batch_error():
    helper = BatchNormHelper(iters=2)
    helper.create_bn_aux_model(Counting(), [{"image": x} for x in _data(2)])
    with pytest.raises(BatchError, match="'image'.*forward_fn"):
        helper.compute_and_update_bn_stats(1)
