"""recompute() against a float64 two-pass reference of every BN input of every call."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from precise_bn import (
    ConfigError,
    EmptyDataError,
    LayerError,
    NonFiniteStatsError,
    PreciseBNWarning,
    get_bn_modules,
    update_bn,
    update_bn_stats,
    recompute,
)
from reference import assert_close_exact, float64_reference

C = 5
HUGE = 0  # channel whose mean is 1e4 times its std
DEAD = 1  # channel with variance exactly 0


def make_batches(shapes, seed=0, huge=True, dead=True):
    """Batches of shape (N, C, *spatial) with per-channel means/stds, a huge and a dead channel."""
    gen = torch.Generator().manual_seed(seed)
    means = torch.tensor([1e4, 3.5, -2.0, 0.5, 40.0])
    stds = torch.tensor([1.0, 0.0, 0.3, 2.0, 5.0])
    if not huge:
        means[HUGE] = 1.0
    if not dead:
        stds[DEAD] = 1.0
    out = []
    for shape in shapes:
        x = torch.randn(*shape, generator=gen)
        view = [1, C] + [1] * (len(shape) - 2)
        out.append(x * stds.view(view) + means.view(view))
    return out


class BNOnly(nn.Module):
    """Feeds the batch straight into the BN layer, so the reference is the data itself."""

    def __init__(self, bn: nn.Module):
        super().__init__()
        self.bn = bn

    def forward(self, x):
        return self.bn(x)


class SubclassedBN(nn.BatchNorm2d):
    pass


def _syncbn_runs_on_cpu() -> bool:
    """torch < 1.13 refuses SyncBatchNorm on CPU tensors even without a process group."""
    try:
        with torch.no_grad():
            nn.SyncBatchNorm(2)(torch.zeros(2, 2, 1, 1))
    except ValueError:
        return False
    return True


KINDS = {
    "bn1d_nc": (lambda: nn.BatchNorm1d(C), [(7, C), (9, C), (3, C)]),
    "bn1d_ncl": (lambda: nn.BatchNorm1d(C), [(4, C, 6), (4, C, 6), (1, C, 9)]),
    "bn2d": (lambda: nn.BatchNorm2d(C), [(4, C, 5, 5), (4, C, 5, 5), (3, C, 5, 5)]),
    "bn3d": (lambda: nn.BatchNorm3d(C), [(2, C, 3, 4, 4), (2, C, 3, 4, 4), (1, C, 3, 4, 4)]),
    "subclass": (lambda: SubclassedBN(C), [(4, C, 3, 3), (5, C, 3, 3)]),
    "batch1_spatial": (lambda: nn.BatchNorm2d(C), [(1, C, 6, 6), (1, C, 6, 6), (1, C, 4, 4)]),
}
if _syncbn_runs_on_cpu():
    KINDS["syncbn"] = (lambda: nn.SyncBatchNorm(C), [(4, C, 5, 5), (2, C, 5, 5)])


def _buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_bn_kind_matches_float64_reference(kind):
    factory, shapes = KINDS[kind]
    model = BNOnly(factory())
    batches = make_batches(shapes)
    ref_mean, ref_var, count = float64_reference(model, batches)["bn"]
    report = recompute(model, batches, num_batches=len(batches))
    layer = report["bn"]
    assert layer.elements == count and layer.calls == len(batches)
    assert_close_exact(layer.new_mean, layer.new_var, ref_mean, ref_var, kind + " (float64 result)")
    assert_close_exact(model.bn.running_mean, model.bn.running_var, ref_mean, ref_var, kind + " (buffers)")
    assert model.bn.running_var[DEAD].item() == 0.0


def test_exact_is_a_no_op_kept_for_existing_calls():
    factory, shapes = KINDS[sorted(KINDS)[0]]
    batches = make_batches(shapes)
    written = []
    for given in ({}, {"exact": True}, {"exact": False}):
        torch.manual_seed(0)
        model = BNOnly(factory())
        with pytest.warns(DeprecationWarning, match="exact is deprecated and ignored") if given else \
                warnings.catch_warnings():
            recompute(model, batches, **given)
        written.append(model.state_dict())
    assert all(torch.equal(written[0][key], other[key]) for other in written[1:] for key in written[0])


def test_lazy_bn_once_materialised_and_refused_before():
    lazy = BNOnly(nn.LazyBatchNorm2d())
    batches = make_batches([(3, C, 4, 4), (2, C, 4, 4)])
    with pytest.raises(LayerError, match="bn.*materialised"):
        recompute(lazy, batches, num_batches=2)
    with torch.no_grad():
        lazy(batches[0])
    ref_mean, ref_var, _ = float64_reference(lazy, batches)["bn"]
    recompute(lazy, batches, num_batches=2)
    assert_close_exact(lazy.bn.running_mean, lazy.bn.running_var, ref_mean, ref_var)


class Network(nn.Module):
    """A small CNN with a reused BN layer, a branch used only on even batch sizes, a dead branch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.shared = nn.BatchNorm2d(6)
        self.branch = nn.BatchNorm2d(6)
        self.never = nn.BatchNorm2d(6)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(6, 3)
        self.bn_head = nn.BatchNorm1d(3)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv(x)))
        x = self.shared(torch.relu(self.shared(x)))  # reused: two calls per forward
        if x.shape[0] % 2 == 0:
            x = self.branch(x)
        x = self.drop(x.mean((2, 3)))
        return self.bn_head(self.head(x))


def _network_and_batches(seed=0):
    torch.manual_seed(seed)
    model = Network()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
                module.momentum = 0.3
    batches = make_batches([(4, C, 6, 6), (3, C, 6, 6), (4, C, 6, 6), (2, C, 6, 6), (5, C, 6, 6)], seed)
    return model, batches


def test_reused_partly_used_and_unused_layers():
    model, batches = _network_and_batches()
    model.drop.eval()  # the reference and the pass must see the same activations
    before = _buffers(model)
    ref = float64_reference(model, batches)
    with pytest.warns(PreciseBNWarning, match="never"):
        report = recompute(model, batches, num_batches=10)
    check = assert_close_exact
    for name in ("bn1", "shared", "branch", "bn_head"):
        mean, var, count = ref[name]
        check(report[name].new_mean, report[name].new_var, mean, var, name)
        assert report[name].elements == count
    assert report["shared"].calls == 2 * len(batches)
    assert report["branch"].calls == 3
    assert report.unused == ["never"]
    for key in ("never.running_mean", "never.running_var", "never.num_batches_tracked"):
        assert torch.equal(model.state_dict()[key], before[key])
    assert "never ran" in str(report) and "shared" in str(report)


def test_state_is_restored_and_references_see_new_stats():
    model, batches = _network_and_batches()
    model.drop.train()
    held = model.bn1.running_var
    before = _buffers(model)
    recompute(model, batches, num_batches=5)
    assert model.bn1.running_var is held
    assert not torch.equal(held, before["bn1.running_var"])
    for name, module in model.named_modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, name
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            assert module.momentum == 0.3 and module.training
            assert torch.equal(module.num_batches_tracked, before[name + ".num_batches_tracked"])
    assert model.drop.training
    for p, q in zip(model.parameters(), _network_and_batches()[0].parameters()):
        assert torch.equal(p, q)


def test_report_of_a_float64_layer_keeps_its_old_stats_apart_from_the_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).double()
    batches = [torch.randn(4, 3, 6, 6, dtype=torch.float64) * 3 + 2 for _ in range(3)]
    old_mean, old_var = model[1].running_mean.clone(), model[1].running_var.clone()
    layer = recompute(model, batches, progress=False).layers[0]
    assert torch.equal(layer.old_mean, old_mean) and torch.equal(layer.old_var, old_var)
    assert layer.old_mean.data_ptr() != model[1].running_mean.data_ptr()
    assert torch.equal(layer.new_mean, model[1].running_mean) and layer.mean_drift > 0.1


def test_eval_mode_model_recomputes_all_layers_and_stays_in_eval():
    model, batches = _network_and_batches()
    model.eval()
    ref = float64_reference(model, batches)
    with pytest.warns(PreciseBNWarning):
        report = recompute(model, batches, num_batches=5)
    assert {layer.name for layer in report.layers} == {"bn1", "shared", "branch", "never", "bn_head"}
    mean, var, _ = ref["bn1"]
    assert_close_exact(model.bn1.running_mean, model.bn1.running_var, mean, var)
    assert not any(m.training for m in model.modules())


def test_only_training_layers_by_default_and_explicit_lists():
    model, batches = _network_and_batches()
    model.bn1.eval()
    assert model.bn1 not in get_bn_modules(model)
    before = model.bn1.running_mean.clone()
    with pytest.warns(PreciseBNWarning):
        report = recompute(model, batches, num_batches=2)
    assert "bn1" not in {layer.name for layer in report.layers}
    assert torch.equal(model.bn1.running_mean, before)
    report = recompute(model, batches, num_batches=2, layers=["bn1", model.bn_head])
    assert [layer.name for layer in report.layers] == ["bn1", "bn_head"]
    assert not torch.equal(model.bn1.running_mean, before) and not model.bn1.training
    with pytest.raises(ConfigError, match="conv"):
        recompute(model, batches, layers=["conv"])
    with pytest.raises(ConfigError, match="nope"):
        recompute(model, batches, layers=["nope"])


def test_untracked_and_frozen_layers_are_skipped():
    model = nn.Sequential(nn.BatchNorm2d(C, track_running_stats=False), nn.BatchNorm2d(C))
    report = recompute(model, make_batches([(2, C, 3, 3)]), num_batches=1)
    assert [layer.name for layer in report.layers] == ["1"]


@pytest.mark.parametrize("wrap", ["tuple", "list", "dict", "forward_fn"])
def test_batch_conventions(wrap):
    model = BNOnly(nn.BatchNorm2d(C))
    batches = make_batches([(3, C, 4, 4), (2, C, 4, 4)], huge=False)
    ref_mean, ref_var, _ = float64_reference(model, batches)["bn"]
    if wrap == "tuple":
        data = [(x, torch.zeros(len(x))) for x in batches]
        kwargs = {}
    elif wrap == "list":
        data = [[x, "meta"] for x in batches]
        kwargs = {}
    elif wrap == "dict":
        data = [{"input": x, "target": 0} for x in batches]
        kwargs = {}
    else:
        data = [{"pixels": x} for x in batches]
        kwargs = {"forward_fn": lambda m, b: m(b["pixels"])}
    report = recompute(model, data, num_batches=2, **kwargs)
    assert report.samples == 5
    assert_close_exact(model.bn.running_mean, model.bn.running_var, ref_mean, ref_var)


def test_num_samples_budget_and_short_loader_warning():
    model = BNOnly(nn.BatchNorm2d(C))
    batches = make_batches([(4, C, 2, 2)] * 5, huge=False)
    report = recompute(model, batches, num_samples=10)
    assert report.batches == 3 and report.samples == 12
    ref_mean, ref_var, _ = float64_reference(model, batches[:3])["bn"]
    assert_close_exact(model.bn.running_mean, model.bn.running_var, ref_mean, ref_var)
    with pytest.warns(PreciseBNWarning, match=r"5 batches.*num_batches=8"):
        assert recompute(model, batches, num_batches=8).batches == 5
    with pytest.warns(PreciseBNWarning, match=r"20 samples.*num_samples=100"):
        recompute(model, batches, num_samples=100)
    with pytest.raises(ConfigError, match="num_batches"):
        recompute(model, batches, num_batches=0)


def test_a_short_loader_says_whether_its_budget_was_asked_for_or_a_default():
    """fvcore's ``update_bn_stats(model, loader)`` reads up to 200 batches by default: a loader of
    one batch is told it fell short of the default, naming the argument, not of a budget the
    caller never gave; a budget given, even 200, was asked for."""
    model = BNOnly(nn.BatchNorm2d(C))
    one = make_batches([(4, C, 2, 2)], huge=False)
    for call, says in [
        (lambda: update_bn_stats(model, one), "after 1 batch, before the default num_iters=200 (num_iters was not "
                                              "given: pass it to set the budget)"),
        (lambda: update_bn_stats(model, one, num_iters=200), "after 1 batch; num_iters=200 was asked for"),
        (lambda: recompute(model, one, num_batches=200), "after 1 batch; num_batches=200 was asked for"),
    ]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        short = [str(w.message) for w in caught if "ran out" in str(w.message)]
        assert len(short) == 1 and short[0] == "the data ran out " + says, short


def test_stop_names_what_ran_out():
    model = BNOnly(nn.BatchNorm2d(C))
    batches = make_batches([(4, C, 2, 2)] * 5, huge=False)
    for options, stop, words in [({"num_batches": 2}, "num_batches", "num_batches batches were read"),
                                 ({"num_samples": 10}, "num_samples", "num_samples samples were read"),
                                 ({}, "data", "the data ran out")]:
        report = recompute(model, batches, **options)
        assert report.stop == stop and report.to_dict()["stop"] == stop
        assert "stopped: {};".format(words) in str(report) and "budget" not in str(report)


def test_a_budget_below_min_batches_warns_before_the_pass_that_rtol_is_never_checked():
    model = BNOnly(nn.BatchNorm2d(C))
    batches = make_batches([(4, C, 2, 2)] * 8, huge=False)
    at_first_batch = []

    def loader():
        at_first_batch.append([str(w.message) for w in caught])
        yield from batches

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = recompute(model, loader(), rtol=0.1, num_batches=4)
    assert at_first_batch == [["rtol=0.1 will never be checked: num_batches=4 gives 4 batches, fewer than "
                               "min_batches=16; read more or lower min_batches"]]
    assert report.stop == "num_batches"
    assert "rtol=0.1 was not checked: 4 batches were read, fewer than min_batches=16" in str(caught[-1].message)
    loader_ = torch.utils.data.DataLoader(torch.cat(batches), batch_size=4)
    with pytest.warns(PreciseBNWarning, match=r"num_samples=20 in batches of 4 gives 5 batches"):
        recompute(model, loader_, rtol=0.1, num_samples=20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recompute(model, loader_, rtol=0.1, num_samples=20, min_batches=5)
        recompute(model, batches, num_batches=4)
    assert [str(w.message).split(":")[0] for w in caught] == ["rtol=0.1 not reached after 5 batches (stopped"]


def test_empty_loader_raises_before_touching_anything():
    model, _ = _network_and_batches()
    before = _buffers(model)
    with pytest.raises(EmptyDataError):
        recompute(model, [], num_batches=3)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks for m in model.modules())


class Boom(Exception):
    pass


def _failing(batches, at, exc):
    for i, batch in enumerate(batches):
        if i == at:
            raise exc
        yield batch


@pytest.mark.parametrize("exc", [Boom("data broke"), KeyboardInterrupt()], ids=["exception", "interrupt"])
def test_failure_mid_pass_leaves_model_exactly_as_it_was(exc):
    model, batches = _network_and_batches()
    model.bn_head.eval()
    before = _buffers(model)
    flags = {n: (m.training, getattr(m, "momentum", None)) for n, m in model.named_modules()}
    with pytest.raises(type(exc)):
        recompute(model, _failing(batches, 3, exc), num_batches=10)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert flags == {n: (m.training, getattr(m, "momentum", None)) for n, m in model.named_modules()}
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_exception_in_forward_fn_restores_state():
    model, batches = _network_and_batches()
    before = _buffers(model)
    calls = []

    def forward_fn(m, batch):
        calls.append(1)
        m(batch)
        if len(calls) == 2:
            raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError, match="forward failed"):
        recompute(model, batches, num_batches=5, forward_fn=forward_fn)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_nan_batch_raises_naming_layer_and_changes_nothing():
    model, batches = _network_and_batches()
    before = _buffers(model)
    batches[2] = batches[2].clone()
    batches[2][0, 2, 1, 1] = float("nan")
    with pytest.raises(NonFiniteStatsError, match="bn1"):
        recompute(model, batches, num_batches=5)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_nan_in_old_buffers_does_not_leak():
    model = BNOnly(nn.BatchNorm2d(C))
    model.bn.running_var.fill_(float("nan"))
    model.bn.running_mean.fill_(float("inf"))
    batches = make_batches([(2, C, 3, 3), (3, C, 3, 3)])
    ref_mean, ref_var, _ = float64_reference(model, batches)["bn"]
    recompute(model, batches, num_batches=2)
    assert_close_exact(model.bn.running_mean, model.bn.running_var, ref_mean, ref_var)


def test_unbiased_option_and_momentum_none():
    model = BNOnly(nn.BatchNorm2d(C, momentum=None))
    batches = make_batches([(2, C, 3, 3), (3, C, 3, 3)], huge=False)
    ref_mean, ref_var, count = float64_reference(model, batches)["bn"]
    report = recompute(model, batches, num_batches=2, unbiased=True)
    assert_close_exact(report["bn"].new_mean, report["bn"].new_var, ref_mean, ref_var * count / (count - 1))
    assert model.bn.momentum is None


def test_ddp_like_wrapper_is_unwrapped_and_device_moves_batches():
    model = BNOnly(nn.BatchNorm2d(C))
    batches = make_batches([(2, C, 3, 3), (3, C, 3, 3)], huge=False)
    ref_mean, ref_var, _ = float64_reference(model, batches)["bn"]
    report = recompute(model, [(x.double(), 0) for x in batches], num_batches=2,
                             forward_fn=lambda m, b: m(b[0].float()), device="cpu")
    assert report.batches == 2
    assert_close_exact(model.bn.running_mean, model.bn.running_var, ref_mean, ref_var)


def test_autocast_keeps_bn_in_float32():
    model = nn.Sequential(nn.Conv2d(C, 4, 1), nn.BatchNorm2d(4))
    batches = make_batches([(2, C, 3, 3), (3, C, 3, 3)], huge=False, dead=False)
    report = recompute(model, batches, num_batches=2, autocast=torch.bfloat16)
    assert model[1].running_mean.dtype == torch.float32
    # bfloat16 convolutions: compare with the float64 statistics of the autocast activations.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        acts = torch.cat([model[0](x).double().transpose(0, 1).reshape(4, -1) for x in batches], 1)
    torch.testing.assert_close(report["1"].new_mean, acts.mean(1), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(report["1"].new_var, acts.var(1, unbiased=False), rtol=1e-9, atol=1e-9)


def test_progress_bar_and_logging(caplog, capsys):
    model = BNOnly(nn.BatchNorm2d(C))
    batches = make_batches([(2, C, 3, 3)] * 4, huge=False)
    with caplog.at_level("INFO", logger="precise_bn"):
        recompute(model, batches, num_batches=4, progress=False, log_period=2)
    text = caplog.text
    assert "measuring 1 BatchNorm layer " in text and "s/batch" in text and "4 batches" in text
    assert capsys.readouterr().err == ""
    # The bar's total is what will really be read: the loader's length, not a larger budget.
    recompute(model, batches, num_batches=200, progress=True)
    err = capsys.readouterr().err
    assert "4/4" in err and "/200" not in err
    recompute(model, batches, num_samples=6, progress=True)  # in batches too: 3 of 2 samples
    assert "3/3 [" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="progress"):
        recompute(model, batches, progress="bar")


def test_update_bn_drop_in_covers_whole_loader_and_all_layers():
    model, batches = _network_and_batches()
    model.drop.eval()
    model.bn1.eval()
    ref = float64_reference(model, batches)
    data = [(x, torch.zeros(len(x))) for x in batches] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreciseBNWarning)
        report = update_bn(data, model)
    assert report.batches == 3 * len(batches)
    mean, var, _ = ref["bn1"]
    assert_close_exact(model.bn1.running_mean, model.bn1.running_var, mean, var)
    assert not model.bn1.training


def test_report_drift_and_json():
    model = BNOnly(nn.BatchNorm2d(C))
    batches = make_batches([(3, C, 3, 3)] * 2, huge=False)
    report = recompute(model, batches, num_batches=2)
    layer = report["bn"]
    expected = ((layer.new_mean - layer.old_mean).abs() / (layer.new_var + model.bn.eps).sqrt()).max()
    assert layer.mean_drift == pytest.approx(float(expected))
    data = report.to_dict()
    assert data["layers"][0]["name"] == "bn" and data["batches"] == 2
    assert math.isfinite(data["layers"][0]["var_drift"])


def test_channels_whose_standard_errors_cannot_be_trusted_are_reported():
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, C, 2, 2, generator=gen) for _ in range(32)]
    batches[7][0, 2] += 500.0  # one sample far out in channel 2: one call carries its spread
    report = recompute(BNOnly(nn.BatchNorm2d(C)), batches)
    assert report["bn"].se_untrusted == [2] and report.to_dict()["layers"][0]["se_untrusted"] == [2]
    assert report["bn"].se_reasons == {"tails": [2]} == report.to_dict()["layers"][0]["se_reasons"]
    assert "standard errors not trusted in 1 channel of 1 layer (heavy tails: 1)" in report.summary()
    assert recompute(BNOnly(nn.BatchNorm2d(C)), batches[8:]).layers[0].se_untrusted == []


def test_a_compiled_model_is_reported_under_the_users_layer_names():
    compile_ = getattr(torch, "compile", None)  # torch >= 2.0
    model = nn.Sequential(nn.Conv2d(C, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    batches = make_batches([(2, C, 3, 3), (3, C, 3, 3)], huge=False, dead=False)
    reference = float64_reference(model, batches)
    wrapped = compile_(model) if compile_ is not None else model
    assert compile_ is None or "_orig_mod.1" in dict(wrapped.named_modules())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = recompute(wrapped, batches, layers=["1", "4"])
        never = recompute(wrapped, batches[:1], layers=["1", "4"], forward_fn=lambda m, b: m[1](m[0](b)))
    assert [layer.name for layer in report.layers] == ["1", "4"]
    assert never.unused == ["4"] and any("never ran" in str(w.message) and ": 4" in str(w.message) for w in caught)
    for name in ("1", "4"):
        module = dict(model.named_modules())[name]
        assert_close_exact(report[name].new_mean, report[name].new_var, *reference[name][:2], name)
        assert type(module) is nn.BatchNorm2d
