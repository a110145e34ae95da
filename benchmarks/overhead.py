"""What precise-bn costs over the plain forward pass, and its largest error against float64.

    python benchmarks/overhead.py [--quick] [--out DIR] [--threads N] [--reps N]

For a ResNet-style 2D CNN, a 3D video CNN and a BN MLP, on the same batches: the time of
``precise_bn.recompute`` and of fvcore's ``update_bn_stats`` over the time of a plain train-mode
forward under ``no_grad``, at steady state (the float64 sums compiled, ``common.settle``), as the
median of per-repetition ratios with the order rotated each repetition; and every method's
largest error against a float64 reference, on normal data and on data whose first BN layer sees
means 1e2..1e4 times the std. Writes the "overhead" section of ``DIR/RESULTS.md``. Where a cost
target is missed, it adds a torch.profiler breakdown of where the extra time goes.
"""
from __future__ import annotations

import argparse
from typing import List, Optional, Sequence, Tuple

import cases
import common
import methods
from cases import Case
from common import FLOOR

METHODS = [FLOOR, "precise-bn", "fvcore"]
CNNS = ("resnet_style_2d", "video_cnn_3d")
TARGET = 1.05  # over the forward; and no more than fvcore
#: Against fvcore, per model: the MLP's calls are few and cheap next to its matrix products, so
#: its target is a margin over fvcore rather than parity.
VERSUS_FVCORE = {"bn_mlp": 1.15}

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


def targets(results: Sequence[methods.CaseResult]) -> Tuple[List[str], List[methods.CaseResult]]:
    """One line per target, measured; and the results whose precise-bn missed one."""
    lines, missed = [], []
    for r in results:
        t = r.timing
        ok = True
        if r.case.model in CNNS:
            ok = t["precise-bn"].median <= TARGET
            lines.append(common.target_line("precise-bn on {}: {:.3f}x the forward (target <= {:.2f}x)".format(
                r.case.model, t["precise-bn"].median, TARGET), ok))
        versus = t["precise-bn"].versus(t["fvcore"])
        bound = VERSUS_FVCORE.get(r.case.model, 1.0)
        lines.append(common.target_line(
            "precise-bn on {}: {:.3f}x the forward, fvcore {:.3f}x; precise-bn / fvcore = {:.3f} "
            "(median of per-repetition ratios; target <= {:g})".format(
                r.case.model, t["precise-bn"].median, t["fvcore"].median, versus, bound), versus <= bound))
        if not ok or versus > bound:
            missed.append(r)
    return lines, missed


def render(timed: Sequence[methods.CaseResult], shifted: Sequence[methods.CaseResult], args: argparse.Namespace,
           argv: Optional[Sequence[str]], target_lines: Sequence[str], profiles: Sequence[str]) -> str:
    parts = [
        "## Overhead over the forward pass (`benchmarks/overhead.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.run_text(args.threads),
        "Sizes (random-init weights, inputs from `torch.randn`):",
        common.markdown_table(cases.CASE_HEADERS, [r.cells for r in timed]),
        methods.time_table(timed, METHODS),
        "Targets: at most {:.2f}x the forward on the CNNs, and no more than fvcore:".format(TARGET),
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
    profiles = [methods.extra_time_by_op(result, "precise-bn") for result in missed[: 1 if args.quick else None]]
    text = render(timed, shifted, args, argv, lines, profiles)
    common.write_section(args.out / "RESULTS.md", "overhead", text)
    print(text)


if __name__ == "__main__":
    main()
