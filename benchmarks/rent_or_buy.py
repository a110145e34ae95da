"""Rent or buy: a sequence of short default passes, each in a fresh process, on a machine that
never compiled the float64 sums, against the two fixed choices.

    python benchmarks/rent_or_buy.py [--quick] [--out DIR] [--passes N] [--batches B] [--every K]

The model is a stack of BatchNorm2d + ReLU layers (``LAYERS`` of ``CHANNELS`` channels on
``SIDE``x``SIDE`` maps, batch ``BATCH``): little besides BN, so that the eager sums are most of a
pass and a compile pays within a few tens of passes. Each pass is a fresh Python process timing
one ``precise_bn.recompute`` of ``B`` batches, on one thread.

- ``rent or buy``: ``N`` passes under ``PRECISE_BN_COMPILE=auto`` on one package cache, empty at
  the start (and an empty inductor cache): the cache's ledger decides when to compile.
- ``always eager``: a pass under ``never`` every ``K`` passes of the sequence; the cost of ``n``
  passes is ``n`` times their median.
- ``compile first``: one pass under ``always`` on an empty cache of its own (compiles, then
  measures), before the sequence, and a pass loading its package every ``K`` passes; the cost of
  ``n`` passes is the first plus ``n - 1`` times the median of the others.

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


def sequences(passes: int, every: int, spec: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """The rent-or-buy sequence on a cache empty at its start; interleaved with it (every
    ``every`` passes, so that all three see the same load), an eager pass and a pass loading the
    package that the compile-first pass made, first of all, in a cache of its own."""
    out: Dict[str, List[Dict[str, Any]]] = {"auto": [], "never": [], "always": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="precise-bn-rent-") as root:
        rent, bought = Path(root) / "rent", Path(root) / "bought"
        common.log.info("rent or buy: the compile-first pass")
        out["always"].append(run_process("always", spec, bought / "packages", bought / "inductor"))
        for i in range(passes):
            common.log.info("rent or buy: pass %d of %d", i + 1, passes)
            out["auto"].append(run_process("auto", spec, rent / "packages", rent / "inductor"))
            if i % every == 0:
                out["never"].append(run_process("never", spec, Path(root) / "none", Path(root) / "none-inductor"))
                out["warm"].append(run_process("auto", spec, bought / "packages", bought / "inductor"))
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--passes", type=int, default=None, help="passes in the sequence (default 40; 3 with --quick)")
    parser.add_argument("--batches", type=int, default=None, help="batches per pass (default 12; 2 with --quick)")
    parser.add_argument("--every", type=int, default=None,
                        help="a pass of each fixed choice every this many passes (default 4; 1 with --quick)")
    args = common.parse_common(parser, argv)
    started = time.perf_counter()
    quick = args.quick
    spec = dict(QUICK if quick else {"layers": LAYERS, "channels": CHANNELS, "side": SIDE, "batch": BATCH},
                batches=args.batches or (2 if quick else 12))
    passes, every = args.passes or (3 if quick else 40), args.every or (1 if quick else 4)
    runs = sequences(passes, every, spec)
    rent, reps = runs["auto"], len(runs["never"])
    eager = statistics.median(r["seconds"] for r in runs["never"])
    compile_pass, warm = runs["always"][0]["seconds"], statistics.median(r["seconds"] for r in runs["warm"])
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
        common.target_line("every prefix of the sequence costs at most {:.0f}x the better fixed choice: worst {:.2f}".format(
            BOUND, worst), worst <= BOUND),
        "({:.0f} s in all; the machine may be shared: ratios come from one run.)".format(time.perf_counter() - started)])
    print(text)
    common.write_section(args.out / "RESULTS.md", "rent or buy", text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(json.loads(sys.argv[2]))))
    else:
        main()
