"""Precise BN across processes: real gloo process groups on localhost, 2 and 3 ranks.

One spawn per world size runs every scenario of :mod:`dist_workers` (start-up dominates the
cost); each test below then checks one scenario's per-rank results against a float64
reference over the union of the ranks' batches, and that all ranks hold identical bits.
Ranks rendezvous through a file store in the test's temporary folder, so parallel runs never
compete for a port, and the whole spawn is killed past a deadline, so a hang fails instead of
blocking.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

import dist_workers as W
from cli_helpers import torchrun
import precise_bn
from precise_bn import PopulationStats, recompute
from precise_bn import distributed
from precise_bn.options import OPTION_FIELDS, Options
from reference import assert_close_exact, float64_reference

SPAWN_TIMEOUT_S = 900.0  # a hang guard: a spawn takes seconds
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(precise_bn.__file__)))


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world_runs(request, tmp_path_factory):
    world = request.param
    tmp_dir = str(tmp_path_factory.mktemp("world{}".format(world)))
    return world, W.spawn_ranks(world, tmp_dir, SPAWN_TIMEOUT_S)


def scenario(world_runs, name):
    """One scenario's result on every rank; fails if a rank never finished it (a hang)."""
    world, results = world_runs
    missing = [rank for rank, r in enumerate(results) if name not in r]
    assert not missing, "scenario {!r} never finished on rank(s) {}".format(name, missing)
    return world, [r[name] for r in results]


def test_all_ranks_finish_in_time(world_runs):
    _, results = world_runs
    assert results[0]["_finished"], "ranks were killed after {:.0f} s".format(SPAWN_TIMEOUT_S)


def assert_identical_on_all_ranks(per_rank, what):
    """The float32 buffers and the report's float64 stats are the same bits on every rank."""
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        for key in ("buffers", "layers"):
            for name, values in first[key].items():
                for value, theirs in zip(values, other[key][name]):
                    same = torch.equal(value, theirs) if torch.is_tensor(value) else value == theirs
                    assert same, "{}: layer {} {} differ on rank 0 and {}".format(what, name, key, rank)


def assert_matches_reference(results, batches, check, what):
    """Each result's buffers and report equal the float64 reference over ``batches``.

    The reference runs the plain-BatchNorm model (same weights as the SyncBatchNorm one): during
    the pass SyncBatchNorm must normalise each rank's batch alone, as one process would.
    """
    ref = float64_reference(W.make_model(), batches)
    for result in results:
        assert set(result["buffers"]) == set(ref)
        for name, (ref_mean, ref_var, count) in ref.items():
            mean, var = result["buffers"][name]
            check(mean, var, ref_mean, ref_var, "{} layer {} buffers".format(what, name))
            new_mean, new_var, elements, calls = result["layers"][name]
            check(new_mean, new_var, ref_mean, ref_var, "{} layer {} report".format(what, name))
            assert (elements, calls) == (count, len(batches)), what
        assert result["batches"] == len(batches)
        assert result["samples"] == sum(len(b) for b in batches)


MERGED = {
    "kernel": (W.UNEVEN, assert_close_exact),
    "ddp": (W.UNEVEN, assert_close_exact),
    "ddp_no_broadcast": (W.UNEVEN, assert_close_exact),
    "empty_rank": (W.RANK1_EMPTY, assert_close_exact),
    "syncbn": (W.UNEVEN, assert_close_exact),
}


@pytest.mark.parametrize("name", sorted(MERGED))
def test_merged_stats_equal_union_reference_and_are_identical(world_runs, name):
    sizes, check = MERGED[name]
    world, per_rank = scenario(world_runs, name)
    for rank, result in enumerate(per_rank):
        assert "error" not in result, "rank {}: {}".format(rank, result)
        assert result["world_size"] == world
    assert_identical_on_all_ranks(per_rank, name)
    assert_matches_reference(per_rank, W.union_batches(sizes, world), check, name)


def test_ddp_wrapper_still_trains_after_the_pass(world_runs):
    for name in ("ddp", "ddp_no_broadcast"):
        _, per_rank = scenario(world_runs, name)
        grads = [r["grads"] for r in per_rank]
        assert torch.isfinite(grads[0]).all() and grads[0].abs().sum() > 0
        # Each rank stepped on its own batch: equal gradients prove DDP's all-reduce ran.
        assert all(torch.equal(grads[0], g) for g in grads[1:]), name


def test_syncbn_runs_locally_during_the_pass_and_is_restored(world_runs):
    _, per_rank = scenario(world_runs, "syncbn")
    assert all(r["forward_restored"] for r in per_rank)


@pytest.mark.parametrize("name", ["helper", "hook"])
def test_helper_and_hook_merge_across_ranks(world_runs, name):
    world, per_rank = scenario(world_runs, name)
    seen = [
        b for rank in range(world) for b in W.cycled(W.rank_batches(W.UNEVEN, rank), W.HELPER_ITERS)
    ]
    assert_identical_on_all_ranks(per_rank, name)
    assert_matches_reference(per_rank, seen, assert_close_exact, name)


def test_merge_over_a_subgroup(world_runs):
    world, per_rank = scenario(world_runs, "subgroup")
    assert [r["world_size"] for r in per_rank] == [2, 2] + [1] * (world - 2)
    assert_identical_on_all_ranks(per_rank[:2], "subgroup")
    inside = W.union_batches(W.UNEVEN, 2)
    assert_matches_reference(per_rank[:2], inside, assert_close_exact, "subgroup")
    for rank in range(2, world):
        alone = W.rank_batches(W.UNEVEN, rank)
        assert_matches_reference([per_rank[rank]], alone, assert_close_exact, "rank {}".format(rank))


def test_per_rank_option_keeps_each_ranks_own_stats(world_runs):
    world, per_rank = scenario(world_runs, "per_rank")
    for rank, result in enumerate(per_rank):
        assert result["world_size"] == 1
        alone = W.rank_batches(W.UNEVEN, rank)
        assert_matches_reference([result], alone, assert_close_exact, "rank {}".format(rank))
    assert not torch.equal(per_rank[0]["buffers"]["1"][0], per_rank[1]["buffers"]["1"][0])


def test_no_batch_on_any_rank_raises_everywhere_and_changes_nothing(world_runs):
    _, per_rank = scenario(world_runs, "all_empty")
    for result in per_rank:
        assert result["error"] == "EmptyDataError" and "on any rank" in result["message"]
        assert result["unchanged"]


def test_layer_mismatch_raises_on_every_rank(world_runs):
    _, per_rank = scenario(world_runs, "layout_mismatch")
    for result in per_rank:
        assert result["error"] == "DistributedError" and "disagree" in result["message"]
        assert result["unchanged"]


def test_failure_on_one_rank_raises_on_all_instead_of_hanging(world_runs):
    world, per_rank = scenario(world_runs, "failure")
    assert per_rank[1]["error"] == "OSError"
    for rank in [0] + list(range(2, world)):
        assert per_rank[rank]["error"] == "DistributedError", per_rank[rank]
        assert "[1]" in per_rank[rank]["message"]
    assert all(r["unchanged"] for r in per_rank)


def test_prior_pools_the_samples_of_every_rank_and_undo_restores_every_rank(world_runs):
    world, per_rank = scenario(world_runs, "undo")
    assert_identical_on_all_ranks(per_rank, "undo")
    model = W.make_model()
    union = W.union_batches(W.UNEVEN, world)
    ref = float64_reference(model, union)
    samples = sum(b.shape[0] for b in union)
    for name, m in model.named_modules():
        if name in ref:
            mean_t, var_t, _ = ref[name]
            mean_s, var_s = m.running_mean.double(), m.running_var.double()
            total = 8 + samples
            mean = (8 * mean_s + samples * mean_t) / total
            var = (8 * var_s + samples * var_t) / total + 8 * samples * (mean_s - mean_t) ** 2 / total ** 2
            new_mean, new_var, _, _ = per_rank[0]["layers"][name]
            assert_close_exact(new_mean, new_var, mean, var, name)
            assert_close_exact(*per_rank[0]["targets"][name], mean_t, var_t, name)
    assert all(r["undone"] for r in per_rank)


@pytest.mark.parametrize("name, failing, error", [
    ("interrupt", 1, "KeyboardInterrupt"),
    ("lazy_layer", 1, "LayerError"),
    ("warning_as_error", 0, "PreciseBNWarning"),
    ("undo_refused", 1, "UndoError"),
])
def test_any_exception_on_one_rank_makes_every_rank_fail_together(world_runs, name, failing, error):
    """Ctrl-C mid-pass, a LayerError before the first round, a warning turned into an error after
    the merge, an undo that one rank refuses: the failing rank raises its own error, every other
    rank a DistributedError naming it (told in a round, not timed out), and no rank changes its
    model."""
    world, per_rank = scenario(world_runs, name)
    assert per_rank[failing]["error"] == error, per_rank[failing]
    for rank in range(world):
        if rank != failing:
            assert per_rank[rank]["error"] == "DistributedError", per_rank[rank]
            assert "[{}]".format(failing) in per_rank[rank]["message"], per_rank[rank]
            assert "waited" not in per_rank[rank]["message"]
    assert all(r["unchanged"] for r in per_rank)


def test_a_killed_rank_makes_the_others_raise_within_the_timeout(tmp_path):
    """Rank 1 is killed in the middle of its data: rank 0 raises DistributedError, wrapping
    the backend's error, instead of waiting for gloo's half hour."""
    result, killed = W.spawn_alone("killed_mid_pass", 2, str(tmp_path), SPAWN_TIMEOUT_S, timeout=5.0)
    assert killed is None and result is not None, "rank 0 never finished"
    assert result["error"] == "DistributedError", result
    assert "rank 0" in result["message"] and result["unchanged"]


def test_a_rank_without_bn_layers_fails_every_rank_at_once_and_the_next_call_works(world_runs):
    """Rank 1's model has no BatchNorm layer: every rank raises, told in the first round (not
    timed out), naming each rank's layers; no rank is left out of step for the next call."""
    world, per_rank = scenario(world_runs, "no_layer_on_rank_1")
    for result in per_rank:
        assert result["error"] == "DistributedError" and result["unchanged"], result
        message = result["message"]
        assert "disagree on layers" in message and "waited" not in message, message
        assert "0 layer(s), 0 channels (none) on rank 1" in message, message
        others = "rank 0" if world == 2 else "ranks 0, 2"
        assert "3 layer(s), 15 channels (1:4, 4:6, 9:5) on {}".format(others) in message, message
    again = [r["again"] for r in per_rank]
    assert_identical_on_all_ranks(again, "the next call")
    assert_matches_reference(again, W.union_batches(W.UNEVEN, world), assert_close_exact, "the next call")


def test_no_bn_layer_on_any_rank_returns_together_and_the_next_call_works(world_runs):
    world, per_rank = scenario(world_runs, "no_layer_anywhere")
    assert [(r["layers"], r["world_size"]) for r in per_rank] == [(0, world)] * world
    again = [r["again"] for r in per_rank]
    assert_matches_reference(again, W.union_batches(W.UNEVEN, world), assert_close_exact, "the next call")


@pytest.mark.parametrize("option", sorted(W.DISAGREEING))
def test_ranks_disagreeing_on_an_option_all_raise_naming_it_and_each_ranks_value(world_runs, option):
    """Rank 1 alone sets ``option``: every rank raises in the first round, before any batch,
    naming the option and the value of each rank; nothing changes."""
    world, per_rank = scenario(world_runs, "disagree_" + option)
    default = repr(getattr(Options(), option))
    others = "rank 0" if world == 2 else "ranks 0, 2"
    expected = "disagree on {} ({} on {}; {} on rank 1)".format(option, default, others, repr(W.DISAGREEING[option]))
    for result in per_rank:
        assert result["error"] == "DistributedError" and result["unchanged"], result
        assert expected in result["message"] and "waited" not in result["message"], result["message"]
        assert "layers (" not in result["message"], result["message"]  # only what differs


def test_ranks_running_other_precise_bn_versions_all_raise_naming_them(world_runs):
    world, per_rank = scenario(world_runs, "other_version")
    others = "rank 0" if world == 2 else "ranks 0, 2"
    for result in per_rank:
        assert result["error"] == "DistributedError", result
        assert "disagree on precise-bn version ({} on {}; 0.0.1 on rank 1)".format(
            precise_bn.__version__, others) in result["message"], result


def test_fields_too_long_for_their_slot_are_cut_but_told_apart():
    """What the round after differing digests shows: each value (cut to its slot, the cut
    marked), the ranks holding it as ranges, and digests where the cut values look alike."""
    fields = [{"layers": "x" * 1000 + end, "rtol": rtol} for end, rtol in [("a", "None"), ("b", "0.5")]]
    tables = [distributed._decode(distributed._encode(fields[rank in (3, 6)])) for rank in range(7)]
    layers = distributed._by_value([table["layers"] for table in tables])
    shown = "x" * (distributed._SLOT_BYTES - 8 - len("layers") - 1) + "..."
    assert layers.count(shown + " (digest ") == 2
    assert " on ranks 0-2, 4-5; " in layers and layers.endswith(" on ranks 3, 6")
    assert distributed._by_value([table["rtol"] for table in tables]) == "None on ranks 0-2, 4-5; 0.5 on ranks 3, 6"


def test_every_agreed_option_is_one_that_ranks_could_set_apart():
    """Each option is either compared across ranks or one that may differ per rank (why, below);
    a new option must be put on one side."""
    per_rank = {
        "forward_fn", "device", "progress", "log_period",  # how a rank runs or reports, not what it measures
        "layers",  # compared as the layers it selects, with their widths
        "group",  # the ranks that merge are those of the group
        "timeout",  # how long each rank waits
    }
    fields = set(OPTION_FIELDS)
    assert set(distributed.AGREED_OPTIONS) | per_rank == fields
    assert not set(distributed.AGREED_OPTIONS) & per_rank


def test_a_group_without_this_rank_is_refused_before_anything_runs(world_runs):
    """``group=`` a group of rank 0 alone: the other ranks raise ConfigError naming it, from
    the options and from recompute, unchanged, and are still in step for every later scenario;
    with sync=False they recompute alone."""
    world, per_rank = scenario(world_runs, "outside_group")
    assert per_rank[0]["error"] is None and per_rank[0]["options"]["error"] is None
    for rank, result in enumerate(per_rank):
        if rank:
            for error in (result, result["options"]):
                assert error["error"] == "ConfigError", error
                assert "group=GroupMember.NON_GROUP_MEMBER does not contain this process (rank {} ".format(rank) \
                    in error["message"], error
            assert result["unchanged"]
        assert result["alone"]["world_size"] == 1
        assert_matches_reference([result["alone"]], W.rank_batches(W.UNEVEN, rank), assert_close_exact, "alone")


def test_single_process_is_the_identity():
    assert not distributed.is_distributed()
    assert (distributed.get_world_size(), distributed.get_rank()) == (1, 0)
    assert distributed.is_main_process() and not distributed.resolve_sync(None)
    assert not distributed.resolve_sync(True)
    stats = PopulationStats(2, name="bn")
    stats.add_call(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25]), 4)
    ranks = distributed.Ranks(enabled=True)
    assert ranks.world == 1 and ranks.assemble(ranks.merge_part([stats])) == [stats]
    assert ranks.exchange(distributed.ACTIVE, 3, 12)[0].batches == 3
    ranks.abort()
    distributed.barrier()


def test_syncbn_on_one_process_matches_reference_and_is_restored():
    model = W.make_model(sync_bn=True)
    batches = W.union_batches(W.UNEVEN, 3)
    report = recompute(model, batches)
    check = assert_close_exact
    for name, (ref_mean, ref_var, count) in float64_reference(W.make_model(), batches).items():
        module = dict(model.named_modules())[name]
        assert isinstance(module, nn.SyncBatchNorm) and "forward" not in vars(module)
        check(module.running_mean, module.running_var, ref_mean, ref_var, name)
        assert report[name].elements == count and report[name].calls == len(batches)


def _load_example():
    path = os.path.join(REPO_ROOT, "scripts", "distributed_example.py")
    spec = importlib.util.spec_from_file_location("distributed_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_torchrun_example_env_init(tmp_path):
    """``torchrun --nproc_per_node=2`` (env:// init): rank 0 saves stats equal to the union's."""
    path, example = _load_example()
    save = tmp_path / "bn.pt"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, *torchrun(2), path, "--save", str(save),
    ]
    # A new session lets a timeout kill the launcher and its workers together.
    proc = subprocess.Popen(
        command, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=SPAWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("torchrun ran past {:.0f} s:\n{}".format(SPAWN_TIMEOUT_S, output.decode()))
    text = output.decode()
    assert proc.returncode == 0, text
    assert "identical on all 2 ranks: True" in text, text
    state = torch.load(str(save))
    dataset = example.make_dataset()
    batches = [b[0] for rank in range(2) for b in example.shard_loader(dataset, rank, 2)]
    for name, (ref_mean, ref_var, _) in float64_reference(example.make_model(), batches).items():
        assert_close_exact(
            state[name + ".running_mean"], state[name + ".running_var"], ref_mean, ref_var, name
        )


def test_sliced_merge_equals_one_process_merging_in_rank_order(world_runs):
    """Every rank ends with the bits of one process merging every rank's statistics in rank
    order, though each merged only a slice of the channels; the rtol round's maximum per layer
    is the maximum over the whole merged layer."""
    world, per_rank = scenario(world_runs, "sliced_merge")
    expected = []
    for index, width in enumerate(W.MERGE_WIDTHS):
        total = PopulationStats(width)
        for rank in range(world):
            total.merge(W.random_stats(rank)[index])
        expected.append(total)
    for result in per_rank:
        assert all(torch.equal(got, want.state()) for got, want in zip(result["merged"], expected))
        assert result["worst"] == [float(s.mean.max()) for s in expected]
        payload = sum(PopulationStats.state_size(w) for w in W.MERGE_WIDTHS) * 8
        assert 0 < result["received"] < 2 * payload  # an all-gather of everything would be (world - 1) x
