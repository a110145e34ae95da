"""Are the standard errors calibrated on hard data, and does ``rtol`` keep its promise there?

    python benchmarks/calibration.py [--quick | --medium] [--out DIR] [--threads N]

Populations of known statistics (per-sample effects plus per-position noise, 2x2 positions,
a few channels each): normal, Student's t with 5 and 2.5 degrees of freedom, lognormal with
sigma 1 and 2, rare outliers (one sample in 1,000 shifted by 50 std), and a rarely active
channel (active on one sample in 2,000, as a ReLU output), read in shuffled batches; and
loaders that break independence (:data:`ORDER_KINDS`): the same batch repeated, AR(1) batch
offsets, one dominant batch, a mean or variance drifting along the data, beside independent
batches of equal and alternating sizes. For each, many draws are recomputed with a BatchNorm2d:

* a fixed budget: how often the true error lies within two stated standard errors, how often
  the channel is marked in ``LayerReport.se_untrusted``, and how often one or the other holds;
* ``rtol``: how often the pass stops on it, after how many batches, how many channels end
  beyond ``rtol`` in passes that stopped on it (``rtol`` promises about 5% at most), and in how
  many of those passes a channel was marked (none may be);
* for the loaders, covered or marked against the batches read (``calibration.png``);
* few batches (k = 6 to 32): how often Student's t interval covers, and how often each flag
  fires, on normal, heavy-tailed and dependent batches.

Writes ``DIR/CALIBRATION.md`` and ``DIR/calibration.png`` (default: next to this script). The
quick run of ``tests/test_precision.py`` uses the same populations.
"""
from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import common
from precise_bn import BNReport, LayerReport, PopulationStats, recompute
from precise_bn.precision import FLAGS, LOADER_FLAGS, flags, t975

KINDS = ("normal", "t5", "t2.5", "lognormal1", "lognormal2", "outliers", "rare")
#: Loaders that break independence, and the control (see :func:`order_stream`).
ORDER_KINDS = ("independent", "alternating sizes", "repeated batch", "AR(1) 0.9", "AR(1) 0.99",
               "one dominant batch", "mean drift", "variance drift")
SIDE = 2
#: The std of the AR(1) batch offsets (the normal population's is 0.86), the growth of the mean per
#: batch of the mean drift, and the relative growth of the variance per batch of the variance drift.
OFFSET, DRIFT, VAR_DRIFT = 0.5, 0.02, 0.02


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


def shares(outcomes: Sequence[Tuple[LayerReport, List[torch.Tensor]]]) -> Dict[str, float]:
    """Over ``(layer, (mean, var))`` pairs, each a pass and its population: the shares of channels
    whose variance and mean are within two stated standard errors of the population's, marked,
    and each covered or marked; and how many channels, of how many, were marked for what the
    loader did (any reason but heavy tails)."""
    covered, flagged, mean_covered = [], [], []
    loader = sum(len(channels) for layer, _ in outcomes for reason, channels in layer.se_reasons.items()
                 if reason != "tails")
    for layer, (mean, var) in outcomes:
        covered.append((layer.new_var - var).abs() <= 2 * layer.var_stderr)
        mean_covered.append((layer.new_mean - mean).abs() <= 2 * layer.mean_stderr)
        marked = torch.zeros(len(mean), dtype=torch.bool)
        marked[layer.se_untrusted] = True
        flagged.append(marked)
    cov, flag, mcov = torch.stack(covered), torch.stack(flagged), torch.stack(mean_covered)
    return {"var_cover": float(cov.double().mean()), "mean_cover": float(mcov.double().mean()),
            "flagged": float(flag.double().mean()),
            "cover_or_flag": float((cov | flag).double().mean()),
            "mean_cover_or_flag": float((mcov | flag).double().mean()),
            "loader_marks": loader, "channels": flag.numel()}


def fixed_budget(x: torch.Tensor, batch: int, batches: int, count: int) -> Dict[str, float]:
    """:func:`shares` over ``count`` draws of ``batches`` shuffled batches of ``batch``."""
    truth = exact_stats(x)
    return shares([(report.layers[0], truth) for report in draws(x, batch, count, num_batches=batches)])


def _split(x: torch.Tensor, sizes: Sequence[int]) -> List[torch.Tensor]:
    return list(x[:sum(sizes)].split(list(sizes)))


def order_stream(kind: str, x: torch.Tensor, batches: int, seed: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """One draw of a loader of :data:`ORDER_KINDS` over the samples ``x`` (normal): its first
    ``batches`` batches in the order read, and the population's mean and variance, float64.

    ``independent`` and ``alternating sizes`` (16 and 48) are shuffled batches; ``repeated
    batch`` reads one shuffled batch of 32 again and again; ``AR(1) phi`` adds to each shuffled
    batch of 32 a per-channel offset following an AR(1) of std :data:`OFFSET` (population: the
    samples plus the offsets' stationary law); ``one dominant batch`` reads batches of 8 and one
    of 2,048 at a random place among the first 32; the drifts read a data set of all of ``x`` in
    batches of 32, in order, whose mean grows by :data:`DRIFT` per batch, or whose variance grows
    by :data:`VAR_DRIFT` of itself per batch (population: that whole data set).
    """
    gen = torch.Generator().manual_seed(seed)
    shuffled = x[torch.randperm(len(x), generator=gen)]
    mean, var = exact_stats(x)
    if kind in ("independent", "AR(1) 0.9", "AR(1) 0.99", "mean drift", "variance drift"):
        out = _split(shuffled, [32] * (len(x) // 32 if "drift" in kind else batches))
    elif kind == "alternating sizes":
        out = _split(shuffled, [16 if i % 2 else 48 for i in range(batches)])
    elif kind == "repeated batch":
        out = [shuffled[:32]] * batches
    elif kind == "one dominant batch":
        sizes = [8] * (batches - 1)
        sizes.insert(int(torch.randint(min(batches, 32), (1,), generator=gen)), 2048)
        out = _split(shuffled, sizes)
    else:
        raise ValueError("unknown kind {!r}; one of {}".format(kind, ", ".join(ORDER_KINDS)))
    if kind.startswith("AR(1)"):
        phi, offset = float(kind.split()[1]), torch.randn(x.shape[1], generator=gen) * OFFSET
        for i, batch in enumerate(out):
            out[i] = batch + offset.view(1, -1, 1, 1)
            offset = phi * offset + (1 - phi * phi) ** 0.5 * OFFSET * torch.randn(x.shape[1], generator=gen)
        var = var + OFFSET ** 2
    elif kind == "mean drift":
        out = [batch + DRIFT * (i - (len(out) - 1) / 2) for i, batch in enumerate(out)]
    elif kind == "variance drift":
        out = [mean.float().view(1, -1, 1, 1) + (batch - mean.float().view(1, -1, 1, 1)) * (1 + VAR_DRIFT * i) ** 0.5
               for i, batch in enumerate(out)]
    if "drift" in kind:
        mean, var = exact_stats(torch.cat(out))
    return out[:batches], [mean, var]


def _recompute(batches: Sequence[torch.Tensor], **options) -> BNReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rtol not reached, channels marked: counted by the caller
        return recompute(nn.BatchNorm2d(batches[0].shape[1]), iter(batches), progress=False, layers="all", **options)


def order_budget(kind: str, x: torch.Tensor, batches: int, count: int) -> Dict[str, float]:
    """:func:`shares` over ``count`` draws of ``batches`` batches of a loader."""
    outcomes = []
    for seed in range(count):
        stream, truth = order_stream(kind, x, batches, seed)
        outcomes.append((_recompute(stream).layers[0], truth))
    return shares(outcomes)


def beyond(report: BNReport, mean: torch.Tensor, var: torch.Tensor, rtol: float) -> torch.Tensor:
    """Channels whose mean (in units of the std) or variance (relative) is off by more than ``rtol``."""
    layer = report.layers[0]
    return torch.maximum((layer.new_mean - mean).abs() / var.sqrt(), (layer.new_var - var).abs() / var) > rtol


def stop_shares(runs: Sequence[Tuple[BNReport, List[torch.Tensor]]], rtol: float) -> Dict[str, float]:
    """Over passes with ``rtol`` and their populations: the share that stopped on ``rtol``, their
    mean batches, the share of their channels beyond ``rtol``, and the share of them that had a
    channel marked for what the loader did (``rtol`` never stops on one)."""
    stopped = [(r, truth) for r, truth in runs if r.stop == "rtol"]
    out = torch.cat([beyond(r, mean, var, rtol) for r, (mean, var) in stopped]) if stopped else torch.zeros(0)
    nan = float("nan")
    return {"stopped": len(stopped) / len(runs),
            "batches": sum(r.batches for r, _ in stopped) / len(stopped) if stopped else nan,
            "beyond": float(out.double().mean()) if stopped else nan,
            "marked": sum(any(reason in r.layers[0].se_reasons for reason in LOADER_FLAGS)
                          for r, _ in stopped) / len(stopped) if stopped else nan}


def rtol_stops(x: torch.Tensor, batch: int, rtol: float, budget: int, count: int) -> Dict[str, float]:
    """:func:`stop_shares` over ``count`` draws of shuffled batches with ``rtol`` and a budget."""
    truth = exact_stats(x)
    return stop_shares([(r, truth) for r in draws(x, batch, count, rtol=rtol, num_batches=budget)], rtol)


def order_rtol(kind: str, x: torch.Tensor, rtol: float, budget: int, count: int) -> Dict[str, float]:
    """:func:`stop_shares` over ``count`` draws of a loader of :data:`ORDER_KINDS`."""
    runs = []
    for seed in range(count):
        stream, truth = order_stream(kind, x, budget, seed)
        runs.append((_recompute(stream, rtol=rtol, num_batches=budget), truth))
    return stop_shares(runs, rtol)


def detection(kind: str, x: torch.Tensor, reads: Sequence[int], count: int) -> List[float]:
    """Per number of batches read, the share of channels whose mean and variance are within two
    standard errors or that are marked, over ``count`` draws of a loader; the statistics merged
    batch by batch as a pass merges them, and marked as its report marks them."""
    hits: List[List[torch.Tensor]] = [[] for _ in reads]
    for seed in range(count):
        stream, (mean, var) = order_stream(kind, x, max(reads), seed)
        stats = PopulationStats(x.shape[1])
        for done, batch in enumerate(stream, 1):
            rows = batch.double().transpose(0, 1).reshape(x.shape[1], -1)
            stats.add_call(rows.mean(1), rows.var(1, unbiased=False), rows.shape[1])
            if done in reads:
                new_mean, new_var = stats.finalize()
                mean_se, var_se = stats.stderr()
                hit = ((new_mean - mean).abs() <= 2 * mean_se) & ((new_var - var).abs() <= 2 * var_se)
                for channels in flags(stats).values():
                    hit[channels] = True
                hits[reads.index(done)].append(hit)
    return [float(torch.stack(h).double().mean()) for h in hits]


#: The batches of the few-batches section: population kinds read shuffled, then loaders.
FEW_KINDS = ("normal", "t5", "lognormal1", "AR(1) 0.9", "mean drift")


def few_batches(kind: str, x: torch.Tensor, ks: Sequence[int], count: int) -> List[Dict[str, float]]:
    """Per k of ``ks``, over ``count`` draws of k batches of 32 (shuffled from ``x``, or a loader
    of :data:`ORDER_KINDS`): the shares of channels whose mean and variance lie within
    ``t975(k - 1)`` standard errors of the population's, and flagged, in all and per reason."""
    out = []
    for k in ks:
        covered, marked = {"mean": [], "var": []}, {reason: 0 for reason in ("any",) + tuple(FLAGS)}
        for seed in range(count):
            if kind in ORDER_KINDS:
                stream, (mean, var) = order_stream(kind, x, k, seed)
            else:
                order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
                stream, (mean, var) = list(x[order[:32 * k]].split(32)), exact_stats(x)
            stats = PopulationStats(x.shape[1])
            for batch in stream:
                rows = batch.double().transpose(0, 1).reshape(x.shape[1], -1)
                stats.add_call(rows.mean(1), rows.var(1, unbiased=False), rows.shape[1])
            new_mean, new_var = stats.finalize()
            mean_se, var_se = stats.stderr()
            t = t975(k - 1)
            covered["mean"].append((new_mean - mean).abs() <= t * mean_se)
            covered["var"].append((new_var - var).abs() <= t * var_se)
            found = flags(stats)
            marked["any"] += sum(len(c) for c in found.values())
            for reason, channels in found.items():
                marked[reason] += len(channels)
        total = count * x.shape[1]
        row = {key: float(torch.cat(hits).double().mean()) for key, hits in covered.items()}
        row.update({reason: n / total for reason, n in marked.items()})
        out.append(row)
    return out


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
    order_batches: Sequence[int]
    reads: Sequence[int]
    curve_draws: int
    few: Sequence[int] = (6, 8, 10, 12, 16, 24, 32)
    few_channels: int = 64
    few_draws: int = 40


FULL = Config(samples=40_000, channels=8, draws=100, rtol_draws=40, fixed=((32, 32), (2, 128)), rtol=0.1,
              normal_rtols=(1e-2, 5e-2), normal_draws=20, order_batches=(32, 128), reads=(16, 32, 64, 128, 256, 512),
              curve_draws=40)
QUICK = Config(samples=3_200, channels=2, draws=2, rtol_draws=1, fixed=((32, 4),), rtol=0.3, normal_rtols=(0.3,),
               normal_draws=1, order_batches=(16,), reads=(16, 32), curve_draws=1, few=(6, 8), few_channels=2,
               few_draws=1)
#: What ``--medium`` runs: every table, with fewer draws (well under 15 minutes on two shared cores).
MEDIUM = Config(samples=40_000, channels=8, draws=20, rtol_draws=6, fixed=((32, 32), (2, 128)), rtol=0.1,
                normal_rtols=(5e-2,), normal_draws=4, order_batches=(32, 128), reads=(16, 32, 64, 128, 256),
                curve_draws=8, few_draws=20)


def _cells(r: Dict[str, float]) -> List[str]:
    return ["{:.1%}".format(r[key]) for key in ("var_cover", "mean_cover", "flagged", "cover_or_flag",
                                                 "mean_cover_or_flag")]


def _stop_cells(s: Dict[str, float]) -> List[str]:
    return ["{:.0%}".format(s["stopped"]), "{:.0f}".format(s["batches"]) if s["stopped"] else "-",
            "{:.1%}".format(s["beyond"]) if s["stopped"] else "-",
            "{:.0%}".format(s["marked"]) if s["stopped"] else "-"]


def render(cfg: Config, fixed: Dict, stops: Dict, normal: Dict, order: Dict, few: Dict, curves: Dict,
           argv: Optional[Sequence[str]], threads: int) -> str:
    rows = [[kind] + [c for shape in cfg.fixed for c in _cells(fixed[kind, shape])] + _stop_cells(stops[kind])
            for kind in KINDS]
    headers = ["population"]
    for batch, batches in cfg.fixed:
        headers += ["{}x{}: var covered".format(batches, batch), "mean covered", "marked", "var covered or marked",
                    "mean covered or marked"]
    stop_headers = ["rtol={:g}: stopped on it".format(cfg.rtol), "batches", "channels beyond rtol",
                    "marked at the stop"]
    order_rows = [[kind] + [c for batches in cfg.order_batches for c in _cells(order[kind, batches])]
                  + _stop_cells(stops[kind]) for kind in ORDER_KINDS]
    order_headers = ["loader"]
    for batches in cfg.order_batches:
        order_headers += ["{} batches: var covered".format(batches), "mean covered", "marked",
                          "var covered or marked", "mean covered or marked"]
    curve_rows = [[kind] + ["{:.0%}".format(v) for v in curves[kind]] for kind in ORDER_KINDS]
    return "\n\n".join([
        "# Calibration of the standard errors on hard data (`benchmarks/calibration.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.environment_text(threads),
        "## Heavy tails",
        "{} samples per population, {} channels, {} draws per fixed budget (batches x batch size), {} draws "
        "with `rtol={:g}` and a budget of the whole population ({} batches of 32). \"covered\": the true error "
        "within two stated standard errors; \"marked\": in `LayerReport.se_untrusted`; \"marked at the stop\": "
        "passes that stopped on `rtol` with a channel marked for what the loader did (any reason but heavy "
        "tails).".format(
            cfg.samples, cfg.channels, cfg.draws, cfg.rtol_draws, cfg.rtol, cfg.samples // 32),
        common.markdown_table(headers + stop_headers, rows),
        "## Loaders that break independence",
        "The normal population above, read by each loader of `calibration.ORDER_KINDS` (`order_stream`: AR(1) "
        "offsets of std {:g} against the population's 0.86, the mean drift {:g} and the variance drift {:g} of "
        "itself per batch of 32, over a data set of {} batches read in order); {} draws per budget, {} with "
        "`rtol={:g}` and a budget of {} batches; columns as above.".format(
            OFFSET, DRIFT, VAR_DRIFT, cfg.samples // 32, cfg.draws, cfg.rtol_draws, cfg.rtol, cfg.samples // 32),
        common.markdown_table(order_headers + stop_headers, order_rows),
        "Independent batches, of equal and alternating sizes, at both budgets: {} of {} channels marked for what "
        "the loader did (any reason but heavy tails).".format(
            sum(order[kind, b]["loader_marks"] for kind in ORDER_KINDS[:2] for b in cfg.order_batches),
            sum(order[kind, b]["channels"] for kind in ORDER_KINDS[:2] for b in cfg.order_batches)),
        "Mean and variance both covered, or marked, against the batches read ({} draws each; "
        "`calibration.png`):".format(cfg.curve_draws),
        common.markdown_table(["loader"] + ["{} batches".format(k) for k in cfg.reads], curve_rows),
        "## Few batches",
        "k batches of 32 ({} channels, {} draws per k): the normal, t5 and lognormal1 populations read "
        "shuffled, the AR(1) 0.9 and mean-drift loaders. \"covered\": the population's value within "
        "`t975(k - 1)` standard errors; then the share of channels flagged, in all and per reason "
        "(`precise_bn.precision.runs_from` gives the calls from which each can fire).".format(
            cfg.few_channels, cfg.few_draws),
        common.markdown_table(["batches", "k", "mean covered", "var covered", "flagged"] + list(FLAGS), [
            [kind, str(k), "{:.1%}".format(r["mean"]), "{:.1%}".format(r["var"])]
            + ["{:.1%}".format(r[key]) for key in ("any",) + tuple(FLAGS)]
            for kind in FEW_KINDS for k, r in zip(cfg.few, few[kind])]),
        "## `rtol` on normal data",
        "`rtol` on an endless stream of standard normal batches (64 channels, batches of 32, {} passes each): "
        "`rtol` promises about 95% of channels within it, i.e. at most about 5% beyond.".format(cfg.normal_draws),
        common.markdown_table(["rtol", "batches", "channels beyond rtol", "worst pass"], [
            ["{:g}".format(r), "{:.0f}".format(normal[r]["batches"]), "{:.1%}".format(normal[r]["beyond"]),
             "{:.1%}".format(normal[r]["worst"])] for r in cfg.normal_rtols]),
    ]) + "\n"


def plot(cfg: Config, curves: Dict, path: Path) -> None:
    """Covered or marked against the batches read, one line per loader."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, kind in enumerate(ORDER_KINDS):  # a line style each: some lines lie on others
        ax.plot(cfg.reads, [100 * v for v in curves[kind]], marker="os^vD<>x"[index % 8],
                linestyle=("-", "--", ":", "-.")[index % 4], label=kind)
    ax.axhline(90, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    common.plain_log_ticks(ax, cfg.reads)
    ax.set_xlabel("batches read")
    ax.set_ylabel("channels covered or marked (%)")
    ax.set_title("Two standard errors cover the mean's and the variance's error, or the channel is marked",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study(cfg: Config) -> tuple:
    """Every measurement of the page, on one thread: tensors this small only lose time to more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fixed, stops, normal, order, few, curves = {}, {}, {}, {}, {}, {}
    budget = cfg.samples // 32
    try:
        for kind in KINDS:
            x = population(kind, cfg.samples, cfg.channels)
            for shape in cfg.fixed:
                common.log.info("calibration: %s, %d batches of %d", kind, shape[1], shape[0])
                fixed[kind, shape] = fixed_budget(x, shape[0], shape[1], cfg.draws)
            common.log.info("calibration: %s, rtol=%g", kind, cfg.rtol)
            stops[kind] = rtol_stops(x, 32, cfg.rtol, budget, cfg.rtol_draws)
        x = population("normal", cfg.samples, cfg.channels)
        for kind in ORDER_KINDS:
            for batches in cfg.order_batches:
                common.log.info("calibration: %s, %d batches", kind, batches)
                order[kind, batches] = order_budget(kind, x, batches, cfg.draws)
            common.log.info("calibration: %s, rtol=%g", kind, cfg.rtol)
            stops[kind] = order_rtol(kind, x, cfg.rtol, budget, cfg.rtol_draws)
            curves[kind] = detection(kind, x, cfg.reads, cfg.curve_draws)
        for kind in FEW_KINDS:
            common.log.info("calibration: %s, few batches", kind)
            source = population(kind if kind in KINDS else "normal", cfg.samples, cfg.few_channels)
            few[kind] = few_batches(kind, source, cfg.few, cfg.few_draws)
        for rtol in cfg.normal_rtols:
            common.log.info("calibration: normal stream, rtol=%g", rtol)
            normal[rtol] = normal_rtol(rtol, cfg.normal_draws)
    finally:
        torch.set_num_threads(threads)
    return fixed, stops, normal, order, few, curves


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--medium", action="store_true", help="every table with fewer draws (minutes)")
    args = common.parse_common(parser, argv)
    cfg = QUICK if args.quick else MEDIUM if args.medium else FULL
    results = study(cfg)
    text = render(cfg, *results, argv, 1)
    (args.out / "CALIBRATION.md").write_text(text, encoding="utf-8")
    plot(cfg, results[-1], args.out / "calibration.png")
    print(text)


if __name__ == "__main__":
    main()
