"""Split BN: SlowFast's SubBatchNorm3d (its code as SlowFast has it, which is not installed
here) and timm's SplitBatchNorm2d. The recipe of docs/integrations.md ("Split BatchNorm") gives
the float64 statistics of the layers' inputs; an eval-mode model gets one warning saying so."""
from __future__ import annotations

import copy
import warnings
from typing import Dict, List

import pytest
import torch
from torch import nn

from precise_bn import PreciseBNWarning, recompute
from reference import assert_close_exact


class SubBatchNorm3d(nn.Module):
    """SlowFast's ``slowfast/models/batchnorm_helper.py`` class: BN statistics per split of the
    batch (``split_bn``, in training) and their aggregate (``bn``, in eval mode)."""

    def __init__(self, num_splits: int, **args):
        super().__init__()
        self.num_splits = num_splits
        num_features = args["num_features"]
        if args.get("affine", True):
            self.affine = True
            args["affine"] = False
            self.weight = nn.Parameter(torch.ones(num_features))
            self.bias = nn.Parameter(torch.zeros(num_features))
        else:
            self.affine = False
            args["affine"] = False
        self.bn = nn.BatchNorm3d(**args)
        args["num_features"] = num_features * num_splits
        self.split_bn = nn.BatchNorm3d(**args)

    def _get_aggregated_mean_std(self, means, stds, n):
        mean = means.view(n, -1).sum(0) / n
        std = stds.view(n, -1).sum(0) / n + ((means.view(n, -1) - mean) ** 2).view(n, -1).sum(0) / n
        return mean.detach(), std.detach()

    def aggregate_stats(self):
        if self.split_bn.track_running_stats:
            (self.bn.running_mean.data, self.bn.running_var.data) = self._get_aggregated_mean_std(
                self.split_bn.running_mean, self.split_bn.running_var, self.num_splits)

    def forward(self, x):
        if self.training:
            n, c, t, h, w = x.shape
            x = x.view(n // self.num_splits, c * self.num_splits, t, h, w)
            x = self.split_bn(x)
            x = x.view(n, c, t, h, w)
        else:
            x = self.bn(x)
        if self.affine:
            x = x * self.weight.view((-1, 1, 1, 1))
            x = x + self.bias.view((-1, 1, 1, 1))
        return x


def aggregate_sub_bn_stats(module: nn.Module) -> int:
    """SlowFast's ``slowfast/utils/misc.py`` function."""
    count = 0
    for child in module.children():
        if isinstance(child, SubBatchNorm3d):
            child.aggregate_stats()
            count += 1
        else:
            count += aggregate_sub_bn_stats(child)
    return count


def slowfast_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(3, 4, 1), SubBatchNorm3d(2, num_features=4), nn.ReLU(),
                         nn.Conv3d(4, 5, 1), SubBatchNorm3d(2, num_features=5)).double()


def clips(dtype: torch.dtype = torch.float64) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 2, 3, 3, generator=generator) * 2 + 1).to(dtype) for _ in range(3)]


def inputs_of(model: nn.Module, kind: type, batches: List[torch.Tensor]) -> Dict[str, List[torch.Tensor]]:
    """Every input of each ``kind`` module of a train-mode copy of ``model``, in float64, by name."""
    copied = copy.deepcopy(model).train()
    seen: Dict[str, List[torch.Tensor]] = {}
    for name, module in copied.named_modules():
        if isinstance(module, kind):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, []).append(
                args[0].detach().double()))
    with torch.no_grad():
        for batch in batches:
            copied(batch)
    return seen


def population(inputs: List[torch.Tensor]):
    """Float64 per-channel mean and population variance of all elements of ``inputs``."""
    x = torch.cat([i.transpose(0, 1).reshape(i.shape[1], -1) for i in inputs], dim=1)
    mean = x.mean(dim=1)
    return mean, ((x - mean[:, None]) ** 2).mean(dim=1)


def split_warnings(caught: List[warnings.WarningMessage]) -> List[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, PreciseBNWarning) and "split BatchNorm" in str(w.message)]


def test_subbatchnorm3d_recipe_train_mode_then_aggregate_gives_the_float64_statistics():
    model = slowfast_net()
    data = clips()
    reference = inputs_of(model, SubBatchNorm3d, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recompute(model, data)
    assert not split_warnings(caught)
    assert aggregate_sub_bn_stats(model) == 2
    modules = dict(model.named_modules())
    for name, inputs in reference.items():
        mean, var = population(inputs)
        layer = modules[name].bn
        assert_close_exact(layer.running_mean, layer.running_var, mean, var, name)


def test_an_eval_mode_model_with_subbatchnorm3d_gets_one_warning_saying_what_to_do():
    model = slowfast_net().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recompute(model, clips())
    found = split_warnings(caught)
    assert len(found) == 1, found
    message = str(found[0].message)
    assert message.startswith("Sequential is in eval mode and has split BatchNorm: 2 modules ('1', '4') with a "
                              "`bn` and a `split_bn` (SlowFast's SubBatchNorm3d)"), message
    assert "Recompute with the model in train mode, then call aggregate_sub_bn_stats(model)" in message
    assert found[0].filename == __file__, "the warning names the caller's line"


@pytest.mark.main_env
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_timm_split_batchnorm2d_train_mode_is_measured_per_split_and_eval_mode_warns(mode):
    from timm.layers import SplitBatchNorm2d, convert_splitbn_model

    torch.manual_seed(0)
    model = convert_splitbn_model(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(),
                                                nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)), num_splits=2)
    model.train(mode == "train")
    data = [x[:, :, 0] for x in clips(torch.float32)]
    reference = inputs_of(model, SplitBatchNorm2d, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recompute(model, data)
    found = split_warnings(caught)
    if mode == "eval":
        assert len(found) == 1, found
        message = str(found[0].message)
        assert "2 modules ('1', '4') with `aux_bn` (timm's SplitBatchNorm2d)" in message, message
        assert "train mode on batches built as in training" in message, message
        return
    assert not found
    modules = dict(model.named_modules())
    for name, inputs in reference.items():
        halves = [x.split(x.shape[0] // 2) for x in inputs]
        for layer, part in ((modules[name], 0), (modules[name].aux_bn[0], 1)):
            mean, var = population([h[part] for h in halves])
            assert_close_exact(layer.running_mean, layer.running_var, mean, var, "{} split {}".format(name, part))
