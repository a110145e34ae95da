"""Generated cases (``attack_cases.py``) against the float64 reference: the written statistics are
the float64 population statistics, correctly rounded into the buffers, in every layout, model dtype
and BN class."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from attack_cases import DTYPES, KINDS, LAYOUTS, PATTERNS, make_case
from precise_bn import recompute
from precise_bn.errors import PreciseBNWarning
from reference import assert_close_exact, float64_reference

SEEDS = range(300)


def test_the_generated_cases_cover_every_layout_pattern_dtype_and_kind():
    cases = [make_case(seed) for seed in SEEDS]
    assert {c.layout for c in cases} == set(LAYOUTS) and {c.pattern for c in cases} == set(PATTERNS)
    assert {c.reuse for c in cases} == {1, 2, 3}
    assert {c.dtype for c in cases} == set(DTYPES) and {c.kind for c in cases} == set(KINDS)
    assert {(c.dtype, c.layout) for c in cases} >= {(d, lay) for d in DTYPES for lay in LAYOUTS}


@pytest.mark.parametrize("seed", SEEDS)
def test_the_written_statistics_are_the_float64_ones_correctly_rounded(seed):
    case = make_case(seed)
    try:
        float64_reference(case.model, case.batches[:1], autocast=case.autocast)
    except RuntimeError:  # torch 1.10 has no CPU batch_norm for bfloat16 or float16: neither have we
        with pytest.raises(RuntimeError, match="not implemented"):
            recompute(copy.deepcopy(case.model), case.batches, autocast=case.autocast, progress=False)
        return
    ref_mean, ref_var, count = float64_reference(case.model, case.batches, autocast=case.autocast)[case.bn_name]
    model = copy.deepcopy(case.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreciseBNWarning)
        report = recompute(model, case.batches, autocast=case.autocast, progress=False)
    layer, bn = report[case.bn_name], model.get_submodule(case.bn_name)
    assert layer.elements == count, case
    assert_close_exact(layer.new_mean, layer.new_var, ref_mean, ref_var, str(case))
    assert_close_exact(bn.running_mean, bn.running_var, ref_mean, ref_var, str(case) + ", as written")


# --- the reproducers, end to end


def _conv_bn():
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    with torch.no_grad():
        model[1].weight.fill_(1.0 / 3)
        model[1].bias.fill_(6000.0)
    return model


def test_a_channel_constant_on_the_first_batch_cannot_cost_the_bound():
    gen = torch.Generator().manual_seed(1)
    data = [torch.zeros(32, 3, 16, 16)] + [
        torch.rand(32, 3, 16, 16, generator=gen) + torch.rand(1, generator=gen) * 2 for _ in range(39)]
    model = _conv_bn()
    ref_mean, ref_var, _ = float64_reference(model, data)["2"]
    report = recompute(model, data, progress=False)
    assert_close_exact(report["2"].new_mean, report["2"].new_var, ref_mean, ref_var, "dead first batch")


def test_channels_last_at_mean_over_std_1e4_is_exact_and_draws_no_warning():
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 8, 32, 32, generator=gen) + 1e4).contiguous(memory_format=torch.channels_last)
            for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(8))
    ref_mean, ref_var, _ = float64_reference(model, data)["0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = recompute(model, data, progress=False)
    assert_close_exact(report["0"].new_mean, report["0"].new_var, ref_mean, ref_var, "channels-last 1e4")
    assert_close_exact(model[0].running_mean, model[0].running_var, ref_mean, ref_var, "channels-last 1e4, written")


class _Subclass(torch.nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x)


class _SetsMomentum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = _Subclass(4)

    def forward(self, x):
        self.bn.momentum = None  # a cumulative average, chosen by the model's own forward
        return self.bn(self.conv(x))


def test_a_model_that_sets_its_layers_momentum_in_forward_gets_exact_statistics():
    gen = torch.Generator().manual_seed(2)
    data = [torch.randn(4, 3, 8, 8, generator=gen) + i for i in range(6)]
    model = _SetsMomentum()
    ref_mean, ref_var, _ = float64_reference(model, data)["bn"]
    report = recompute(copy.deepcopy(model), data, progress=False)
    assert_close_exact(report["bn"].new_mean, report["bn"].new_var, ref_mean, ref_var, "momentum set in forward")


@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
def test_statistics_beyond_float32_raise_and_write_nothing(layout):
    from precise_bn.errors import NonFiniteStatsError

    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(4, 3, 5, 5, generator=gen) * 1e20 for _ in range(3)]
    if layout == "channels-last":
        data = [x.contiguous(memory_format=torch.channels_last) for x in data]
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NonFiniteStatsError, match="'0'"):
        recompute(model, data, progress=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
