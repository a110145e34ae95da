"""Generated attacks on the promise: the written statistics are the float64 population
statistics, correctly rounded into the buffers.

    python benchmarks/exact_attack.py [--quick] [--out DIR] [--cases N]

Each seed of ``tests/attack_cases.py`` builds a small model and batches meant to break it (six
layouts; float32, float64, bfloat16 and float16 models and bfloat16 autocast; the stock BN class
or a subclass computing ``E[x^2] - E[x]^2`` in float32; reused layers, ragged batches, means that
start, stop, grow or jump, dead channels coming alive, channels constant but for one rare jump,
sorted loaders, a late outlier batch). Every case runs with the eager float64 sums (a fresh
``Kernels`` under ``PRECISE_BN_COMPILE=never``) and with the compiled ones (``PRECISE_BN_COMPILE=always``: a form met for the first time is
compiled, on the caller's thread, before it is measured; the run must measure nothing eagerly
but a call whose shift was far from its mean, measured again). Per layout, model dtype
and BN class: the worst error of the written buffers against the float64 two-pass reference of
the same batches, in units of the promise's tolerance (``tests/reference.exact_tolerance``; at
most 1 keeps it, a dead channel must be exactly 0), the channels outside it, and the worst error
of the report's float64 statistics in units of 1e-7. Writes the "attack" section of
``DIR/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attack_cases import DTYPES, KINDS, LAYOUTS, Case, make_case  # noqa: E402
from reference import exact_tolerance, float64_reference  # noqa: E402

import precise_bn  # noqa: E402
from precise_bn import compiled  # noqa: E402
from precise_bn.errors import PreciseBNWarning  # noqa: E402

PATHS = ("eager", "compiled")
GROUPS = (("layout", LAYOUTS), ("dtype", DTYPES), ("kind", KINDS))


def in_tolerance_units(mean: torch.Tensor, var: torch.Tensor, ref_mean: torch.Tensor, ref_var: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Per channel, the larger of the mean's and the variance's error over the promise's
    tolerance for statistics stored in ``dtype``; ``inf`` for a dead channel (reference variance
    0) whose variance is not exactly 0, or for a nonzero error where the tolerance is 0."""
    mean_tol, var_tol = exact_tolerance(ref_mean, ref_var, dtype)
    ratios = []
    for got, ref, tol in ((mean, ref_mean, mean_tol), (var, ref_var, var_tol)):
        err = (got.double().cpu() - ref).abs()
        ratios.append(torch.where(tol > 0, err / tol.clamp(min=torch.finfo(torch.float64).tiny),
                                  torch.where(err > 0, torch.full_like(err, float("inf")), torch.zeros_like(err))))
    worst = torch.maximum(*ratios).nan_to_num(float("inf"))
    dead = ref_var == 0
    worst[dead] = torch.where(var.double().cpu()[dead] == 0, worst[dead], torch.full_like(worst[dead], float("inf")))
    return worst


@dataclasses.dataclass
class Outcome:
    """One case on one path: per channel, the written buffers' and the report's errors in units
    of their tolerances, how many elements the compiled path still measured eagerly, and what
    the call raised, if it did (then no errors)."""

    written: Optional[torch.Tensor] = None
    report: Optional[torch.Tensor] = None
    eager_elements: int = 0
    raised: str = ""


def _recompute(case: Case) -> Tuple[precise_bn.BNReport, torch.nn.Module]:
    model = copy.deepcopy(case.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreciseBNWarning)  # an underflow is said out loud; here it is expected
        report = precise_bn.recompute(model, case.batches, autocast=case.autocast, progress=False)
    return report, model.get_submodule(case.bn_name)


def _outcome(case: Case, ref: Tuple[torch.Tensor, torch.Tensor]) -> Outcome:
    try:
        report, bn = _recompute(case)
    except Exception as exc:  # a finding, counted: the other cases still run
        return Outcome(raised="{}: {}".format(type(exc).__name__, (str(exc).splitlines() or [""])[0]))
    layer = report[case.bn_name]
    return Outcome(in_tolerance_units(bn.running_mean, bn.running_var, *ref, bn.running_var.dtype),
                   in_tolerance_units(layer.new_mean, layer.new_var, *ref, torch.float64))


def run_case(case: Case) -> Dict[str, Outcome]:
    """``case`` on both paths."""
    ref_mean, ref_var, _ = float64_reference(case.model, case.batches, autocast=case.autocast)[case.bn_name]
    out = {}
    with common.eager_sums():
        out["eager"] = _outcome(case, (ref_mean, ref_var))
    with common.compile_policy("always"):  # a form met for the first time is compiled before it is measured
        before = compiled.KERNELS.eager_elements
        out["compiled"] = _outcome(case, (ref_mean, ref_var))
        out["compiled"].eager_elements = compiled.KERNELS.eager_elements - before
    return out


def group_table(key: str, values: Sequence[str], cases: Sequence[Case], outcomes: Sequence[Dict[str, Outcome]]) -> str:
    headers = [key, "cases", "channels"]
    for path in PATHS:
        headers += ["{}: worst / tolerance".format(path), "{}: outside".format(path),
                    "{}: float64 worst / 1e-7".format(path), "{}: raised".format(path)]
    rows = []
    for value in values:
        mine = [(c, o) for c, o in zip(cases, outcomes) if getattr(c, key) == value]
        if not mine:
            continue
        row: List[object] = [value, len(mine), sum(c.model.get_submodule(c.bn_name).num_features for c, _ in mine)]
        for path in PATHS:
            ran = [o[path] for _, o in mine if not o[path].raised]
            written = torch.cat([o.written for o in ran] or [torch.zeros(0)])
            report = torch.cat([o.report for o in ran] or [torch.zeros(0)])
            row += ["{:.5g}".format(float(written.max())) if written.numel() else "-", int((written > 1).sum()),
                    common.fmt_err(float(report.max())) if report.numel() else "-", len(mine) - len(ran)]
        rows.append(row)
    return common.markdown_table(headers, rows)


def raised_lines(cases: Sequence[Case], outcomes: Sequence[Dict[str, Outcome]], most: int = 10) -> List[str]:
    """The cases whose call raised, the first ``most`` of them by seed, with what they raised."""
    found = [(c, path, o[path].raised) for c, o in zip(cases, outcomes) for path in PATHS if o[path].raised]
    lines = ["- {}, {} sums: {}".format(c, path, why) for c, path, why in found[:most]]
    if len(found) > most:
        lines.append("- ... and {} more".format(len(found) - most))
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--cases", type=int, default=None, help="seeds to run (default 3000, quick 12)")
    args = common.parse_common(parser, argv)
    count = args.cases or (12 if args.quick else 3000)
    common.log.info("attack: %d generated cases, eager and compiled sums", count)
    started = time.perf_counter()
    cases, outcomes = [], []
    for seed in range(count):
        cases.append(make_case(seed))
        outcomes.append(run_case(cases[-1]))
        if (seed + 1) % 100 == 0:
            common.log.info("attack: %d cases in %.0f s", seed + 1, time.perf_counter() - started)
    outside = {path: sum(int((o[path].written > 1).sum()) for o in outcomes if not o[path].raised) for path in PATHS}
    raised = {path: sum(1 for o in outcomes if o[path].raised) for path in PATHS}
    leaked = sum(o["compiled"].eager_elements for o in outcomes)
    text = "\n\n".join([
        "## Generated attacks on the promise (`benchmarks/exact_attack.py`)",
        "Command: `{}` ({:.0f} s)".format(common.command_line(argv), time.perf_counter() - started),
        common.run_text(args.threads),
        "{} generated cases (`tests/attack_cases.py`, seeds 0 to {}), each run with the eager float64 sums and "
        "with the compiled ones. Per channel, the error of the written `running_mean` and `running_var` "
        "against the float64 two-pass reference of the same batches, in units of the promise's tolerance "
        "(`tests/reference.exact_tolerance`: 1e-7 of the std for the mean and of the variance for the "
        "variance, plus half a unit in the last place of the buffers' dtype; the larger of the two ratios; "
        "a dead channel whose variance is not exactly 0 counts as inf): at most 1 keeps the promise. "
        "`outside`: channels above 1. `float64 worst / 1e-7`: the report's float64 statistics, before "
        "their rounding into the buffers, in units of 1e-7.".format(count, count - 1),
    ] + ["By {}:\n\n{}".format(key, group_table(key, values, cases, outcomes)) for key, values in GROUPS] + [
        "Compiles that failed: {}. Elements the compiled runs still measured eagerly: {}.".format(
            "; ".join(compiled.KERNELS.failures) or "none", leaked),
    ] + (["Cases whose call raised:\n\n" + "\n".join(raised_lines(cases, outcomes))] if any(raised.values()) else []) + [
        "\n".join([
            common.target_line("every case ran and every written channel is within the promise, eager sums "
                               "({} outside, {} raised)".format(outside["eager"], raised["eager"]),
                               outside["eager"] == 0 and raised["eager"] == 0),
            common.target_line("every case ran and every written channel is within the promise, compiled sums "
                               "({} outside, {} raised)".format(outside["compiled"], raised["compiled"]),
                               outside["compiled"] == 0 and raised["compiled"] == 0),
            common.target_line("the compiled runs measured every call with the compiled sums",
                               leaked == 0 and not compiled.KERNELS.failures),
        ]),
    ])
    common.write_section(args.out / "RESULTS.md", "attack", text)
    print(text)


if __name__ == "__main__":
    main()
