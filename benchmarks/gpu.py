"""The default pass on a GPU: its cost against the forward and fvcore, the host synchronisations
per BN call, and its exactness against float64.

    python benchmarks/gpu.py [--quick] [--out DIR] [--reps N]

Where CUDA is not available it says so in one line and exits 0, writing nothing. Otherwise, on
``cuda:0``, for each case (the sizes of ``cost.py``, and resnet50 at 224 x 224): the plain
train-mode forward under ``no_grad``, ``precise_bn.recompute`` at steady state (the float64 sums
loaded, or compiled once for this GPU, by ``common.settle``) and fvcore's ``update_bn_stats``,
each timed by wall clock with the device synchronised before and after, as the median of
adjacent ratios to the forward (``common.time_ratios``). Then one pass under
``torch.cuda.set_sync_debug_mode("warn")``: the synchronising operations it issued, per BN call
and in all (the ones between batches and at the end of the pass are the driver's, not a call's).
Then the written buffers against the float64 two-pass reference of every BN input
(``methods.stat_errors``), and each method's peak of device memory over the forward's, next to
the parameters' size (a pass keeps its copy of them in host memory). Writes the "gpu" section of ``DIR/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

import cases
import common
import methods
from cases import Case
from common import FLOOR

METHODS = [FLOOR, "precise-bn", "fvcore"]
FULL = [Case("resnet50", (3, 64, 64), 8, 16), Case("mobilenet_v3_large", (3, 64, 64), 16, 16),
        Case("r2plus1d_18", (3, 8, 56, 56), 4, 8), Case("resnet50", (3, 224, 224), 32, 16),
        Case("bn_mlp", (256,), 256, 64, options={"in_features": 256, "width": 1024, "depth": 4})]
QUICK = [Case("resnet_style_2d", (3, 8, 8), 2, 2, options={"widths": (8,), "blocks": 1})]


def on_device(run: Callable[[Any, Any], None], model: torch.nn.Module, batches: List[torch.Tensor]) -> Callable[[], None]:
    """``run`` on a copy of ``model``, the device synchronised before and after (wall time)."""
    def timed() -> None:
        torch.cuda.synchronize()
        run(copy.deepcopy(model), batches)
        torch.cuda.synchronize()
    return timed


def syncs_per_call(model: torch.nn.Module, batches: List[torch.Tensor]) -> Dict[str, float]:
    """One default pass with CUDA's sync debug mode on: synchronising operations per BN call."""
    calls = [0]
    handles = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
               for _, m in cases.bn_layers(model)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            methods.precise_default(model, batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for handle in handles:
        handle.remove()
    syncs = sum(1 for w in seen if "synchroniz" in str(w.message))
    return {"syncs": syncs, "calls": calls[0], "per_call": syncs / max(calls[0], 1)}


def device_peak(run: Callable[[Any, Any], None], model: torch.nn.Module, batches: List[torch.Tensor]) -> float:
    """The peak device memory ``run`` allocates on a copy of ``model`` beyond what was allocated
    before it, in MiB."""
    model = copy.deepcopy(model)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(model, batches)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2.0 ** 20


def run_case(case: Case, reps: int) -> List[Any]:
    model, batches = case.build()
    model = model.cuda()
    batches = [b.cuda() for b in batches]
    runs = {name: on_device(methods.METHODS[name], model, batches) for name in METHODS}
    timing = common.time_ratios(runs, reps)
    synced = syncs_per_call(copy.deepcopy(model), batches)
    recomputed = copy.deepcopy(model)
    methods.precise_default(recomputed, batches)
    errors = methods.stat_errors(recomputed, methods.float64_reference(model, batches))
    versus = timing["precise-bn"].versus(timing["fvcore"])
    peaks = {name: device_peak(methods.METHODS[name], model, batches) for name in METHODS}
    parameters = sum(p.numel() * p.element_size() for p in model.parameters()) / 2.0 ** 20
    return case.describe(model) + [
        "{:.1f}".format(parameters), "{:.2f}".format(peaks["precise-bn"] - peaks[FLOOR]),
        "{:.2f}".format(peaks["fvcore"] - peaks[FLOOR]),
        timing["precise-bn"].cell(), timing["fvcore"].cell(), "{:.3f}".format(versus),
        "{} ({} calls, {:.2f} per call)".format(synced["syncs"], synced["calls"], synced["per_call"]),
        common.fmt_err(errors["var_rel"]), common.fmt_err(errors["mean_std"]), "yes" if errors["within"] else "**no**",
    ]


HEADERS = cases.CASE_HEADERS + ["parameters (MiB)", "precise-bn device peak over the forward's (MiB)",
                                "fvcore's (MiB)", "precise-bn / forward", "fvcore / forward", "precise-bn / fvcore",
                                "synchronising operations in a pass", "max rel var err", "max mean err (std)",
                                "within the promise"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7, quick 1)")
    args = common.parse_common(parser, argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; nothing measured")
        return
    reps = args.reps or (1 if args.quick else 7)
    with common.compile_policy("auto"):
        rows = [run_case(case, reps) for case in (QUICK if args.quick else FULL)]
    text = "\n\n".join(common.section_head("The default pass on a GPU (`benchmarks/gpu.py`)", argv) + [
        "Device: {}. Wall time with the device synchronised around each run; ratios are medians of adjacent "
        "runs (min-max in brackets).".format(torch.cuda.get_device_name(0)),
        common.markdown_table(HEADERS, rows),
    ])
    common.write_section(args.out / "RESULTS.md", "gpu", text)
    print(text)


if __name__ == "__main__":
    main()
