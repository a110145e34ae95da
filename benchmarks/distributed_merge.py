"""What the merge of statistics costs each rank, by number of ranks, with ResNet-50's BN layout.

Three exchanges, on W gloo ranks on this machine (W = 2, 4, 8 by default):

* ``gather all``: the merge before the slicing, every rank all-gathering every rank's whole
  statistics (``3 + R C`` float64 per layer of ``C`` channels, ``R`` the
  estimator's ``STATE_ROWS``) and merging all of them in rank order;
* ``sliced``: :meth:`Ranks.merge_part` (each rank receives every rank's part of its slice of
  the channels and merges it) then :meth:`Ranks.assemble` (the merged slices all-gathered);
* ``rtol round``: :meth:`Ranks.merge_part` then :meth:`Ranks.worst` (one float64 per layer
  all-reduced with MAX): what a precision check that does not stop exchanges.

Bytes received per rank are what the collectives deliver from the other ranks (tensor bytes,
not bytes on the wire); times are medians over repetitions, the slowest rank's, barrier to
barrier. Then, in one process, the local work of one rank at W = 1024 (chunks made up, the
merge itself real) and the exact byte counts from the slice plan at 1024 ranks.

    python benchmarks/distributed_merge.py [--ranks 2 4 8] [--repeat 5] [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_common_arguments, command_line, markdown_table, parse_common, run_text,  # noqa: E402
                    write_section)
from precise_bn import slices  # noqa: E402
from precise_bn.distributed import Ranks  # noqa: E402
from precise_bn.estimator import STATE_ROWS, PopulationStats  # noqa: E402

def resnet50_widths() -> List[int]:
    from torchvision.models import resnet50

    return [m.num_features for m in resnet50().modules() if isinstance(m, torch.nn.BatchNorm2d)]


def layer_stats(widths: Sequence[int], seed: int) -> List[PopulationStats]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for index, width in enumerate(widths):
        stats = PopulationStats(width, name=str(index))
        for call in range(3):
            stats.add_call(torch.randn(width, generator=gen), torch.rand(width, generator=gen) + 0.1, 64 + call)
        out.append(stats)
    return out


def gather_all(ranks: Ranks, stats: Sequence[PopulationStats]) -> List[PopulationStats]:
    """The merge before the slicing: every rank's whole statistics to every rank."""
    payload = torch.cat([s.state() for s in stats])
    parts = ranks._gather(payload, "merge")
    merged, offset = [], 0
    for local in stats:
        size = PopulationStats.state_size(local.num_channels)
        total = PopulationStats(local.num_channels, name=local.name)
        for part in parts:
            total.merge(PopulationStats.from_state(part[offset: offset + size]))
        merged.append(total)
        offset += size
    return merged


def _rank(rank: int, world: int, store: str, repeat: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    stats = layer_stats(resnet50_widths(), rank)
    ranks = Ranks(True, timeout=600.0)
    runs = {
        "gather all": lambda: gather_all(ranks, stats),
        "sliced": lambda: ranks.assemble(ranks.merge_part(stats)),
        "rtol round": lambda: ranks.worst(ranks.merge_part(stats), lambda s: float(s.m2.max())),
    }
    result: Dict[str, List[float]] = {}
    for name, run in runs.items():
        seconds, received = [], 0
        for _ in range(repeat):
            dist.barrier()
            before = ranks.received
            start = time.perf_counter()
            run()
            dist.barrier()
            seconds.append(time.perf_counter() - start)
            received = ranks.received - before
        result[name] = [statistics.median(seconds), float(received)]
    torch.save(result, os.path.join(out, "rank{}.pt".format(rank)))
    dist.destroy_process_group()


def measure(world: int, repeat: int) -> Dict[str, List[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), repeat, tmp), nprocs=world)
        per_rank = [torch.load(os.path.join(tmp, "rank{}.pt".format(r))) for r in range(world)]
    return {name: [max(r[name][0] for r in per_rank), max(r[name][1] for r in per_rank)] for name in per_rank[0]}


def planned_bytes(widths: Sequence[int], world: int) -> Dict[str, int]:
    """Bytes one rank receives from the others, from the slice plan alone."""
    payload = sum(PopulationStats.state_size(w) for w in widths)
    size = slices.chunk_size(slices.plan(widths, world))
    return {"gather all": 8 * (world - 1) * payload, "sliced": 8 * 2 * (world - 1) * size,
            "rtol round": 8 * (world - 1) * size + 8 * len(widths) * (world - 1) // world}


def local_merge_seconds(widths: Sequence[int], world: int) -> float:
    """One rank's merge of its slice from ``world`` made-up chunks, and the join of ``world``
    merged slices: the CPU work of the sliced merge at that many ranks, without the network."""
    plan = slices.plan(widths, world)
    size = slices.chunk_size(plan)
    states = [s.state() for s in layer_stats(widths, 0)]
    chunk = slices.pack(states, plan[0], size)
    names = [str(i) for i in range(len(widths))]
    start = time.perf_counter()
    slices.merge_in_rank_order([chunk] * world, plan[0], names)
    merged = [slices.pack(states, segments, size) for segments in plan]
    slices.join(merged, plan, names)
    return time.perf_counter() - start


def gather_all_local_seconds(widths: Sequence[int], world: int) -> float:
    """The local merge of ``gather all`` over ``world`` ranks' whole statistics."""
    parts = layer_stats(widths, 0)
    start = time.perf_counter()
    for local in parts:
        total = PopulationStats(local.num_channels)
        for _ in range(world):
            total.merge(local)
    return time.perf_counter() - start


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="default 2 4 8 (2 with --quick)")
    parser.add_argument("--repeat", type=int, default=None, help="default 5 (1 with --quick)")
    args = parse_common(parser, list(argv) or None)
    args.ranks = args.ranks or ([2] if args.quick else [2, 4, 8])
    args.repeat = args.repeat or (1 if args.quick else 5)
    widths = resnet50_widths()
    payload = 8 * sum(PopulationStats.state_size(w) for w in widths)
    rows = []
    for world in args.ranks:
        measured = measure(world, args.repeat)
        planned = planned_bytes(widths, world)
        for name, (seconds, received) in measured.items():
            assert int(received) == planned[name], (name, received, planned[name])
            rows.append([world, name, "{:,.0f}".format(received),
                         "{:.2f}".format(planned[name] / payload), "{:.1f}".format(1000 * seconds)])
    scale = []
    for world in ((8,) if args.quick else (8, 64, 1024)):
        planned = planned_bytes(widths, world)
        old_seconds = gather_all_local_seconds(widths, min(world, 64)) * world / min(world, 64)
        scale.append([world, "{:,.0f}".format(planned["gather all"]), "{:,.0f}".format(planned["sliced"]),
                      "{:,.0f}".format(planned["rtol round"]), "{:.3f}".format(old_seconds),
                      "{:.3f}".format(local_merge_seconds(widths, world))])
    body = "\n\n".join([
        "## The merge of statistics across ranks (ResNet-50: {} BN layers, {} channels, payload {:,} bytes "
        "per rank)".format(len(widths), sum(widths), payload),
        "Command: `{}`. {}".format(command_line(argv or None), run_text(1)),
        "Measured on W gloo ranks of this machine (all on its cores, so times include sharing them). "
        "Bytes: received per rank from the other ranks; x payload: that over one rank's payload. "
        "Time: the slowest rank, median of {} repetitions.".format(args.repeat),
        markdown_table(["ranks", "exchange", "bytes received per rank", "x payload", "time (ms)"], rows),
        "Carried to more ranks: bytes per rank from the slice plan (exact: W-1 chunks of the largest "
        "slice, twice for the sliced merge; W-1 whole payloads for gather all), and the local CPU work "
        "of one rank measured in one process (gather all: merging W whole payloads, measured at "
        "min(W, 64) and scaled by W/min(W, 64); sliced: packing its W chunks, merging W chunks of its "
        "slice and joining W merged slices). Formula: gather all receives 8 (W-1) (3 L + {r} C) bytes; the sliced "
        "merge 8 * 2 (W-1) S with S = 3 s + {r} ceil(C / W), s the most layers a slice touches, "
        "so about 16 ({r} C + 3 s W) bytes: flat in W up to the 3 s W term (s is 5 for ResNet-50 at 64 "
        "ranks, 2 at 1024). The rtol round is half of that plus 8 bytes per layer.".format(r=STATE_ROWS),
        markdown_table(["ranks", "gather all (bytes)", "sliced (bytes)", "rtol round (bytes)",
                        "gather all, local merge (s)", "sliced, local merge (s)"], scale),
    ])
    write_section(args.out / "DISTRIBUTED_RESULTS.md", "distributed_merge", body)
    print(body)


if __name__ == "__main__":
    main(sys.argv[1:])
