"""precise-bn against the incumbents: speed, precision, memory, and how many samples are enough.

    python benchmarks/compare.py [--quick] [--out DIR] [--threads N] [--reps N]

On the same fixed batches in one process, for torchvision's resnet18, resnet50,
mobilenet_v3_large and r2plus1d_18 (random-init weights) and a BN MLP, on normal data and on
data whose first BN layer sees means 1e2..1e4 times the std: the plain forward (the floor),
precise-bn default and exact, fvcore, ``torch.optim.swa_utils.update_bn``, the pycls /
mmpretrain estimator and the float32 Caffe2 formula. Then time against the number of batches
and the number of BN layers, peak memory against the number of batches, and, on the demo's
trained digits CNN, the distance of the stats from n samples to those of the whole training set.
Writes the "compare" section of ``DIR/RESULTS.md`` and ``DIR/{scaling,memory,samples}.png``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

import common
import precise_bn
from common import FLOOR, Case

METHODS = list(common.METHODS)
COLORS = {name: "C{}".format(i) for i, name in enumerate(METHODS)}  # one colour per method in every plot
PRECISE = ("precise-bn", "precise-bn exact")
FAILURE_MODES = ("fvcore", "Caffe2 formula (float32)")
CNNS = ("resnet18", "resnet50", "mobilenet_v3_large", "r2plus1d_18")
MIB = 2.0 ** 20
MEMORY_BATCHES = 2  # per main case: memory is flat in the number of batches (see the scaling)


@dataclasses.dataclass
class Config:
    """Sizes of one run: the main cases (normal data; the shifted ones are derived), the scaling
    sweeps and the samples study."""

    cases: List[Case]
    reps: int  # at least; more for cheap cases, until min_seconds of timing
    min_seconds: float
    scaling: Case  # template: its batch count is swept
    batch_counts: Tuple[int, ...]
    depth_cnn: Case  # template: options["blocks"] is swept
    depth_mlp: Case  # template: options["depth"] is swept
    depths: Tuple[int, ...]
    scaling_reps: int
    sample_sizes: Tuple[int, ...]
    draws: int
    train_steps: int
    memory_repeats: int


MLP = {"in_features": 256, "width": 1024, "depth": 4}
FULL = Config(
    cases=[
        Case("resnet18", (3, 64, 64), 16, 16),
        Case("resnet50", (3, 64, 64), 8, 16),
        Case("mobilenet_v3_large", (3, 64, 64), 16, 16),
        Case("r2plus1d_18", (3, 8, 56, 56), 4, 8),
        Case("bn_mlp", (256,), 256, 64, options=MLP),
    ],
    reps=5,
    min_seconds=60.0,
    scaling=Case("resnet_style_2d", (3, 32, 32), 16, 0),
    batch_counts=(4, 16, 64),
    depth_cnn=Case("resnet_style_2d", (3, 32, 32), 16, 8, options={"widths": (32,), "blocks": 1}),
    depth_mlp=Case("bn_mlp", (256,), 256, 16, options=dict(MLP)),
    depths=(1, 2, 4, 8, 16),
    scaling_reps=3,
    sample_sizes=(64, 128, 256, 512, 1024, 1347),
    draws=10,
    train_steps=300,
    memory_repeats=2,
)
QUICK = Config(
    cases=[
        Case("resnet18", (3, 32, 32), 4, 2),
        Case("resnet50", (3, 32, 32), 2, 2),
        Case("mobilenet_v3_large", (3, 32, 32), 4, 2),
        Case("r2plus1d_18", (3, 4, 32, 32), 2, 2),
        Case("bn_mlp", (32,), 32, 2, options={"in_features": 32, "width": 64, "depth": 2}),
    ],
    reps=1,
    min_seconds=0.0,
    scaling=Case("resnet_style_2d", (3, 16, 16), 4, 0, options={"widths": (16, 32), "blocks": 1}),
    batch_counts=(2, 4),
    depth_cnn=Case("resnet_style_2d", (3, 16, 16), 4, 2, options={"widths": (16,), "blocks": 1}),
    depth_mlp=Case("bn_mlp", (32,), 32, 2, options={"in_features": 32, "width": 64, "depth": 1}),
    depths=(1, 2),
    scaling_reps=1,
    sample_sizes=(64, 256),
    draws=2,
    train_steps=30,
    memory_repeats=1,
)


def variant(case: Case, **changes) -> Case:
    """A copy of ``case`` with some fields (``options`` merged, not replaced) changed."""
    options = dict(case.options, **changes.pop("options", {}))
    return dataclasses.replace(case, options=options, **changes)


# --------------------------------------------------------------------------------------------
# Scaling


def bn_count(case: Case) -> int:
    model, _ = case.build()
    return len(common.bn_layers(model))


def time_cases(cases: Sequence[Case], reps: int) -> List[Dict[str, common.Timing]]:
    out = []
    for case in cases:
        model, batches = case.build()
        out.append(common.time_ratios(common.runs_on_copies(model, batches, METHODS), reps))
    return out


def plot_scaling(path: Path, counts, by_batches, cnn_layers, by_cnn_depth, mlp_layers, by_mlp_depth) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for name in METHODS:
        axes[0].plot(counts, [t[name].seconds for t in by_batches], "o-", color=COLORS[name], label=name)
        if name != FLOOR:
            axes[1].plot(cnn_layers, [t[name].median for t in by_cnn_depth], "o-", color=COLORS[name], label=name)
            axes[2].plot(mlp_layers, [t[name].median for t in by_mlp_depth], "o-", color=COLORS[name], label=name)
    axes[0].set(xscale="log", yscale="log", xlabel="batches", ylabel="seconds (median)",
                title="time vs batches (resnet_style_2d)")
    axes[1].set(xscale="log", xlabel="BN layers", ylabel="time / forward (median)",
                title="ratio vs depth (resnet_style_2d)")
    axes[2].set(xscale="log", xlabel="BN layers", ylabel="time / forward (median)", title="ratio vs depth (bn_mlp)")
    for ax, ticks in zip(axes, (counts, cnn_layers, mlp_layers)):
        common.plain_log_ticks(ax, ticks)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(path: Path, counts, peaks: Sequence[Dict[str, int]]) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in METHODS[1:]:
        ax.plot(counts, [p[name] / MIB for p in peaks], "o-", color=COLORS[name], label=name)
    ax.set(xscale="log", xlabel="batches", ylabel="peak RSS over the forward's (MiB)",
           title="memory vs batches (resnet_style_2d)")
    common.plain_log_ticks(ax, counts)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Samples needed


def buffers(model: nn.Module) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    return {n: (m.running_mean.double().clone(), m.running_var.double().clone()) for n, m in common.bn_layers(model)}


def distance(stats, target, eps: float = 1e-5) -> Tuple[float, float]:
    """Mean over every channel of every layer of ``|dmean| / sqrt(var + eps)`` and of
    ``|dvar| / (var + eps)``, ``var`` from ``target``: the normalisation error each causes."""
    dm, dv = [], []
    for name, (mean, var) in target.items():
        m, v = stats[name]
        dm.append((m - mean).abs() / (var + eps).sqrt())
        dv.append((v - var).abs() / (var + eps))
    return float(torch.cat(dm).mean()), float(torch.cat(dv).mean())


def samples_needed(cfg: Config):
    """Train the demo's CNN, then per sample size and draw: recompute from a random subset and
    measure the distance to the stats of the whole training set, and the held-out accuracy."""
    from precise_bn import demo

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors this small only lose time to more threads (as in the demo)
    try:
        train_x, train_y, test_x, test_y = demo.load_digits_splits(seed=0)
        torch.manual_seed(0)
        model = demo.train(demo.make_model(), train_x, train_y, steps=cfg.train_steps,
                           batch_size=demo.BATCH_SIZE, seed=0)

        def recompute(x: torch.Tensor, exact: bool = False):
            run = copy.deepcopy(model)
            precise_bn.update_bn_stats(run, list(x.split(demo.BATCH_SIZE)), num_iters=None, exact=exact)
            return buffers(run), demo.evaluate(run, test_x, test_y)[0]

        whole, whole_acc = recompute(train_x, exact=True)
        ema = buffers(model)
        ema_acc = demo.evaluate(copy.deepcopy(model), test_x, test_y)[0]
        rows = []
        sizes = [n for n in cfg.sample_sizes if n < len(train_x)] + [len(train_x)]
        for n in sizes:
            draws = []
            for d in range(cfg.draws):
                pick = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(d))[:n]
                stats, acc = recompute(train_x[pick])
                draws.append(distance(stats, whole) + (acc,))
            rows.append((n, draws))
    finally:
        torch.set_num_threads(threads)
    return {"n_train": len(train_x), "n_test": len(test_x), "rows": rows, "ema": distance(ema, whole),
            "ema_acc": ema_acc, "whole_acc": whole_acc, "layers": len(whole),
            "channels": sum(v[0].numel() for v in whole.values())}


def plot_samples(path: Path, result) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ns = [n for n, _ in result["rows"]]
    titles = ("mean |d mean| / std", "mean |d var| / var", "held-out accuracy")
    for k, (ax, title) in enumerate(zip(axes, titles)):
        values = [[d[k] for d in draws] for _, draws in result["rows"]]
        ax.plot(ns, [statistics.median(v) for v in values], "o-", label="precise-bn on n samples (median)")
        ax.fill_between(ns, [min(v) for v in values], [max(v) for v in values], alpha=0.25, label="min-max over draws")
        ema = result["ema_acc"] if k == 2 else result["ema"][k]
        ax.axhline(ema, color="C3", linestyle="--", label="EMA stats after training")
        if k == 2:
            ax.axhline(result["whole_acc"], color="C2", linestyle=":", label="whole training set")
        else:
            ax.set_yscale("log")
        ax.set(xscale="log", xlabel="samples n", title=title)
        common.plain_log_ticks(ax, ns)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle("distance to the stats of the whole training set (demo digits CNN)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def samples_table(result) -> str:
    def cell(values, fmt):
        return (fmt + " ({}-{})").format(statistics.median(values), fmt.format(min(values)), fmt.format(max(values)))

    rows = [
        [n, cell([d[0] for d in draws], "{:.2e}"), cell([d[1] for d in draws], "{:.2e}"), cell([d[2] for d in draws], "{:.3f}")]
        for n, draws in result["rows"]
    ]
    rows.append(["EMA after training", "{:.2e}".format(result["ema"][0]), "{:.2e}".format(result["ema"][1]),
                 "{:.3f}".format(result["ema_acc"])])
    rows.append(["whole set, exact (the target)", "0", "0", "{:.3f}".format(result["whole_acc"])])
    return common.markdown_table(["samples n", "mean abs d mean / std", "mean abs d var / var", "held-out accuracy"], rows)


# --------------------------------------------------------------------------------------------
# Report


def targets(timed, errors, mem_counts, mem_scaling) -> List[str]:
    lines = []
    for r in timed:
        t = r.timing
        if r.case.model in CNNS:
            lines.append(common.target_line("precise-bn on {}: {:.3f}x the forward (<= 1.02x)".format(
                r.case.model, t["precise-bn"].median), t["precise-bn"].median <= 1.02))
            lines.append(common.target_line("precise-bn exact on {}: {:.3f}x the forward (<= 1.10x)".format(
                r.case.model, t["precise-bn exact"].median), t["precise-bn exact"].median <= 1.10))
        versus = t["precise-bn"].versus(t["fvcore"])
        lines.append(common.target_line("precise-bn / fvcore on {}: {:.3f} (<= 1)".format(r.case.model, versus), versus <= 1.0))
    for r in errors:
        failing = {m: r.errors[m]["bad"] for m in FAILURE_MODES if r.errors[m]["bad"]}
        if failing:
            ours = {m: r.errors[m]["bad"] for m in PRECISE}
            lines.append(common.target_line(
                "{} / {} data: channels with var <= 0 or NaN: {}; precise-bn: {}".format(
                    r.case.model, r.case.data, failing, ours), not any(ours.values())))
    bounds = [(r.case.model, r.case.data, m) for r in errors for m in PRECISE if not r.errors[m]["within"]]
    lines.append(common.target_line("precise-bn (default and exact) within the core's error bound in every row{}".format(
        "" if not bounds else "; outside: {}".format(bounds)), not bounds))
    for name in PRECISE:
        values = [p[name] / MIB for p in mem_scaling]
        growth = values[-1] - values[0]
        lines.append(common.target_line(
            "{} memory over the forward from {} to {} batches: {} MiB (growth {:+.2f} MiB, flat = under 1 MiB)".format(
                name, mem_counts[0], mem_counts[-1], " / ".join("{:.2f}".format(v) for v in values), growth),
            abs(growth) < 1.0))
    return lines


def render(cfg: Config, args, timed, shifted, memory, counts, by_batches, mem_scaling,
           cnn_layers, by_cnn, mlp_layers, by_mlp, samples) -> str:
    errors = [r for pair in zip(timed, shifted) for r in pair]
    memory_rows = [[r.case.model] + ["{:.2f}".format(p[m] / MIB) for m in METHODS[1:]] for r, p in zip(timed, memory)]
    scaling_rows = [[n] + [t[m].cell() if m != FLOOR else "{:.3f} s".format(t[m].seconds) for m in METHODS]
                    for n, t in zip(counts, by_batches)]
    depth_rows = [[family, layers] + [t[m].cell() for m in METHODS[1:]]
                  for family, layer_list, timings in (("resnet_style_2d", cnn_layers, by_cnn), ("bn_mlp", mlp_layers, by_mlp))
                  for layers, t in zip(layer_list, timings)]
    mem_rows = [[n] + ["{:.2f}".format(p[m] / MIB) for m in METHODS[1:]] for n, p in zip(counts, mem_scaling)]
    parts = [
        "## precise-bn against the incumbents (`benchmarks/compare.py`)",
        "Command: `{}`".format(common.command_line()),
        common.environment_text(args.threads),
        "Methods: the plain train-mode forward under `no_grad` (the floor); precise-bn "
        "`update_bn_stats` (default: the BN kernel's own float32 batch stats, merged in float64) "
        "and with `exact=True` (each call's stats from the BN input itself); fvcore "
        "`update_bn_stats`; `torch.optim.swa_utils.update_bn`; the pycls / mmpretrain estimator "
        "(momentum 1, plain float32 average of per-batch means and unbiased variances, "
        "reimplemented in `benchmarks/common.py` from that description); and the Caffe2 helper's "
        "formula, float32 `E[x^2] - E[x]^2` over the per-batch stats, as the reference of the "
        "cancellation failure. Every method runs on its own copy of the model, on the same batches.",
        "Sizes (random-init weights, `weights=None`; inputs from `torch.randn`):",
        common.markdown_table(common.CASE_HEADERS, [r.cells for r in timed]),
        "### Targets",
        "\n".join(targets(timed, errors, counts, mem_scaling)),
        "### Time",
        common.time_table(timed, METHODS) + "\n\nTimed on normal data only: the arithmetic "
        "does not depend on the values.",
        "### Precision",
        common.error_table(errors),
        "### Peak memory over the floor",
        "Peak resident memory of each method minus that of the plain forward on the same batches, "
        "in MiB ({} batches per case). On CPU, `tracemalloc` does not see torch's allocations and "
        "torch keeps no allocator statistics, so a fresh worker process reads the kernel's own "
        "high-water mark of its resident set (`VmHWM`, reset through `/proc/self/clear_refs` "
        "before each run), with glibc told to return every block of 64 KiB or more to the system "
        "when it is freed, so that the mark follows live tensors. Smallest of {} run(s) after a "
        "warm-up. Resolution: one page, but heap and Python-object churn move figures by a few "
        "hundred KiB either way, so |values| under ~0.5 MiB are zero within noise. What this "
        "counts: state kept across batches (precise-bn: per layer a float64 mean and M2 per "
        "channel, a float32 block of up to 64 calls' per-channel mean and variance, allocated "
        "before the first batch, and a snapshot of the model's buffers for the restore) and "
        "transient copies (`exact`: a float64 copy of one BN input at a time).".format(MEMORY_BATCHES, cfg.memory_repeats),
        common.markdown_table(["model"] + METHODS[1:], memory_rows),
        "### Scaling",
        "![scaling](scaling.png)",
        "Time against the number of batches ({}, {} per batch; floor in seconds, methods as ratio "
        "to the floor, median of {} repetitions):".format(
            cfg.scaling.model, "x".join(map(str, cfg.scaling.sample_shape)) + " x {}".format(cfg.scaling.batch_size),
            cfg.scaling_reps),
        common.markdown_table(["batches"] + METHODS, scaling_rows),
        "Time ratio to the floor against depth (number of BN layers; resnet_style_2d: one stage of "
        "`blocks` residual blocks, {} batches; bn_mlp: `depth` Linear-BN-ReLU blocks, {} batches):".format(
            cfg.depth_cnn.batches, cfg.depth_mlp.batches),
        common.markdown_table(["model", "BN layers"] + METHODS[1:], depth_rows),
        "![memory](memory.png)",
        "Peak memory over the floor (MiB) against the number of batches ({}):".format(cfg.scaling.model),
        common.markdown_table(["batches"] + METHODS[1:], mem_rows),
        "### Samples needed",
        "![samples](samples.png)",
        "The demo's CNN (`precise_bn.demo.make_model`: {} BN layers, {} channels) trained for {} "
        "steps on scikit-learn's digits ({} training, {} held-out images). Target: precise-bn "
        "`exact` stats over the whole training set in batches of 32. Per n, {} random subsets of n "
        "training images (batches of 32) are recomputed with precise-bn; distance = mean over "
        "every channel of every layer of |d mean| / sqrt(var + eps) and |d var| / (var + eps), the "
        "error each makes in the normalisation; median (min-max) over the draws. The EMA row is "
        "the running stats training left. The last size is the whole set in another random "
        "order: what remains there is the effect of batch composition, since every layer above "
        "the first sees inputs normalised with its batch's own stats.".format(
            samples["layers"], samples["channels"], cfg.train_steps, samples["n_train"], samples["n_test"], cfg.draws),
        samples_table(samples),
    ]
    return "\n\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions of the main table")
    args = common.parse_common(parser, argv)
    cfg = QUICK if args.quick else FULL
    if args.reps:
        cfg = dataclasses.replace(cfg, reps=args.reps)

    common.log.info("main table: %d cases x %d methods, at least %d timed repetitions", len(cfg.cases), len(METHODS), cfg.reps)
    timed = [common.evaluate_case(c, METHODS, cfg.reps, cfg.min_seconds) for c in cfg.cases]
    shifted = [common.evaluate_case(dataclasses.replace(c, data="shifted"), METHODS, 0) for c in cfg.cases]

    common.log.info("scaling: batches %s, depths %s", cfg.batch_counts, cfg.depths)
    counts = cfg.batch_counts
    batch_cases = [dataclasses.replace(cfg.scaling, batches=n) for n in counts]
    by_batches = time_cases(batch_cases, cfg.scaling_reps)
    cnn_cases = [variant(cfg.depth_cnn, options={"blocks": d}) for d in cfg.depths]
    mlp_cases = [variant(cfg.depth_mlp, options={"depth": d}) for d in cfg.depths]
    by_cnn, by_mlp = time_cases(cnn_cases, cfg.scaling_reps), time_cases(mlp_cases, cfg.scaling_reps)

    common.log.info("peak memory (worker process)")
    memory_cases = [dataclasses.replace(c, batches=MEMORY_BATCHES) for c in cfg.cases]
    peaks = common.peak_memory_over_floor(memory_cases + batch_cases, METHODS, args.threads, cfg.memory_repeats)
    memory, mem_scaling = peaks[: len(memory_cases)], peaks[len(memory_cases):]

    common.log.info("samples needed: demo CNN, %d steps, sizes %s x %d draws", cfg.train_steps, cfg.sample_sizes, cfg.draws)
    samples = samples_needed(cfg)

    cnn_layers, mlp_layers = [bn_count(c) for c in cnn_cases], [bn_count(c) for c in mlp_cases]
    plot_scaling(args.out / "scaling.png", counts, by_batches, cnn_layers, by_cnn, mlp_layers, by_mlp)
    plot_memory(args.out / "memory.png", counts, mem_scaling)
    plot_samples(args.out / "samples.png", samples)
    text = render(cfg, args, timed, shifted, memory, counts, by_batches, mem_scaling,
                  cnn_layers, by_cnn, mlp_layers, by_mlp, samples)
    common.write_section(args.out / "RESULTS.md", "compare", text)
    print(text)


if __name__ == "__main__":
    main()
