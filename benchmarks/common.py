"""What the benchmarks share: models, data, the estimators compared, the float64 reference,
error metrics, timing with a rotated order, peak memory, and writing RESULTS.md.

Run as a script (``python benchmarks/common.py memory``) it is the memory worker: a fresh
process, started with glibc's malloc told to hand every large block straight back to the
system, that reads its own peak resident set size around each method (see
:func:`peak_memory_over_floor`).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import functools
import gc
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import precise_bn
from precise_bn.atomic import atomic_write

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from reference import assert_close_default, assert_close_exact  # noqa: E402  (the core's bounds)

log = logging.getLogger("precise_bn.benchmarks")

Batches = List[torch.Tensor]
Method = Callable[[nn.Module, Batches], Any]
Stats = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------------------------
# Models


def bn_mlp(in_features: int = 64, width: int = 256, depth: int = 4, classes: int = 10) -> nn.Module:
    """``depth`` blocks of Linear -> BatchNorm1d -> ReLU, then a classifier."""
    layers: List[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(in_features if i == 0 else width, width), nn.BatchNorm1d(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class _Block(nn.Module):
    """A ResNet basic block in 2 or 3 spatial dimensions."""

    def __init__(self, dims: int, cin: int, cout: int, stride: int):
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
        self.conv1 = conv(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = bn(cout)
        self.conv2 = conv(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = bn(cout)
        self.shortcut = (
            nn.Sequential(conv(cin, cout, 1, stride, bias=False), bn(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def small_resnet(
    dims: int = 2, widths: Sequence[int] = (32, 64, 128), blocks: int = 2, classes: int = 10
) -> nn.Module:
    """A ResNet-style CNN (``dims=2``) or video CNN (``dims=3``): a stem, then ``blocks`` basic
    blocks per stage of ``widths``, each stage after the first halving the resolution."""
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
    pool = nn.AdaptiveAvgPool2d(1) if dims == 2 else nn.AdaptiveAvgPool3d(1)
    layers: List[nn.Module] = [conv(3, widths[0], 3, 1, 1, bias=False), bn(widths[0]), nn.ReLU()]
    cin = widths[0]
    for stage, width in enumerate(widths):
        for b in range(blocks):
            layers.append(_Block(dims, cin, width, 2 if stage > 0 and b == 0 else 1))
            cin = width
    return nn.Sequential(*layers, pool, nn.Flatten(), nn.Linear(cin, classes))


def _torchvision(name: str) -> nn.Module:
    import torchvision

    video = name == "r2plus1d_18"
    return getattr(torchvision.models.video if video else torchvision.models, name)(weights=None)


BUILDERS: Dict[str, Callable[..., nn.Module]] = {
    "resnet18": functools.partial(_torchvision, "resnet18"),
    "resnet50": functools.partial(_torchvision, "resnet50"),
    "mobilenet_v3_large": functools.partial(_torchvision, "mobilenet_v3_large"),
    "r2plus1d_18": functools.partial(_torchvision, "r2plus1d_18"),
    "resnet_style_2d": functools.partial(small_resnet, 2),
    "video_cnn_3d": functools.partial(small_resnet, 3),
    "bn_mlp": bn_mlp,
}


def bn_layers(model: nn.Module) -> List[Tuple[str, _BatchNorm]]:
    """The BN layers every method recomputes: those that track stats and are in train mode."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.training
    ]


# --------------------------------------------------------------------------------------------
# Data


class ChannelOffset:
    """Forward pre-hook adding a constant per-channel offset to a BN layer's input.

    It stands for a layer whose input has a large mean next to its spread (raw features,
    a bias that grew during training): the hook belongs to the model, so every method and the
    float64 reference see the same shifted input, and the BN layer normalises the offset away.
    """

    def __init__(self, offset: torch.Tensor):
        self.offset = offset

    def __call__(self, module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        x = args[0]
        return (x + self.offset.view([1, -1] + [1] * (x.dim() - 2)),) + tuple(args[1:])


def shift_first_bn(model: nn.Module, batch: torch.Tensor, low: float = 1e2, high: float = 1e4) -> str:
    """Give the first BN layer that runs inputs whose channel means are ``low``..``high`` times
    their std (log-spaced over the channels, std measured on ``batch``); returns its name."""
    seen: List[Tuple[str, torch.Tensor]] = []
    probe = copy.deepcopy(model)
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.append((name, args[0])))
        for name, m in bn_layers(probe)
    ]
    with torch.no_grad():
        probe(batch)
    for handle in handles:
        handle.remove()
    name, x = seen[0]
    dims = [d for d in range(x.dim()) if d != 1]
    std = x.double().std(dim=dims)
    ratios = torch.logspace(torch.log10(torch.tensor(low)), torch.log10(torch.tensor(high)), std.numel())
    offset = (ratios.double() * std).float()
    dict(model.named_modules())[name].register_forward_pre_hook(ChannelOffset(offset))
    return name


@dataclasses.dataclass
class Case:
    """One benchmark setting: a model from :data:`BUILDERS`, its input and its data.

    ``data="shifted"`` applies :func:`shift_first_bn`. Weights and batches depend only on
    ``seed``, so a worker process rebuilds exactly the same case from its fields.
    """

    model: str
    sample_shape: Tuple[int, ...]
    batch_size: int
    batches: int
    data: str = "normal"
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0

    def build(self) -> Tuple[nn.Module, Batches]:
        torch.manual_seed(self.seed)
        model = BUILDERS[self.model](**self.options).train()
        gen = torch.Generator().manual_seed(self.seed + 1)
        batches = [
            torch.randn((self.batch_size,) + tuple(self.sample_shape), generator=gen)
            for _ in range(self.batches)
        ]
        if self.data == "shifted":
            shift_first_bn(model, batches[0])
        elif self.data != "normal":
            raise ValueError("Case.data must be 'normal' or 'shifted', got {!r}".format(self.data))
        return model, batches

    def describe(self, model: nn.Module) -> List[Any]:
        """Table cells: model, options, input, batch, batches, BN layers, BN channels, parameters."""
        layers = bn_layers(model)
        return [
            self.model,
            ", ".join("{}={}".format(k, v) for k, v in sorted(self.options.items())) or "-",
            "x".join(str(s) for s in self.sample_shape),
            self.batch_size,
            self.batches,
            len(layers),
            sum(m.num_features for _, m in layers),
            "{:.1f}M".format(sum(p.numel() for p in model.parameters()) / 1e6),
        ]


CASE_HEADERS = ["model", "options", "input (C x [T x] H x W)", "batch", "batches", "BN layers", "BN channels", "params"]


# --------------------------------------------------------------------------------------------
# The estimators


def plain_forward(model: nn.Module, batches: Batches) -> None:
    """The floor: the train-mode forward passes alone, under ``no_grad``."""
    with torch.no_grad():
        for batch in batches:
            model(batch)


def precise_default(model: nn.Module, batches: Batches) -> None:
    precise_bn.update_bn_stats(model, batches, num_iters=len(batches))


def precise_exact(model: nn.Module, batches: Batches) -> None:
    precise_bn.update_bn_stats(model, batches, num_iters=len(batches), exact=True)


def fvcore_update(model: nn.Module, batches: Batches) -> None:
    from fvcore.nn.precise_bn import update_bn_stats

    update_bn_stats(model, batches, num_iters=len(batches))


def swa_utils_update(model: nn.Module, batches: Batches) -> None:
    torch.optim.swa_utils.update_bn(batches, model)


def momentum_one_average(model: nn.Module, batches: Batches, caffe2_formula: bool = False) -> None:
    """The incumbents that read each batch's stats with momentum 1 and average them in float32.

    ``caffe2_formula=False`` is the pycls / mmpretrain estimator: after every forward, add the
    layer's batch mean and *unbiased* batch variance (what ``running_var`` holds with momentum
    1) to running sums; write their plain averages. It ignores the spread of the batch means
    and keeps Bessel's correction of each small batch.

    ``caffe2_formula=True`` is the formula of the original Caffe2 helper: average the batch mean
    and ``E[x^2] = biased var + mean^2``, then write ``E[x^2] - E[x]^2``, all in float32. It is
    exact in real numbers and shown as the failure mode of cancellation: when a channel's mean
    dwarfs its std, both terms agree in every digit float32 keeps.

    Like both originals, it reads the buffers once per forward, so a layer called twice in one
    forward contributes only its last call.
    """
    layers = [m for _, m in bn_layers(model)]
    counts: Dict[nn.Module, int] = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, args: counts.__setitem__(mod, args[0].numel() // args[0].shape[1]))
        for m in layers
    ]
    momenta = [m.momentum for m in layers]
    sums = [(torch.zeros_like(m.running_mean), torch.zeros_like(m.running_var)) for m in layers]
    try:
        for m in layers:
            m.momentum = 1.0
        with torch.no_grad():
            for batch in batches:
                model(batch)
                for m, (sum_mean, sum_second) in zip(layers, sums):
                    sum_mean += m.running_mean
                    if caffe2_formula:
                        n = counts[m]
                        sum_second += m.running_var * ((n - 1) / n) + m.running_mean.square()
                    else:
                        sum_second += m.running_var
            for m, (sum_mean, sum_second) in zip(layers, sums):
                mean = sum_mean / len(batches)
                second = sum_second / len(batches)
                m.running_mean.copy_(mean)
                m.running_var.copy_(second - mean.square() if caffe2_formula else second)
    finally:
        for m, momentum in zip(layers, momenta):
            m.momentum = momentum
        for handle in handles:
            handle.remove()


METHODS: Dict[str, Method] = {
    "forward (floor)": plain_forward,
    "precise-bn": precise_default,
    "precise-bn exact": precise_exact,
    "fvcore": fvcore_update,
    "swa_utils.update_bn": swa_utils_update,
    "pycls/mmpretrain": momentum_one_average,
    "Caffe2 formula (float32)": functools.partial(momentum_one_average, caffe2_formula=True),
}
FLOOR = "forward (floor)"


# --------------------------------------------------------------------------------------------
# Reference and errors


def float64_reference(model: nn.Module, batches: Batches) -> Stats:
    """Per BN layer, the float64 mean and biased variance of every element of every call.

    Two streaming passes over the batches (sums, then squared deviations from the pass-one
    mean, both in float64), so it holds per-channel vectors only: keeping every activation, as
    the test suite's reference does, would not fit in memory for resnet50 or r2plus1d.
    """
    ref_model = copy.deepcopy(model)
    layers = bn_layers(ref_model)
    totals = {name: [0, 0.0, 0.0] for name, _ in layers}  # count, sum, sum of squared deviations
    means: Dict[str, torch.Tensor] = {}

    def hook(module: nn.Module, args: Tuple[Any, ...], name: str) -> None:
        x = args[0].detach().double()
        x = x.transpose(0, 1).reshape(x.shape[1], -1)
        entry = totals[name]
        if name in means:
            entry[2] = entry[2] + ((x - means[name][:, None]) ** 2).sum(dim=1)
        else:
            entry[0] += x.shape[1]
            entry[1] = entry[1] + x.sum(dim=1)

    handles = [
        m.register_forward_pre_hook(functools.partial(hook, name=name)) for name, m in layers
    ]
    try:
        plain_forward(ref_model, batches)
        means.update({name: t[1] / t[0] for name, t in totals.items() if t[0]})
        plain_forward(ref_model, batches)
    finally:
        for handle in handles:
            handle.remove()
    return {name: (means[name], totals[name][2] / totals[name][0]) for name in means}


def stat_errors(model: nn.Module, reference: Stats, exact_bound: bool = False) -> Dict[str, Any]:
    """How far ``model``'s BN buffers are from ``reference``, over all layers and channels.

    ``var_rel``: largest ``|var - ref| / ref``; ``mean_std``: largest ``|mean - ref| / ref_std``
    (channels with a reference variance of 0 are left out of both); ``bad``: channels whose
    variance came out <= 0 or NaN although the reference is positive; ``within``: whether every
    layer meets the core's bound (``tests/reference.py``: the default path's, or with
    ``exact_bound`` the exact path's).
    """
    var_rel = mean_std = 0.0
    bad = 0
    within = True
    check = assert_close_exact if exact_bound else assert_close_default
    for name, module in bn_layers(model):
        ref_mean, ref_var = reference[name]
        mean, var = module.running_mean.double(), module.running_var.double()
        live = ref_var > 0
        if live.any():
            var_rel = max(var_rel, float(((var - ref_var).abs() / ref_var)[live].nan_to_num(float("inf")).max()))
            err = (mean - ref_mean).abs() / ref_var.sqrt()
            mean_std = max(mean_std, float(err[live].nan_to_num(float("inf")).max()))
        bad += int((live & ~(var > 0)).sum())
        try:
            check(mean, var, ref_mean, ref_var, name)
        except AssertionError:
            within = False
    return {"var_rel": var_rel, "mean_std": mean_std, "bad": bad, "within": within}


# --------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass
class Timing:
    """Per-repetition ratios to the floor, and the seconds of the floor run each was paired with."""

    ratios: List[float]
    floor_seconds: List[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def seconds(self) -> float:
        """Median seconds of the method itself."""
        return statistics.median(r * f for r, f in zip(self.ratios, self.floor_seconds))

    def versus(self, other: "Timing") -> float:
        """Median over repetitions of this method's time over ``other``'s (same repetitions)."""
        return statistics.median(a / b for a, b in zip(self.ratios, other.ratios))

    def cell(self) -> str:
        return "{:.3f} ({:.2f}-{:.2f})".format(self.median, min(self.ratios), max(self.ratios))


def rotated_seconds(
    runs: Mapping[str, Callable[[], Any]], reps: int, clock: Callable[[], float] = time.perf_counter
) -> Dict[str, List[float]]:
    """Seconds of every run in each of ``reps`` repetitions, after one untimed warm-up each,
    the order rotated by one each repetition so that no run always goes first (cold caches)
    or last. ``clock`` is wall time by default; ``time.process_time`` gives CPU time."""
    names = list(runs)
    for run in runs.values():
        run()
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            start = clock()
            runs[name]()
            seconds[name].append(clock() - start)
    return seconds


def _timed(run: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def time_ratios(
    runs: Mapping[str, Callable[[], Any]], reps: int, floor: str = FLOOR, min_seconds: float = 0.0
) -> Dict[str, Timing]:
    """Wall time of every run over the floor's, each ratio from a floor run timed right next to
    it, after one untimed warm-up of every run.

    Each repetition times, for every method in turn (order rotated by one each repetition), the
    floor and the method back to back, the floor first on even repetitions and last on odd ones.
    A ratio of two adjacent runs cancels the drift of a shared machine, which moves ratios
    taken several runs apart by a few points. ``reps`` repetitions, and more (up to four times
    as many) until ``min_seconds`` have been spent, so that cheap cases get as many samples as
    the machine's noise needs.
    """
    methods = [name for name in runs if name != floor]
    for run in runs.values():
        run()
    ratios: Dict[str, List[float]] = {name: [] for name in methods}
    floors: Dict[str, List[float]] = {name: [] for name in methods}
    started = time.perf_counter()
    rep = 0
    while rep < reps or (time.perf_counter() - started < min_seconds and rep < 4 * reps):
        k = rep % max(len(methods), 1)
        for name in methods[k:] + methods[:k]:
            if rep % 2 == 0:
                base, other = _timed(runs[floor]), _timed(runs[name])
            else:
                other, base = _timed(runs[name]), _timed(runs[floor])
            ratios[name].append(other / base)
            floors[name].append(base)
        rep += 1
    timings = {name: Timing(ratios[name], floors[name]) for name in methods}
    every_floor = [f for name in methods for f in floors[name]] or [_timed(runs[floor])]
    timings[floor] = Timing([1.0] * len(every_floor), every_floor)
    return timings


def runs_on_copies(model: nn.Module, batches: Batches, methods: Iterable[str]) -> Dict[str, Callable[[], Any]]:
    """One zero-argument run per method, each on its own copy of ``model``."""
    return {
        name: functools.partial(METHODS[name], copy.deepcopy(model), batches) for name in methods
    }


@dataclasses.dataclass
class CaseResult:
    """A case's description cells, its timings (empty if not timed) and per-method errors."""

    case: Case
    cells: List[Any]
    timing: Dict[str, Timing]
    errors: Dict[str, Dict[str, Any]]


def evaluate_case(case: Case, methods: Sequence[str], reps: int, min_seconds: float = 0.0) -> CaseResult:
    """Errors of every method (each on a fresh copy) against the float64 reference, and with
    ``reps > 0`` their time ratios to the floor on the same batches (see :func:`rotated_seconds`)."""
    model, batches = case.build()
    reference = float64_reference(model, batches)
    errors = {}
    for name in methods:
        if name != FLOOR:
            result = copy.deepcopy(model)
            METHODS[name](result, batches)
            errors[name] = stat_errors(result, reference, exact_bound=name == "precise-bn exact")
    runs = runs_on_copies(model, batches, [FLOOR] + [m for m in methods if m != FLOOR])
    timing = time_ratios(runs, reps, min_seconds=min_seconds) if reps else {}
    return CaseResult(case, case.describe(model), timing, errors)


# --------------------------------------------------------------------------------------------
# Memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1))


def _reset_peak_rss() -> None:
    """Set the peak resident set size (VmHWM) back to the current one (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_of(method: Method, model: nn.Module, batches: Batches) -> int:
    """Bytes by which the resident set peaks above where it was when ``method`` started."""
    gc.collect()
    _reset_peak_rss()
    start = _status_kib("VmRSS")
    method(model, batches)
    return (_status_kib("VmHWM") - start) * 1024


def _measure_peaks(cases: Sequence[Case], methods: Sequence[str], repeats: int) -> List[Dict[str, int]]:
    """In this process: per case, each method's smallest peak over ``repeats`` runs, each on a
    fresh copy of the model made before the mark is reset; every method is warmed up once
    (lazy imports, caches) and every case once by the floor (kernel caches for its shapes)."""
    warm: set = set()
    out = []
    for case in cases:
        model, batches = case.build()
        plain_forward(copy.deepcopy(model), batches)
        peaks = {}
        for name in methods:
            if name not in warm:
                METHODS[name](copy.deepcopy(model), batches)
                warm.add(name)
            peaks[name] = min(_peak_of(METHODS[name], copy.deepcopy(model), batches) for _ in range(repeats))
        out.append(peaks)
    return out


def peak_memory_over_floor(
    cases: Sequence[Case], methods: Sequence[str], threads: int, repeats: int = 2
) -> List[Dict[str, int]]:
    """Per case and method, the peak resident memory above the floor's peak, in bytes.

    On CPU there is no allocator statistic for torch tensors and ``tracemalloc`` does not see
    them, so this reads the kernel's own high-water mark of the process's resident memory:
    a fresh worker process, whose glibc malloc returns every block of 64 KiB or more to the
    system when freed (``MALLOC_MMAP_THRESHOLD_``), resets the mark before each run and reads it
    after. The floor's peak is the forward's activations; a method's excess over it is what
    that method holds or allocates beyond them (its state, and any transient copies). Each
    figure is the smallest of ``repeats`` runs; resolution one page (4 KiB).
    """
    names = [FLOOR] + [m for m in methods if m != FLOOR]
    spec = {"cases": [dataclasses.asdict(c) for c in cases], "methods": names, "threads": threads, "repeats": repeats}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536", MALLOC_ARENA_MAX="2")
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "memory"],
        input=json.dumps(spec), capture_output=True, text=True, env=env, check=False, timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError("memory worker failed:\n" + done.stderr[-4000:])
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    return [{name: p[name] - p[FLOOR] for name in names if name != FLOOR} for p in peaks]


def _memory_worker() -> None:
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    cases = [Case(**dict(c, sample_shape=tuple(c["sample_shape"]))) for c in spec["cases"]]
    print(json.dumps(_measure_peaks(cases, spec["methods"], spec["repeats"])))


# --------------------------------------------------------------------------------------------
# Reporting


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs (CI)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="folder for RESULTS.md and the plots (default: benchmarks/)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for everything timed (default 2; 1 with --quick, "
                        "where two threads spinning on a busy machine only add noise)")


def parse_common(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parse, fix the thread count, create the output folder and turn on progress logging."""
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.quick else 2
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    return args


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def target_line(text: str, ok: bool) -> str:
    return "- {}: **{}**".format(text, "met" if ok else "missed")


def fmt_err(value: float) -> str:
    return "{:.1e}".format(value) if value == value and value != float("inf") else str(value)


def time_table(results: Sequence[CaseResult], methods: Sequence[str]) -> str:
    """The time ratios of the timed ``results``, one row per case, and how they were taken."""
    others = [m for m in methods if m != FLOOR]
    rows = [
        [r.case.model, "{:.1f}".format(1e3 * statistics.median(r.timing[FLOOR].floor_seconds) / r.case.batches),
         len(r.timing[others[0]].ratios)]
        + [r.timing[m].cell() for m in others]
        for r in results
    ]
    return (
        "Time of each method over the time of the plain train-mode forward under `no_grad` on the "
        "same batches: median of the per-repetition ratios (`reps` of them), each ratio against a "
        "floor run timed right next to the method's run (before it on even repetitions, after it "
        "on odd ones; methods in rotated order), after one untimed warm-up (min-max of the ratios "
        "in parentheses). A call includes everything the function does once per call (finding "
        "the layers, snapshot and restore of buffers, the report). 1-minute load average when the "
        "table was written: {:.2f} on {} logical cores.\n\n".format(os.getloadavg()[0], os.cpu_count())
        + markdown_table(["model", "floor (ms/batch)", "reps"] + others, rows)
    )


def error_table(results: Sequence[CaseResult]) -> str:
    """Every method's errors in ``results``, one row per case, data and method, explained."""
    rows = [
        [r.case.model, r.case.data, m, fmt_err(e["var_rel"]), fmt_err(e["mean_std"]), e["bad"],
         "yes" if e["within"] else "**no**"]
        for r in results
        for m, e in r.errors.items()
    ]
    return (
        "Largest errors of the written buffers against a float64 two-pass reference of every BN "
        "input, over all layers and channels: relative variance error, mean error in units of "
        "the channel's std, channels whose variance came out <= 0 or NaN, and whether every layer "
        "is within the core's bound (`tests/reference.py`: the default path's bound for every "
        "method, the exact path's for `precise-bn exact`). `shifted`: the first BN layer's input "
        "channels have means 1e2..1e4 times their std; there, storing a mean of 1e4 std in a "
        "float32 buffer alone moves it by up to 1e4 x 2^-24 = 6e-4 std, whatever the method.\n\n"
        + markdown_table(
            ["model", "data", "method", "max rel var err", "max mean err (std)", "var <= 0 / NaN", "within bound"],
            rows,
        )
    )


def environment_text(threads: int) -> str:
    """Versions and machine, for the top of a RESULTS.md section."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    versions = ["Python {}".format(platform.python_version()), "torch {}".format(torch.__version__)]
    for module in ("torchvision", "fvcore", "numpy", "matplotlib"):
        try:
            mod = __import__(module)
            versions.append("{} {}".format(module, getattr(mod, "__version__", "?")))
        except ImportError:
            pass
    versions.append("precise-bn {}".format(precise_bn.__version__))
    return (
        "Machine: {} ({} logical cores), {}; torch.set_num_threads({}). {}. Run {}.".format(
            cpu, os.cpu_count(), platform.platform(), threads, ", ".join(versions),
            datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        )
    )


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])


def write_section(path: Path, key: str, body: str) -> None:
    """Replace the part of ``path`` between this key's markers, keeping the rest of the file.

    Each script owns its section of RESULTS.md, so either can be rerun alone, and text written
    around the sections by hand survives.
    """
    begin, end = "<!-- BEGIN {} -->".format(key), "<!-- END {} -->".format(key)
    block = "{}\n{}\n{}".format(begin, body.strip(), end)
    text = path.read_text() if path.exists() else "# precise-bn benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.touch()  # a new file gets the usual permissions, which atomic_write then keeps
    atomic_write(path, lambda f: f.write(text.encode()))


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plain_log_ticks(ax, values: Sequence[float]) -> None:
    """Tick a log-scaled x axis at exactly ``values``, written as plain numbers, and grid it."""
    ax.set_xticks(list(values))
    ax.set_xticklabels([str(v) for v in values], rotation=45 if len(values) > 4 else 0)
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)


if __name__ == "__main__":
    if sys.argv[1:] != ["memory"]:
        raise SystemExit("usage: python benchmarks/common.py memory  (JSON spec on stdin)")
    _memory_worker()
