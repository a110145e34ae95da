"""What the demo shows, over seeds: held-out accuracy and loss with the EMA running stats that
training left and with the precise stats, for ``precise-bn demo --seed S``, S = 0 .. N-1.

    python benchmarks/demo_seeds.py [--quick] [--out DIR] [--seeds N] [--steps STEPS]

Each seed is one whole ``run_demo`` (the command's code: training, checkpoint, ``recompute``
on the file, evaluation of both files on the 450 held-out digits); the seed sets the network's
initialisation and the order of its training batches, the held-out digits stay the same, so
seed S here prints what ``precise-bn demo --seed S`` prints, with fewer seeds too. The network
runs in float64, so the figures are those of any CPU with any torch kernels (docs/cli.md gives
the margin). Writes the "demo" section of ``DIR/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
from typing import List, Optional, Sequence

import torch

import common
from precise_bn.cli.demo import DEFAULT_STEPS, DemoResult, run_demo


def summary(results: List[DemoResult]) -> str:
    """One line: means, and on how many seeds the precise stats did better or worse."""
    n = len(results)
    return (
        "Over {} seeds: mean held-out accuracy {:.2%} with the EMA stats, {:.2%} with the precise stats; "
        "mean loss {:.4f} and {:.4f}. The precise stats lowered the loss on {} of {} seeds, raised the "
        "accuracy on {} and lowered it on {}.".format(
            n, statistics.mean(r.ema_accuracy for r in results), statistics.mean(r.precise_accuracy for r in results),
            statistics.mean(r.ema_loss for r in results), statistics.mean(r.precise_loss for r in results),
            sum(r.precise_loss < r.ema_loss for r in results), n,
            sum(r.precise_accuracy > r.ema_accuracy for r in results),
            sum(r.precise_accuracy < r.ema_accuracy for r in results),
        )
    )


def kernels_line() -> str:
    return ("CPU kernels: {} (`torch.backends.cpu.get_cpu_capability()`), torch {}. The network is float64 from its "
            "initialisation to its evaluation: other kernels move the printed losses by about 1e-13, far below their "
            "last digit, so any machine prints these figures.".format(
                torch.backends.cpu.get_cpu_capability(), torch.__version__))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0 .. N-1 (default 10, quick 2)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default: the demo's {}, quick 5)".format(DEFAULT_STEPS))
    args = common.parse_common(parser, argv)
    seeds = args.seeds or (2 if args.quick else 10)
    steps = args.steps or (5 if args.quick else DEFAULT_STEPS)
    results = []
    for seed in range(seeds):
        common.log.info("demo: seed %d of %d", seed, seeds)
        with contextlib.redirect_stdout(io.StringIO()):
            results.append(run_demo(steps=steps, seed=seed, quiet=True))
    rows = [(seed, "{:.2%}".format(r.ema_accuracy), "{:.4f}".format(r.ema_loss), "{:.2%}".format(r.precise_accuracy),
             "{:.4f}".format(r.precise_loss)) for seed, r in enumerate(results)]
    text = "\n\n".join([
        "## What the demo shows, over seeds (`benchmarks/demo_seeds.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.run_text(1),
        "`precise-bn demo --steps {} --seed S`: the CNN with 4 BatchNorm layers trained on the 1347 bundled "
        "training digits, its checkpoint recalibrated by the `recompute` command's code, both checkpoints "
        "evaluated on the 450 held-out digits.".format(steps),
        kernels_line(),
        common.markdown_table(["seed", "EMA accuracy", "EMA loss", "precise accuracy", "precise loss"], rows),
        summary(results),
    ])
    common.write_section(args.out / "RESULTS.md", "demo", text)
    print(text)


if __name__ == "__main__":
    main()
