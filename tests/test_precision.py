"""The standard errors are calibrated: on data with a known population, over many random draws
of shuffled batches, the true error of the written stats lies within two standard errors in
90-99% of channels (about 95% is what a standard error means; with k calls the ratio of error to
estimated standard error follows roughly Student's t with k - 1 degrees of freedom, 94.6% at
k = 32). Correlated batches break that, as the docs say, and a test shows by how much.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from precise_bn import recompute
from precise_bn.driver import CHECK_EVERY

SAMPLES, CHANNELS, SIDE, BATCH = 40_000, 12, 2, 32


def _population() -> torch.Tensor:
    """Per-sample effects plus per-position noise, in six shapes of distribution (two channels
    each): normal, lognormal, squared normal, a two-valued mixture, a mean of 100 std, Student-t."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(SAMPLES, CHANNELS, 1, 1, generator=gen) * 0.7
    base = base + torch.randn(SAMPLES, CHANNELS, SIDE, SIDE, generator=gen) * 0.5
    x = base.clone()
    x[:, 2:4] = base[:, 2:4].exp()
    x[:, 4:6] = base[:, 4:6] ** 2
    x[:, 6:8] = (base[:, 6:8] > 0.8).float() * 5 + base[:, 6:8] * 0.1
    x[:, 8:10] = base[:, 8:10] + 100.0
    chi2 = (torch.randn(SAMPLES, 2, SIDE, SIDE, 5, generator=gen) ** 2).mean(-1)
    x[:, 10:12] = base[:, 10:12] / chi2.sqrt()
    return x


def _coverage(errors, stderrs) -> float:
    z = torch.stack(errors) / torch.stack(stderrs)
    return float((z.abs() <= 2).double().mean())


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors this small only lose time to more threads, many times over on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def population():
    x = _population()
    rows = x.double().transpose(0, 1).reshape(CHANNELS, -1)
    return x, rows.mean(1), rows.var(1, unbiased=False)


def _draws(x, pop_mean, pop_var, draws, order=None, **options):
    """Recompute a BatchNorm2d on each draw's batches; per draw the errors, standard errors and report."""
    out = []
    for draw in range(draws):
        index = order if order is not None else torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(draw))
        start = 0 if order is None else draw * 4096
        batches = (x[index[start + i * BATCH: start + (i + 1) * BATCH]] for i in range(SAMPLES // BATCH))
        report = recompute(nn.BatchNorm2d(CHANNELS), batches, progress=False, layers="all", **options)
        layer = report.layers[0]
        out.append(((layer.new_mean - pop_mean, layer.mean_stderr), (layer.new_var - pop_var, layer.var_stderr), report))
    return out


def test_two_standard_errors_cover_the_true_error_of_shuffled_batches(population):
    results = _draws(*population, draws=100, num_batches=32)
    assert all(r.calls == 32 for *_, report in results for r in report.layers)
    mean_cover = _coverage(*zip(*[m for m, _, _ in results]))
    var_cover = _coverage(*zip(*[v for _, v, _ in results]))
    assert 0.90 <= mean_cover <= 0.99, mean_cover
    assert 0.90 <= var_cover <= 0.99, var_cover


def test_the_precision_stop_keeps_the_coverage_and_meets_rtol(population):
    """Stopping as soon as every channel looks precise enough (optional stopping) picks passes
    whose standard errors came out small; over all channels the coverage holds."""
    results = _draws(*population, draws=60, rtol=0.1, num_batches=400)
    reports = [report for *_, report in results]
    assert {report.stop for report in reports} == {"rtol"}
    for report in reports:
        assert report.batches % CHECK_EVERY == 0 and report.batches >= 16
        assert report.worst("mean_rel_stderr") <= 0.1 and report.worst("var_rel_stderr") <= 0.1
    mean_cover = _coverage(*zip(*[m for m, _, _ in results]))
    var_cover = _coverage(*zip(*[v for _, v, _ in results]))
    assert 0.90 <= mean_cover <= 0.99, mean_cover
    assert 0.90 <= var_cover <= 0.99, var_cover


def test_correlated_batches_make_the_standard_errors_optimistic(population):
    """A loader sorted by a per-sample feature (as an unshuffled data set sorted by class or by
    time is): consecutive batches resemble each other and the spread between them says little
    about the error. The coverage falls far below what a standard error promises."""
    x, pop_mean, pop_var = population
    order = x[:, 0].mean((1, 2)).argsort()  # sorted by channel 0's per-sample mean
    results = _draws(x, pop_mean, pop_var, draws=8, order=order, num_batches=32)
    assert _coverage(*zip(*[(error[:1], stderr[:1]) for (error, stderr), _, _ in results])) < 0.5


@pytest.mark.main_env
def test_calibrated_on_the_demo_cnn_and_its_digits():
    """The demo's CNN trained on its bundled digits: the population is the training set as
    batches of 32 random images see it (every layer after the first depends on which images share
    a batch), measured exactly over 400 random batches."""
    from precise_bn import digits

    train_x, train_y, _, _ = digits.load_digits()
    torch.manual_seed(0)
    model = digits.train(digits.make_model(), train_x, train_y, steps=60, batch_size=digits.BATCH_SIZE, seed=0)

    def random_batches(seed, count):
        gen = torch.Generator().manual_seed(seed)
        return [train_x[torch.randperm(len(train_x), generator=gen)[: digits.BATCH_SIZE]] for _ in range(count)]

    target = recompute(copy.deepcopy(model), random_batches(1, 400), exact=True, progress=False)
    errors = {"mean": [], "var": []}
    for draw in range(60):
        report = recompute(copy.deepcopy(model), random_batches(100 + draw, 32), progress=False)
        for layer, whole in zip(report.layers, target.layers):
            errors["mean"].append((layer.new_mean - whole.new_mean, layer.mean_stderr))
            errors["var"].append((layer.new_var - whole.new_var, layer.var_stderr))
    for key, pairs in errors.items():
        diffs, stderrs = zip(*pairs)
        cover = float(((torch.cat(diffs) / torch.cat(stderrs)).abs() <= 2).double().mean())
        assert 0.90 <= cover <= 0.99, (key, cover)
