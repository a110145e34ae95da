"""Loaders whose batches are not independent draws, and the diagnostics that notice them from the
statistics a pass merges: the same batch repeated, AR(1) batch offsets, one dominant batch, a
drifting mean; and the control, independent batches of equal and alternating sizes, on which they
stay silent and ``rtol`` stops where it stopped without them. The loaders are those of
``benchmarks/calibration.py`` (``order_stream``), which measures them at full size.
"""
from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from precise_bn import PopulationStats, PreciseBNWarning, precision, recompute
from precise_bn.estimator import combine_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import calibration  # noqa: E402

CHANNELS = 8
#: The flags that say what a loader did (heavy tails say what the data are).
ORDER = ("identical", "concentrated", "drift", "correlated")


@pytest.fixture(scope="module")
def samples():
    return calibration.population("normal", 40_000, CHANNELS)


def _pass(stream, **options):
    """A BatchNorm2d recomputed over ``stream``: the report and the warnings' text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = recompute(nn.BatchNorm2d(CHANNELS), iter(stream), progress=False, **options)
    return report, " ".join(str(w.message) for w in caught if issubclass(w.category, PreciseBNWarning))


def _covered_or_flagged(report, truth):
    """Per channel: the mean and the variance within two standard errors, or the channel flagged."""
    layer, (mean, var) = report.layers[0], truth
    hit = (layer.new_mean - mean).abs() <= 2 * layer.mean_stderr
    hit &= (layer.new_var - var).abs() <= 2 * layer.var_stderr
    hit[layer.se_untrusted] = True
    return hit


def _calls(stream):
    """Per-call counts, means and biased variances (float64), as a pass reads them."""
    rows = [b.double().transpose(0, 1).reshape(CHANNELS, -1) for b in stream]
    return ([r.shape[1] for r in rows], torch.stack([r.mean(1) for r in rows]),
            torch.stack([r.var(1, unbiased=False) for r in rows]))


def _call_spread(stats):
    """The count²-weighted standard deviation between calls of their means and of their second
    moments: the standard errors times ``sqrt((N^2 - sum n^2) / sum n^2)``."""
    calls = ((stats.count ** 2 - stats.weight) / stats.weight) ** 0.5
    return [se * calls for se in stats.stderr()]


def _merged(counts, means, variances, block=64):
    """The calls merged in blocks of ``block``, in order, as the capture merges them."""
    stats = PopulationStats(means.shape[1])
    for start in range(0, len(counts), block):
        m, v = means[start:start + block].clone(), variances[start:start + block].clone()
        stats.add(combine_calls(m, v, counts[start:start + block], stats.center_for(m[0])))
    return stats


def test_a_repeated_batch_is_flagged_and_rtol_reads_on_saying_why(samples):
    """Independent batches whose elements vary cannot have the same means and variances bit for
    bit: every channel is flagged, and ``rtol`` (met at 16 batches before, every standard error 0)
    reads the whole data and says why."""
    stream, _ = calibration.order_stream("repeated batch", samples, 200, 0)
    report, said = _pass(stream, rtol=0.01)
    layer = report.layers[0]
    assert float((layer.mean_stderr / layer.new_var.sqrt()).max()) < 1e-9  # what the spread says
    assert report.stop == "data" and report.batches == 200
    assert layer.se_reasons == {"identical": list(range(CHANNELS))} and layer.se_untrusted == list(range(CHANNELS))
    assert "rtol=0.01 not reached after 200 batches" in said and "one batch read again and again" in said
    summary = report.summary()
    assert "stopped: the data ran out;" in summary and summary.endswith(
        "; standard errors not trusted in 8 channels of 1 layer (identical batch statistics: 8), so rtol=0.01 could not "
        "stop the pass"), summary
    stats = _merged(*_calls(stream[:40]))
    spread = _call_spread(stats)
    assert float(spread[0].max()) == 0.0 and float((spread[1] / stats.m2 * stats.count).max()) < 1e-15


def test_ar1_batch_offsets_at_09_are_flagged_as_correlated(samples):
    """Per-channel batch offsets following an AR(1) with phi = 0.9: two standard errors cover a
    third of the channels; after 128 batches the lag-1 correlation of the batch means flags at
    least 90% of them, the rest being covered, and an ``rtol`` pass never stops on a flagged
    channel."""
    hits, correlated = [], 0
    for seed in range(4):
        stream, truth = calibration.order_stream("AR(1) 0.9", samples, 128, seed)
        report, said = _pass(stream)
        hits.append(_covered_or_flagged(report, truth))
        correlated += len(report.layers[0].se_reasons.get("correlated", []))
        assert "consecutive batches resemble each other" in said
    assert float(torch.cat(hits).double().mean()) >= 0.9 and correlated >= 0.75 * 4 * CHANNELS
    lag_mean = _merged(*_calls(stream)).order_stats()[0]
    assert float(lag_mean.min()) > precision.SERIAL + precision.SERIAL_Z / math.sqrt(128)
    for seed in range(3):
        stream, _ = calibration.order_stream("AR(1) 0.9", samples, 400, seed)
        report, said = _pass(stream, rtol=0.1)
        assert report.stop != "rtol" or not report.layers[0].se_untrusted
        assert report.stop == "rtol" or "rtol never stops while standard errors cannot be trusted" in said


def test_one_dominant_batch_is_flagged_and_its_standard_errors_are_unbiased(samples):
    """31 batches of 8 and one of 2,048, all independent: the standard error's k/(k-1) assumed
    equal counts and came out 2.2 times too small; ``sum e^2 / (N^2 - sum n^2)`` is unbiased for any
    counts, and the channels are flagged, the standard errors resting on about one call's worth."""
    stream, truth = calibration.order_stream("one dominant batch", samples, 32, 0)
    report, said = _pass(stream)
    assert report.layers[0].se_reasons == {"concentrated": list(range(CHANNELS))}
    assert "a few batches hold most of the elements" in said
    gen = torch.Generator().manual_seed(0)
    counts = [8] * 31 + [2048]
    n = torch.tensor(counts, dtype=torch.float64)
    total, squares = float(n.sum()), float((n * n).sum())
    new, old = [], []
    for _ in range(2000):  # independent elements of variance 1: the written mean has variance 1 / N
        means = torch.randn(32, 1, generator=gen, dtype=torch.float64) / n.sqrt()[:, None]
        stats = _merged(counts, means, torch.ones(32, 1, dtype=torch.float64))
        new.append(float(stats.stderr()[0]) ** 2 * total)
        spread = float((n[:, None] ** 2 * (means - float(stats.mean)) ** 2).sum())
        old.append(32 / 31 * spread / total)
    assert 0.93 <= sum(new) / len(new) <= 1.07, sum(new) / len(new)
    assert sum(old) / len(old) < 0.25
    assert stats.effective_calls() == pytest.approx(total * total / squares)


def test_a_drifting_mean_is_flagged_and_rtol_does_not_stop_on_it(samples):
    """A data set read in order whose mean grows along it: the statistics of its start say nothing
    of its end. After 128 batches the trend of the batch means along the calls flags every
    channel; ``rtol`` reads on and says why."""
    stream, truth = calibration.order_stream("mean drift", samples, 128, 0)
    report, said = _pass(stream)
    assert report.layers[0].se_reasons == {"drift": list(range(CHANNELS))}
    assert "the mean or variance moves along the data" in said
    assert not bool(((report.layers[0].new_mean - truth[0]).abs() <= 2 * report.layers[0].mean_stderr).any())
    stream, _ = calibration.order_stream("mean drift", samples, 1250, 1)
    report, said = _pass(stream, rtol=0.1, num_batches=400)
    assert report.stop == "num_batches" and "rtol never stops while standard errors cannot be trusted" in said
    trend = _merged(*_calls(stream[:128])).order_stats()[2]
    assert float(trend.min()) > precision.DRIFT_Z


@pytest.mark.parametrize("kind", ["independent", "alternating sizes"])
def test_the_control_is_not_flagged_and_stays_calibrated(samples, kind):
    """Independent batches of equal or alternating (16, 48) sizes: no channel is flagged for what
    the loader did, over 24 passes of 32 and 128 batches and over 3,000 channels merged directly
    at 16 to 256 calls; two standard errors cover 90-99% of the means and variances."""
    hits, covered = [], []
    for batches in (32, 128):
        for seed in range(12):
            stream, truth = calibration.order_stream(kind, samples, batches, seed)
            report, said = _pass(stream)
            assert not set(report.layers[0].se_reasons) & set(ORDER) and "cannot be trusted" not in said
            layer, (mean, var) = report.layers[0], truth
            covered += [(layer.new_mean - mean).abs() <= 2 * layer.mean_stderr,
                        (layer.new_var - var).abs() <= 2 * layer.var_stderr]
    assert 0.90 <= float(torch.cat(covered).double().mean()) <= 0.99
    gen = torch.Generator().manual_seed(1)
    for calls in (16, 64, 256):
        counts = [16 if kind != "independent" and i % 2 else (48 if kind != "independent" else 32)
                  for i in range(calls)]
        n = torch.tensor(counts, dtype=torch.float64)[:, None]
        means = torch.randn(calls, 1000, generator=gen, dtype=torch.float64) / n.sqrt()
        variances = 1.0 + torch.randn(calls, 1000, generator=gen, dtype=torch.float64) * (2.0 / n).sqrt()
        flagged = precision.flags(_merged(counts, means, variances))
        hits.append(sum(len(flagged.get(reason, [])) for reason in ORDER))
    assert hits == [0, 0, 0]


def test_the_flags_do_not_move_an_rtol_stop_on_independent_batches(monkeypatch):
    """On independent normal batches, ``rtol`` stops after the same batches with the order
    diagnostics as with thresholds that never flag (where it stopped before them)."""
    stops = {}
    for rule in ("with", "without"):
        if rule == "without":
            monkeypatch.setattr(precision, "REPEATED", 0.0)
            monkeypatch.setattr(precision, "CONCENTRATED", 0.0)
            monkeypatch.setattr(precision, "DRIFT_Z", math.inf)
            monkeypatch.setattr(precision, "SERIAL", math.inf)
        stops[rule] = [recompute(nn.BatchNorm1d(64), calibration.normal_stream(seed), rtol=0.05,
                                 progress=False).batches for seed in range(4)]
    assert stops["with"] == stops["without"], stops


def test_batches_that_spread_little_by_construction_are_not_taken_for_a_repeated_batch():
    """Two layers whose calls spread far less than independent elements of their variance would,
    legitimately. A zero-padded convolution of a channel whose mean is 1e4 times its std: borders
    and interior differ by a pattern that every sample shares, which dominates each batch's
    variance. A BatchNorm right after another, which normalised each batch in the pass: every
    call's mean is the first layer's bias and its variance nearly its weight squared. Neither is
    the same batch bit for bit, so neither is flagged for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4))
    gen = torch.Generator().manual_seed(0)
    shift = torch.tensor([1e4, 0.0]).view(1, 2, 1, 1)
    batches = [torch.randn(4, 2, 6, 6, generator=gen) + shift for _ in range(32)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = recompute(model, batches, progress=False)
    counts, means, variances = _calls_of(model[0], batches)
    stats = _merged(counts, means, variances)
    mean_spread = _call_spread(stats)[0] / (stats.mean.square() + stats.m2 / stats.count).sqrt()
    assert float(mean_spread.min()) > 1e3 * precision.REPEATED
    total, squares = sum(counts), sum(n * n for n in counts)  # what independent elements would spread
    independent = stats.m2 / total * (total - squares / total)
    assert float((_call_spread(stats)[0] ** 2 * squares / independent).max()) < 1e-5
    assert "identical" not in report.layers[0].se_reasons and "cannot be trusted" not in " ".join(
        str(w.message) for w in caught)
    chained = nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm2d(4))
    batches = [torch.randn(8, 4, 5, 5, generator=gen) * 100 + 3 for _ in range(64)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = recompute(chained, batches, progress=False).layers[1]
    assert not set(second.se_reasons) & set(ORDER) and float(second.var_rel_stderr) < 1e-5


def _calls_of(conv, batches):
    with torch.no_grad():
        rows = [conv(b).double().transpose(0, 1).reshape(conv.out_channels, -1) for b in batches]
    return ([r.shape[1] for r in rows], torch.stack([r.mean(1) for r in rows]),
            torch.stack([r.var(1, unbiased=False) for r in rows]))
