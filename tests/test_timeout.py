"""``timeout``: no limit for None and infinity, never rounded down to no limit, and a failure
inside the abort path leaves no signal relay behind."""
from __future__ import annotations

import datetime
import math
import signal

import pytest
import torch
from torch import nn

from precise_bn import ConfigError, recompute
from precise_bn import distributed, driver
from precise_bn.options import Options


@pytest.mark.parametrize("value", [None, float("inf")])
def test_none_and_infinity_mean_no_limit(value):
    assert Options(timeout=value).timeout == math.inf
    assert distributed.wait_limit(Options(timeout=value).timeout) is None


@pytest.mark.parametrize("value, millis", [(1e-9, 1), (datetime.timedelta(microseconds=1), 1), (0.0015, 2),
                                           (2.5, 2500)])
def test_tiny_values_never_become_no_limit(value, millis):
    limit = distributed.wait_limit(Options(timeout=value).timeout)
    assert limit == datetime.timedelta(milliseconds=millis)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "10", True, datetime.timedelta(0)])
def test_other_values_are_refused_when_given(value):
    with pytest.raises(ConfigError, match="timeout"):
        Options(timeout=value)


class _BrokenRanks(distributed.Ranks):
    """Rounds whose first exchange and whose abort both raise something unexpected."""

    def exchange(self, *args, **kwargs):
        raise OverflowError("first round")

    def abort(self):
        raise OverflowError("abort")


def test_a_failure_inside_the_abort_path_releases_the_relays(monkeypatch):
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    before = signal.getsignal(signal.SIGINT)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(driver, "Ranks", _BrokenRanks)
    with pytest.raises(OverflowError, match="abort"):
        recompute(model, [torch.randn(4, 3)])
    assert signal.getsignal(signal.SIGINT) is before
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
