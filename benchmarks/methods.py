"""The estimators compared, the float64 reference they are measured against, and one case's
evaluation: every method's errors and its time over the forward's, and where extra time goes.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import precise_bn
from cases import Batches, Case, bn_layers
from common import FLOOR, REPO, Timing, eager_sums, fmt_err, markdown_table, time_ratios

sys.path.insert(0, str(REPO / "tests"))
from reference import assert_close_exact  # noqa: E402  (the promise)

Method = Callable[[nn.Module, Batches], Any]
#: The default pass with the float64 sums as eager operators (what compiling them saves).
EAGER = "precise-bn, eager sums"
Stats = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


def plain_forward(model: nn.Module, batches: Batches) -> None:
    """The floor: the train-mode forward passes alone, under ``no_grad``."""
    with torch.no_grad():
        for batch in batches:
            model(batch)


def precise_default(model: nn.Module, batches: Batches) -> None:
    precise_bn.recompute(model, batches, progress=False)


def precise_eager(model: nn.Module, batches: Batches) -> None:
    """The default pass with the eager float64 sums, whatever this process compiled."""
    with eager_sums():
        precise_bn.recompute(model, batches, progress=False)


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
    FLOOR: plain_forward,
    "precise-bn": precise_default,
    EAGER: precise_eager,
    "fvcore": fvcore_update,
    "swa_utils.update_bn": swa_utils_update,
    "pycls/mmpretrain": momentum_one_average,
    "Caffe2 formula (float32)": functools.partial(momentum_one_average, caffe2_formula=True),
}


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


def stat_errors(model: nn.Module, reference: Stats) -> Dict[str, Any]:
    """How far ``model``'s BN buffers are from ``reference``, over all layers and channels.

    ``var_rel``: largest ``|var - ref| / ref``; ``mean_std``: largest ``|mean - ref| / ref_std``
    (channels with a reference variance of 0 are left out of both); ``bad``: channels whose
    variance came out <= 0 or NaN although the reference is positive; ``within``: whether every
    layer keeps precise-bn's promise (``tests/reference.assert_close_exact``: the float64
    statistics correctly rounded into the buffers' dtype).
    """
    var_rel = mean_std = 0.0
    bad = 0
    within = True
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
            # The buffers as written: the promise allows for the rounding into their dtype.
            assert_close_exact(module.running_mean, module.running_var, ref_mean, ref_var, name)
        except AssertionError:
            within = False
    return {"var_rel": var_rel, "mean_std": mean_std, "bad": bad, "within": within}


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


def evaluate_case(case: Case, methods: Sequence[str], reps: int, min_seconds: float = 0.0,
                  clock: Callable[[], float] = time.perf_counter) -> CaseResult:
    """Errors of every method (each on a fresh copy) against the float64 reference, and with
    ``reps > 0`` their time ratios to the floor on the same batches (see
    :func:`common.time_ratios`; wall time unless ``clock``)."""
    model, batches = case.build()
    reference = float64_reference(model, batches)
    errors = {}
    for name in methods:
        if name != FLOOR:
            result = copy.deepcopy(model)
            METHODS[name](result, batches)
            errors[name] = stat_errors(result, reference)
    runs = runs_on_copies(model, batches, [FLOOR] + [m for m in methods if m != FLOOR])
    timing = time_ratios(runs, reps, min_seconds=min_seconds, clock=clock) if reps else {}
    return CaseResult(case, case.describe(model), timing, errors)


def time_table(results: Sequence[CaseResult], methods: Sequence[str], clock: str = "wall time") -> str:
    """The time ratios of the timed ``results``, one row per case, and how they were taken
    (``clock`` says what was timed)."""
    others = [m for m in methods if m != FLOOR]
    rows = [
        [r.case.model, "{:.1f}".format(1e3 * statistics.median(r.timing[FLOOR].floor_seconds) / r.case.batches),
         len(r.timing[others[0]].ratios)]
        + [r.timing[m].cell() for m in others]
        for r in results
    ]
    return (
        "Time ({}) of each method over that of the plain train-mode forward under `no_grad` on the "
        "same batches: median of the per-repetition ratios (`reps` of them), each ratio against a "
        "floor run timed right next to the method's run (before it on even repetitions, after it "
        "on odd ones; methods in rotated order), after one untimed warm-up and the compile of the "
        "float64 sums it measured (steady state; min-max of the ratios in parentheses). A call includes everything the function does once per call (finding "
        "the layers, snapshot and restore of buffers, the report). 1-minute load average when the "
        "table was written: {:.2f} on {} logical cores.\n\n".format(clock, os.getloadavg()[0], os.cpu_count())
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
        "keeps precise-bn's promise, checked for every method alike (`tests/reference.assert_close_exact` "
        "applied to the buffers as written: the float64 statistics within 1e-7, correctly rounded "
        "into the buffers' dtype, a dead channel exactly 0). `shifted`: the first BN layer's input "
        "channels have means 1e2..1e4 times their std; there, storing a mean of 1e4 std in a "
        "float32 buffer alone moves it by up to 1e4 x 2^-24 = 6e-4 std, whatever the method.\n\n"
        + markdown_table(
            ["model", "data", "method", "max rel var err", "max mean err (std)", "var <= 0 / NaN",
             "within the promise"],
            rows,
        )
    )


def extra_time_by_op(result: CaseResult, method: str, reps: int = 3, rows: int = 8, clock: str = "wall-clock") -> str:
    """Where ``method``'s extra time over the floor goes, on ``result``'s case, as markdown.

    torch.profiler over ``reps`` alternating runs of the method and of the floor keeps, per
    operator, the smallest self CPU time over the runs; the operators that grew most are listed
    (a compiled region's own loop counts as that region's self time). The extra time of the
    timing table (``clock`` says which) minus the net extra in operators is time spent in
    Python outside any operator: the capture's per-call bookkeeping and per-run setup.
    """
    case = result.case
    model, batches = case.build()
    calls = case.batches * len(bn_layers(model))
    totals: List[Dict[str, Tuple[float, int]]] = [{}, {}]
    for name in (FLOOR, method):
        METHODS[name](copy.deepcopy(model), batches)  # warm-up
    for _ in range(reps):
        for name, total in zip((FLOOR, method), totals):
            run = copy.deepcopy(model)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                METHODS[name](run, batches)
            for e in prof.key_averages():
                total[e.key] = (min(total.get(e.key, (float("inf"), 0))[0], e.self_cpu_time_total), e.count)
    floor, other = totals
    extra = {k: (other[k][0] - floor.get(k, (0, 0))[0]) / 1e3 for k in other}  # ms
    in_ops = sum(extra.values())
    wall = 1e3 * (result.timing[method].seconds - result.timing[FLOOR].seconds)
    table = markdown_table(
        ["operator", "extra self CPU (ms)", "per BN call (us)", "calls (method / floor)"],
        [
            ["`{}`".format(k), "{:.1f}".format(extra[k]), "{:.1f}".format(1e3 * extra[k] / calls),
             "{} / {}".format(other[k][1], floor.get(k, (0, 0))[1])]
            for k in sorted(extra, key=extra.get, reverse=True)[:rows]
        ],
    )
    return (
        "Profile of `{m}` on {model} ({b} batches x {l} BN layers = {c} BN calls per run). "
        "Extra {k} time over the floor (timing table): {w:.1f} ms per run, {wc:.1f} us per BN "
        "call. Net extra self CPU time in operators (smallest of {r} profiled runs per "
        "operator): {o:.1f} ms ({oc:.1f} us per call). The rest, {p:.1f} ms ({pc:.1f} us per "
        "call), is Python outside any operator. Operators that grew most:\n\n{t}".format(
            m=method, k=clock, model=case.model, b=case.batches, l=calls // case.batches, c=calls, w=wall,
            wc=1e3 * wall / calls, r=reps, o=in_ops, oc=1e3 * in_ops / calls, p=wall - in_ops,
            pc=1e3 * (wall - in_ops) / calls, t=table,
        )
    )
