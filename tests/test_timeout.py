"""``timeout``: no limit for None and infinity, never rounded down to no limit, a failure inside
the abort path leaves no signal relay behind, and every wait for other ranks, the making of
precise-bn's own process group included, ends within it."""
from __future__ import annotations

import datetime
import math
import signal

import pytest
import torch
from torch import nn

import dist_workers as W
from precise_bn import ConfigError, recompute
from precise_bn import distributed, driver
from precise_bn.options import Options
from reference import assert_close_exact
from test_distributed import assert_matches_reference


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


# Real gloo ranks with a short timeout. Ranks waiting for one that never answers give up
# within the timeout (plus the store's one-second polling): these bounds, ten times that, only
# catch a wait for the missing rank.
SHORT_TIMEOUT = 2.0
GIVEN_UP_WITHIN = 10 * (SHORT_TIMEOUT + 1.0)
LATE_BY = GIVEN_UP_WITHIN + 10.0  # a rank this late must not be waited for
SPAWN_TIMEOUT_S = 600.0  # a hang guard for the whole spawn


def _gave_up(result, what, within=GIVEN_UP_WITHIN):
    assert result is not None and result["error"] == "DistributedError", (what, result)
    assert "waited more than {:g} s".format(SHORT_TIMEOUT) in result["message"], (what, result)
    assert result["unchanged"] and result["seconds"] < within, (what, result)


def test_a_rank_late_for_its_first_call_is_not_waited_for_and_the_next_call_works(tmp_path):
    """Rank 2 calls late: ranks 0 and 1 give up within the timeout, while making precise-bn's
    own process group; rank 2 raises too, alone (once gloo gives up connecting to ranks that
    left: a few timeouts). Once all are past that call, the next one works on every rank;
    when rank 2 then stays away, the others' next call gives up again."""
    per_rank = W.spawn_alone("late_first_call", 3, str(tmp_path), SPAWN_TIMEOUT_S, timeout=SHORT_TIMEOUT,
                             stall=LATE_BY)
    assert all(r is not None for r in per_rank), per_rank
    for rank, result in enumerate(per_rank):
        _gave_up(result["first"], "rank {} first call".format(rank), SPAWN_TIMEOUT_S if rank == 2 else GIVEN_UP_WITHIN)
        assert "creation of precise-bn's process group" in result["first"]["message"]
        if rank != 2:
            _gave_up(result["third"], "rank {} third call".format(rank))
    again = [r["again"] for r in per_rank]
    assert_matches_reference(again, W.union_batches(W.UNEVEN, 3), assert_close_exact, "the next call")


def test_ranks_that_never_call_are_given_up_on_within_the_timeout(tmp_path):
    """Of four ranks, rank 3 is killed and rank 2 exits, neither having called: ranks 0 and 1
    raise within the timeout, and again at their next call."""
    per_rank = W.spawn_alone("two_never_call", 4, str(tmp_path), SPAWN_TIMEOUT_S, timeout=SHORT_TIMEOUT)
    assert per_rank[2] == {} and per_rank[3] is None
    for rank in (0, 1):
        for call in ("first", "second"):
            _gave_up(per_rank[rank][call], "rank {} {} call".format(rank, call))
