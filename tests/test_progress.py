"""The progress bar counts batches, and its total is what the pass really reads: a sample budget
is met by whole batches, so 60 samples in batches of 16 are 4 batches (64 samples)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from precise_bn import recompute
from precise_bn.data import batches_for_samples


def _batches(count: int, size: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(size, 3, generator=gen) for _ in range(count)]


@pytest.mark.parametrize("data_len", [10, 3])
def test_the_bar_of_a_sample_budget_ends_at_the_batches_really_read(capsys, data_len):
    report = recompute(nn.BatchNorm1d(3), _batches(data_len, 16), num_samples=60, progress=True)
    read = min(data_len, 4)
    assert report.batches == read and report.samples == 16 * read
    final = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "{0}/{0} [".format(read) in final and "batch" in final and "{} samples".format(16 * read) in final, final


def test_the_estimate_follows_the_batches_read_and_the_caps():
    assert batches_for_samples(1, 16, 60, None) == 4  # 16 + 3 more of 16 reach 60
    assert batches_for_samples(4, 64, 60, None) == 4  # met: what was read is all
    assert batches_for_samples(1, 16, 60, 2) == 2  # the data has 2 batches
    assert batches_for_samples(2, 20, 60, None) == 6  # ragged batches: 10 on average so far
    assert batches_for_samples(0, 0, 60, 7) == 7 and batches_for_samples(0, 0, 60, None) is None
