"""How many batches are enough: the precision stop (``rtol``) against a fixed budget, the
standard errors against the true error, and what the check costs.

    python benchmarks/budget.py [--quick] [--out DIR] [--threads N]

On the demo's CNN trained on its bundled digits (real data) and on torchvision models with a
finite synthetic data set: the population is the data set as batches see it, measured over many
reshuffled epochs, twice with different orders (their distance is the target's own noise). Each run reads an endless shuffled loader (reshuffled every epoch) with
``rtol`` = 1e-2, 3e-3, 1e-3, or fvcore's 200 iterations; for each: batches, time, why it stopped,
the worst standard error the report states, and the true error of the written stats against the
population. Then the calibration (the demo, many draws of independent random batches: true error
against predicted standard error) and the cost of the check (``rtol_cost.py``). Writes the
"budget" section of ``DIR/RESULTS.md`` and ``DIR/budget.png``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import cases
import common
import rtol_cost
from precise_bn import BNReport, recompute

RTOLS = (1e-2, 3e-3, 1e-3)
FVCORE_ITERS = 200


@dataclasses.dataclass
class Config:
    """Sizes of one run: the demo (training steps, epochs of its population, budget of its runs),
    the synthetic studies, the calibration draws and the measurement of the check's cost."""

    train_steps: int
    target_epochs: int
    max_batches: int  # budget of the demo's runs
    synthetic: List[Tuple[cases.Case, int]]  # model (its batch size), data set size
    synthetic_epochs: int
    synthetic_max: int
    draws: int
    draw_batches: int
    cost: cases.Case
    cost_reps: int
    ranks: bool
    fixed_batches: int = FVCORE_ITERS


FULL = Config(
    train_steps=300, target_epochs=500, max_batches=200_000,
    synthetic=[(cases.Case("resnet18", (3, 16, 16), 32, 0), 4096),
               (cases.Case("mobilenet_v3_small", (3, 16, 16), 32, 0), 4096)],
    synthetic_epochs=64, synthetic_max=2048,
    draws=100, draw_batches=32, cost=cases.Case("resnet50", (3, 64, 64), 8, 64), cost_reps=5, ranks=True,
)
QUICK = Config(
    train_steps=10, target_epochs=2, max_batches=48,
    synthetic=[(cases.Case("resnet_style_2d", (3, 8, 8), 4, 0, options={"widths": (8,), "blocks": 1}), 64)],
    synthetic_epochs=2, synthetic_max=48, draws=3, draw_batches=16,
    cost=cases.Case("bn_mlp", (16,), 8, 24, options={"in_features": 16, "width": 16, "depth": 1}), cost_reps=1,
    ranks=False, fixed_batches=24,
)


def epochs(x: torch.Tensor, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of ``x``, reshuffled every epoch (a shuffling loader, last partial batch dropped)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=gen)
        for i in range(len(x) // batch):
            yield x[order[i * batch: (i + 1) * batch]]


def random_batches(x: torch.Tensor, batch: int, count: int, seed: int) -> List[torch.Tensor]:
    """``count`` independent draws of ``batch`` distinct samples of ``x``."""
    gen = torch.Generator().manual_seed(seed)
    return [x[torch.randperm(len(x), generator=gen)[:batch]] for _ in range(count)]


def relative_errors(report: BNReport, target: BNReport) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per channel with a variance: ``|d mean| / std`` and ``|d var| / var`` against ``target``."""
    dm, dv = [], []
    for layer, whole in zip(report.layers, target.layers):
        live = whole.new_var > 0
        dm.append(((layer.new_mean - whole.new_mean).abs() / whole.new_var.sqrt())[live])
        dv.append(((layer.new_var - whole.new_var).abs() / whole.new_var)[live])
    return torch.cat(dm), torch.cat(dv)


def relative_stderrs(report: BNReport, target: BNReport) -> Tuple[torch.Tensor, torch.Tensor]:
    """The stated standard errors in the units of :func:`relative_errors`."""
    sm, sv = [], []
    for layer, whole in zip(report.layers, target.layers):
        live = whole.new_var > 0
        sm.append((layer.mean_stderr / whole.new_var.sqrt())[live])
        sv.append((layer.var_stderr / whole.new_var)[live])
    return torch.cat(sm), torch.cat(sv)


def population(model: nn.Module, x: torch.Tensor, batch: int, count: int, seed: int) -> BNReport:
    """The statistics of ``count`` epochs of ``x`` in reshuffled batches."""
    return recompute(copy.deepcopy(model), epochs(x, batch, seed), num_batches=count * (len(x) // batch),
                     progress=False, log_period=None)


def runs(model: nn.Module, x: torch.Tensor, batch: int, target: BNReport, budget: int,
         fixed: int) -> List[Dict[str, Any]]:
    """One row per ``rtol`` and for a fixed budget of ``fixed`` batches (fvcore's default: 200):
    what was read and how far off it is."""
    rows = []
    fixed_label = "{} batches{}".format(fixed, " (fvcore's default)" if fixed == FVCORE_ITERS else "")
    for label, options in [("rtol={:g}".format(r), {"rtol": r, "num_batches": budget}) for r in RTOLS] + [
            (fixed_label, {"num_batches": fixed})]:
        report = recompute(copy.deepcopy(model), epochs(x, batch, seed=7), progress=False, log_period=None, **options)
        dm, dv = relative_errors(report, target)
        rtol = options.get("rtol")
        se_m, se_v = relative_stderrs(report, target)
        rows.append({"label": label, "rtol": rtol, "report": report, "mean_err": float(dm.max()),
                     "var_err": float(dv.max()), "median": float(torch.cat([dm, dv]).median()),
                     "within": None if rtol is None else float(((dm <= rtol) & (dv <= rtol)).double().mean()),
                     "within_se": float(torch.cat([dm <= 2 * se_m, dv <= 2 * se_v]).double().mean())})
    return rows


def study(name: str, model: nn.Module, x: torch.Tensor, batch: int, target_epochs: int, budget: int,
          fixed: int) -> Dict[str, Any]:
    common.log.info("budget: %s, %d samples, batches of %d", name, len(x), batch)
    target = population(model, x, batch, target_epochs, seed=1)
    other = population(model, x, batch, target_epochs, seed=2)
    noise = relative_errors(other, target)
    return {"name": name, "samples": len(x), "batch": batch, "target": target, "epochs": target_epochs,
            "noise": max(float(noise[0].max()), float(noise[1].max())),
            "rows": runs(model, x, batch, target, budget, fixed)}


def calibration(model: nn.Module, x: torch.Tensor, batch: int, target: BNReport, cfg: Config) -> Dict[str, Any]:
    """Many draws of independent random batches: per channel, predicted and true relative errors."""
    se: Dict[str, List[torch.Tensor]] = {"mean": [], "var": []}
    err: Dict[str, List[torch.Tensor]] = {"mean": [], "var": []}
    for draw in range(cfg.draws):
        report = recompute(copy.deepcopy(model), random_batches(x, batch, cfg.draw_batches, 100 + draw),
                           progress=False, log_period=None)
        for key, values in zip(("mean", "var"), relative_stderrs(report, target)):
            se[key].append(values)
        for key, values in zip(("mean", "var"), relative_errors(report, target)):
            err[key].append(values)
    out: Dict[str, Any] = {"draws": cfg.draws, "batches": cfg.draw_batches}
    for key in ("mean", "var"):
        s, e = torch.cat(se[key]), torch.cat(err[key])
        out[key] = (s, e)
        out[key + "_cover"] = float((e <= 2 * s).double().mean())
    return out


def demo_study(cfg: Config) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    from precise_bn import digits

    train_x, train_y, _, _ = digits.load_digits()
    torch.manual_seed(0)
    model = digits.train(digits.make_model(), train_x, train_y, steps=cfg.train_steps, batch_size=digits.BATCH_SIZE,
                         seed=0)
    result = study("demo CNN, digits ({} steps)".format(cfg.train_steps), model, train_x, digits.BATCH_SIZE,
                   cfg.target_epochs, cfg.max_batches, cfg.fixed_batches)
    ema = BNReport(layers=[dataclasses.replace(layer, new_mean=m.running_mean.double(), new_var=m.running_var.double())
                           for layer, (_, m) in zip(result["target"].layers, cases.bn_layers(model))])
    dm, dv = relative_errors(ema, result["target"])
    result["ema"] = (float(dm.max()), float(dv.max()), float(torch.cat([dm, dv]).median()))
    return result, calibration(model, train_x, digits.BATCH_SIZE, result["target"], cfg)


def synthetic_study(case: cases.Case, size: int, cfg: Config) -> Dict[str, Any]:
    model, _ = case.build()
    x = torch.randn((size,) + tuple(case.sample_shape), generator=torch.Generator().manual_seed(3))
    return study("{} ({}), synthetic".format(case.model, "x".join(map(str, case.sample_shape))), model, x,
                 case.batch_size, cfg.synthetic_epochs, cfg.synthetic_max, cfg.fixed_batches)


def plot(path, studies: Sequence[Dict[str, Any]], calib: Dict[str, Any]) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 6.8))
    ax = axes[0]
    for i, s in enumerate(studies):
        color = "C{}".format(i)
        rows = sorted(s["rows"], key=lambda r: r["report"].batches)
        batches = [r["report"].batches for r in rows]
        stated = [max(r["report"].worst("mean_rel_stderr"), r["report"].worst("var_rel_stderr")) for r in rows]
        ax.plot(batches, stated, "x--", color=color, label="{}: worst stated standard error".format(s["name"]))
        ax.plot(batches, [max(r["mean_err"], r["var_err"]) for r in rows], "o-", color=color,
                label="{}: worst true error".format(s["name"]))
        ax.plot(batches, [r["median"] for r in rows], "s:", color=color, markersize=4,
                label="{}: median true error".format(s["name"]))
        ax.axhline(s["noise"], color=color, linewidth=0.8, alpha=0.5)
        labels: Dict[int, List[str]] = {}  # runs that read the same batches (a budget hit) share one label
        for r, b in zip(rows, batches):
            labels.setdefault(b, []).append(r["label"].split(" (")[0])
        for b, y in zip(batches, stated):
            if b in labels:  # the first study's labels above its points, the next below
                ax.annotate(", ".join(labels.pop(b)), (b, y), fontsize=7, color=color, textcoords="offset points",
                            xytext=(4, 6) if i % 2 == 0 else (4, -12))
    ax.set(xscale="log", yscale="log", xlabel="batches read", ylabel="relative error against the population",
           title="precision stop and fixed budget (faint lines: the population's own noise)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax = axes[1]
    for key, color in (("mean", "C0"), ("var", "C1")):
        se, err = calib[key]
        ax.scatter(se.numpy(), err.clamp(min=1e-7).numpy(), s=3, alpha=0.25, color=color,
                   label="{} ({:.1%} within 2 se)".format("|d mean| / std" if key == "mean" else "|d var| / var",
                                                          calib[key + "_cover"]))
    lo = min(float(calib[k][0].min()) for k in ("mean", "var"))
    hi = max(float(calib[k][0].max()) for k in ("mean", "var"))
    for factor, style in ((1, "-"), (2, "--")):
        ax.plot([lo, hi], [factor * lo, factor * hi], "k" + style, linewidth=1, label="true = {} x predicted".format(factor))
    ax.set(xscale="log", yscale="log", xlabel="predicted standard error (relative)", ylabel="true error (relative)",
           title="calibration: demo CNN, {} draws of {} random batches".format(calib["draws"], calib["batches"]))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_table(s: Dict[str, Any]) -> str:
    rows = []
    for r in s["rows"]:
        report = r["report"]
        rows.append([r["label"], report.batches, report.samples, report.stop, "{:.2f}".format(report.seconds),
                     common.fmt_err(max(report.worst("mean_rel_stderr"), report.worst("var_rel_stderr"))),
                     common.fmt_err(r["mean_err"]), common.fmt_err(r["var_err"]), common.fmt_err(r["median"]),
                     "-" if r["within"] is None else "{:.1%}".format(r["within"]), "{:.1%}".format(r["within_se"])])
    if "ema" in s:
        rows.append(["EMA stats after training", "-", "-", "-", "-", "-"] + [common.fmt_err(v) for v in s["ema"]]
                    + ["-", "-"])
    return "**{}**: {} samples in batches of {}; population: {} reshuffled epochs (another such pass " \
           "is within {} of it).\n\n".format(s["name"], s["samples"], s["batch"], s["epochs"], common.fmt_err(s["noise"])) \
        + common.markdown_table(["run", "batches", "samples", "stopped", "seconds", "worst stated se",
                                 "worst d mean / std", "worst d var / var", "median error", "channels within rtol",
                                 "errors within 2 se"], rows)


def cost_table(case: cases.Case, single: Dict[str, float], double: Optional[Dict[str, float]]) -> str:
    rows = [["1 process", "{:.3f}".format(single["seconds"]), "{:.3f} ({:.2f}-{:.2f})".format(
        single["ratio"], single["low"], single["high"]), "{:.2f}".format(single["ms_per_check"]),
        "{:.2f}".format(single["full_check_ms"])]]
    if double is not None:
        rows.append(["2 gloo ranks (1 thread each; rank 0's times)", "{:.3f}".format(double["seconds"]),
                     "{:.3f} ({:.2f}-{:.2f})".format(double["ratio"], double["low"], double["high"]),
                     "{:.2f}".format(double["ms_per_check"]), "-"])
    return (
        "Cost of the check: {m} ({s} x {b} per batch, {k} BN layers), {n} batches per rank, `rtol=1e-12` (never "
        "met, so both passes read the same batches) against no `rtol`; median (min-max) of the per-repetition "
        "time ratios, each against an adjacent run. On one process each check is also timed alone (merging "
        "the calls pending since the previous check, then the precision test): one with `rtol` not met stops "
        "at the first layer not yet precise; a full check, the last one of a pass that stops, computes every "
        "layer's standard errors.\n\n".format(
            m=case.model, s="x".join(map(str, case.sample_shape)), b=case.batch_size, n=case.batches,
            k=len(cases.bn_layers(case.build()[0])))
        + common.markdown_table(["setting", "seconds without rtol", "with rtol / without", "ms per check",
                                 "ms per full check"], rows))


def render(args: argparse.Namespace, argv: Optional[Sequence[str]], studies: Sequence[Dict[str, Any]],
           calib: Dict[str, Any], cfg: Config, single: Dict[str, float], double: Optional[Dict[str, float]]) -> str:
    parts = [
        "## How many batches are enough (`benchmarks/budget.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.run_text(args.threads) + " The seconds column is wall time on this shared machine.",
        "![budget](budget.png)",
        "Each run reads an endless loader of the data set, reshuffled every epoch, and stops on `rtol` "
        "(the rule of `docs/precision.md`, checked every 8 batches after 16: for every channel, Student's t "
        "quantile times a standard error taken one of its own deviations high within `rtol` of its std and "
        "variance, a standard error that can be trusted, a dead channel read long enough) or on its budget; "
        "the 200-batch row is fvcore's default. Errors are relative, against "
        "the population (`d mean / std`, `d var / var`), worst over all channels of all layers and the "
        "median; `channels within rtol`: both errors within `rtol`. When a run reads the data set several "
        "times, the stated standard error (which treats every batch as a fresh draw from an unlimited "
        "population) overstates the error against the data set's own statistics. A true error below the "
        "population's own noise (the faint lines; the distance between two population passes) cannot be "
        "resolved: the synthetic runs are therefore capped at {} batches, against {} read by each of their "
        "population passes.".format(cfg.synthetic_max, min(cfg.synthetic_epochs * (size // case.batch_size)
                                                           for case, size in cfg.synthetic)),
    ] + [study_table(s) for s in studies] + [
        "Calibration on the demo CNN: {} draws of {} batches of 32 images drawn at random (independently per "
        "batch); the true error lies within two stated standard errors in {:.1%} of channels for the mean and "
        "{:.1%} for the variance (right panel; about 95% is what a standard error means, a little less with "
        "few batches: Student's t).".format(calib["draws"], calib["batches"], calib["mean_cover"], calib["var_cover"]),
        cost_table(cfg.cost, single, double),
    ]
    return "\n\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    args = common.parse_common(parser, argv)
    cfg = QUICK if args.quick else FULL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo's tensors only lose time to more threads
    try:
        demo, calib = demo_study(cfg)
    finally:
        torch.set_num_threads(threads)
    studies = [demo] + [synthetic_study(case, size, cfg) for case, size in cfg.synthetic]
    common.log.info("budget: cost of the check on %s", cfg.cost.model)
    single = rtol_cost.single_process(cfg.cost, cfg.cost_reps)
    double = rtol_cost.two_ranks(cfg.cost, cfg.cost_reps) if cfg.ranks else None
    plot(args.out / "budget.png", studies, calib)
    text = render(args, argv, studies, calib, cfg, single, double)
    common.write_section(args.out / "RESULTS.md", "budget", text)
    print(text)


if __name__ == "__main__":
    main()
