"""Code the distributed tests run inside each spawned rank, and the data both sides agree on.

The parent test process and every rank build the same model and the same per-rank batches from
fixed seeds, so the parent can compute the float64 reference over the union of the ranks'
batches while the ranks only report what they ended with.
"""
from __future__ import annotations

import importlib
import os
import signal
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from precise_bn import BatchNormHelper, PopulationStats, PreciseBNHook, recompute
from precise_bn import distributed
from precise_bn.distributed import Ranks
from precise_bn.options import Options

Result = Dict[str, Any]

# Batch sizes per rank (rank r uses row r): uneven counts and sizes, and one layout where
# rank 1 gets nothing at all.
UNEVEN = [[5, 3, 7], [4], [6, 2]]
RANK1_EMPTY = [[5, 3], [], [4, 6, 2]]
HELPER_ITERS = 2


def make_model(sync_bn: bool = False) -> nn.Module:
    """Two BatchNorm2d layers and a BatchNorm1d (layers ``1``, ``4``, ``9``); fixed weights."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 5),
        nn.BatchNorm1d(5),
    )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync_bn else model


def bn_names(model: nn.Module) -> List[str]:
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def rank_batches(sizes: List[List[int]], rank: int) -> List[torch.Tensor]:
    """Rank ``rank``'s batches: shifted and scaled per channel so no statistic is trivial."""
    gen = torch.Generator().manual_seed(100 + rank)
    shift = torch.tensor([3.0, -1.0, 0.5]).view(1, 3, 1, 1)
    return [torch.randn(n, 3, 6, 6, generator=gen) * 2.0 + shift for n in sizes[rank]]


def union_batches(sizes: List[List[int]], world: int) -> List[torch.Tensor]:
    return [b for rank in range(world) for b in rank_batches(sizes, rank)]


def cycled(batches: List[torch.Tensor], iters: int) -> List[torch.Tensor]:
    """What an endless cycle over ``batches`` yields in ``iters`` steps (none if empty)."""
    return [batches[i % len(batches)] for i in range(iters)] if batches else []


def outcome(model: nn.Module, report=None) -> Result:
    """The BN buffers the model ends with and, if given, the report's merged float64 stats."""
    out: Result = {
        "buffers": {
            name: (m.running_mean.detach().clone(), m.running_var.detach().clone())
            for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m.running_mean, nn.parameter.UninitializedBuffer)
        }
    }
    if report is not None:
        out["batches"] = report.batches
        out["samples"] = report.samples
        out["world_size"] = report.world_size
        out["layers"] = {
            layer.name: (layer.new_mean, layer.new_var, layer.elements, layer.calls)
            for layer in report.layers
        }
    return out


def raised(model: nn.Module, run: Callable[[], Any]) -> Result:
    """Call ``run``; report the error it raised (KeyboardInterrupt included) and whether the BN
    buffers kept their bits."""
    before = outcome(model)["buffers"]
    try:
        run()
    except BaseException as exc:
        after = outcome(model)["buffers"]
        unchanged = all(torch.equal(before[k][i], after[k][i]) for k in before for i in (0, 1))
        return {"error": type(exc).__name__, "message": str(exc), "unchanged": unchanged}
    return {"error": None}


def _plain(rank: int, world: int, **options: Any) -> Result:
    model = make_model()
    return outcome(model, recompute(model, rank_batches(UNEVEN, rank), **options))


def _ddp(rank: int, world: int, broadcast_buffers: bool) -> Result:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    out = outcome(model, recompute(ddp, rank_batches(UNEVEN, rank)))
    # The wrapper still trains: a forward issues its buffer broadcast and backward all-reduces
    # the gradients of different per-rank batches into the same average on every rank.
    ddp.train()
    ddp(rank_batches([[4]] * world, rank)[0]).pow(2).mean().backward()
    out["grads"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return out


def _empty_rank(rank: int, world: int) -> Result:
    model = make_model()
    return outcome(model, recompute(model, rank_batches(RANK1_EMPTY, rank)))


def _all_empty(rank: int, world: int) -> Result:
    model = make_model()
    return raised(model, lambda: recompute(model, []))


def _helper(rank: int, world: int) -> Result:
    model = make_model()
    helper = BatchNormHelper(iters=HELPER_ITERS)
    helper.create_bn_aux_model(model, rank_batches(UNEVEN, rank))
    return outcome(model, helper.compute_and_update_bn_stats(curr_iter=1))


def _hook(rank: int, world: int) -> Result:
    model = make_model()
    hook = PreciseBNHook(model, rank_batches(UNEVEN, rank), num_batches=HELPER_ITERS)
    return outcome(model, hook.before_eval(1))


def _syncbn(rank: int, world: int) -> Result:
    model = make_model(sync_bn=True)
    out = outcome(model, recompute(model, rank_batches(UNEVEN, rank)))
    out["forward_restored"] = all(
        "forward" not in vars(m) for m in model.modules() if isinstance(m, nn.SyncBatchNorm)
    )
    return out


def _subgroup(rank: int, world: int) -> Result:
    """Ranks 0 and 1 merge over a group of their own; any other rank recalibrates alone."""
    group = dist.new_group([0, 1])  # a collective: every rank creates it
    model = make_model()
    options: Dict[str, Any] = {"group": group} if rank < 2 else {"sync": False}
    return outcome(model, recompute(model, rank_batches(UNEVEN, rank), **options))


def no_bn_model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 2))


def _no_layer_on_rank_1(rank: int, world: int) -> Result:
    """Rank 1's model has no BatchNorm layer: every rank raises at once; the next call works."""
    model = make_model()
    mine = no_bn_model() if rank == 1 else model
    out = raised(model, lambda: recompute(mine, rank_batches(UNEVEN, rank), timeout=LONG_TIMEOUT))
    out["again"] = _plain(rank, world, timeout=LONG_TIMEOUT)
    return out


def _no_layer_anywhere(rank: int, world: int) -> Result:
    """No rank has a BatchNorm layer: every rank returns an empty report; the next call works."""
    report = recompute(no_bn_model(), rank_batches(UNEVEN, rank), timeout=LONG_TIMEOUT)
    return {"layers": len(report.layers), "world_size": report.world_size,
            "again": _plain(rank, world, timeout=LONG_TIMEOUT)}


#: One option rank 1 sets differently from the other ranks, per scenario ``disagree_<option>``.
DISAGREEING: Dict[str, Any] = {"rtol": 0.5, "min_batches": 32, "unbiased": True, "num_batches": 2,
                               "num_samples": 5, "prior": 4.0, "sync": True, "autocast": torch.bfloat16}


def _disagree(option: str) -> Callable[[int, int], Result]:
    def scenario(rank: int, world: int) -> Result:
        model = make_model()
        options = {option: DISAGREEING[option]} if rank == 1 else {}
        return raised(model, lambda: recompute(model, rank_batches(UNEVEN, rank), timeout=LONG_TIMEOUT, **options))
    return scenario


def _other_version(rank: int, world: int) -> Result:
    """Rank 1 runs another precise-bn version."""
    model = make_model()
    saved = distributed.__version__
    distributed.__version__ = "0.0.1" if rank == 1 else saved
    try:
        return raised(model, lambda: recompute(model, rank_batches(UNEVEN, rank), timeout=LONG_TIMEOUT))
    finally:
        distributed.__version__ = saved


def _outside_group(rank: int, world: int) -> Result:
    """``group=`` a group of rank 0 alone: refused on the other ranks before any round (the
    scenarios after it would be out of step otherwise), unless they also pass ``sync=False``."""
    group = dist.new_group([0])  # a collective: every rank creates it
    model = make_model()
    out = raised(model, lambda: recompute(model, rank_batches(UNEVEN, rank), group=group, timeout=LONG_TIMEOUT))
    out["options"] = raised(model, lambda: Options(group=group))
    alone = make_model()
    out["alone"] = outcome(alone, recompute(alone, rank_batches(UNEVEN, rank), group=group,
                                            sync=False if rank else None))
    return out


def _layout_mismatch(rank: int, world: int) -> Result:
    model = make_model()
    layers = None if rank == 0 else bn_names(model)[:1]
    return raised(model, lambda: recompute(model, rank_batches(UNEVEN, rank), layers=layers))


class _FailingLoader:
    """Yields the rank's first ``good`` batches, then raises (a corrupt file on one rank)."""

    def __init__(self, batches: List[torch.Tensor], good: int):
        self.batches = batches
        self.good = good

    def __iter__(self):
        for batch in self.batches[: self.good]:
            yield batch
        raise OSError("cannot read batch {} on this rank".format(self.good))


def _failure(rank: int, world: int) -> Result:
    """Rank 1's loader fails: on its first batch with 2 ranks, on its second with 3."""
    model = make_model()
    batches = rank_batches(UNEVEN, rank)
    loader = _FailingLoader(batches, good=world - 2) if rank == 1 else batches
    return raised(model, lambda: recompute(model, loader))


class _InterruptingLoader(_FailingLoader):
    """Ctrl-C on one rank, in the middle of its data."""

    def __iter__(self):
        for batch in self.batches[: self.good]:
            yield batch
        raise KeyboardInterrupt


def _interrupt(rank: int, world: int) -> Result:
    """Rank 1 is interrupted after one batch; the others have more to read."""
    model = make_model()
    batches = rank_batches(UNEVEN, rank) * 4
    loader = _InterruptingLoader(batches, good=1) if rank == 1 else batches
    return raised(model, lambda: recompute(model, loader, timeout=LONG_TIMEOUT))


def _lazy_layer(rank: int, world: int) -> Result:
    """Rank 1's model has a lazy BN layer never run: layer selection fails before any round."""
    model = make_model()
    if rank == 1:
        model.add_module("lazy", nn.LazyBatchNorm1d())
    return raised(model, lambda: recompute(model, rank_batches(UNEVEN, rank), timeout=LONG_TIMEOUT))


def _warning_as_error(rank: int, world: int) -> Result:
    """Only rank 0 turns warnings into errors, and only its data ends before the budget: it
    fails after the merge, at its short-data warning; no rank may write."""
    model = make_model()
    batches = rank_batches(UNEVEN, rank) if rank == 0 else rank_batches(UNEVEN, rank) * 9
    with warnings.catch_warnings():
        if rank == 0:
            warnings.simplefilter("error")
        else:
            warnings.simplefilter("ignore")
        return raised(model, lambda: recompute(model, batches, num_batches=4, timeout=LONG_TIMEOUT))


MERGE_WIDTHS = [5, 1, 7, 2]  # cut mid-layer by 2 and by 3 ranks


def random_stats(rank: int) -> List[PopulationStats]:
    """Layers of :data:`MERGE_WIDTHS` channels with a few calls of random statistics."""
    gen = torch.Generator().manual_seed(200 + rank)
    stats = []
    for index, width in enumerate(MERGE_WIDTHS):
        layer = PopulationStats(width, name="layer{}".format(index))
        for calls in range(1 + rank % 2 + index % 3):
            layer.add_call(torch.randn(width, generator=gen) * 3 + 1, torch.rand(width, generator=gen) + 0.1,
                           3 + calls + rank)
        stats.append(layer)
    return stats


def _sliced_merge(rank: int, world: int) -> Result:
    """The sliced merge over real collectives, and the per-layer maximum the rtol round uses."""
    ranks = Ranks(True, timeout=LONG_TIMEOUT)
    part = ranks.merge_part(random_stats(rank))
    worst = ranks.worst(part, lambda piece: float(piece.mean.max()))
    return {"merged": [s.state() for s in ranks.assemble(part)], "worst": worst, "received": ranks.received}


def _undo(rank: int, world: int) -> Result:
    """Every rank recomputes with a prior (n: the samples of all ranks), then undoes."""
    model = make_model()
    before = outcome(model)["buffers"]
    report = recompute(model, rank_batches(UNEVEN, rank), prior=8, timeout=LONG_TIMEOUT)
    result = outcome(model, report)
    result["targets"] = {layer.name: (layer.target_mean, layer.target_var) for layer in report.layers}
    report.undo()
    after = outcome(model)["buffers"]
    result["undone"] = all(torch.equal(before[k][i], after[k][i]) for k in before for i in (0, 1))
    return result


def _undo_refused(rank: int, world: int) -> Result:
    """Rank 1's statistics change after the call: no rank may undo."""
    model = make_model()
    report = recompute(model, rank_batches(UNEVEN, rank), timeout=LONG_TIMEOUT)
    if rank == 1:
        with torch.no_grad():
            model[4].running_var.mul_(2)
    return raised(model, report.undo)


SCENARIOS: Dict[str, Callable[[int, int], Result]] = {
    "sliced_merge": _sliced_merge,
    "kernel": _plain,
    "per_rank": lambda rank, world: _plain(rank, world, sync=False),
    "ddp": lambda rank, world: _ddp(rank, world, broadcast_buffers=True),
    "ddp_no_broadcast": lambda rank, world: _ddp(rank, world, broadcast_buffers=False),
    "empty_rank": _empty_rank,
    "all_empty": _all_empty,
    "helper": _helper,
    "hook": _hook,
    "syncbn": _syncbn,
    "subgroup": _subgroup,
    "layout_mismatch": _layout_mismatch,
    "no_layer_on_rank_1": _no_layer_on_rank_1,
    "no_layer_anywhere": _no_layer_anywhere,
    **{"disagree_" + option: _disagree(option) for option in DISAGREEING},
    "other_version": _other_version,
    "outside_group": _outside_group,
    "undo": _undo,
    # Last: if a rank's failure were not propagated, the others would wait until the timeout.
    "failure": _failure,
    "interrupt": _interrupt,
    "lazy_layer": _lazy_layer,
    "warning_as_error": _warning_as_error,
    "undo_refused": _undo_refused,
}

# Far above how long any scenario takes: an error message that names this wait would mean the
# failure reached the other ranks by timing out, not by being told.
LONG_TIMEOUT = 120.0


def run_rank(rank: int, world: int, init_file: str, out_dir: str, table: str = __name__) -> None:
    """Join a gloo group through a file store and run every scenario of module ``table``'s
    ``SCENARIOS``, saving after each one.

    Saving after each scenario keeps what finished if a later one hangs; an error is recorded
    as that scenario's result, since the tests check which error each rank raised.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    path = os.path.join(out_dir, "rank{}.pt".format(rank))
    results: Dict[str, Result] = {}
    for name, scenario in importlib.import_module(table).SCENARIOS.items():
        try:
            results[name] = scenario(rank, world)
        except BaseException as exc:
            results[name] = {"error": type(exc).__name__, "message": str(exc)}
        torch.save(results, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.destroy_process_group()


def spawn_ranks(world: int, tmp_dir: str, timeout: float, table: str = __name__) -> List[Result]:
    """Run :func:`run_rank` on ``world`` spawned processes; kill them all past ``timeout`` s.

    Returns each rank's results (scenarios that never finished are absent) and, under the key
    ``"_finished"`` of rank 0's dict, whether every process exited cleanly in time.
    """
    init_file = os.path.join(tmp_dir, "store")
    context = mp.spawn(
        run_rank, args=(world, init_file, tmp_dir, table), nprocs=world, join=False
    )
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while not finished and time.monotonic() < deadline:
            finished = context.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    results = []
    for rank in range(world):
        path = os.path.join(tmp_dir, "rank{}.pt".format(rank))
        results.append(torch.load(path) if os.path.exists(path) else {})
    results[0]["_finished"] = finished
    return results


class _DyingLoader(_FailingLoader):
    """The process dies in the middle of its data, as under ``kill -9``."""

    def __iter__(self):
        for batch in self.batches[: self.good]:
            yield batch
        os.kill(os.getpid(), signal.SIGKILL)


def timed(model: nn.Module, run: Callable[[], Any]) -> Result:
    """:func:`raised`, and how many seconds ``run`` took."""
    start = time.monotonic()
    out = raised(model, run)
    out["seconds"] = time.monotonic() - start
    return out


def _killed_mid_pass(rank: int, world: int, timeout: float) -> Result:
    """Rank 1 dies after its first batch."""
    model = make_model()
    batches = rank_batches(UNEVEN, rank) * 20
    loader = _DyingLoader(batches, good=1) if rank == 1 else batches
    return raised(model, lambda: recompute(model, loader, timeout=timeout))


def _late_first_call(rank: int, world: int, timeout: float, stall: float) -> Result:
    """Rank 2 makes its first call ``stall`` seconds late: the others give up within the
    timeout. Once every rank is past that call (a barrier on the user's group), the next call
    works on every rank; then rank 2 leaves and the others' next call raises too."""
    model = make_model()
    if rank == 2:
        time.sleep(stall)
    out = {"first": timed(model, lambda: recompute(model, rank_batches(UNEVEN, rank), timeout=timeout))}
    dist.barrier()
    out["again"] = _plain(rank, world, timeout=LONG_TIMEOUT)
    if rank != 2:
        out["third"] = timed(model, lambda: recompute(model, rank_batches(UNEVEN, rank), timeout=timeout))
    return out


def _two_never_call(rank: int, world: int, timeout: float) -> Result:
    """Of four ranks, rank 3 is killed and rank 2 leaves, neither having called; ranks 0 and 1
    call twice."""
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        return {}
    model = make_model()
    return {call: timed(model, lambda: recompute(model, rank_batches(UNEVEN, rank), timeout=timeout))
            for call in ("first", "second")}


ALONE: Dict[str, Callable[..., Result]] = {
    "killed_mid_pass": _killed_mid_pass,
    "late_first_call": _late_first_call,
    "two_never_call": _two_never_call,
}


def _alone(rank: int, world: int, init_file: str, out_dir: str, name: str, kwargs: Dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    result = ALONE[name](rank, world, **kwargs)
    torch.save(result, os.path.join(out_dir, "alone{}.pt".format(rank)))
    os._exit(0)  # no destroy_process_group: it would wait for ranks that are gone


def spawn_alone(name: str, world: int, tmp_dir: str, spawn_timeout: float, **kwargs: Any) -> List[Optional[Result]]:
    """Run the scenario ``ALONE[name](rank, world, **kwargs)`` on ``world`` fresh gloo ranks,
    each killed past ``spawn_timeout`` s; returns each rank's result (None where it saved none)."""
    context = mp.spawn(_alone, args=(world, os.path.join(tmp_dir, "store"), tmp_dir, name, kwargs), nprocs=world,
                       join=False)
    deadline = time.monotonic() + spawn_timeout
    for process in context.processes:
        process.join(max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    paths = [os.path.join(tmp_dir, "alone{}.pt".format(rank)) for rank in range(world)]
    return [torch.load(path) if os.path.exists(path) else None for path in paths]
