"""Rent or buy: a sequence of short default passes, each in a fresh process, on a machine that
never compiled the float64 sums, against the two fixed choices.

    python benchmarks/rent_or_buy.py [--quick] [--out DIR] [--passes N] [--batches B] [--reps R]

The model is a stack of BatchNorm2d + ReLU layers (``LAYERS`` of ``CHANNELS`` channels on
``SIDE``x``SIDE`` maps, batch ``BATCH``): little besides BN, so that the eager sums are most of a
pass and a compile pays within a few tens of passes. Each pass is a fresh Python process timing
one ``precise_bn.recompute`` of ``B`` batches, on one thread.

- ``rent or buy``: ``N`` passes under ``PRECISE_BN_COMPILE=auto`` on one package cache, empty at
  the start (and an empty inductor cache): the cache's ledger decides when to compile.
- ``always eager``: ``R`` passes under ``never``; the sequence's cost is ``n`` times their median.
- ``compile first``: one pass under ``always`` on an empty cache (compiles, then measures),
  then ``R`` passes loading the package; the cost of ``n`` passes is the first plus ``n - 1``
  times the median of the others.

For every prefix of ``n`` passes the table gives the cost of each, and the ratio of rent or buy to
the better fixed choice for that ``n`` (at most about 2: the competitive bound of rent or buy).
Writes the "rent or buy" section of ``DIR/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import common

LAYERS, CHANNELS, SIDE, BATCH = 8, 64, 56, 32
QUICK = {"layers": 2, "channels": 8, "side": 8, "batch": 4}
BOUND = 2.0
SLACK = 1.2  # the bound holds for the ledger's estimate; timing noise on a shared machine on top


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    from torch import nn

    from precise_bn import compiled, recompute

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(spec["layers"]) for m in (nn.BatchNorm2d(spec["channels"]), nn.ReLU())])
    gen = torch.Generator().manual_seed(1)
    shape = (spec["batch"], spec["channels"], spec["side"], spec["side"])
    batches = [torch.randn(shape, generator=gen) for _ in range(spec["batches"])]
    start = time.perf_counter()
    recompute(model, batches, progress=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "compiled": len(compiled.KERNELS.compiled),
            "loaded": len(compiled.KERNELS.ready), "eager_elements": compiled.KERNELS.eager_elements}


def run_process(policy: str, spec: Dict[str, Any], cache: Path, inductor: Path) -> Dict[str, Any]:
    env = dict(os.environ, PRECISE_BN_COMPILE=policy, PRECISE_BN_CACHE=str(cache), TORCHINDUCTOR_CACHE_DIR=str(inductor),
               PYTHONPATH=os.pathsep.join([str(common.REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env, check=False, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError("rent-or-buy worker failed ({}):\n{}".format(policy, done.stderr[-4000:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def sequence(policy: str, count: int, spec: Dict[str, Any], first: Optional[str] = None) -> List[Dict[str, Any]]:
    """``count`` fresh processes on one cache, empty at the start; the first under ``first`` if given."""
    with tempfile.TemporaryDirectory(prefix="precise-bn-rent-") as empty:
        out = []
        for i in range(count):
            chosen = first if first and i == 0 else policy
            common.log.info("rent or buy: %s pass %d of %d", chosen, i + 1, count)
            out.append(run_process(chosen, spec, Path(empty) / "packages", Path(empty) / "inductor"))
        return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--passes", type=int, default=None, help="passes in the sequence (default 40; 3 with --quick)")
    parser.add_argument("--batches", type=int, default=None, help="batches per pass (default 12; 2 with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="passes timed per fixed choice (default 3; 1 with --quick)")
    args = common.parse_common(parser, argv)
    started = time.perf_counter()
    quick = args.quick
    spec = dict(QUICK if quick else {"layers": LAYERS, "channels": CHANNELS, "side": SIDE, "batch": BATCH},
                batches=args.batches or (2 if quick else 12))
    passes, reps = args.passes or (3 if quick else 40), args.reps or (1 if quick else 3)
    rent = sequence("auto", passes, spec)
    eager = statistics.median(r["seconds"] for r in sequence("never", reps, spec))
    bought = sequence("auto", reps + 1, spec, first="always")
    compile_pass, warm = bought[0]["seconds"], statistics.median(r["seconds"] for r in bought[1:])
    rows, worst, paid = [], 0.0, 0.0
    compiled_at = next((i + 1 for i, r in enumerate(rent) if r["compiled"]), None)
    for n, run in enumerate(rent, 1):
        paid += run["seconds"]
        fixed = min(n * eager, compile_pass + (n - 1) * warm)
        worst = max(worst, paid / fixed)
        if n in (1, 2, 3, 5) or n % 5 == 0 or n == compiled_at or n == passes:
            rows.append([n, "{:.1f}".format(paid), "{:.1f}".format(n * eager), "{:.1f}".format(compile_pass + (n - 1) * warm),
                         "{:.2f}".format(paid / fixed), "compiled" if n == compiled_at else ""])
    text = "\n\n".join([
        "\n".join(common.section_head("Rent or buy: short default passes in fresh processes", argv)),
        "{} BatchNorm2d + ReLU layers, {} channels, {}x{} maps, batch {}, {} batches per pass; every pass a fresh "
        "process, one thread; costs are the `recompute` calls' seconds summed. Always eager: {:.2f} s a pass "
        "(median of {}); compile first: {:.1f} s for the pass that compiles, then {:.2f} s a pass (median of {}). "
        "Rent or buy compiled in pass {} of {}.".format(
            spec["layers"], spec["channels"], spec["side"], spec["side"], spec["batch"], spec["batches"], eager, reps,
            compile_pass, warm, reps, compiled_at or "none", passes),
        common.markdown_table(["passes", "rent or buy (s)", "always eager (s)", "compile first (s)",
                               "rent / better fixed", ""], rows),
        common.target_line("every prefix of the sequence costs at most {:.0f}x the better fixed choice (x{} for timing "
                           "noise): worst {:.2f}".format(BOUND, SLACK, worst), worst <= BOUND * SLACK),
        "({:.0f} s in all; the machine may be shared: ratios come from one run.)".format(time.perf_counter() - started)])
    print(text)
    common.write_section(args.out / "RESULTS.md", "rent or buy", text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(json.loads(sys.argv[2]))))
    else:
        main()
