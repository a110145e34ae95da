"""Peak resident memory of each method over the forward's, read in a fresh worker process.

Run as a script (``python benchmarks/memory.py``) it is the worker: a fresh process, started
with glibc's malloc told to hand every large block straight back to the system, that reads its
own peak resident set size around each method (see :func:`peak_memory_over_floor`).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import Batches, Case  # noqa: E402
from common import FLOOR, collect, settle  # noqa: E402
from methods import METHODS, Method  # noqa: E402


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1))


def _reset_peak_rss() -> None:
    """Set the peak resident set size (VmHWM) back to the current one (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_of(method: Method, model: nn.Module, batches: Batches) -> int:
    """Bytes by which the resident set peaks above where it was when ``method`` started."""
    collect()
    _reset_peak_rss()
    start = _status_kib("VmRSS")
    method(model, batches)
    return (_status_kib("VmHWM") - start) * 1024


def _measure_peaks(cases: Sequence[Case], methods: Sequence[str], repeats: int) -> List[Dict[str, int]]:
    """In this process: per case, each method's smallest peak over ``repeats`` runs, each on a
    fresh copy of the model made before the mark is reset; every method is warmed up on every
    case (lazy imports, kernel caches for its shapes) and the float64 sums it needs compiled
    (``common.settle``) before the first mark."""
    out = []
    for case in cases:
        model, batches = case.build()
        for name in methods:
            METHODS[name](copy.deepcopy(model), batches)
        settle()
        peaks = {name: min(_peak_of(METHODS[name], copy.deepcopy(model), batches) for _ in range(repeats))
                 for name in methods}
        out.append(peaks)
    return out


def peak_memory_over_floor(
    cases: Sequence[Case], methods: Sequence[str], threads: int, repeats: int = 2, in_process: bool = False
) -> List[Dict[str, int]]:
    """Per case and method, the peak resident memory above the floor's peak, in bytes.

    On CPU there is no allocator statistic for torch tensors and ``tracemalloc`` does not see
    them, so this reads the kernel's own high-water mark of the process's resident memory:
    a fresh worker process, whose glibc malloc returns every block of 64 KiB or more to the
    system when freed (``MALLOC_MMAP_THRESHOLD_``), resets the mark before each run and reads it
    after. The floor's peak is the forward's activations; a method's excess over it is what
    that method holds or allocates beyond them (its state, and any transient copies). Each
    figure is the smallest of ``repeats`` runs; resolution one page (4 KiB).

    ``in_process`` measures in this process instead (``--quick``: it checks that the code runs;
    the figures then include whatever this process's allocator keeps).
    """
    names = [FLOOR] + [m for m in methods if m != FLOOR]
    if in_process:
        peaks = _measure_peaks(cases, names, repeats)
    else:
        spec = {"cases": [dataclasses.asdict(c) for c in cases], "methods": names, "threads": threads,
                "repeats": repeats}
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536", MALLOC_ARENA_MAX="2")
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve())],
            input=json.dumps(spec), capture_output=True, text=True, env=env, check=False, timeout=3600,
        )
        if done.returncode != 0:
            raise RuntimeError("memory worker failed:\n" + done.stderr[-4000:])
        peaks = json.loads(done.stdout.strip().splitlines()[-1])
    return [{name: p[name] - p[FLOOR] for name in names if name != FLOOR} for p in peaks]


def _memory_worker() -> None:
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    cases = [Case(**dict(c, sample_shape=tuple(c["sample_shape"]))) for c in spec["cases"]]
    print(json.dumps(_measure_peaks(cases, spec["methods"], spec["repeats"])))


if __name__ == "__main__":
    _memory_worker()
