"""What precise-bn costs over the plain forward pass, and its largest error against float64.

    python benchmarks/overhead.py [--quick] [--out DIR] [--threads N] [--reps N]

For a ResNet-style 2D CNN, a 3D video CNN and a BN MLP, on the same batches: the time of
``precise_bn.recompute`` (default and ``exact=True``) and of fvcore's ``update_bn_stats`` over
the time of a plain train-mode forward under ``no_grad``, as the median of per-repetition ratios
with the order rotated each repetition; and every method's largest error against a float64
reference, on normal data and on data whose first BN layer sees means 1e2..1e4 times the std.
Writes the "overhead" section of ``DIR/RESULTS.md``. Where a cost target is missed, it adds a
torch.profiler breakdown of where the extra time goes.
"""
from __future__ import annotations

import argparse
import copy
from typing import Dict, List, Optional, Sequence, Tuple

from torch.profiler import ProfilerActivity, profile

import cases
import common
import methods
from cases import Case
from common import FLOOR

METHODS = [FLOOR, "precise-bn", "precise-bn exact", "fvcore"]
CNNS = ("resnet_style_2d", "video_cnn_3d")
DEFAULT_TARGET, EXACT_TARGET = 1.02, 1.05

FULL = [
    Case("resnet_style_2d", (3, 32, 32), 16, 32, options={"widths": (32, 64, 128, 256), "blocks": 2}),
    Case("video_cnn_3d", (3, 8, 32, 32), 4, 32, options={"widths": (16, 32, 64), "blocks": 2}),
    Case("bn_mlp", (256,), 256, 64, options={"in_features": 256, "width": 1024, "depth": 4}),
]
QUICK = [
    Case("resnet_style_2d", (3, 8, 8), 2, 2, options={"widths": (8,), "blocks": 1}),
    Case("bn_mlp", (16,), 8, 2, options={"in_features": 16, "width": 16, "depth": 1}),
]


def with_data(settings: Sequence[Case], data: str) -> List[Case]:
    return [Case(**dict(vars(c), data=data)) for c in settings]


def extra_time_by_op(result: methods.CaseResult, method: str, reps: int = 3, rows: int = 8) -> str:
    """Where ``method``'s extra time over the floor goes, on ``result``'s case, as markdown.

    torch.profiler over ``reps`` alternating runs of the method and of the floor keeps, per
    operator, the smallest self CPU time over the runs; the operators that grew most are listed.
    The wall-clock extra of the timing table minus the net extra in operators is time spent in
    Python outside any operator: the capture's per-call bookkeeping and per-run setup.
    """
    case = result.case
    model, batches = case.build()
    calls = case.batches * len(cases.bn_layers(model))
    totals: List[Dict[str, Tuple[float, int]]] = [{}, {}]
    for name in (FLOOR, method):
        methods.METHODS[name](copy.deepcopy(model), batches)  # warm-up
    for _ in range(reps):
        for name, total in zip((FLOOR, method), totals):
            run = copy.deepcopy(model)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                methods.METHODS[name](run, batches)
            for e in prof.key_averages():
                total[e.key] = (min(total.get(e.key, (float("inf"), 0))[0], e.self_cpu_time_total), e.count)
    floor, other = totals
    extra = {k: (other[k][0] - floor.get(k, (0, 0))[0]) / 1e3 for k in other}  # ms
    in_ops = sum(extra.values())
    wall = 1e3 * (result.timing[method].seconds - result.timing[FLOOR].seconds)
    table = common.markdown_table(
        ["operator", "extra self CPU (ms)", "per BN call (us)", "calls (method / floor)"],
        [
            ["`{}`".format(k), "{:.1f}".format(extra[k]), "{:.1f}".format(1e3 * extra[k] / calls),
             "{} / {}".format(other[k][1], floor.get(k, (0, 0))[1])]
            for k in sorted(extra, key=extra.get, reverse=True)[:rows]
        ],
    )
    return (
        "Profile of `{m}` on {model} ({b} batches x {l} BN layers = {c} BN calls per run). "
        "Wall-clock extra over the floor (timing table): {w:.1f} ms per run, {wc:.1f} us per BN "
        "call. Net extra self CPU time in operators (smallest of {r} profiled runs per "
        "operator): {o:.1f} ms ({oc:.1f} us per call). The rest, {p:.1f} ms ({pc:.1f} us per "
        "call), is Python outside any operator. Operators that grew most:\n\n{t}".format(
            m=method, model=case.model, b=case.batches, l=calls // case.batches, c=calls, w=wall,
            wc=1e3 * wall / calls, r=reps, o=in_ops, oc=1e3 * in_ops / calls, p=wall - in_ops,
            pc=1e3 * (wall - in_ops) / calls, t=table,
        )
    )


def targets(results: Sequence[methods.CaseResult]) -> Tuple[List[str], List[Tuple[methods.CaseResult, str]]]:
    """One line per target of the core issue, measured; and the (result, method) pairs missed."""
    lines, missed = [], []
    for r in results:
        t = r.timing
        if r.case.model in CNNS:
            for method, bound in (("precise-bn", DEFAULT_TARGET), ("precise-bn exact", EXACT_TARGET)):
                ok = t[method].median <= bound
                lines.append(common.target_line("{} on {}: {:.3f}x the forward (target <= {:.2f}x)".format(
                    method, r.case.model, t[method].median, bound), ok))
                if not ok:
                    missed.append((r, method))
        else:
            versus = t["precise-bn"].versus(t["fvcore"])
            ok = versus <= 1.0
            lines.append(common.target_line(
                "precise-bn on {}: {:.3f}x the forward, fvcore {:.3f}x; precise-bn / fvcore = {:.3f} "
                "(median of per-repetition ratios; target <= 1)".format(
                    r.case.model, t["precise-bn"].median, t["fvcore"].median, versus), ok))
            if not ok:
                missed.append((r, "precise-bn"))
    return lines, missed


def render(timed: Sequence[methods.CaseResult], shifted: Sequence[methods.CaseResult], args: argparse.Namespace,
           argv: Optional[Sequence[str]], target_lines: Sequence[str], profiles: Sequence[str]) -> str:
    parts = [
        "## Overhead over the forward pass (`benchmarks/overhead.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.environment_text(args.threads),
        "Sizes (random-init weights, inputs from `torch.randn`):",
        common.markdown_table(cases.CASE_HEADERS, [r.cells for r in timed]),
        methods.time_table(timed, METHODS),
        "Targets of the core issue:",
        "\n".join(target_lines),
        methods.error_table(list(timed) + list(shifted)),
    ]
    return "\n\n".join(parts + list(profiles))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 9, quick 2)")
    args = common.parse_common(parser, argv)
    reps = args.reps or (2 if args.quick else 9)
    settings = QUICK if args.quick else FULL
    common.log.info("%d cases x %d methods, at least %d timed repetitions", len(settings), len(METHODS), reps)
    timed = [methods.evaluate_case(c, METHODS, reps, 0.0 if args.quick else 30.0) for c in settings]
    shifted = [methods.evaluate_case(c, METHODS, 0) for c in with_data(settings, "shifted")]
    lines, missed = targets(timed)
    if missed:
        common.log.info("profiling %d missed target(s)", len(missed))
    profiles = [extra_time_by_op(result, method) for result, method in missed[: 1 if args.quick else None]]
    text = render(timed, shifted, args, argv, lines, profiles)
    common.write_section(args.out / "RESULTS.md", "overhead", text)
    print(text)


if __name__ == "__main__":
    main()
