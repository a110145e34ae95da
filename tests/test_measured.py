"""The default path on the inputs that broke the kernel's statistics: bfloat16, float16 and float64
models, autocast, a naive BN subclass, channels-last, constant channels with a rare jump; every
written buffer the float64 population statistics correctly rounded, and an ordinary run quiet."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from attack_cases import NaiveBatchNorm1d
from precise_bn import recompute
from reference import assert_close_exact, float64_reference

pytestmark = pytest.mark.main_env

torchvision = pytest.importorskip("torchvision")


def _check_all(model, written, data, autocast=None):
    reference = float64_reference(model, data, autocast=autocast)
    layers = dict(written.named_modules())
    assert reference and set(reference) <= set(layers)
    for name, (mean, var, _) in reference.items():
        assert_close_exact(layers[name].running_mean, layers[name].running_var, mean, var, name)


def _quiet_recompute(model, data, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        return recompute(model, data, progress=False, **options)


def _images(count, batch, size, seed=0, channels_last=False):
    gen = torch.Generator().manual_seed(seed)
    data = [torch.randn(batch, 3, size, size, generator=gen) for _ in range(count)]
    return [x.contiguous(memory_format=torch.channels_last) for x in data] if channels_last else data


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["float32", "bf16 autocast"])
def test_resnet18_channels_last_is_exact_and_draws_no_warning(autocast):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(memory_format=torch.channels_last).train()
    data = _images(3, 4, 48, channels_last=True)
    written = copy.deepcopy(model)
    _quiet_recompute(written, data, autocast=autocast)
    _check_all(model, written, data, autocast=autocast)


def _conv_bn(channels=16):
    return nn.Sequential(nn.Conv2d(3, channels, 3), nn.BatchNorm2d(channels), nn.ReLU(),
                         nn.Conv2d(channels, channels, 3), nn.BatchNorm2d(channels))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_low_or_high_precision_model_gets_its_statistics_correctly_rounded(dtype):
    torch.manual_seed(1)
    model = _conv_bn().to(dtype)
    data = [x.to(dtype) for x in _images(4, 8, 12, seed=1)]
    written = copy.deepcopy(model)
    _quiet_recompute(written, data)
    _check_all(model, written, data)


def test_half_batchnorm1d_rows_far_from_zero():
    gen = torch.Generator().manual_seed(2)
    ratios = torch.linspace(1, 60, 64)
    data = [(torch.randn(256, 64, generator=gen) + ratios).half() for _ in range(8)]
    model = nn.Sequential(nn.BatchNorm1d(64)).half()
    written = copy.deepcopy(model)
    _quiet_recompute(written, data)
    _check_all(model, written, data)


def test_a_subclass_computing_the_naive_variance_in_float32_is_measured_from_its_input():
    gen = torch.Generator().manual_seed(3)
    ratios = torch.linspace(175, 250, 32)
    data = [torch.randn(512, 32, generator=gen) + ratios for _ in range(8)]
    model = nn.Sequential(NaiveBatchNorm1d(32))
    written = copy.deepcopy(model)
    _quiet_recompute(written, data)
    _check_all(model, written, data)


def test_constant_channels_stay_exactly_0_in_channels_last_until_their_rare_jump():
    gen = torch.Generator().manual_seed(4)
    data = []
    for i in range(12):
        x = torch.randn(16, 4, 9, 9, generator=gen)
        x[:, 1:] = 3.7
        if i == 11:
            x[3, 2, 4, 4] = 50.0
        data.append(x.contiguous(memory_format=torch.channels_last))
    model = nn.Sequential(nn.BatchNorm2d(4))
    report = _quiet_recompute(copy.deepcopy(model), data[:11])
    assert report["0"].new_var[1:].tolist() == [0.0, 0.0, 0.0]  # dead so far: rtol's dead-channel rule holds
    written = copy.deepcopy(model)
    _quiet_recompute(written, data)
    assert written[0].running_var[1] == 0 and written[0].running_var[3] == 0 and written[0].running_var[2] > 0
    _check_all(model, written, data)
