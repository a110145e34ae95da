"""Does ``precise_bn.check`` tell stale BN statistics from fitting ones, without false alarms?

    python benchmarks/check.py [--quick] [--out DIR] [--seeds N] [--samples N] [--trials N]

On the demo's CNN (:mod:`precise_bn.digits`, 4 BN layers, 176 channels), for each seed (the
network's initialisation and training order, the samples drawn, the weights changed), with the
default tolerance and ``alpha``:

* **same population**: statistics recomputed on one sample and checked on an independent sample
  of the same population: which layers are flagged;
* **a conv changed**: after that recompute, 30% of one conv's weights set to zero at random (as
  pruning does): which layers are flagged (every BN layer after it should be, none before);
  also 30% noise (a random change of 30% of the weights' norm), whose effect fades faster;
* **EMA**: the running statistics a short training left, checked: how far off, and whether flagged.

The population is the 1797 bundled digits, each shifted by up to one pixel: a sample is ``N``
independent draws of a digit and a shift. Then the false-alarm rate, where the answer is known:
``--trials`` pairs of independent samples of one population (recompute on one, check the
other), at tolerance 0 (sampling alone must explain the difference), with and without Holm's
correction, on the CNN and on a BatchNorm1d of 4096 normal channels. Writes ``DIR/CHECK.md``.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import common
from precise_bn import CheckReport, check, recompute
from precise_bn.digits import BATCH_SIZE, load_digits, make_model, train
from precise_bn.staleness import DEFAULT_ALPHA, DEFAULT_TOLERANCE

#: The CNN's convolutions (indices in its Sequential) and the BN layer right after each.
CONVS = (0, 3, 6)
BN_LAYERS = ("1", "4", "7", "11")
CHANGED_CONV = 3
FRACTION = 0.3
STEPS = 300
WIDE = 4096


def draw(count: int, gen: torch.Generator) -> List[torch.Tensor]:
    """``count`` independent draws from the population (a digit, shifted by -1, 0 or 1 pixel
    each way, zeros coming in at the edge), in batches of the demo's size."""
    train_x, _, test_x, _ = load_digits()
    digits = torch.cat([train_x, test_x])
    index = torch.randint(len(digits), (count,), generator=gen)
    offset = torch.randint(3, (count, 2), generator=gen)
    padded = F.pad(digits[index], (1, 1, 1, 1))
    rows = (offset[:, :1] + torch.arange(8)).view(count, 1, 8, 1).expand(count, 1, 8, 10)
    cols = (offset[:, 1:] + torch.arange(8)).view(count, 1, 1, 8).expand(count, 1, 8, 8)
    return list(padded.gather(2, rows).gather(3, cols).split(BATCH_SIZE))


def pruned(model: nn.Module, conv: int, gen: torch.Generator) -> nn.Module:
    """A copy of ``model`` with :data:`FRACTION` of conv ``conv``'s weights set to zero at random."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        weight = changed[conv].weight
        weight.mul_((torch.rand(weight.shape, generator=gen) >= FRACTION).to(weight.dtype))
    return changed


def noisy(model: nn.Module, conv: int, gen: torch.Generator) -> nn.Module:
    """A copy of ``model`` with random noise of :data:`FRACTION` of conv ``conv``'s weight norm added."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        weight = changed[conv].weight
        noise = torch.randn(weight.shape, generator=gen)
        weight.add_(noise * (FRACTION * weight.norm() / noise.norm()))
    return changed


@dataclass
class Trial:
    """One seed's verdicts: EMA statistics, a same-population sample, and changed convs."""

    ema: CheckReport
    same: CheckReport
    changed: Dict[str, CheckReport]


def trial(seed: int, samples: int, steps: int, convs: Sequence[int] = CONVS, noise: bool = True) -> Trial:
    """Train with ``seed``, check the EMA statistics, recompute on one sample of ``samples``
    draws, check on another, then check each conv of ``convs`` changed (pruned, and noisy)."""
    gen = torch.Generator().manual_seed(seed)
    train_x, train_y, _, _ = load_digits()
    torch.manual_seed(seed)
    model = train(make_model(), train_x, train_y, steps=steps, batch_size=BATCH_SIZE, seed=seed)
    first, second = draw(samples, gen), draw(samples, gen)
    ema = check(model, second, progress=False)
    recompute(model, first, progress=False)
    changed = {}
    for conv in convs:
        changed["pruned conv {}".format(conv)] = check(pruned(model, conv, gen), second, progress=False)
        if noise:
            changed["noisy conv {}".format(conv)] = check(noisy(model, conv, gen), second, progress=False)
    return Trial(ema, check(model, second, progress=False), changed)


def after(key: str) -> List[str]:
    """The BN layers after the conv a ``changed`` key names."""
    return list(BN_LAYERS[CONVS.index(int(key.rsplit(" ", 1)[1])):])


def false_alarms(make: Callable[[], nn.Module], sample: Callable[[torch.Generator], List[torch.Tensor]],
                 trials: int, alphas: Sequence[float]) -> Dict[str, float]:
    """Over ``trials`` pairs of independent samples: how often any layer is flagged at tolerance
    0 with Holm's correction at each of ``alphas``, and with none (any raw p-value below alpha)."""
    hits: Dict[str, int] = {}
    for index in range(trials):
        gen = torch.Generator().manual_seed(10_000 + index)
        model = make()
        recompute(model, sample(gen), progress=False)
        report = check(model, sample(gen), tolerance=(0.0, 0.0), progress=False)
        for correction, field in (("Holm", "p"), ("none", "unadjusted")):
            smallest = min(float(p[~p.isnan()].min()) for fit in report.layers for p in getattr(fit, field).values())
            for alpha in alphas:
                key = "{}, alpha {:g}".format(correction, alpha)
                hits[key] = hits.get(key, 0) + (smallest <= alpha)
    return {key: count / trials for key, count in hits.items()}


def trained_digits(seed: int, steps: int) -> Callable[[], nn.Module]:
    train_x, train_y, _, _ = load_digits()
    torch.manual_seed(seed)
    model = train(make_model(), train_x, train_y, steps=steps, batch_size=BATCH_SIZE, seed=seed)
    return lambda: copy.deepcopy(model)


def wide_normal(batches: int) -> Callable[[torch.Generator], List[torch.Tensor]]:
    return lambda gen: [torch.randn(BATCH_SIZE, WIDE, generator=gen) * 2.0 + 1.0 for _ in range(batches)]


def render(trials: List[Trial], alarms: Dict[str, Dict[str, float]], args: argparse.Namespace,
           argv: Optional[Sequence[str]]) -> str:
    seeds = len(trials)
    flagged = sum(bool(t.same.stale) for t in trials)
    rows = []
    for key in trials[0].changed:
        later = after(key)
        caught = sum(all(name in t.changed[key].stale for name in later) for t in trials)
        quiet = sum(not [n for n in t.changed[key].stale if n not in later] for t in trials)
        counts = ", ".join("{} {}/{}".format(name, sum(name in t.changed[key].stale for t in trials), seeds)
                           for name in BN_LAYERS)
        rows.append((key, ", ".join(later), "{}/{}".format(caught, seeds), "{}/{}".format(quiet, seeds), counts))
    ema_rows = []
    for name in BN_LAYERS:
        fits = [t.ema[name] for t in trials]
        ema_rows.append((name, "{}/{}".format(sum(f.stale for f in fits), seeds),
                         "{:.3f}".format(sum(f.layer.mean_drift for f in fits) / seeds),
                         "{:.3f}".format(max(f.layer.mean_drift for f in fits)),
                         "{:.3f}".format(sum(f.layer.var_drift for f in fits) / seeds),
                         "{:.3f}".format(max(f.layer.var_drift for f in fits))))
    alarm_rows = [(where, key, "{:.1%}".format(rate)) for where, rates in alarms.items() for key, rate in rates.items()]
    return "\n\n".join([
        "# `precise-bn check`: stale statistics found, fitting ones left alone (`benchmarks/check.py`)",
        "Command: `{}`. {}".format(common.command_line(argv), common.environment_text(torch.get_num_threads())),
        "The demo's CNN (`precise_bn/digits.py`: BN layers {}) trained for {} steps per seed; samples of {} "
        "independent draws of a bundled digit shifted by up to one pixel; default tolerance (mean {:g} std, "
        "variance {:g} relative) and alpha {:g}.".format(", ".join(BN_LAYERS), args.steps, args.samples,
                                                         DEFAULT_TOLERANCE[0], DEFAULT_TOLERANCE[1], DEFAULT_ALPHA),
        "## Same population\n\nRecomputed on one sample, checked on an independent one: a layer flagged in "
        "**{} of {} seeds**.".format(flagged, seeds),
        "## A conv changed after recomputing\n\n{:.0%} of one conv's weights set to zero at random (pruned), or "
        "noise of {:.0%} of its weights' norm added (noisy); checked on the independent sample.".format(
            FRACTION, FRACTION),
        common.markdown_table(["change", "BN layers after it", "all of them flagged", "none before flagged",
                               "seeds flagged, per layer"], rows),
        "## EMA statistics after training\n\nThe running statistics {} training steps left, checked on a "
        "sample: seeds where the layer is flagged, and its drift (mean over seeds, largest).".format(args.steps),
        common.markdown_table(["layer", "flagged", "mean drift (mean)", "mean drift (max)", "var drift (mean)",
                               "var drift (max)"], ema_rows),
        "## False-alarm rate at tolerance 0\n\n{} pairs of independent samples of one population; tolerance 0, "
        "so any layer flagged is a false alarm, with Holm's correction over all channels and without any "
        "(a channel's raw p-value at most alpha).".format(args.trials),
        common.markdown_table(["model, samples", "correction, alpha", "runs with a layer flagged"], alarm_rows),
    ]) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0 .. N-1 (default 10, quick 2)")
    parser.add_argument("--samples", type=int, default=None, help="draws per sample (default 65536, quick 2048)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default {}, quick 20)".format(STEPS))
    parser.add_argument("--trials", type=int, default=None, help="false-alarm trials (default 200, quick 4)")
    args = common.parse_common(parser, argv)
    quick = args.quick
    args.seeds = args.seeds or (2 if quick else 10)
    args.samples = args.samples or (2048 if quick else 65536)
    args.steps = args.steps or (20 if quick else STEPS)
    args.trials = args.trials or (4 if quick else 200)
    trials = []
    for seed in range(args.seeds):
        common.log.info("check: seed %d of %d", seed, args.seeds)
        trials.append(trial(seed, args.samples, args.steps))
    small = 1024 if quick else 4096
    alarms = {
        "digits CNN, {} draws".format(small): false_alarms(trained_digits(0, args.steps),
                                                          lambda gen: draw(small, gen), args.trials, (0.01, 0.05)),
        "BatchNorm1d({}), 64 batches of {}".format(WIDE, BATCH_SIZE): false_alarms(
            lambda: nn.BatchNorm1d(WIDE), wide_normal(64), args.trials, (0.01, 0.05)),
    }
    text = render(trials, alarms, args, argv)
    (args.out / "CHECK.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
