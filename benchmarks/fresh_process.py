"""A 32-batch resnet18 pass in a fresh process: precise-bn against fvcore, wall clock, one
thread, with the compiled sums on disk and on a machine that never compiled them; and how long
each process takes to exit once its call returned.

    python benchmarks/fresh_process.py [--quick] [--out DIR] [--reps N] [--cold-reps N]

Every measurement is a fresh Python process (this script with ``--worker``) that builds
torchvision's resnet18 (random weights, ``torch.manual_seed(0)``) and 32 batches of
``torch.randn`` (seed 1), then times one call on one thread: ``precise_bn.recompute`` under
``PRECISE_BN_COMPILE=auto`` or fvcore's ``update_bn_stats``. The processes import the package of
this checkout. ``warm``: the package cache (``PRECISE_BN_CACHE``) was filled once first by
``python -m precise_bn.moments``, as a cluster image would be; ``cold``: each precise-bn process
gets an empty package cache and an empty inductor cache, as on a machine that never compiled
(``auto`` then compiles only once the eager sums have cost this machine about a compile). precise-bn and fvcore processes
alternate (which goes first alternates too), and each ratio is taken between adjacent
processes. Per size and cache: the call's seconds, the process's seconds from its start to the
call's return, and from the call's return to the process's end (``exit``: an fvcore process
never imported precise-bn); for precise-bn, the sums loaded or compiled and the share of
elements measured eagerly. Writes the "fresh process" section of ``DIR/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import common

SIZES = ((112, 16), (224, 32))  # image side, batch size
QUICK_SIZES = ((32, 2),)
BATCHES = 32
TARGET = 1.3
COLD_TARGET = 1.5
EXIT_TARGET = 0.5
PRECISE, FVCORE = "precise-bn", "fvcore"


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One timed call in this (fresh) process; what it measured, as JSON-able values."""
    import torch
    import torchvision

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).train()
    gen = torch.Generator().manual_seed(1)
    side, batch = spec["side"], spec["batch"]
    batches = [torch.randn(batch, 3, side, side, generator=gen) for _ in range(spec["batches"])]
    out: Dict[str, Any] = {}
    if spec["method"] == PRECISE:
        from precise_bn import compiled, recompute

        start, cpu = time.perf_counter(), time.process_time()
        report = recompute(model, batches, progress=False)
        out["call"], out["cpu"] = time.perf_counter() - start, time.process_time() - cpu
        out["returned"] = time.time()
        kernels = compiled.KERNELS
        out["ready"] = len(kernels.ready)
        out["compiled"] = len(kernels.compiled)
        out["prepare_seconds"] = kernels.compile_seconds
        out["eager_share"] = kernels.eager_elements / sum(layer.elements * layer.old_mean.numel()
                                                          for layer in report.layers)
        out["failures"] = list(kernels.failures)
    else:
        from fvcore.nn.precise_bn import update_bn_stats

        start, cpu = time.perf_counter(), time.process_time()
        update_bn_stats(model, batches, num_iters=len(batches))
        out["call"], out["cpu"] = time.perf_counter() - start, time.process_time() - cpu
        out["returned"] = time.time()
    return out


def run_process(method: str, side: int, batch: int, batches: int, packages: Path,
                inductor: Optional[Path] = None) -> Dict[str, Any]:
    """Start this script as a worker for one call (packages kept in ``packages``, inductor's
    cache in ``inductor`` if given) and return what it measured, with ``process``: seconds from
    just before the process was started to the call's return, and ``exit``: from the call's
    return to the process's end."""
    spec = {"method": method, "side": side, "batch": batch, "batches": batches}
    env = dict(os.environ, PRECISE_BN_COMPILE="auto", PRECISE_BN_CACHE=str(packages),
               PYTHONPATH=os.pathsep.join([str(common.REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if inductor is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    started = time.time()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env, check=False, timeout=3600)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError("fresh-process worker failed ({} at {}x{}):\n{}".format(
            method, side, batch, done.stderr[-4000:]))
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["process"] = out["returned"] - started
    out["exit"] = ended - out["returned"]
    return out


def pairs(side: int, batch: int, batches: int, reps: int, packages: Optional[Path]
          ) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """``reps`` adjacent (precise-bn, fvcore) processes, precise-bn first on even repetitions;
    with ``packages`` None each precise-bn process gets empty caches of its own."""
    out = []
    for rep in range(reps):
        results: Dict[str, Dict[str, Any]] = {}
        for method in ((PRECISE, FVCORE) if rep % 2 == 0 else (FVCORE, PRECISE)):
            common.log.info("fresh process: %s, %dx%d batch %d, %s cache, repetition %d", method, side, side, batch,
                            "warm" if packages else "cold", rep + 1)
            if packages is None:
                with tempfile.TemporaryDirectory(prefix="precise-bn-cold-") as empty:
                    results[method] = run_process(method, side, batch, batches, Path(empty) / "packages",
                                                  Path(empty) / "inductor")
            else:
                results[method] = run_process(method, side, batch, batches, packages)
        out.append((results[PRECISE], results[FVCORE]))
    return out


def _spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    return (fmt + " (" + fmt + "-" + fmt + ")").format(statistics.median(values), min(values), max(values))


def rows(side: int, batch: int, cache: str, done: Sequence[Tuple[Dict[str, Any], Dict[str, Any]]]
         ) -> Tuple[List[Any], List[Any]]:
    """A row of :data:`TIME_HEADERS` and one of :data:`COMPILE_HEADERS`."""
    ours = [p for p, _ in done]
    theirs = [f for _, f in done]
    head = ["{0}x{0}, batch {1}".format(side, batch), cache, len(done)]
    return head + [
        _spread([f["call"] for f in theirs]), _spread([p["call"] for p in ours]),
        _spread([p["call"] / f["call"] for p, f in done], "{:.3f}"),
        _spread([p["cpu"] / f["cpu"] for p, f in done], "{:.3f}"),
        _spread([f["process"] for f in theirs]), _spread([p["process"] for p in ours]),
        _spread([p["process"] / f["process"] for p, f in done], "{:.3f}"),
        _spread([f["exit"] for f in theirs]), _spread([p["exit"] for p in ours]),
    ], head + [
        _spread([p["ready"] for p in ours], "{:.0f}"), _spread([p["compiled"] for p in ours], "{:.0f}"),
        _spread([p["prepare_seconds"] for p in ours], "{:.2f}"),
        _spread([100 * p["eager_share"] for p in ours], "{:.0f}%"),
        "; ".join(sorted({f for p in ours for f in p["failures"]})) or "none",
    ]


TIME_HEADERS = ["input", "cache", "pairs", "fvcore call (s)", "precise-bn call (s)", "precise-bn / fvcore, call",
                "precise-bn / fvcore, CPU time of the call", "fvcore process (s)", "precise-bn process (s)",
                "precise-bn / fvcore, process", "fvcore exit (s)", "precise-bn exit (s)"]
COMPILE_HEADERS = ["input", "cache", "pairs", "sums loaded", "of them compiled in the call",
                   "seconds loading and compiling", "elements measured eagerly", "failed compiles"]
TARGETS = {"warm": TARGET, "cold": COLD_TARGET}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--reps", type=int, default=None, help="pairs of processes per size, warm cache (default 5, quick 1)")
    parser.add_argument("--cold-reps", type=int, default=None, help="pairs per size, cold cache (default 2, quick 1)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = common.parse_common(parser, argv)
    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    reps = args.reps or (1 if args.quick else 5)
    cold_reps = args.cold_reps or (1 if args.quick else 2)
    sizes = QUICK_SIZES if args.quick else SIZES
    started = time.perf_counter()
    time_rows, compile_rows, lines = [], [], []
    packages = Path(tempfile.mkdtemp(prefix="precise-bn-warm-"))
    try:
        common.log.info("fresh process: compiling the sums ahead of time into %s", packages)
        subprocess.run([sys.executable, "-m", "precise_bn.moments", "--dtypes", "float32"], check=True,
                       env=dict(os.environ, PRECISE_BN_CACHE=str(packages)), cwd=str(common.REPO),
                       capture_output=True, timeout=3600)
        exits = []
        for side, batch in sizes:
            for label, done in (("warm", pairs(side, batch, BATCHES, reps, packages)),
                                ("cold", pairs(side, batch, BATCHES, cold_reps, None))):
                time_row, compile_row = rows(side, batch, label, done)
                time_rows.append(time_row)
                compile_rows.append(compile_row)
                ratio = statistics.median(p["call"] / f["call"] for p, f in done)
                lines.append(common.target_line("{0}x{0}, batch {1}, {2} cache: precise-bn / fvcore = {3:.3f} "
                                                "(<= {4})".format(side, batch, label, ratio, TARGETS[label]),
                                                ratio <= TARGETS[label]))
                exits += [p["exit"] - f["exit"] for p, f in done]
        lines.append(common.target_line("exit: precise-bn's processes end at most {:.2f} s later than fvcore's "
                                        "after the call (<= {})".format(max(exits), EXIT_TARGET),
                                        max(exits) <= EXIT_TARGET))
    finally:
        shutil.rmtree(packages, ignore_errors=True)
    text = "\n\n".join([
        "## A fresh process: a 32-batch resnet18 pass against fvcore (`benchmarks/fresh_process.py`)",
        "Command: `{}` ({:.0f} s)".format(common.command_line(argv), time.perf_counter() - started),
        common.run_text(1, sums="Workers: `PRECISE_BN_COMPILE=auto`."),
        "Each figure comes from its own fresh Python process: torchvision's resnet18 (random weights), "
        "{} batches of `torch.randn`, `torch.set_num_threads(1)`, one call timed by wall clock. `call`: the "
        "`recompute` or `update_bn_stats` call alone; `CPU time of the call`: the process's CPU time over "
        "the call; `process`: from just before the process was started to the call's return (interpreter, "
        "imports, model and data included); `exit`: from the call's return to the process's end. Median "
        "(min-max) over the pairs; each ratio is taken between the two processes of a pair, run one after "
        "the other. `warm`: the float64 sums were compiled once before, by `python -m precise_bn.moments "
        "--dtypes float32`, and are loaded from disk; `cold`: each precise-bn process starts with empty "
        "package and inductor caches, as on a machine that never compiled, and `auto` compiles only if the "
        "planned pass pays for it.".format(BATCHES),
        common.markdown_table(TIME_HEADERS, time_rows),
        common.markdown_table(COMPILE_HEADERS, compile_rows),
        "Targets: at most {}x fvcore's time in a fresh process with the sums on disk, {}x on a machine that "
        "never compiled them (the call), and an exit within {} s of a process that never imported precise-bn:".format(
            TARGET, COLD_TARGET, EXIT_TARGET),
        "\n".join(lines),
    ])
    common.write_section(args.out / "RESULTS.md", "fresh process", text)
    print(text)


if __name__ == "__main__":
    main()
