"""Generated cases (``attack_cases.py``) against the float64 reference: ``exact=True`` never
outside its bound, and the default path outside 1e-3 only in channels it names as untrusted."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from attack_cases import LAYOUTS, PATTERNS, make_case
from precise_bn import recompute
from precise_bn.errors import PreciseBNWarning
from reference import assert_close_exact, float64_reference

SEEDS = range(240)


def _run(case, exact):
    model = copy.deepcopy(case.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreciseBNWarning)
        report = recompute(model, case.batches, exact=exact, progress=False)
    return report["bn"], model.bn


def test_the_generated_cases_cover_every_layout_and_pattern():
    cases = [make_case(seed) for seed in SEEDS]
    assert {c.layout for c in cases} == set(LAYOUTS) and {c.pattern for c in cases} == set(PATTERNS)
    assert {c.reuse for c in cases} == {1, 2, 3}


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_stays_within_its_bound_and_the_default_names_what_it_may_miss(seed):
    case = make_case(seed)
    ref_mean, ref_var, count = float64_reference(case.model, case.batches)["bn"]
    layer, bn = _run(case, exact=True)
    assert layer.elements == count and not layer.untrusted, case
    assert_close_exact(layer.new_mean, layer.new_var, ref_mean, ref_var, str(case))
    assert_close_exact(bn.running_mean, bn.running_var, ref_mean, ref_var, str(case) + ", as written")

    layer, _ = _run(case, exact=False)
    live = ref_var > 0
    rel = torch.zeros_like(ref_var)
    rel[live] = (layer.new_var[live] - ref_var[live]).abs() / ref_var[live]
    missed = set(torch.nonzero(rel > 1e-3).reshape(-1).tolist())
    assert missed <= set(layer.untrusted), (str(case), rel, layer.untrusted)


# --- the reproducers, end to end


def _conv_bn():
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    with torch.no_grad():
        model[1].weight.fill_(1.0 / 3)
        model[1].bias.fill_(6000.0)
    return model


def test_a_channel_constant_on_the_first_batch_cannot_cost_exact_mode_its_bound():
    gen = torch.Generator().manual_seed(1)
    data = [torch.zeros(32, 3, 16, 16)] + [
        torch.rand(32, 3, 16, 16, generator=gen) + torch.rand(1, generator=gen) * 2 for _ in range(39)]
    model = _conv_bn()
    ref_mean, ref_var, _ = float64_reference(model, data)["2"]
    report = recompute(model, data, exact=True, progress=False)
    assert_close_exact(report["2"].new_mean, report["2"].new_var, ref_mean, ref_var, "dead first batch")


def test_channels_last_at_mean_over_std_1e4_is_named_by_default_and_exact_with_exact():
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 8, 32, 32, generator=gen) + 1e4).contiguous(memory_format=torch.channels_last)
            for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(8))
    ref_mean, ref_var, _ = float64_reference(model, data)["0"]
    with pytest.warns(PreciseBNWarning, match=r"in 1 layer\(s\).*0 \(channels 0, 1, .*exact=True"):
        report = recompute(copy.deepcopy(model), data, progress=False)
    assert report["0"].untrusted == list(range(8))
    report = recompute(model, data, exact=True, progress=False)
    assert not report["0"].untrusted
    assert_close_exact(report["0"].new_mean, report["0"].new_var, ref_mean, ref_var, "channels-last 1e4")


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
    for exact in (False, True):
        report = recompute(copy.deepcopy(model), data, exact=exact, progress=False)
        assert_close_exact(report["bn"].new_mean, report["bn"].new_var, ref_mean, ref_var, "exact={}".format(exact))


@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("exact", [False, True])
def test_statistics_beyond_float32_raise_and_write_nothing(layout, exact):
    from precise_bn.errors import NonFiniteStatsError

    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(4, 3, 5, 5, generator=gen) * 1e20 for _ in range(3)]
    if layout == "channels-last":
        data = [x.contiguous(memory_format=torch.channels_last) for x in data]
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NonFiniteStatsError, match="'0'"):
        recompute(model, data, exact=exact, progress=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
