"""Are the standard errors calibrated on hard data, and does ``rtol`` keep its promise there?

    python benchmarks/calibration.py [--quick] [--out DIR] [--threads N]

Populations of known statistics (per-sample effects plus per-position noise, 2x2 positions,
a few channels each): normal, Student's t with 5 and 2.5 degrees of freedom, lognormal with
sigma 1 and 2, rare outliers (one sample in 1,000 shifted by 50 std), and a rarely active
channel (active on one sample in 2,000, as a ReLU output). For each, many draws of shuffled
batches are recomputed with a BatchNorm2d:

* a fixed budget: how often the true error lies within two stated standard errors, how often
  the channel is marked in ``LayerReport.se_untrusted``, and how often one or the other holds;
* ``rtol``: how often the pass stops on it, after how many batches, and how many channels end
  beyond ``rtol`` in passes that stopped on it (``rtol`` promises about 5% at most).

Writes ``DIR/CALIBRATION.md`` (default: next to this script). The quick run of
``tests/test_precision.py`` uses the same populations.
"""
from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

import common
from precise_bn import BNReport, recompute

KINDS = ("normal", "t5", "t2.5", "lognormal1", "lognormal2", "outliers", "rare")
SIDE = 2


def population(kind: str, samples: int, channels: int, seed: int = 0) -> torch.Tensor:
    """``samples`` samples of ``channels`` channels of one kind of distribution (see the module
    docstring), float32 ``(samples, channels, 2, 2)``."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(samples, channels, 1, 1, generator=gen) * 0.7
    base = base + torch.randn(samples, channels, SIDE, SIDE, generator=gen) * 0.5
    if kind == "normal":
        return base
    if kind in ("t5", "t2.5"):
        dof = float(kind[1:])
        # A chi-square of dof degrees of freedom is 2 gamma(dof/2); torch's gamma sampler takes
        # no generator, so the global one is seeded for this draw only.
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            chi2 = torch._standard_gamma(torch.full(base.shape, dof / 2.0, dtype=torch.float64)) * 2.0
        return (base / (chi2 / dof).sqrt()).float()
    if kind in ("lognormal1", "lognormal2"):
        return (base / base.std() * float(kind[-1])).exp()
    if kind == "outliers":
        return base + (torch.rand(samples, channels, 1, 1, generator=gen) < 1e-3).float() * 50.0
    if kind == "rare":
        active = torch.rand(samples, channels, 1, 1, generator=gen) < 1.0 / 2000
        return torch.where(active, torch.relu(5.0 + base), torch.zeros(()))
    raise ValueError("unknown kind {!r}; one of {}".format(kind, ", ".join(KINDS)))


def normal_stream(seed: int, channels: int = 64, batch: int = 32) -> Iterator[torch.Tensor]:
    """An endless stream of ``(batch, channels)`` standard normal batches: population mean 0,
    variance 1, no finite data set to exhaust."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(batch, channels, generator=gen)


def normal_rtol(rtol: float, count: int) -> Dict[str, float]:
    """Passes over :func:`normal_stream` that stop on ``rtol``: mean batches, the share of
    channels beyond ``rtol``, and the worst such share in one pass."""
    batches, shares = [], []
    for seed in range(count):
        report = recompute(nn.BatchNorm1d(64), normal_stream(seed), rtol=rtol, progress=False)
        layer = report.layers[0]
        batches.append(report.batches)
        shares.append(float((torch.maximum(layer.new_mean.abs(), (layer.new_var - 1).abs()) > rtol).double().mean()))
    return {"batches": sum(batches) / count, "beyond": sum(shares) / count, "worst": max(shares)}


def exact_stats(x: torch.Tensor) -> List[torch.Tensor]:
    """The population's mean and biased variance per channel, float64."""
    rows = x.double().transpose(0, 1).reshape(x.shape[1], -1)
    return [rows.mean(1), rows.var(1, unbiased=False)]


def draws(x: torch.Tensor, batch: int, count: int, **options) -> List[BNReport]:
    """``count`` recomputations of a BatchNorm2d, each over its own shuffle of ``x``."""
    reports = []
    for seed in range(count):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        batches = (x[order[i * batch:(i + 1) * batch]] for i in range(len(x) // batch))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rtol not reached: counted below
            reports.append(recompute(nn.BatchNorm2d(x.shape[1]), batches, progress=False, layers="all",
                                     **options))
    return reports


def fixed_budget(x: torch.Tensor, batch: int, batches: int, count: int) -> Dict[str, float]:
    """Coverage of two standard errors (mean, variance), channels marked, and either, over
    ``count`` draws of ``batches`` batches."""
    mean, var = exact_stats(x)
    covered, flagged, mean_covered = [], [], []
    for report in draws(x, batch, count, num_batches=batches):
        layer = report.layers[0]
        covered.append((layer.new_var - var).abs() <= 2 * layer.var_stderr)
        mean_covered.append((layer.new_mean - mean).abs() <= 2 * layer.mean_stderr)
        marked = torch.zeros(x.shape[1], dtype=torch.bool)
        marked[layer.se_untrusted] = True
        flagged.append(marked)
    cov, flag, mcov = torch.stack(covered), torch.stack(flagged), torch.stack(mean_covered)
    return {"var_cover": float(cov.double().mean()), "mean_cover": float(mcov.double().mean()),
            "flagged": float(flag.double().mean()), "cover_or_flag": float((cov | flag).double().mean())}


def beyond(report: BNReport, mean: torch.Tensor, var: torch.Tensor, rtol: float) -> torch.Tensor:
    """Channels whose mean (in units of the std) or variance (relative) is off by more than ``rtol``."""
    layer = report.layers[0]
    return torch.maximum((layer.new_mean - mean).abs() / var.sqrt(), (layer.new_var - var).abs() / var) > rtol


def rtol_stops(x: torch.Tensor, batch: int, rtol: float, budget: int, count: int) -> Dict[str, float]:
    """Over ``count`` draws with ``rtol`` and a budget: the share that stopped on ``rtol``, their
    mean batches, and the share of their channels beyond ``rtol``."""
    mean, var = exact_stats(x)
    reports = draws(x, batch, count, rtol=rtol, num_batches=budget)
    stopped = [r for r in reports if r.stop == "rtol"]
    out = torch.cat([beyond(r, mean, var, rtol) for r in stopped]) if stopped else torch.zeros(0)
    return {"stopped": len(stopped) / len(reports),
            "batches": sum(r.batches for r in stopped) / len(stopped) if stopped else float("nan"),
            "beyond": float(out.double().mean()) if stopped else float("nan")}


@dataclass
class Config:
    samples: int
    channels: int
    draws: int
    rtol_draws: int
    fixed: Sequence[tuple]  # (batch size, batches)
    rtol: float
    normal_rtols: Sequence[float]
    normal_draws: int


FULL = Config(samples=40_000, channels=8, draws=100, rtol_draws=40, fixed=((32, 32), (2, 128)), rtol=0.1,
              normal_rtols=(1e-2, 5e-2), normal_draws=20)
QUICK = Config(samples=3_200, channels=2, draws=2, rtol_draws=1, fixed=((32, 4),), rtol=0.3, normal_rtols=(0.3,),
               normal_draws=1)


def render(cfg: Config, fixed: Dict, stops: Dict, normal: Dict, argv: Optional[Sequence[str]], threads: int) -> str:
    rows = []
    for kind in KINDS:
        row = [kind]
        for shape in cfg.fixed:
            r = fixed[kind, shape]
            row += ["{:.1%}".format(r["var_cover"]), "{:.1%}".format(r["mean_cover"]), "{:.1%}".format(r["flagged"]),
                    "{:.1%}".format(r["cover_or_flag"])]
        s = stops[kind]
        row += ["{:.0%}".format(s["stopped"]), "{:.0f}".format(s["batches"]) if s["stopped"] else "-",
                "{:.1%}".format(s["beyond"]) if s["stopped"] else "-"]
        rows.append(row)
    headers = ["population"]
    for batch, batches in cfg.fixed:
        tag = "{}x{}".format(batches, batch)
        headers += [tag + ": var covered", "mean covered", "marked", "covered or marked"]
    headers += ["rtol={:g}: stopped on it".format(cfg.rtol), "batches", "channels beyond rtol"]
    return "\n\n".join([
        "# Calibration of the standard errors on hard data (`benchmarks/calibration.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.environment_text(threads),
        "{} samples per population, {} channels, {} draws per fixed budget (batches x batch size), {} draws "
        "with `rtol={:g}` and a budget of the whole population ({} batches of 32). \"covered\": the true error "
        "within two stated standard errors; \"marked\": in `LayerReport.se_untrusted`.".format(
            cfg.samples, cfg.channels, cfg.draws, cfg.rtol_draws, cfg.rtol, cfg.samples // 32),
        common.markdown_table(headers, rows),
        "`rtol` on an endless stream of standard normal batches (64 channels, batches of 32, {} passes each): "
        "`rtol` promises about 95% of channels within it, i.e. at most about 5% beyond.".format(cfg.normal_draws),
        common.markdown_table(["rtol", "batches", "channels beyond rtol", "worst pass"], [
            ["{:g}".format(r), "{:.0f}".format(normal[r]["batches"]), "{:.1%}".format(normal[r]["beyond"]),
             "{:.1%}".format(normal[r]["worst"])] for r in cfg.normal_rtols]),
    ]) + "\n"


def study(cfg: Config) -> tuple:
    """Every measurement of the page, on one thread: tensors this small only lose time to more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fixed, stops, normal = {}, {}, {}
    try:
        for kind in KINDS:
            x = population(kind, cfg.samples, cfg.channels)
            for shape in cfg.fixed:
                common.log.info("calibration: %s, %d batches of %d", kind, shape[1], shape[0])
                fixed[kind, shape] = fixed_budget(x, shape[0], shape[1], cfg.draws)
            common.log.info("calibration: %s, rtol=%g", kind, cfg.rtol)
            stops[kind] = rtol_stops(x, 32, cfg.rtol, cfg.samples // 32, cfg.rtol_draws)
        for rtol in cfg.normal_rtols:
            common.log.info("calibration: normal stream, rtol=%g", rtol)
            normal[rtol] = normal_rtol(rtol, cfg.normal_draws)
    finally:
        torch.set_num_threads(threads)
    return fixed, stops, normal


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    args = common.parse_common(parser, argv)
    cfg = QUICK if args.quick else FULL
    text = render(cfg, *study(cfg), argv, 1)
    (args.out / "CALIBRATION.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
