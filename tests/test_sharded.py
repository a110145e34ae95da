"""FSDP2, FSDP1 and the rounds' own group on two gloo ranks (one spawn runs every scenario of
:mod:`wrapper_workers`): uneven per-rank data, identical bits on both ranks equal to the plain
model's merge and close to the float64 reference over the union, the sharding restored."""
from __future__ import annotations

import re

import pytest
import torch

import dist_workers as W
import wrapper_workers as S
from reference import assert_close_exact, float64_reference
from test_distributed import SPAWN_TIMEOUT_S, assert_identical_on_all_ranks, assert_matches_reference

pytestmark = pytest.mark.main_env  # FSDP2, Accelerate and Lightning


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return W.spawn_ranks(2, str(tmp_path_factory.mktemp("sharded")), SPAWN_TIMEOUT_S, table="wrapper_workers")


def scenario(runs, name):
    missing = [rank for rank, r in enumerate(runs) if name not in r]
    assert not missing, "scenario {!r} never finished on rank(s) {}".format(name, missing)
    return [r[name] for r in runs]


def test_all_ranks_finish_in_time(runs):
    assert runs[0]["_finished"]


@pytest.mark.parametrize("name", ["fsdp2_uneven", "fsdp1_uneven", "no_limit"])
def test_one_vs_nine_batches_match_the_union_and_the_plain_model_bit_for_bit(runs, name):
    per_rank = scenario(runs, name)
    for result in per_rank:
        assert "error" not in result, result
    assert_identical_on_all_ranks(per_rank, name)
    assert_matches_reference(per_rank, W.union_batches(S.ONE_VS_NINE, 2), assert_close_exact, name)
    plain = scenario(runs, "plain_uneven")[0]
    for layer, (mean, var) in plain["buffers"].items():
        assert torch.equal(per_rank[0]["buffers"][layer][0], mean), (name, layer)
        assert torch.equal(per_rank[0]["buffers"][layer][1], var), (name, layer)


@pytest.mark.parametrize("name", ["fsdp2_uneven", "fsdp1_uneven"])
def test_sharding_is_restored_and_the_model_still_trains(runs, name):
    per_rank = scenario(runs, name)
    assert all(r["restored"] for r in per_rank)
    grads = [r["grads"] for r in per_rank]
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    if name == "fsdp2_uneven":  # whole gradients, reduced over both ranks (FSDP1 keeps each rank's shard)
        assert torch.equal(grads[0], grads[1])


def test_fsdp1_report_names_are_the_users(runs):
    for result in scenario(runs, "fsdp1_uneven"):
        assert result["names"] == ["1", "4", "9"]
        assert result["layer_1_calls"] == 10


def test_a_shard_the_size_of_a_header_gives_the_union_statistics(runs):
    per_rank = scenario(runs, "fsdp2_header")
    assert_identical_on_all_ranks(per_rank, "fsdp2_header")
    batches = S.header_batches(0) + S.header_batches(1)
    (ref_mean, ref_var, count), = float64_reference(S.header_model(), batches).values()
    for result in per_rank:
        mean, var = result["buffers"]["1"]
        assert_close_exact(mean, var, ref_mean, ref_var, "header-sized shard")
        assert result["layers"]["1"][2] == count


def test_a_failure_under_fsdp2_raises_on_both_ranks_and_restores_the_sharding(runs):
    per_rank = scenario(runs, "fsdp2_failure")
    assert per_rank[1]["error"] == "OSError" and per_rank[0]["error"] == "DistributedError"
    assert all(r["unchanged"] and r["restored"] for r in per_rank)
    assert torch.equal(per_rank[0]["grads"], per_rank[1]["grads"])


def test_ranks_out_of_step_raise_naming_both_sides(runs):
    for result in scenario(runs, "out_of_step"):
        assert result["error"] == "DistributedError", result
        assert re.search(r"round \d+ \(start\)", result["message"]), result
        assert re.search(r"round \d+ \(end\)", result["message"]), result


def test_after_a_timeout_the_users_group_and_later_calls_still_work(runs):
    per_rank = scenario(runs, "timeout")
    for result in per_rank:
        assert result["error"] == "DistributedError" and "waited more than 1 s" in result["message"], result
        assert result["unchanged"] and result["all_reduce"] == 2.0
    assert_identical_on_all_ranks([r["again"] for r in per_rank], "after the timeout")
    assert_matches_reference([r["again"] for r in per_rank], W.union_batches(S.ONE_VS_NINE, 2),
                             assert_close_exact, "after the timeout")


def test_accelerate_counts_the_padding_of_even_batches(runs):
    """Accelerate (``even_batches=True``) pads the last batches so that every rank has as many:
    the padding samples are measured like the others; the merge is what the ranks were given."""
    per_rank = scenario(runs, "accelerate")
    for result in per_rank:
        assert "error" not in result, result
        assert result["wrapped"] == "DistributedDataParallel"
    seen = [batch for result in per_rank for batch in result["seen"]]
    assert sum(len(b) for b in seen) > S.ACCELERATE_SAMPLES  # padded
    assert_identical_on_all_ranks(per_rank, "accelerate")
    assert_matches_reference(per_rank, seen, assert_close_exact, "accelerate")


def test_accelerate_without_even_batches_measures_one_processs_batches(runs):
    """With ``even_batches=False`` the ranks read one process's batches, dealt in turn, one rank
    a batch fewer: each sample once, and the merge is one process's over the whole dataset."""
    per_rank = scenario(runs, "accelerate_uneven")
    for result in per_rank:
        assert "error" not in result, result
    one = [batch[0] for batch in torch.utils.data.DataLoader(S.accelerate_dataset(S.UNEVEN_SAMPLES),
                                                             batch_size=S.UNEVEN_BATCH)]
    seen = [batch for result in per_rank for batch in result["seen"]]
    assert sorted(b.flatten().tolist() for b in seen) == sorted(b.flatten().tolist() for b in one)
    assert [len(r["seen"]) for r in per_rank] == [3, 2]
    assert_identical_on_all_ranks(per_rank, "accelerate_uneven")
    assert_matches_reference(per_rank, one, assert_close_exact, "accelerate_uneven")


def test_lightning_ddp_callback_merges_the_ranks(runs):
    per_rank = scenario(runs, "lightning_ddp")
    for result in per_rank:
        assert "error" not in result, result
    batches = [b for rank in range(2) for b in W.cycled(W.rank_batches(S.ONE_VS_NINE, rank), S.LIGHTNING_BATCHES)]
    ref = float64_reference(W.make_model(), batches)
    for result in per_rank:
        for name, (ref_mean, ref_var, _) in ref.items():
            assert_close_exact(*result["buffers"][name], ref_mean, ref_var, "lightning ddp " + name)
    assert all(torch.equal(per_rank[0]["buffers"][n][i], per_rank[1]["buffers"][n][i]) for n in ref for i in (0, 1))
