"""What the default pass costs at steady state: precise-bn against the plain forward and fvcore,
in CPU time on one thread, and what compiling its float64 sums buys.

    python benchmarks/cost.py [--quick] [--out DIR] [--reps N]

On resnet50, mobilenet_v3_large and r2plus1d_18 (the sizes of ``compare.py``) and timm's
efficientnet_b0, regnety_016 and resnet50d at 64 x 64 (many BN layers on small activations;
their target is against fvcore alone), on the same batches in one process: the plain train-mode forward under ``no_grad`` (the floor),
``precise_bn.recompute`` at steady state (after one call, ``common.settle`` has loaded, or
compiled once for the machine, the sums it measured; the script checks that no compile failed
and that the next call measures nothing eagerly), the same pass with the eager float64 sums (a fresh ``Kernels`` under
``PRECISE_BN_COMPILE=never``), and fvcore's ``update_bn_stats``. The default path runs under
``PRECISE_BN_COMPILE=auto`` whatever the caller's environment says. Each run is timed by the CPU
time of this process (``time.process_time``) on one thread, which counts only the cycles the run
was given on a shared machine; caches and memory bandwidth stay shared, and the min-max of the
adjacent-floor ratios shows that noise. Where a target (at most 1.05x the forward, no more than
fvcore) is missed, a torch.profiler breakdown of where the extra time goes. Then the errors on
normal and shifted data, and the fixed cost of a call on a tiny forward. Writes the "cost"
section of ``DIR/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from typing import List, Optional, Sequence, Tuple

import torch

import cases
import common
import compare
import methods
from common import FLOOR
from methods import EAGER
from precise_bn import compiled

METHODS = [FLOOR, "precise-bn", EAGER, "fvcore"]
MODELS = ("resnet50", "mobilenet_v3_large", "r2plus1d_18")
TARGET = 1.05
#: timm models with many BN layers on small activations: the target is against fvcore alone.
TIMM = [cases.Case(name, (3, 64, 64), 8, 16) for name in ("efficientnet_b0", "regnety_016", "resnet50d")]
TIMM_TARGET = 1.10


@dataclasses.dataclass
class Steady:
    """What the check of the steady state found for one case."""

    compiled: List[str]
    failures: List[str]
    eager_elements_second_call: int
    eager_elements_while_timed: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.compiled) and not self.failures and not self.eager_elements_second_call \
            and not self.eager_elements_while_timed


def reach_steady_state(case: cases.Case) -> Steady:
    """One default call on ``case``, the sums it measured loaded (compiled if this machine never
    did), then a second call: what is loaded, what failed, and how many elements the second call
    measured eagerly."""
    model, batches = case.build()
    methods.precise_default(copy.deepcopy(model), batches)
    common.settle()
    before = compiled.KERNELS.eager_elements
    methods.precise_default(copy.deepcopy(model), batches)
    kernels = compiled.KERNELS
    return Steady(sorted(compiled.kernel_name(where[:2] + (where[2].type,)) for where in kernels.ready),
                  list(kernels.failures), kernels.eager_elements - before)


def measure(case: cases.Case, reps: int) -> Tuple[methods.CaseResult, Steady]:
    steady = reach_steady_state(case)
    before = compiled.KERNELS.eager_elements
    result = methods.evaluate_case(case, METHODS, reps, clock=time.process_time)
    steady.eager_elements_while_timed = compiled.KERNELS.eager_elements - before
    return result, steady


def steady_line(r: methods.CaseResult, s: Steady) -> str:
    return common.target_line(
        "steady state on {}: compiled {}; failed compiles: {}; elements measured eagerly by the second "
        "call: {}, by every call timed after it: {}".format(
            r.case.model, ", ".join(s.compiled) or "nothing", "; ".join(s.failures) or "none",
            s.eager_elements_second_call, s.eager_elements_while_timed), s.ok)


def target_lines(timed: Sequence[methods.CaseResult], steady: Sequence[Steady],
                 shifted: Sequence[methods.CaseResult]) -> List[str]:
    lines = []
    for r, s in zip(timed, steady):
        t = r.timing
        versus = t["precise-bn"].versus(t["fvcore"])
        if r.case.model in {c.model for c in TIMM}:
            lines += [common.target_line("precise-bn / fvcore on timm {}: {:.3f} (<= {:.2f}; {:.3f}x the "
                                         "forward)".format(r.case.model, versus, TIMM_TARGET, t["precise-bn"].median),
                                         versus <= TIMM_TARGET), steady_line(r, s)]
            continue
        lines += [
            common.target_line("precise-bn on {}: {:.3f}x the forward (<= {:.2f}x)".format(
                r.case.model, t["precise-bn"].median, TARGET), t["precise-bn"].median <= TARGET),
            common.target_line("precise-bn / fvcore on {}: {:.3f} (<= 1; fvcore {:.3f}x the forward)".format(
                r.case.model, versus, t["fvcore"].median), versus <= 1.0),
            steady_line(r, s),
        ]
    outside = ["{} / {} / {}".format(r.case.model, r.case.data, m) for r in list(timed) + list(shifted)
               for m in ("precise-bn", EAGER) if not r.errors[m]["within"]]
    lines.append(common.target_line("precise-bn (compiled and eager sums) within the promise on normal and shifted "
                                    "data{}".format("; outside: {}".format(outside) if outside else ""), not outside))
    return lines


def fixed_cost(reps: int) -> str:
    """What one call costs beyond its forward when the forward is tiny: a convolution and a BN
    layer on one batch of 2x3x8x8, in CPU time; the median over ``reps`` rotated repetitions of
    a hundred calls each."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    batches = [torch.randn(2, 3, 8, 8)]

    def hundred(method: str):
        def run() -> None:
            for _ in range(100):
                methods.METHODS[method](model, batches)
        return run

    methods.precise_default(model, batches)
    common.settle()
    with torch.no_grad():
        seconds = common.rotated_seconds({m: hundred(m) for m in METHODS}, reps, clock=time.process_time)
    floor = statistics.median(seconds[FLOOR]) / 100
    rows = []
    for method in METHODS:
        per_call = statistics.median(seconds[method]) / 100
        rows.append([method, "{:.3f}".format(per_call * 1e3), "{:.1f}x".format(per_call / floor),
                     "-" if method == FLOOR else "{:.3f}".format((per_call - floor) * 1e3)])
    return ("Fixed cost of one call, on a forward of a few microseconds (a 3x3 convolution and one "
            "BN layer, one batch of 2x3x8x8; CPU time, median of {} repetitions of 100 calls; `precise-bn` "
            "with its sums compiled):\n\n".format(reps)
            + common.markdown_table(["method", "ms per call", "over the forward", "ms beyond the forward"], rows))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.set_defaults(threads=1)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7, quick 1)")
    args = common.parse_common(parser, argv)
    reps = args.reps or (1 if args.quick else 7)
    settings = compare.QUICK.cases if args.quick else [c for c in compare.FULL.cases if c.model in MODELS] + TIMM
    common.log.info("cost: %d cases, %d timed repetitions, CPU time", len(settings), reps)
    with common.compile_policy("auto"):
        measured = [measure(c, reps) for c in settings]
        timed = [r for r, _ in measured]
        steady = [s for _, s in measured]
        shifted = [methods.evaluate_case(dataclasses.replace(c, data="shifted"), METHODS, 0) for c in settings]
        lines = target_lines(timed, steady, shifted)
        missed = [r for r in timed if r.timing["precise-bn"].versus(r.timing["fvcore"]) > 1.0]
        profiles = [methods.extra_time_by_op(r, "precise-bn", clock="CPU") for r in missed[: 1 if args.quick else None]]
        fixed = fixed_cost(3 if args.quick else 15)
        text = "\n\n".join([
            "## The default pass against the forward and fvcore, in CPU time (`benchmarks/cost.py`)",
            "Command: `{}`".format(common.command_line(argv)),
            common.run_text(args.threads),
            common.markdown_table(cases.CASE_HEADERS, [r.cells for r in timed]),
            methods.time_table(timed, METHODS, clock="CPU time of the process") + "\n\n`precise-bn`: at steady "
            "state, its float64 sums compiled (the second call in the process and later); `{}`: the same pass "
            "with the sums as eager float64 operators, as before they are compiled or without a compiler.".format(EAGER),
            "Targets:",
            "\n".join(lines),
        ] + profiles + [methods.error_table(list(timed) + list(shifted)), fixed])
    common.write_section(args.out / "RESULTS.md", "cost", text)
    print(text)


if __name__ == "__main__":
    main()
