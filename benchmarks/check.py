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
* **EMA**: the running statistics a short training left, checked on the 1347 training images
  it ran on: how far off, and whether flagged.

The population is the 1797 bundled digits, each shifted by up to one pixel: a sample is ``N``
independent draws of a digit and a shift. Then the false-alarm rate, where the answer is known:
``--trials`` pairs of independent samples of one population (recompute on one, check the
other), at tolerance 0 (sampling alone must explain the difference), with and without Holm's
correction, on the CNN and on a BatchNorm1d of 4096 normal channels; and the far tails of the
per-channel statistics against Student's t, which Holm's thresholds reach, for the mean, the
variance's ratio and its log. Writes ``DIR/CHECK.md``.
"""
from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import common
from precise_bn import CheckReport, check, recompute
from precise_bn.digits import BATCH_SIZE, load_digits, make_model, train
from precise_bn.estimator import PopulationStats
from precise_bn.precision import t_tail
from precise_bn.staleness import DEFAULT_ALPHA, DEFAULT_TOLERANCE, LayerFit

#: The CNN's convolutions (indices in its Sequential) and the BN layer right after each.
CONVS = (0, 3, 6)
BN_LAYERS = ("1", "4", "7", "11")
#: The conv the tests change: two BN layers before it, two after.
CHANGED_CONV = 6
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
    """Train with ``seed``, check the EMA statistics on the training images, recompute on one
    sample of ``samples`` draws, check on another, then check each conv of ``convs`` changed
    (pruned, and noisy)."""
    gen = torch.Generator().manual_seed(seed)
    train_x, train_y, _, _ = load_digits()
    torch.manual_seed(seed)
    model = train(make_model(), train_x, train_y, steps=steps, batch_size=BATCH_SIZE, seed=seed)
    ema = check(model, list(train_x[torch.randperm(len(train_x), generator=gen)].split(BATCH_SIZE)), progress=False)
    first, second = draw(samples, gen), draw(samples, gen)
    recompute(model, first, progress=False)
    changed = {}
    for conv in convs:
        change = torch.Generator().manual_seed(1000 * seed + conv)  # the same change whatever the samples
        changed["pruned conv {}".format(conv)] = check(pruned(model, conv, change), second, progress=False)
        if noise:
            changed["noisy conv {}".format(conv)] = check(noisy(model, conv, change), second, progress=False)
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


def tails(kind: str, calls: int, size: int, pairs: int, levels: Sequence[float]) -> Dict[str, List[float]]:
    """Pairs of independent samples of :data:`WIDE` channels, ``calls`` calls of ``size`` each
    (``kind``: ``normal``, or ``relu``, max(0, x + 0.5) of normal x): for the mean, the
    variance's ratio and its log, how many channels' t-statistics pass the two-sided quantile of
    each of ``levels`` of Student's t with ``calls - 1`` degrees of freedom, over how many t
    promises."""
    counts = {key: [0] * len(levels) for key in ("mean", "var ratio", "log var ratio")}
    dof = torch.tensor(float(calls - 1))
    for index in range(pairs):
        gen = torch.Generator().manual_seed(20_000 + index)
        measured = []
        for _ in range(2):
            stats = PopulationStats(WIDE)
            for _ in range(calls):
                x = torch.randn(size, WIDE, generator=gen, dtype=torch.float64)
                x = torch.relu(x + 0.5) if kind == "relu" else x
                stats.add_call(x.mean(0), x.var(0, unbiased=False), size)
            measured.append((*stats.finalize(), stats.stderr()[0], stats.stderr()[1]))
        (mean_a, var_a, _, _), (mean_b, var_b, se_mean, se_var) = measured
        paired = math.sqrt(2.0)
        statistics = {"mean": (mean_a - mean_b) / (paired * se_mean), "var ratio": (var_a - var_b) / (paired * se_var),
                      "log var ratio": (var_a / var_b).log() / (paired * se_var / var_b)}
        for key, t in statistics.items():
            p = 2.0 * t_tail(t.abs(), dof)
            for j, level in enumerate(levels):
                counts[key][j] += int((p <= level).sum())
    return {key: [count / (level * pairs * WIDE) for count, level in zip(values, levels)]
            for key, values in counts.items()}


def _layer_p(fit: LayerFit) -> float:
    """A layer's smallest adjusted p-value, mean or variance (1 when nothing was tested)."""
    return min([p for p in (fit.smallest_p("mean"), fit.smallest_p("var")) if p is not None] or [1.0])


def trained_digits(seed: int, steps: int) -> Callable[[], nn.Module]:
    train_x, train_y, _, _ = load_digits()
    torch.manual_seed(seed)
    model = train(make_model(), train_x, train_y, steps=steps, batch_size=BATCH_SIZE, seed=seed)
    return lambda: copy.deepcopy(model)


def wide_normal(batches: int) -> Callable[[torch.Generator], List[torch.Tensor]]:
    return lambda gen: [torch.randn(BATCH_SIZE, WIDE, generator=gen) * 2.0 + 1.0 for _ in range(batches)]


TAIL_LEVELS = (1e-3, 1e-4, 1e-5)
TAIL_CASES = (("normal", 64, 32), ("normal", 16, 8), ("relu", 64, 32))


def render(trials: List[Trial], alarms: Dict[str, Dict[str, float]], tail_rows: List[Sequence[str]],
           args: argparse.Namespace, argv: Optional[Sequence[str]]) -> str:
    seeds = len(trials)
    flagged = sum(bool(t.same.stale) for t in trials)
    rows = []
    for key in trials[0].changed:
        later = after(key)
        caught = sum(all(name in t.changed[key].stale for name in later) for t in trials)
        quiet = sum(not [n for n in t.changed[key].stale if n not in later] for t in trials)
        counts = ", ".join("{} {}/{}".format(name, sum(name in t.changed[key].stale for t in trials), seeds)
                           for name in BN_LAYERS)
        weakest = max(_layer_p(t.changed[key][name]) for t in trials for name in later)
        rows.append((key, ", ".join(later), "{}/{}".format(caught, seeds), "{:.2g}".format(weakest),
                     "{}/{}".format(quiet, seeds), counts))
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
        "noise of {:.0%} of its weights' norm added (noisy); checked on the independent sample. \"largest p "
        "after it\": the largest, over seeds and the layers after the conv, of a layer's smallest adjusted p-value "
        "(flagged at most alpha).".format(FRACTION, FRACTION),
        common.markdown_table(["change", "BN layers after it", "all of them flagged", "largest p after it",
                               "none before flagged", "seeds flagged, per layer"], rows),
        "## EMA statistics after training\n\nThe running statistics {} training steps left, checked on the 1347 "
        "training images they were gathered on: seeds where the layer is flagged, and its drift (mean over seeds, "
        "largest).".format(args.steps),
        common.markdown_table(["layer", "flagged", "mean drift (mean)", "mean drift (max)", "var drift (mean)",
                               "var drift (max)"], ema_rows),
        "## False-alarm rate at tolerance 0\n\n{} pairs of independent samples of one population; tolerance 0, "
        "so any layer flagged is a false alarm, with Holm's correction over all channels and without any "
        "(a channel's raw p-value at most alpha).".format(args.trials),
        common.markdown_table(["model, samples", "correction, alpha", "runs with a layer flagged"], alarm_rows),
        "## Far tails of the per-channel statistics\n\n{} pairs of independent samples of {} channels: how many "
        "channels' statistics (the difference over sqrt(2) times the second sample's standard error) fall beyond "
        "the two-sided quantile of Student's t with calls - 1 degrees of freedom, as a multiple of what t promises "
        "(1: exact; Holm's thresholds for a model with thousands of channels lie near 1e-6). `relu`: max(0, x + 0.5) "
        "of normal x.".format(args.pairs, WIDE),
        common.markdown_table(["population", "calls x samples", "statistic"] + ["beyond {:g}".format(level)
                                                                            for level in TAIL_LEVELS], tail_rows),
    ]) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0 .. N-1 (default 10, quick 2)")
    parser.add_argument("--samples", type=int, default=None, help="draws per sample (default 65536, quick 2048)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default {}, quick 20)".format(STEPS))
    parser.add_argument("--trials", type=int, default=None, help="false-alarm trials (default 200, quick 4)")
    parser.add_argument("--pairs", type=int, default=None, help="pairs of samples for the tails (default 100, quick 1)")
    args = common.parse_common(parser, argv)
    quick = args.quick
    args.seeds = args.seeds or (2 if quick else 10)
    args.samples = args.samples or (2048 if quick else 65536)
    args.steps = args.steps or (20 if quick else STEPS)
    args.trials = args.trials or (4 if quick else 200)
    args.pairs = args.pairs or (1 if quick else 100)
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
    tail_rows = []
    for kind, calls, size in TAIL_CASES:
        for key, ratios in tails(kind, calls, size, args.pairs, TAIL_LEVELS).items():
            tail_rows.append((kind, "{} x {}".format(calls, size), key) + tuple("{:.2f}".format(r) for r in ratios))
    text = render(trials, alarms, tail_rows, args, argv)
    (args.out / "CHECK.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
