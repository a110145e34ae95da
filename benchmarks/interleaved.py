"""What reading every BN call costs, measured batch by batch against a plain copy of the model.

    python benchmarks/interleaved.py [--quick] [--out DIR] [--threads N] [--reps N]

The whole-run ratios of ``overhead.py`` and ``compare.py`` move by a few points between runs on
a shared machine, as much as the 1.05x target. Here two copies of one torchvision model take the
same batches alternately, one batch at a time (which of the two goes first alternates too), so
drift cancels within microseconds:

* ``capture``: copy B runs inside an open precise-bn pass (``BNPass``, default path): every BN
  call goes through the capture and is measured from its input in float64, by the compiled sums
  (compiled after the warm-up, ``common.settle``). The per-run cost (finding layers, snapshot,
  final merge) is left out: this isolates the per-call cost.
* ``empty hook``: copy B has a forward hook that does nothing on every BN layer, the floor of
  any hook-based reader.
* ``identical``: copy B is a plain copy, like A: the machine's own noise.

Each row gives the median over repetitions of B's time over A's, each summed over the batches
of one repetition, and the smallest and largest of those ratios.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402
import common  # noqa: E402

from precise_bn.options import Options  # noqa: E402
from precise_bn.pytorch.bn_pass import BNPass  # noqa: E402

VARIANTS = ("identical", "empty hook", "capture")


def _prepare(variant: str, model: nn.Module) -> Callable[[], None]:
    """Set copy B up for ``variant``; returns how to undo it."""
    if variant == "capture":
        bn_pass = BNPass(model, Options())
        bn_pass.__enter__()
        return lambda: bn_pass.__exit__(None, None, None)
    if variant == "empty hook":
        handles = [
            m.register_forward_hook(lambda module, args, out: None)
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        return lambda: [h.remove() for h in handles]
    return lambda: None


def interleaved_ratios(model: nn.Module, batches: List[torch.Tensor], variant: str, reps: int) -> List[float]:
    """Per repetition, B's summed time over A's, batches fed alternately to A and B."""
    plain, other = copy.deepcopy(model), copy.deepcopy(model)
    undo = _prepare(variant, other)
    ratios = []
    try:
        with torch.no_grad():
            for x in batches:  # warm-up
                plain(x)
                other(x)
            common.settle()
            for rep in range(reps):
                spent = {id(plain): 0.0, id(other): 0.0}
                for i, x in enumerate(batches):
                    for net in ((plain, other) if (i + rep) % 2 else (other, plain)):
                        start = time.perf_counter()
                        net(x)
                        spent[id(net)] += time.perf_counter() - start
                ratios.append(spent[id(other)] / spent[id(plain)])
    finally:
        undo()
    return ratios


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--reps", type=int, default=None, help="repetitions per variant (default 60, quick 2)")
    args = common.parse_common(parser, argv)
    reps = args.reps or (2 if args.quick else 60)
    case = (
        cases.Case("resnet_style_2d", (3, 8, 8), 2, 2, options={"widths": (8,), "blocks": 1})
        if args.quick
        else cases.Case("mobilenet_v3_large", (3, 64, 64), 16, 8)
    )
    model, batches = case.build()
    rows = []
    results: Dict[str, List[float]] = {}
    for variant in VARIANTS:
        common.log.info("interleaved: %s, %d repetitions", variant, reps)
        results[variant] = interleaved_ratios(model, batches, variant, reps)
        r = results[variant]
        rows.append([variant, "{:.4f}".format(statistics.median(r)), "{:.2f}-{:.2f}".format(min(r), max(r))])
    body = "\n\n".join([
        "## Per-call cost, batch by batch (`benchmarks/interleaved.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.run_text(args.threads),
        common.markdown_table(cases.CASE_HEADERS, [case.describe(model)]),
        "Two copies of the model take the same batches alternately, one batch at a time; copy B "
        "is set up as the row says (see the script's docstring), copy A is plain. Median over {} "
        "repetitions of B's time over A's, each repetition summing {} batches. `identical` is "
        "the machine's noise.".format(reps, case.batches),
        common.markdown_table(["copy B", "B / A (median)", "min-max"], rows),
    ])
    common.write_section(args.out / "RESULTS.md", "interleaved", body)


if __name__ == "__main__":
    main()
