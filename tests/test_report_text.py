"""``print(report)``: the table ends with what each column means, as the command prints it, and
a drift large enough to matter is marked."""
from __future__ import annotations

import logging

import torch

from factories import batches, small_net
from precise_bn import recompute
from precise_bn.report import COLUMNS, DEFINITIONS, LARGE_DRIFT


def _report(offset: float):
    torch.manual_seed(0)
    net = small_net()  # fresh stats (mean 0, var 1); the data's mean is ``offset``, its std 2
    return recompute(net, batches(offset=offset), progress=False)


def test_the_printed_report_ends_with_the_legend():
    text = [line for line in str(_report(offset=0.0)).splitlines() if not line.startswith("  *")]
    legend = text[-len(COLUMNS):]
    assert [line.split()[0:2] for line in legend] == [title.split() for title in COLUMNS]
    assert all(line.endswith(DEFINITIONS[key]) for line, key in zip(legend, COLUMNS.values()))


def test_large_drifts_are_marked_and_the_mark_is_explained():
    report = _report(offset=3.0)
    text = str(report).splitlines()
    assert text[-1] == "  *  a drift of {:g} or more: the old running stats did not fit this data".format(LARGE_DRIFT)
    rows = {line.split()[0]: line for line in text[2:2 + len(report.layers)]}
    for layer in report.layers:
        cells = rows[layer.name].split()
        for cell, drift in zip(cells[3:5], (layer.mean_drift, layer.var_drift)):
            assert cell.endswith("*") == (drift >= LARGE_DRIFT), (layer.name, cell, drift)
    assert any(layer.mean_drift >= LARGE_DRIFT for layer in report.layers)  # the data's mean is 1.5 std away


def test_small_drifts_are_not_marked():
    report = _report(offset=0.0)
    report.layers = [layer for layer in report.layers if max(layer.mean_drift, layer.var_drift) < LARGE_DRIFT]
    assert report.layers, "every layer drifted a lot: the test's data no longer makes the case"
    assert "*" not in str(report)


def test_one_batch_of_one_sample_is_counted_in_the_singular(caplog):
    torch.manual_seed(0)
    net = small_net()
    net.eval()  # a batch of one sample: batch statistics in training mode need two
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm1d):
            module.track_running_stats = False  # the BN1d needs two samples; the BN2d layers one image
    with caplog.at_level(logging.INFO, logger="precise_bn"):
        report = recompute(net, [batches(n=2, batch_size=1)[0][0][:1]], progress=False)
    assert report.batches == 1 and report.samples == 1
    assert ", 1 batch (1 sample)," in report.summary()
    assert any(": 1 batch (1 sample) read in" in r.getMessage() for r in caplog.records), caplog.text
    many = _report(offset=0.0)
    assert ", {} batches ({} samples),".format(many.batches, many.samples) in many.summary()


def test_one_batch_prints_no_standard_error_and_no_nan():
    """One call says nothing about the spread between calls: the standard errors are NaN, and
    the report says why instead of printing them."""
    torch.manual_seed(0)
    report = recompute(small_net(), [batches()[0][0]], progress=False)
    text = str(report)
    assert report.batches == 1 and all(layer.calls == 1 for layer in report.layers)
    assert "worst relative standard error: mean n/a (one batch), var n/a (one batch)" in report.summary()
    rows = text.splitlines()[2:2 + len(report.layers)]
    assert all(row.split("  ")[-2:] == ["n/a (1 call)", "n/a (1 call)"] for row in rows), rows
    assert "nan" not in text.lower()


def test_a_layer_that_ran_once_in_a_longer_pass_prints_no_nan():
    """A layer run by one batch of several: its cells say why, and the worst is not known."""
    torch.manual_seed(0)
    net = small_net(extra_layer=True)
    data = [x for x, _ in batches()]
    calls = []

    def forward(model, x):
        calls.append(1)
        return model(x) if len(calls) == 1 else model[:-1](x)

    report = recompute(net, data, forward_fn=forward, progress=False)
    assert report.batches == len(data) > 1 and report["11"].calls == 1
    assert "worst relative standard error: mean n/a (a layer ran once), var n/a (a layer ran once)" in report.summary()
    text = str(report)
    assert "nan" not in text.lower()
    rows = {row.split()[0]: row for row in text.splitlines()[2:2 + len(report.layers)]}
    assert [name for name, row in rows.items() if "n/a (1 call)" in row] == ["11"], rows
