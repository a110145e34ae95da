"""The drop-ins keep their originals' contracts: fvcore's ``update_bn_stats`` and swa_utils'
``update_bn``, run side by side with the originals (installed in the main environment), and
every difference the table in docs/dropins.md lists."""
from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from fvcore.nn import update_bn_stats as fvcore_update_bn_stats
from torch import nn
from torch.optim import swa_utils

from precise_bn import BNReport, EmptyDataError, PreciseBNWarning, update_bn, update_bn_stats
from reference import assert_close_exact, float64_reference

pytestmark = pytest.mark.main_env


class Recorder(nn.Module):
    """Remembers exactly what it was called with, and normalises the tensor it finds in it."""

    def __init__(self, channels: int = 3):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.seen: list = []

    def forward(self, batch):
        self.seen.append(batch)
        x = batch
        while not torch.is_tensor(x):
            x = x["pixels"] if isinstance(x, dict) else x[0]
        return self.bn(x)


class TwoPathways(nn.Module):
    """A SlowFast-like model: a list of pathway tensors in, one BN layer per pathway."""

    def __init__(self):
        super().__init__()
        self.slow = nn.Sequential(nn.Conv3d(3, 4, 1), nn.BatchNorm3d(4))
        self.fast = nn.Sequential(nn.Conv3d(3, 2, 1), nn.BatchNorm3d(2))

    def forward(self, pathways):
        slow, fast = pathways
        return self.slow(slow).mean() + self.fast(fast).mean()


def _pathway_batches(count=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(2, 3, 2, 4, 4, generator=gen) + 3, torch.randn(2, 3, 8, 4, 4, generator=gen) * 2]
            for _ in range(count)]


def _images(count, seed=0, size=4):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, 3, 5, 5, generator=gen) * 2 + 1 for _ in range(count)]


@pytest.mark.parametrize("wrap", ["tensor", "list", "tuple", "dict"])
def test_fvcore_drop_in_hands_every_batch_to_the_model_unchanged(wrap):
    images = _images(3)
    batches = {
        "tensor": images,
        "list": [[x, x + 1] for x in images],
        "tuple": [(x, torch.zeros(len(x))) for x in images],
        "dict": [{"pixels": x, "input": "not a tensor"} for x in images],
    }[wrap]
    ours, theirs = Recorder(), Recorder()
    update_bn_stats(ours, batches, num_iters=3)
    fvcore_update_bn_stats(theirs, batches, num_iters=3)
    assert len(ours.seen) == len(theirs.seen) == 3
    assert all(a is b for a, b in zip(ours.seen, batches)) and all(a is b for a, b in zip(theirs.seen, batches))
    torch.testing.assert_close(ours.bn.running_mean, theirs.bn.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.bn.running_var, theirs.bn.running_var, rtol=1e-5, atol=1e-6)


def test_slowfast_style_loader_works_unchanged_and_matches_the_reference():
    model = TwoPathways()
    batches = _pathway_batches()
    reference = float64_reference(model, batches, forward_fn=lambda m, b: m(b))
    fv_model = copy.deepcopy(model)
    report = update_bn_stats(model, batches, num_iters=len(batches))
    fvcore_update_bn_stats(fv_model, batches, num_iters=len(batches))
    for name in ("slow.1", "fast.1"):
        ref_mean, ref_var, _ = reference[name]
        module = dict(model.named_modules())[name]
        assert_close_exact(module.running_mean, module.running_var, ref_mean, ref_var, name)
        theirs = dict(fv_model.named_modules())[name]
        torch.testing.assert_close(module.running_var, theirs.running_var, rtol=1e-4, atol=1e-5)
    assert report.samples == 2 * len(batches)


@pytest.mark.parametrize("progress", [None, "", "none", "bar", 0, False, object()])
def test_fvcore_progress_accepts_any_value_and_shows_a_bar_only_for_tqdm(progress, capsys):
    update_bn_stats(Recorder(), _images(2), num_iters=2, progress=progress)
    assert "it/s" not in capsys.readouterr().err and "batch/s" not in capsys.readouterr().err
    update_bn_stats(Recorder(), _images(2), num_iters=2, progress="tqdm")
    assert "2/2" in capsys.readouterr().err


def test_fvcore_differences_listed_in_dropins_md():
    """Short loader: a warning, not an AssertionError; the report is returned; a reused layer
    counts every call; num_batches_tracked and layers that never ran keep their values."""
    model = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3))
    model[1].running_mean.fill_(7.0)
    unused_before = model[1].running_mean.clone()
    tracked_before = model[0].num_batches_tracked.clone()
    images = _images(3)
    with pytest.warns(PreciseBNWarning, match="3 batches.*num_iters=5"):
        report = update_bn_stats(nn.Sequential(model[0]), images, num_iters=5)
    assert isinstance(report, BNReport) and report.batches == 3
    assert torch.equal(model[0].num_batches_tracked, tracked_before)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(self.bn(x) * 2 + 5)

    twice = Twice()
    assert update_bn_stats(twice, images, num_iters=3)["bn"].calls == 6
    with pytest.raises(AssertionError):
        fvcore_update_bn_stats(Twice(), images, num_iters=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreciseBNWarning)
        update_bn_stats(model, [x for x in images], num_iters=3, forward_fn=lambda m, b: m[0](b))
    assert torch.equal(model[1].running_mean, unused_before)


def test_fvcore_eval_mode_model_and_large_means():
    """A model in eval mode is recomputed (fvcore recomputes nothing); a channel whose mean is
    1e4 times its std gets its variance, where fvcore's float32 E[x^2]-E[x]^2 does not."""
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 2, 6, 6, generator=gen) * torch.tensor([1.0, 1.0]).view(1, 2, 1, 1)
               + torch.tensor([1e4, 0.0]).view(1, 2, 1, 1) for _ in range(6)]
    ours, theirs = nn.BatchNorm2d(2).eval(), nn.BatchNorm2d(2).eval()
    update_bn_stats(ours, batches, num_iters=6)
    fvcore_update_bn_stats(theirs, batches, num_iters=6)
    assert torch.equal(theirs.running_var, torch.ones(2)) and not ours.training
    ref_mean, ref_var, _ = float64_reference(nn.BatchNorm2d(2), batches)[""]
    assert_close_exact(ours.running_mean, ours.running_var, ref_mean, ref_var)
    trained = nn.BatchNorm2d(2)
    fvcore_update_bn_stats(trained, batches, num_iters=6)
    assert abs(float(trained.running_var[0]) - float(ref_var[0])) > 0.05 * float(ref_var[0])


class SwaRecorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3, momentum=0.3)
        self.drop = nn.Dropout(0.5)
        self.seen: list = []

    def forward(self, x):
        self.seen.append(x)
        if isinstance(x, dict):
            x = x["x"]
        return self.bn(self.drop(x))


def test_swa_drop_in_calls_the_first_item_of_any_list_or_tuple():
    """swa_utils calls ``model(batch[0])`` for every list/tuple, whatever its first item."""
    images = _images(4)
    for batches in ([({"x": x}, 0) for x in images], [[x] for x in images], images):
        model = SwaRecorder()
        update_bn(batches, model)
        expected = [b[0] if isinstance(b, (list, tuple)) else b for b in batches]
        assert len(model.seen) == len(batches) and all(a is b for a, b in zip(model.seen, expected))


def test_swa_drop_in_keeps_modes_momentum_and_counters():
    """Every BN layer is recomputed and keeps its mode and momentum, as in swa_utils; dropout
    keeps the mode the user gave it and num_batches_tracked its value (both differ)."""
    model = SwaRecorder().eval()
    model.drop.train()
    tracked = model.bn.num_batches_tracked.clone()
    before = model.bn.running_mean.clone()
    update_bn([(x, 0) for x in _images(3)], model, device="cpu")
    assert not model.bn.training and model.drop.training and model.bn.momentum == 0.3
    assert torch.equal(model.bn.num_batches_tracked, tracked)
    assert not torch.equal(model.bn.running_mean, before)


def test_swa_drop_in_mean_is_swas_and_variance_the_populations():
    """With equal batch sizes the mean equals swa_utils' average of batch means; the variance is
    the population's, where swa_utils averages unbiased batch variances."""
    images = _images(5, size=6)
    ours, theirs = SwaRecorder(), SwaRecorder()
    ours.drop.p = theirs.drop.p = 0.0
    update_bn([(x, 0) for x in images], ours)
    swa_utils.update_bn([(x, 0) for x in images], theirs)
    torch.testing.assert_close(ours.bn.running_mean, theirs.bn.running_mean, rtol=1e-5, atol=1e-5)
    ref_mean, ref_var, _ = float64_reference(nn.Sequential(nn.BatchNorm2d(3)), images)["0"]
    assert_close_exact(ours.bn.running_mean, ours.bn.running_var, ref_mean, ref_var)
    assert not torch.allclose(theirs.bn.running_var, ref_var.float(), rtol=1e-4, atol=0)


def test_swa_drop_in_refuses_an_empty_loader_and_moves_only_the_input():
    model = SwaRecorder()
    before = model.bn.running_var.clone()
    with pytest.raises(EmptyDataError):
        update_bn([], model)
    assert torch.equal(model.bn.running_var, before)
    moved = []
    model = SwaRecorder()
    original = model.forward
    model.forward = lambda x: (moved.append(x.device), original(x))[1]
    update_bn(itertools.islice(([x.double().float(), "label"] for x in _images(2)), 2), model, device="cpu")
    assert moved == [torch.device("cpu")] * 2


class _Fails:
    """Two batches, then the loader breaks."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches[:2]
        raise OSError("loader broke")


def test_every_fvcore_difference_in_the_dropins_table():
    images = _images(3)
    # return value, data shorter than num_iters, no batch at all, num_iters=None
    assert fvcore_update_bn_stats(nn.BatchNorm2d(3), images, num_iters=3) is None
    with pytest.raises(AssertionError):
        fvcore_update_bn_stats(nn.BatchNorm2d(3), images, num_iters=5)
    with pytest.raises(AssertionError):
        fvcore_update_bn_stats(nn.BatchNorm2d(3), [], num_iters=2)
    with pytest.raises(EmptyDataError):
        update_bn_stats(nn.BatchNorm2d(3), [], num_iters=2)
    with pytest.raises(TypeError):
        fvcore_update_bn_stats(nn.BatchNorm2d(3), images, num_iters=None)
    assert update_bn_stats(nn.BatchNorm2d(3), images, num_iters=None).batches == 3
    # num_batches_tracked and rebinding of the buffers; a layer that never ran
    for run in (fvcore_update_bn_stats, update_bn_stats):
        bn = nn.BatchNorm2d(3)
        mean_object = bn.running_mean
        run(bn, images, 3)
        if run is fvcore_update_bn_stats:
            assert float(bn.num_batches_tracked) == 3 and bn.running_mean is not mean_object
        else:
            assert float(bn.num_batches_tracked) == 0 and bn.running_mean is mean_object
    for run in (fvcore_update_bn_stats, update_bn_stats):
        pair = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3))
        pair[1].running_mean.fill_(7.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PreciseBNWarning)
            run(_FirstOnly(pair), images, 3)
        expected = 0.0 if run is fvcore_update_bn_stats else 7.0
        assert torch.equal(pair[1].running_mean, torch.full((3,), expected))
    # an exception mid-pass
    for run in (fvcore_update_bn_stats, update_bn_stats):
        bn = nn.BatchNorm2d(3, momentum=0.2)
        with pytest.raises(OSError):
            run(bn, _Fails(images), 3)
        assert bn.momentum == (1.0 if run is fvcore_update_bn_stats else 0.2)


class _FirstOnly(nn.Module):
    """Runs only the first layer of a Sequential: the second never runs."""

    def __init__(self, seq):
        super().__init__()
        self.seq = seq

    def forward(self, x):
        return self.seq[0](x)


def test_every_swa_difference_in_the_dropins_table():
    gen = torch.Generator().manual_seed(4)
    ragged = [torch.randn(n, 3, 4, 4, generator=gen) * 2 + k for k, n in enumerate((2, 9, 3))]
    ours, theirs = SwaRecorder(), SwaRecorder()
    ours.drop.p = theirs.drop.p = 0.0
    modes = []
    for model in (ours, theirs):
        model.eval()
        original = model.drop.forward
        model.drop.forward = lambda x, original=original: (modes.append(original.__self__.training), original(x))[1]
    assert update_bn(ragged, ours) is not None and swa_utils.update_bn(ragged, theirs) is None
    ref_mean, ref_var, _ = float64_reference(nn.Sequential(nn.BatchNorm2d(3)), ragged)["0"]
    assert_close_exact(ours.bn.running_mean, ours.bn.running_var, ref_mean, ref_var)
    assert (theirs.bn.running_mean - ref_mean.float()).abs().max() > 0.1  # equal weights per batch
    assert modes == [False] * 3 + [True] * 3  # swa_utils switched dropout to training mode
    assert float(theirs.bn.num_batches_tracked) == 3 and float(ours.bn.num_batches_tracked) == 0
    # empty loader, device with a dict input, an exception mid-pass
    for run, expected in ((swa_utils.update_bn, None), (update_bn, EmptyDataError)):
        model = SwaRecorder()
        model.bn.running_var.fill_(4.0)
        if expected is None:
            run([], model)
            assert torch.equal(model.bn.running_var, torch.ones(3))
        else:
            with pytest.raises(expected):
                run([], model)
            assert torch.equal(model.bn.running_var, torch.full((3,), 4.0))
    dict_batches = [({"x": x}, 0) for x in _images(2)]
    with pytest.raises(AttributeError):
        swa_utils.update_bn(dict_batches, SwaRecorder(), device="cpu")
    update_bn(dict_batches, SwaRecorder(), device="cpu")
    for run in (swa_utils.update_bn, update_bn):
        model = SwaRecorder()
        with pytest.raises(OSError):
            run(_Fails(_images(3)), model)
        assert model.bn.momentum == (None if run is swa_utils.update_bn else 0.3)


def test_far_tiny_and_overflowing_statistics_differ_from_both_originals_as_the_table_says():
    """Channels-last input at mean/std 1e4: both originals are silently off, ours is exact;
    a variance of 1e-50: both originals write it silently, ours writes it rounded and says so;
    inputs of 1e20: both originals write non-finite statistics, ours raises and changes nothing."""
    from precise_bn import NonFiniteStatsError

    gen = torch.Generator().manual_seed(5)
    far = [(torch.randn(64, 3, 16, 16, generator=gen) + 1e4).contiguous(memory_format=torch.channels_last)
           for _ in range(2)]
    tiny = [torch.randn(8, 3, 4, 4, generator=gen) * 1e-25 for _ in range(2)]
    huge = [torch.randn(4, 3, 4, 4, generator=gen) * 1e20 for _ in range(2)]
    ref_mean, ref_var, _ = float64_reference(nn.Sequential(nn.BatchNorm2d(3)), far)["0"]
    originals = (lambda m, data: fvcore_update_bn_stats(m, data, len(data)),
                 lambda m, data: swa_utils.update_bn(data, m))
    for original in originals:
        bn = nn.BatchNorm2d(3)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            original(bn, far)
            original(nn.BatchNorm2d(3), tiny)
        assert not seen, [str(w.message) for w in seen]
        assert ((bn.running_var.double() - ref_var).abs() / ref_var).max() > 1e-5  # ours: 1e-7
        bn = nn.BatchNorm2d(3)
        original(bn, huge)
        assert not torch.isfinite(bn.running_var).all()
    for ours in (lambda m, data: update_bn_stats(m, data, len(data)), lambda m, data: update_bn(data, m)):
        bn = nn.BatchNorm2d(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours(bn, far)
        assert_close_exact(bn.running_mean, bn.running_var, ref_mean, ref_var, "mean/std 1e4, channels-last")
        with pytest.warns(PreciseBNWarning, match="below the smallest normal float32"):
            ours(nn.BatchNorm2d(3), tiny)
        bn = nn.BatchNorm2d(3)
        before = copy.deepcopy(bn.state_dict())
        with pytest.raises(NonFiniteStatsError):
            ours(bn, huge)
        assert all(torch.equal(v, before[k]) for k, v in bn.state_dict().items())
