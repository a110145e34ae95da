"""precise-bn against the incumbents: speed, precision and memory.

    python benchmarks/compare.py [--quick] [--out DIR] [--threads N] [--reps N]

On the same fixed batches in one process, for torchvision's resnet18, resnet50,
mobilenet_v3_large and r2plus1d_18 (random-init weights) and a BN MLP, on normal data and on
data whose first BN layer sees means 1e2..1e4 times the std: the plain forward (the floor),
precise-bn, fvcore, ``torch.optim.swa_utils.update_bn``, the pycls / mmpretrain estimator and
the float32 Caffe2 formula, timed at steady state (``common.settle``). Then time against the number of batches
and the number of BN layers, and peak memory against the number of batches. (How many samples
are enough is ``budget.py``'s.) Writes the "compare" section of ``DIR/RESULTS.md`` and
``DIR/{scaling,memory}.png``.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import cases
import common
import memory
import methods
from cases import Case
from common import FLOOR

METHODS = [m for m in methods.METHODS if m != methods.EAGER]  # what compiling saves is cost.py's
COLORS = {name: "C{}".format(i) for i, name in enumerate(METHODS)}  # one colour per method in every plot
FAILURE_MODES = ("fvcore", "Caffe2 formula (float32)")
CNNS = ("resnet18", "resnet50", "mobilenet_v3_large", "r2plus1d_18")
MIB = 2.0 ** 20
TARGET = 1.05  # over the forward on the CNNs; and no more than fvcore everywhere
MEMORY_BATCHES = 2  # per main case: memory is flat in the number of batches (see the scaling)


@dataclasses.dataclass
class Config:
    """Sizes of one run: the main cases (normal data; the shifted ones are derived) and the
    scaling sweeps."""

    cases: List[Case]
    reps: int  # at least; more for cheap cases, until min_seconds of timing
    min_seconds: float
    scaling: Case  # template: its batch count is swept
    batch_counts: Tuple[int, ...]
    depth_cnn: Case  # template: options["blocks"] is swept
    depth_mlp: Case  # template: options["depth"] is swept
    depths: Tuple[int, ...]
    scaling_reps: int
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
    memory_repeats=2,
)
TINY_MLP = {"in_features": 16, "width": 32, "depth": 1}
QUICK = Config(
    cases=[Case("bn_mlp", (16,), 16, 2, options=TINY_MLP)],
    reps=1,
    min_seconds=0.0,
    scaling=Case("resnet_style_2d", (3, 8, 8), 2, 0, options={"widths": (8,), "blocks": 1}),
    batch_counts=(1, 2),
    depth_cnn=Case("resnet_style_2d", (3, 8, 8), 2, 1, options={"widths": (8,), "blocks": 1}),
    depth_mlp=Case("bn_mlp", (16,), 16, 1, options=TINY_MLP),
    depths=(1, 2),
    scaling_reps=1,
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
    return len(cases.bn_layers(model))


def time_cases(settings: Sequence[Case], reps: int) -> List[Dict[str, common.Timing]]:
    out = []
    for case in settings:
        model, batches = case.build()
        out.append(common.time_ratios(methods.runs_on_copies(model, batches, METHODS), reps))
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
# Report


def targets(timed, errors, mem_counts, mem_scaling) -> List[str]:
    lines = []
    for r in timed:
        t = r.timing
        if r.case.model in CNNS:
            lines.append(common.target_line("precise-bn on {}: {:.3f}x the forward (<= {:.2f}x)".format(
                r.case.model, t["precise-bn"].median, TARGET), t["precise-bn"].median <= TARGET))
        versus = t["precise-bn"].versus(t["fvcore"])
        lines.append(common.target_line("precise-bn / fvcore on {}: {:.3f} (<= 1)".format(r.case.model, versus), versus <= 1.0))
    for r in errors:
        failing = {m: r.errors[m]["bad"] for m in FAILURE_MODES if r.errors[m]["bad"]}
        if failing:
            ours = r.errors["precise-bn"]["bad"]
            lines.append(common.target_line(
                "{} / {} data: channels with var <= 0 or NaN: {}; precise-bn: {}".format(
                    r.case.model, r.case.data, failing, ours), not ours))
    outside = [(r.case.model, r.case.data) for r in errors if not r.errors["precise-bn"]["within"]]
    lines.append(common.target_line("precise-bn keeps its promise in every row{}".format(
        "" if not outside else "; outside: {}".format(outside)), not outside))
    values = [p["precise-bn"] / MIB for p in mem_scaling]
    growth = values[-1] - values[0]
    lines.append(common.target_line(
        "precise-bn memory over the forward from {} to {} batches: {} MiB (growth {:+.2f} MiB, flat = under 1 MiB)".format(
            mem_counts[0], mem_counts[-1], " / ".join("{:.2f}".format(v) for v in values), growth),
        abs(growth) < 1.0))
    return lines


@dataclasses.dataclass
class Measured:
    """Everything one run measured."""

    timed: List[methods.CaseResult]
    shifted: List[methods.CaseResult]
    memory: List[Dict[str, int]]  # per main case
    counts: Tuple[int, ...]
    by_batches: List[Dict[str, common.Timing]]
    mem_scaling: List[Dict[str, int]]  # per batch count
    cnn_layers: List[int]
    by_cnn: List[Dict[str, common.Timing]]
    mlp_layers: List[int]
    by_mlp: List[Dict[str, common.Timing]]

    @property
    def errors(self) -> List[methods.CaseResult]:
        return [r for pair in zip(self.timed, self.shifted) for r in pair]


def render_main(cfg: Config, args: argparse.Namespace, argv: Optional[Sequence[str]], m: Measured) -> List[str]:
    """Methods, sizes, targets, time, precision and memory."""
    memory_rows = [[r.case.model] + ["{:.2f}".format(p[k] / MIB) for k in METHODS[1:]] for r, p in zip(m.timed, m.memory)]
    return [
        "## precise-bn against the incumbents (`benchmarks/compare.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.run_text(args.threads),
        "Methods: the plain train-mode forward under `no_grad` (the floor); `precise_bn.recompute` "
        "(every call of every BN layer measured from its input in float64, merged in float64, "
        "rounded into the buffers); fvcore `update_bn_stats`; "
        "`torch.optim.swa_utils.update_bn`; the pycls / mmpretrain estimator (momentum 1, plain "
        "float32 average of per-batch means and unbiased variances, reimplemented in "
        "`benchmarks/methods.py` from that description); and the Caffe2 helper's formula, float32 "
        "`E[x^2] - E[x]^2` over the per-batch stats, as the reference of the cancellation failure. "
        "Every method runs on its own copy of the model, on the same batches.",
        "Sizes (random-init weights, `weights=None`; inputs from `torch.randn`):",
        common.markdown_table(cases.CASE_HEADERS, [r.cells for r in m.timed]),
        "### Targets",
        "\n".join(targets(m.timed, m.errors, m.counts, m.mem_scaling)),
        "### Time",
        methods.time_table(m.timed, METHODS) + "\n\nTimed on normal data only: the arithmetic "
        "does not depend on the values.",
        "### Precision",
        methods.error_table(m.errors),
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
        "channel and the between-call moments of the standard errors, the float64 per-channel mean "
        "and variance of up to 64 calls waiting to be merged, and a snapshot of the model's buffers "
        "for the restore) and transient copies (the eager float64 sums reuse one scratch buffer of "
        "32k float64 values per thread; the compiled sums read the input in place). The worker "
        "compiles the float64 sums (`common.settle`) before any mark is reset, so the compiler's "
        "own memory is not counted.".format(MEMORY_BATCHES, cfg.memory_repeats),
        common.markdown_table(["model"] + METHODS[1:], memory_rows),
    ]


def render_scaling(cfg: Config, m: Measured) -> List[str]:
    """Time against batches and depth, memory against batches."""
    scaling_rows = [[n] + [t[k].cell() if k != FLOOR else "{:.3f} s".format(t[k].seconds) for k in METHODS]
                    for n, t in zip(m.counts, m.by_batches)]
    depth_rows = [[family, layers] + [t[k].cell() for k in METHODS[1:]]
                  for family, layer_list, timings in (("resnet_style_2d", m.cnn_layers, m.by_cnn),
                                                      ("bn_mlp", m.mlp_layers, m.by_mlp))
                  for layers, t in zip(layer_list, timings)]
    mem_rows = [[n] + ["{:.2f}".format(p[k] / MIB) for k in METHODS[1:]] for n, p in zip(m.counts, m.mem_scaling)]
    return [
        "### Scaling",
        "![scaling](scaling.png)",
        "Time against the number of batches ({}, {} per batch; floor in seconds, methods as ratio "
        "to the floor, median of {} repetitions):".format(
            cfg.scaling.model, "x".join(map(str, cfg.scaling.sample_shape)) + " x {}".format(cfg.scaling.batch_size),
            cfg.scaling_reps),
        common.markdown_table(["batches"] + METHODS, scaling_rows),
        "Time ratio to the floor against depth (number of BN layers; {}: one stage of `blocks` "
        "residual blocks, {} batches; bn_mlp: `depth` Linear-BN-ReLU blocks, {} batches):".format(
            cfg.depth_cnn.model, cfg.depth_cnn.batches, cfg.depth_mlp.batches),
        common.markdown_table(["model", "BN layers"] + METHODS[1:], depth_rows),
        "![memory](memory.png)",
        "Peak memory over the floor (MiB) against the number of batches ({}):".format(cfg.scaling.model),
        common.markdown_table(["batches"] + METHODS[1:], mem_rows),
    ]


def measure(cfg: Config, args: argparse.Namespace) -> Measured:
    common.log.info("main table: %d cases x %d methods, at least %d timed repetitions", len(cfg.cases), len(METHODS), cfg.reps)
    timed = [methods.evaluate_case(c, METHODS, cfg.reps, cfg.min_seconds) for c in cfg.cases]
    shifted = [methods.evaluate_case(dataclasses.replace(c, data="shifted"), METHODS, 0) for c in cfg.cases]

    common.log.info("scaling: batches %s, depths %s", cfg.batch_counts, cfg.depths)
    batch_cases = [dataclasses.replace(cfg.scaling, batches=n) for n in cfg.batch_counts]
    by_batches = time_cases(batch_cases, cfg.scaling_reps)
    cnn_cases = [variant(cfg.depth_cnn, options={"blocks": d}) for d in cfg.depths]
    mlp_cases = [variant(cfg.depth_mlp, options={"depth": d}) for d in cfg.depths]
    by_cnn, by_mlp = time_cases(cnn_cases, cfg.scaling_reps), time_cases(mlp_cases, cfg.scaling_reps)

    common.log.info("peak memory (%s)", "in this process" if args.quick else "worker process")
    memory_cases = [dataclasses.replace(c, batches=MEMORY_BATCHES) for c in cfg.cases]
    peaks = memory.peak_memory_over_floor(memory_cases + batch_cases, METHODS, args.threads, cfg.memory_repeats,
                                          in_process=args.quick)
    return Measured(timed, shifted, peaks[: len(memory_cases)], cfg.batch_counts, by_batches,
                    peaks[len(memory_cases):], [bn_count(c) for c in cnn_cases], by_cnn,
                    [bn_count(c) for c in mlp_cases], by_mlp)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions of the main table")
    args = common.parse_common(parser, argv)
    cfg = QUICK if args.quick else FULL
    if args.reps:
        cfg = dataclasses.replace(cfg, reps=args.reps)
    m = measure(cfg, args)
    plot_scaling(args.out / "scaling.png", m.counts, m.by_batches, m.cnn_layers, m.by_cnn, m.mlp_layers, m.by_mlp)
    plot_memory(args.out / "memory.png", m.counts, m.mem_scaling)
    text = "\n\n".join(render_main(cfg, args, argv, m) + render_scaling(cfg, m))
    common.write_section(args.out / "RESULTS.md", "compare", text)
    print(text)


if __name__ == "__main__":
    main()
