"""Peak resident memory of a pass over the forward's, read in a fresh worker process.

    python benchmarks/memory.py [--quick] [--out DIR] [--threads N] [--reps N]

Writes the "memory" section of ``DIR/RESULTS.md`` and ``DIR/pass_memory.png``: for torchvision
CNNs, a BN MLP and the same MLP holding a large buffer, what ``precise_bn.recompute`` adds to
the plain forward's peak, next to the model's parameters (which a pass copies into host memory
during its first batch, to put back a parameter a forward writes; ``gpu.py`` measures the device) and its buffers (which a pass keeps a copy of,
to put back what the forwards change). ``compare.py``
uses :func:`peak_memory_over_floor` for every method. With ``--worker`` the script is the
worker: a fresh process, started with glibc's malloc told to hand every large block straight
back to the system, that reads its own peak resident set size around each method.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402
import common  # noqa: E402
from cases import Batches, Case  # noqa: E402
from common import FLOOR, collect, settle  # noqa: E402
from methods import METHODS, Method  # noqa: E402

MIB = 2.0 ** 20
PASS = "precise-bn"


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
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
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


MLP = {"in_features": 256, "width": 1024, "depth": 4}
FULL = [
    Case("resnet18", (3, 64, 64), 16, 2),
    Case("resnet50", (3, 64, 64), 8, 2),
    Case("mobilenet_v3_large", (3, 64, 64), 16, 2),
    Case("bn_mlp", (256,), 256, 2, options=MLP),
    Case("bn_mlp", (256,), 256, 2, options=dict(MLP, table_mib=64)),
]
QUICK = [Case("bn_mlp", (16,), 16, 2, options={"in_features": 16, "width": 32, "depth": 1, "table_mib": 1})]


def _sizes(case: Case) -> Dict[str, float]:
    """MiB of the model's parameters and buffers, and its BN channels."""
    model, _ = case.build()
    return {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()) / MIB,
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers()) / MIB,
            "channels": sum(m.num_features for _, m in cases.bn_layers(model))}


def _label(case: Case) -> str:
    table = case.options.get("table_mib")
    return case.model + (" + {} MiB buffer".format(table) if table else "")


def plot(path: Path, labels: Sequence[str], sizes: Sequence[Dict[str, float]], peaks: Sequence[float]) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 1.2 + 0.75 * len(labels)))
    rows = range(len(labels))
    bars = (("parameters (a copy)", [s["parameters"] for s in sizes], "C7"),
            ("buffers (the kept copy)", [s["buffers"] for s in sizes], "C0"),
            ("pass, peak over the forward", list(peaks), "C3"))
    floor = 0.01  # a log axis: values at or below it (the noise of a peak) are drawn there
    for k, (name, values, color) in enumerate(bars):
        places = [r + (k - 1) * 0.27 for r in rows]
        ax.barh(places, [max(v, floor) for v in values], 0.27, color=color, label=name)
        for y, v in zip(places, values):
            ax.text(max(v, floor) * 1.15, y, "{:.2f}".format(v), va="center", fontsize=7)
    ax.set(xscale="log", xlim=(floor, None), xlabel="MiB", yticks=list(rows), yticklabels=list(labels),
           title="extra memory of a pass (peak RSS over the forward's)")
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--reps", type=int, default=None, help="runs per case, the smallest kept (default 3)")
    args = common.parse_common(parser, argv)
    settings = QUICK if args.quick else FULL
    repeats = args.reps or (1 if args.quick else 3)
    common.log.info("memory: %d cases, %s", len(settings), "in this process" if args.quick else "worker process")
    peaks = [p[PASS] / MIB for p in peak_memory_over_floor(settings, [PASS], args.threads, repeats, args.quick)]
    sizes = [_sizes(c) for c in settings]
    labels = [_label(c) for c in settings]
    plot(args.out / "pass_memory.png", labels, sizes, peaks)
    rows = [[label, "{:.1f}".format(s["parameters"]), "{:.2f}".format(s["buffers"]), s["channels"],
             "{:.2f}".format(peak), "{:.2f}".format(peak - s["buffers"]), "{:.3f}".format(peak / s["parameters"])]
            for label, s, peak in zip(labels, sizes, peaks)]
    body = "\n\n".join(common.section_head("Extra memory of a pass (`benchmarks/memory.py`)", argv) + [
        "![pass memory](pass_memory.png)",
        "Peak resident memory of `precise_bn.recompute` minus that of the plain train-mode forward "
        "on the same {} batches, in MiB, smallest of {} run(s) in a fresh worker process ("
        "`VmHWM` reset before each run, glibc returning "
        "every block of 64 KiB or more). Rerun, a case moves by up to about 2 MiB (heap and Python "
        "objects): read the peaks to that precision. A "
        "pass keeps one copy of the model's buffers, to put back whatever the forwards change "
        "(observers, counters, a functional batch_norm's statistics), and a copy of its parameters "
        "while the first batch runs (kept for the pass only if that batch wrote one); the rest is "
        "the capture's per-layer blocks of calls and float64 statistics, "
        "and the report. The last row's model holds a buffer its forward never reads: the pass "
        "copies it all the same.".format(settings[0].batches, repeats),
        common.markdown_table(["model", "parameters", "buffers", "BN channels", "pass peak over the forward",
                               "peak - buffers", "peak / parameters"], rows),
        common.target_line("at most one copy of the parameters: the peak minus the buffers' copy below twice the "
                           "parameters' size in every row",
                           all(p - s["buffers"] < 2 * s["parameters"] for s, p in zip(sizes, peaks))),
    ])
    common.write_section(args.out / "RESULTS.md", "memory", body)
    print(body)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _memory_worker()
    else:
        main()
