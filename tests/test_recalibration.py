"""Temporary recalibration (``recalibrated``, ``report.undo()``) and source/target pooling (``prior``).

Undo is checked bit for bit against the model's own state before the call (every buffer and
parameter, value and tensor object, see ``interrupt_cases.model_state``); pooling against a
float64 reference computed over real source and target samples put together.
"""
from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from torch import nn

from factories import batches as cli_batches
from factories import trained_net
from cli_helpers import TRUST, load, run_cli
from interrupt_cases import make_batches, make_model, model_state
from precise_bn import ConfigError, UndoError, recalibrated, recompute
from precise_bn.errors import PreciseBNWarning
from precise_bn.cli.parser import build_parser
from reference import assert_close_exact, float64_reference


def _bns(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _buffers(model: nn.Module):
    return [(m.running_mean.clone(), m.running_var.clone()) for m in _bns(model)]


# --------------------------------------------------------------------------------------------
# recalibrated


def test_the_block_sees_recomputed_stats_and_leaves_the_model_bit_for_bit_as_it_was():
    model = make_model(blocks=5)
    batches = make_batches(3)
    expected = copy.deepcopy(model)
    recompute(expected, batches, progress=False)
    before = model_state(model)
    with recalibrated(model, batches, progress=False) as report:
        assert len(report.layers) == len(report) > 0
        for mine, theirs in zip(_buffers(model), _buffers(expected)):
            assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
        model.blocks(batches[0])  # a train-mode forward moves the stats and num_batches_tracked
    assert model_state(model) == before


def test_a_warning_on_entering_or_leaving_the_block_points_at_the_with_line():
    """Entering and leaving go through contextlib: the warning names the user's line, not it."""
    model, batches = make_model(blocks=2), make_batches(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        with recalibrated(model, batches, num_batches=5, progress=False):
            pass
    short = [w for w in caught if issubclass(w.category, PreciseBNWarning) and "data ran out" in str(w.message)]
    assert len(short) == 1 and (short[0].filename, short[0].lineno) == (__file__, line), \
        [(w.filename, w.lineno, str(w.message)) for w in caught]


def test_an_exception_in_the_block_restores_the_model_and_propagates():
    model = make_model(blocks=3)
    before = model_state(model)
    with pytest.raises(ZeroDivisionError):
        with recalibrated(model, make_batches(2), progress=False):
            model.blocks[0].bn.running_mean = torch.zeros(4)  # even a replaced tensor comes back
            1 / 0
    assert model_state(model) == before


def test_undo_inside_the_block_is_not_repeated_on_exit():
    model = make_model(blocks=3)
    before = model_state(model)
    with recalibrated(model, make_batches(2), progress=False) as report:
        report.undo()
        assert model_state(model) == before
        with torch.no_grad():
            model.head.running_var.fill_(3.0)  # after the undo, the block's own business
    assert torch.equal(model.head.running_var, torch.full((4,), 3.0))


def test_options_are_checked_when_given():
    model = make_model(blocks=2)
    with pytest.raises(ConfigError, match="prior"):
        recalibrated(model, make_batches(2), prior=-1)


# --------------------------------------------------------------------------------------------
# undo


def test_undo_restores_every_buffer_of_the_recomputed_layers():
    model = make_model(blocks=6)
    before = model_state(model)
    report = recompute(model, make_batches(3), progress=False)
    assert model_state(model) != before
    report.undo()
    assert model_state(model) == before
    with pytest.raises(UndoError, match="already undone"):
        report.undo()
    assert model_state(model) == before


def _in_place(model):
    model.blocks[1].bn.running_mean.add_(1.0)


def _through_data(model):
    tensor = model.blocks[1].bn.running_var
    version = tensor._version
    tensor.data.mul_(2.0)
    assert tensor._version == version  # only the bits can tell


def _replaced(model):
    model.head.running_mean = model.head.running_mean.clone()


def _loaded(model):
    model.load_state_dict(model.state_dict())  # same values, written again


def _train_step(model):
    model(make_batches(1, seed=5)[0])


def _recomputed_again(model):
    recompute(model, make_batches(2, seed=3), progress=False)


@pytest.mark.parametrize("change", [_in_place, _through_data, _replaced, _loaded, _train_step, _recomputed_again])
def test_undo_refuses_and_changes_nothing_when_the_stats_changed_since(change):
    model = make_model(blocks=4)
    report = recompute(model, make_batches(2), progress=False)
    with torch.no_grad():
        change(model)
    changed = model_state(model)
    with pytest.raises(UndoError, match=r"changed since the recalibration \(layer '.*': .*nothing was undone"):
        report.undo()
    assert model_state(model) == changed


def test_a_model_without_bn_layers_has_nothing_to_undo():
    model = nn.Sequential(nn.Linear(3, 3))
    before = model_state(model)
    report = recompute(model, [torch.randn(2, 3)], progress=False)
    report.undo()
    with recalibrated(model, [torch.randn(2, 3)], progress=False) as inside:
        assert len(inside) == 0
    assert model_state(model) == before


# --------------------------------------------------------------------------------------------
# prior: source and target pooled as samples


class ConvNet(nn.Module):
    """A conv layer then BN: a sample is 5x5 elements per channel of ``bn``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def _images(count: int, shift: float, scale: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, 7, 7, generator=gen) * scale + shift for _ in range(count // 8)]


def _set_source(model, source):
    """The running stats set to the float64 statistics of real source samples."""
    ref = float64_reference(model, source)["bn"]
    with torch.no_grad():
        model.bn.running_mean.copy_(ref[0])
        model.bn.running_var.copy_(ref[1])


@pytest.mark.parametrize("shift", [0.5, 200.0], ids=["small-shift", "large-shift"])
@pytest.mark.parametrize("prior", [8, 32, 128])
def test_prior_pools_source_and_target_as_one_population_of_samples(prior, shift):
    """The reference: source and target samples put together, one float64 two-pass. A large
    mean shift makes the between-domain term dominate the variance: robusta's mixing,
    ``p * var_s + (1 - p) * var_t``, misses it by far."""
    model = ConvNet()
    source = _images(prior, 0.0, 1.0, seed=1)
    target = _images(64, shift, 2.0, seed=2)
    _set_source(model, source)
    report = recompute(model, target, prior=prior, progress=False)
    pooled = float64_reference(model, source + target)["bn"]
    assert_close_exact(model.bn.running_mean, model.bn.running_var, pooled[0], pooled[1], "bn")
    layer = report["bn"]
    assert torch.equal(layer.new_mean.float(), model.bn.running_mean)
    target_ref = float64_reference(model, target)["bn"]
    assert_close_exact(layer.target_mean, layer.target_var, target_ref[0], target_ref[1], "bn target")
    p = prior / (prior + 64)
    robusta = p * layer.old_var + (1 - p) * target_ref[1]
    gap = ((pooled[1] - robusta) / pooled[1]).abs().max()
    assert gap > (0.5 if shift > 100 else 1e-3)


def test_drift_measures_how_far_the_target_domain_moved_from_the_source():
    model = ConvNet()
    _set_source(model, _images(32, 0.0, 1.0, seed=1))
    target = _images(64, 3.0, 1.0, seed=2)
    old_mean, old_var = model.bn.running_mean.double(), model.bn.running_var.double()
    layer = recompute(model, target, prior=1000, progress=False)["bn"]
    mean_t, var_t, _ = float64_reference(model, target)["bn"]
    expected = ((mean_t - old_mean).abs() / (var_t + layer.eps).sqrt()).max()
    assert layer.mean_drift == pytest.approx(float(expected), rel=1e-5)
    assert layer.var_drift == pytest.approx(float(((var_t - old_var).abs() / (var_t + layer.eps)).max()), rel=1e-5)
    written = ((layer.new_mean - old_mean).abs() / (layer.new_var + layer.eps).sqrt()).max()
    assert float(written) < layer.mean_drift / 5  # the prior held the written stats back


def test_prior_zero_is_plain_recompute_bit_for_bit():
    batches = make_batches(3)
    plain, pooled = make_model(blocks=4), make_model(blocks=4)
    recompute(plain, batches, progress=False)
    report = recompute(pooled, batches, prior=0, progress=False)
    assert all(torch.equal(a, b) for pair in zip(_buffers(plain), _buffers(pooled)) for a, b in zip(*pair))
    assert all(layer.target_mean is None for layer in report.layers)


def test_unbiased_applies_to_the_target_variance_before_pooling():
    """``unbiased=True``: the target's variance is ``M2 / (n - 1)`` over its elements, what a
    plain unbiased recompute writes; the source's running variance is taken as it is."""
    model = ConvNet()
    _set_source(model, _images(16, 0.0, 1.0, seed=1))
    target = _images(16, 1.0, 1.5, seed=2)
    mean_s, var_s = model.bn.running_mean.double(), model.bn.running_var.double()
    recompute(model, target, prior=16, unbiased=True, progress=False)
    mean_t, var_t, count = float64_reference(model, target)["bn"]
    var_t = var_t * count / (count - 1)
    mean = (16 * mean_s + 16 * mean_t) / 32
    var = (16 * var_s + 16 * var_t) / 32 + 16 * 16 * (mean_s - mean_t) ** 2 / 32 ** 2
    assert_close_exact(model.bn.running_mean, model.bn.running_var, mean, var, "bn")


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "8"])
def test_a_bad_prior_is_refused_when_given(bad):
    with pytest.raises(ConfigError, match="prior must be a number of samples >= 0"):
        recompute(ConvNet(), [], prior=bad)


def test_the_command_line_takes_prior(tmp_path, capsys):
    args = build_parser().parse_args(["recompute", "model.pt", "--model", "m:f", "--data", "d:f", "--prior", "16"])
    assert args.prior == 16.0
    net = trained_net()
    path, out = tmp_path / "c.pt", tmp_path / "out.pt"
    torch.save({"model": net.state_dict()}, str(path))
    assert run_cli(capsys, "recompute", path, "--model", "factories:small_net", "--data", "factories:batches",
                   "--prior", "16", "--output", out, "-q", *TRUST).returncode == 0
    state = load(out)["model"]
    data = cli_batches()
    n = sum(len(x) for x, _ in data)
    for name, (mean_t, var_t, _) in float64_reference(net, data).items():
        mean_s, var_s = net.state_dict()[name + ".running_mean"].double(), net.state_dict()[name + ".running_var"].double()
        mean = (16 * mean_s + n * mean_t) / (16 + n)
        var = (16 * var_s + n * var_t) / (16 + n) + 16 * n * (mean_s - mean_t) ** 2 / (16 + n) ** 2
        assert_close_exact(state[name + ".running_mean"], state[name + ".running_var"], mean, var, name)
