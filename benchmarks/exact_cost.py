"""Exact mode at the default's cost: ``exact=True`` and the default path over the forward, in
CPU time, on the torchvision cases of ``compare.py``.

    python benchmarks/exact_cost.py [--quick] [--out DIR] [--reps N] [--threads N]

``compare.py`` times wall clock on two threads; on a shared two-core machine other jobs move
those ratios by several points, more than a 1.05x target can be told apart by. Here each run is
timed by the CPU time of this process (``time.process_time``) on one thread, which counts only
the cycles the run itself was given; caches and memory bandwidth are still shared, so some
noise stays, and the min-max of the ratios shows it. Same cases, batches and adjacent-floor
ratios as ``compare.py``; then the errors on normal and shifted data, and how many layers exact
mode measured in float64 (the others kept the kernel's statistics). Writes the "exact" section
of ``DIR/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import List, Optional, Sequence

import cases
import common
import compare
import methods
from common import FLOOR

METHODS = [FLOOR, "precise-bn", "precise-bn exact"]
MODELS = ("resnet50", "mobilenet_v3_large", "r2plus1d_18")
TARGET = 1.05


def target_lines(timed: Sequence[methods.CaseResult], shifted: Sequence[methods.CaseResult]) -> List[str]:
    lines = [common.target_line("precise-bn exact on {}: {:.3f}x the forward (<= {:.2f}x)".format(
        r.case.model, r.timing["precise-bn exact"].median, TARGET), r.timing["precise-bn exact"].median <= TARGET)
        for r in timed]
    outside = [r.case.model for r in shifted if not r.errors["precise-bn exact"]["within"]]
    lines.append(common.target_line("precise-bn exact within the exact bound on shifted data{}".format(
        "; outside: {}".format(outside) if outside else ""), not outside))
    return lines


FIXED_METHODS = [FLOOR, "precise-bn", "precise-bn exact", "fvcore"]


def fixed_cost(reps: int) -> str:
    """What one call costs beyond its forward when the forward is tiny: a convolution and a BN
    layer on one batch of 2x3x8x8, in CPU time; the median over ``reps`` rotated repetitions of
    a hundred calls each."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    batches = [torch.randn(2, 3, 8, 8)]

    def hundred(method):
        def run() -> None:
            for _ in range(100):
                methods.METHODS[method](model, batches)
        return run

    with torch.no_grad():
        seconds = common.rotated_seconds({m: hundred(m) for m in FIXED_METHODS}, reps, clock=time.process_time)
    floor = statistics.median(seconds[FLOOR]) / 100
    rows = []
    for method in FIXED_METHODS:
        per_call = statistics.median(seconds[method]) / 100
        rows.append([method, "{:.3f}".format(per_call * 1e3), "{:.1f}x".format(per_call / floor),
                     "-" if method == FLOOR else "{:.3f}".format((per_call - floor) * 1e3)])
    return ("Fixed cost of one call, on a forward of a few microseconds (a 3x3 convolution and one "
            "BN layer, one batch of 2x3x8x8; CPU time, median of {} repetitions of 100 calls):\n\n".format(reps)
            + common.markdown_table(["method", "ms per call", "over the forward", "ms beyond the forward"], rows))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.set_defaults(threads=1)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7, quick 1)")
    args = common.parse_common(parser, argv)
    reps = args.reps or (1 if args.quick else 7)
    settings = compare.QUICK.cases if args.quick else [c for c in compare.FULL.cases if c.model in MODELS]
    common.log.info("exact cost: %d cases, %d timed repetitions, CPU time", len(settings), reps)
    timed = [methods.evaluate_case(c, METHODS, reps, clock=time.process_time) for c in settings]
    shifted = [methods.evaluate_case(dataclasses.replace(c, data="shifted"), METHODS, 0) for c in settings]
    text = "\n\n".join([
        "## Exact mode against the forward, in CPU time (`benchmarks/exact_cost.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.environment_text(args.threads),
        common.markdown_table(cases.CASE_HEADERS, [r.cells for r in timed]),
        methods.time_table(timed, METHODS, clock="CPU time of the process"),
        "Targets:",
        "\n".join(target_lines(timed, shifted)),
        methods.error_table(list(timed) + list(shifted)),
        fixed_cost(3 if args.quick else 15),
    ])
    common.write_section(args.out / "RESULTS.md", "exact", text)
    print(text)


if __name__ == "__main__":
    main()
