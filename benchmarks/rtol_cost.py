"""What the precision stop's check costs: the same pass with and without ``rtol``, on one
process and on two gloo ranks.

The check runs every ``CHECK_EVERY`` batches once ``min_batches`` were read: it merges every
layer's pending calls, (with several ranks) gathers and merges every rank's statistics, and
computes channels' standard errors until a layer is not precise enough yet. To time it alone,
``rtol`` is set so small that it is never met: both passes read the same batches and differ only
by the checks. :func:`check_ms` times one check alone, as the driver makes it.
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cases import Case
from common import FLOOR, settle, time_ratios
from precise_bn import recompute
from precise_bn.data import count_samples
from precise_bn.distributed import Ranks
from precise_bn.driver import CHECK_EVERY
from precise_bn.options import Options
from precise_bn.precision import worst_ratio
from precise_bn.pytorch.bn_pass import BNPass

NEVER_MET = 1e-12


def _runs(case: Case) -> Dict[str, Callable[[], None]]:
    model, batches = case.build()

    def plain() -> None:
        recompute(model, batches, progress=False, log_period=None)

    def checked() -> None:
        recompute(model, batches, progress=False, log_period=None, rtol=NEVER_MET)

    return {FLOOR: plain, "with rtol": checked}


def single_process(case: Case, reps: int) -> Dict[str, float]:
    """Time of the pass with ``rtol`` over the time without (adjacent runs, median of ``reps``),
    and the milliseconds of one check, timed alone."""
    timing = time_ratios(_runs(case), reps)
    return {"ratio": timing["with rtol"].median, "low": min(timing["with rtol"].ratios),
            "high": max(timing["with rtol"].ratios), "seconds": timing[FLOOR].seconds,
            "ms_per_check": check_ms(case, NEVER_MET), "full_check_ms": check_ms(case, 1.0 - 1e-9)}


def check_ms(case: Case, rtol: float, ranks: Optional[Ranks] = None) -> float:
    """Milliseconds of one check, timed alone, as the driver makes it: merging the calls pending
    since the previous check, this rank's slice of every layer merged over ``ranks`` (one
    process when not given), then the worst :func:`~precise_bn.precision.worst_ratio` with
    ``rtol`` over the ranks. With an ``rtol`` never met or one every channel meets alike, every
    layer's standard errors are computed. Mean over the checks of a pass of ``case.batches``
    batches, the first left out."""
    ranks = ranks or Ranks(False)
    model, batches = case.build()
    bn_pass = BNPass(model, Options())
    spent: List[float] = []
    samples = 0
    with bn_pass, torch.no_grad():
        for done, batch in enumerate(batches, 1):
            model(batch)
            samples += count_samples(batch)
            if done % CHECK_EVERY == 0:
                begin = time.perf_counter()
                part = ranks.merge_part(bn_pass.collect())
                max(ranks.worst(part, lambda s: worst_ratio(s, rtol, samples)), default=0.0) <= 1.0
                spent.append(time.perf_counter() - begin)
    return 1e3 * statistics.mean(spent[1:] or spent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, case: Case, reps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = _runs(Case(**dict(vars(case), seed=case.seed + rank)))
        ratios: List[float] = []
        plain_seconds: List[float] = []
        for rep in range(reps + 1):  # the first is a warm-up
            seconds = {}
            for name in ((FLOOR, "with rtol") if rep % 2 else ("with rtol", FLOOR)):
                dist.barrier()
                begin = time.perf_counter()
                runs[name]()
                seconds[name] = time.perf_counter() - begin
            if rep:
                ratios.append(seconds["with rtol"] / seconds[FLOOR])
                plain_seconds.append(seconds[FLOOR])
            else:
                settle()
        check = check_ms(Case(**dict(vars(case), seed=case.seed + rank)), NEVER_MET, Ranks(True))
        if rank == 0:
            torch.save({"ratios": ratios, "seconds": plain_seconds, "check_ms": check}, out)
    finally:
        dist.destroy_process_group()


def two_ranks(case: Case, reps: int) -> Dict[str, float]:
    """The same comparison on two gloo ranks (one thread each), each rank with its own batches;
    rank 0's times. Without ``rtol`` the ranks still meet every ``CHECK_EVERY`` batches for a
    status round; with it, every such round also gathers and merges all statistics."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.pt")
        mp.spawn(_rank, args=(2, _free_port(), case, reps, out), nprocs=2, join=True)
        result = torch.load(out)
    return {"ratio": statistics.median(result["ratios"]), "low": min(result["ratios"]), "high": max(result["ratios"]),
            "seconds": statistics.median(result["seconds"]), "ms_per_check": result["check_ms"]}
