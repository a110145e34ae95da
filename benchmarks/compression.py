"""A compression loop's recalibrations: a precision stop (``rtol``) against Once-for-All's fixed
2,000-sample budget, on 20 pruned subnets of the demo's CNN.

    python benchmarks/compression.py [--quick] [--out DIR] [--threads N]

Each subnet (``examples/compression_loop.py``: filters of smallest L1 norm zeroed with their BN
scale and shift, a random fraction kept per layer) is scored on the held-out digits with the
full network's statistics (stale), then recalibrated inside ``recalibrated`` on shuffled
training batches of 32, scored, and put back: with the whole training split read once (the
population, exact), with 2,000 samples, and with ``rtol`` in {0.1, 0.05, 0.02} (capped at
20,000 samples). Per setting: samples read per subnet (what a recalibration costs, whatever
the machine), held-out accuracy, and its distance to the population's. At the end the model must
hold every bit it started with. Writes ``DIR/COMPRESSION_RESULTS.md``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import common
import demo_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import compression_loop as loop  # noqa: E402

BUDGET = 2000
RTOLS = (0.1, 0.05, 0.02)
RTOL_CAP = 20000


def settings(train_x) -> List[Tuple[str, Any, Dict[str, Any]]]:
    """(label, data for subnet i, options) per recalibration setting."""
    batches = loop.endless
    return [("population (training split once)", lambda i: train_x.split(demo_task.BATCH_SIZE), {}),
            ("fixed {:,} samples".format(BUDGET), lambda i: batches(train_x, demo_task.BATCH_SIZE, i),
             {"num_samples": BUDGET})] + [
        ("rtol={:g}".format(r), lambda i: batches(train_x, demo_task.BATCH_SIZE, i),
         {"rtol": r, "num_samples": RTOL_CAP}) for r in RTOLS]


def _bits(model: torch.nn.Module) -> Dict[str, bytes]:
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}


def study(subnets: int, steps: int) -> Tuple[List[Dict[str, Any]], bool]:
    model, train_x, _, test_x, test_y = demo_task.trained(steps)
    before = _bits(model)
    widths = loop.random_subnets(subnets, len(loop.prunable(model)))
    score = lambda m: demo_task.accuracy(m, test_x, test_y)  # noqa: E731
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    stale_acc = []
    for w in widths:
        loop.prune(model, w)
        stale_acc.append(score(model))
        model.load_state_dict(weights)
    rows = [{"label": "stale (full network's stats)", "acc": stale_acc, "samples": [0] * subnets}]
    for label, data, options in settings(train_x):
        results = loop.score_subnets(model, widths, data, score, **options)
        rows.append({"label": label, "acc": [a for a, _ in results], "samples": [r.samples for _, r in results]})
        common.log.info("compression: %s done", label)
    return rows, _bits(model) == before


def render(argv, rows: List[Dict[str, Any]], intact: bool, subnets: int, steps: int) -> str:
    population = rows[1]["acc"]
    table = []
    for row in rows:
        gaps = [abs(a - p) for a, p in zip(row["acc"], population)]
        table.append([row["label"], "{:,.0f}".format(statistics.mean(row["samples"])),
                      "{:.1%}".format(statistics.mean(row["acc"])),
                      "{:.2%}".format(statistics.mean(gaps)), "{:.2%}".format(max(gaps))])
    return "\n\n".join(common.section_head("Recalibrating pruned subnets (`benchmarks/compression.py`)", argv) + [
        "{} subnets of the demo's CNN ({} training steps), pruned by `examples/compression_loop.py`; each "
        "recalibrated inside `recalibrated(...)`, scored on the held-out digits, put back. Accuracy: "
        "mean over subnets; gap: "
        "|accuracy - accuracy with the population's stats|, mean and worst over subnets.".format(subnets, steps),
        common.markdown_table(["statistics", "samples read (mean)", "accuracy (mean)", "gap (mean)", "gap (worst)"],
                              table),
        "After the {} subnets the model holds every bit it started with: **{}**.".format(
            subnets, "yes" if intact else "NO"),
    ])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    args = common.parse_common(parser, argv)
    torch.set_num_threads(1)  # the demo's tensors only lose time to more threads
    subnets, steps = (3, 30) if args.quick else (20, 300)
    rows, intact = study(subnets, steps)
    text = render(argv, rows, intact, subnets, steps)
    common.write_section(args.out / "COMPRESSION_RESULTS.md", "compression", text)
    print(text)


if __name__ == "__main__":
    main()
