"""A compression loop: prune a network's channels into subnets, and score each subnet with BN
statistics recalibrated for it, then go back to the full network.

    python examples/compression_loop.py [--subnets 20] [--rtol 0.05]

Pruning a channel (its filter and its BN scale and shift set to zero) changes what every later
BN layer sees, so a subnet scored with the full network's statistics is scored wrongly; Once-for-
All, slimmable networks and AIMET recalibrate each candidate on a few thousand training samples
first. ``precise_bn.recalibrated`` does it for the length of a ``with`` block and puts the
statistics back bit for bit when the block ends; ``rtol`` stops each recalibration as soon as
every channel's statistics are known to that relative precision, instead of a fixed budget.

Runs on the demo's CNN and digits (``benchmarks/demo_task.py``);
``benchmarks/compression.py`` measures it against a fixed 2,000-sample budget.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from precise_bn import BNReport, recalibrated

Widths = Tuple[float, ...]
#: Fractions of channels a subnet keeps in each pruned layer.
CHOICES = (0.25, 0.5, 0.75, 1.0)


def prunable(model: nn.Module) -> List[Tuple[nn.Module, nn.modules.batchnorm._BatchNorm]]:
    """Each (conv or linear, the BN layer right after it) of a Sequential model."""
    layers = list(model)
    return [(a, b) for a, b in zip(layers, layers[1:])
            if isinstance(a, (nn.Conv2d, nn.Linear)) and isinstance(b, nn.modules.batchnorm._BatchNorm)]


def random_subnets(count: int, layers: int, seed: int = 0) -> List[Widths]:
    rng = random.Random(seed)
    return [tuple(rng.choice(CHOICES) for _ in range(layers)) for _ in range(count)]


def prune(model: nn.Module, widths: Widths) -> None:
    """Keep the filters of largest L1 norm, ``widths[i]`` of them in layer i; the others are
    zeroed with their BN scale and shift, so the channel outputs exactly 0."""
    with torch.no_grad():
        for (layer, bn), width in zip(prunable(model), widths):
            norms = layer.weight.abs().flatten(1).sum(1)
            dropped = norms.argsort(descending=True)[max(1, round(width * len(norms))):]
            layer.weight[dropped] = 0
            bn.weight[dropped] = 0
            bn.bias[dropped] = 0


def endless(x: Tensor, batch_size: int, seed: int) -> Iterator[Tensor]:
    """Shuffled batches of ``x``, reshuffled every epoch, for ever."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        for index in torch.randperm(len(x), generator=gen).split(batch_size):
            if len(index) == batch_size:
                yield x[index]


def score_subnets(model: nn.Module, subnets: Sequence[Widths], data: Callable[[int], Iterator[Tensor]],
                  score: Callable[[nn.Module], float], **options: Any) -> List[Tuple[float, BNReport]]:
    """For each subnet: prune, recalibrate for the block (``options`` of ``recompute``), score,
    and go back (the statistics by leaving the block, the weights from a copy)."""
    weights = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith(("running_mean", "running_var"))}
    results = []
    for index, widths in enumerate(subnets):
        prune(model, widths)
        with recalibrated(model, data(index), progress=False, **options) as report:
            results.append((score(model), report))
        model.load_state_dict(weights, strict=False)
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subnets", type=int, default=20)
    parser.add_argument("--rtol", type=float, default=0.05)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the demo's tensors only lose time to more threads
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import demo_task

    model, train_x, _, test_x, test_y = demo_task.trained()
    subnets = random_subnets(args.subnets, len(prunable(model)))
    results = score_subnets(model, subnets, lambda i: endless(train_x, demo_task.BATCH_SIZE, seed=i),
                            lambda m: demo_task.accuracy(m, test_x, test_y), rtol=args.rtol, num_samples=20000)
    for widths, (accuracy, report) in zip(subnets, results):
        print("widths {}: accuracy {:.1%} after {} samples ({:.3f} s)".format(
            widths, accuracy, report.samples, report.seconds))


if __name__ == "__main__":
    main()
