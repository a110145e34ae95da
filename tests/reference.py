"""The float64 two-pass reference every numeric test compares against, and the tolerances."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

Reference = Dict[str, Tuple[torch.Tensor, torch.Tensor, int]]


def _default_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, (list, tuple)) and batch and torch.is_tensor(batch[0]):
        return model(batch[0])
    if isinstance(batch, dict) and "input" in batch:
        return model(batch["input"])
    return model(batch)


def float64_reference(
    model: nn.Module,
    batches: Iterable[Any],
    forward_fn: Optional[Callable[[nn.Module, Any], Any]] = None,
    names: Optional[Iterable[str]] = None,
    autocast: Optional[torch.dtype] = None,
) -> Reference:
    """Run a copy of ``model`` (BN layers in train mode, under CPU ``autocast`` if given) and
    keep every BN input of every call.

    Returns, per layer name, the float64 two-pass mean and biased variance over all elements
    of all calls, and the element count per channel. Layers that never ran are absent.
    """
    ref_model = copy.deepcopy(model)
    inputs: Dict[str, list] = {}
    handles = []
    for name, module in ref_model.named_modules():
        if isinstance(module, _BatchNorm) and (names is None or name in set(names)):
            module.train()

            def hook(mod, args, name=name):
                x = args[0].detach().to(torch.float64)
                inputs.setdefault(name, []).append(x.transpose(0, 1).reshape(x.shape[1], -1))

            handles.append(module.register_forward_pre_hook(hook))
    forward = forward_fn or _default_forward
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        for batch in batches:
            forward(ref_model, batch)
    for handle in handles:
        handle.remove()
    out: Reference = {}
    for name, parts in inputs.items():
        x = torch.cat(parts, dim=1)
        mean = x.mean(dim=1)
        var = ((x - mean[:, None]) ** 2).mean(dim=1)
        out[name] = (mean, var, x.shape[1])
    return out


def ulp(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at |x| (float64 result), from the format's
    precision alone: 2**(e - p) for |x| in [2**(e-1), 2**e), the smallest subnormal below."""
    info = torch.finfo(dtype)
    bits = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}[dtype]
    _, exponent = torch.frexp(x.double().abs())
    return torch.maximum(torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - bits),
                         torch.full_like(x, info.tiny * info.eps, dtype=torch.float64))


def ulp32(x: torch.Tensor) -> torch.Tensor:
    """One float32 ulp at |x| (float64 result)."""
    return ulp(x, torch.float32)


def exact_tolerance(ref_mean, ref_var, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The promise's per-channel tolerance on a mean and a variance stored in ``dtype``: 1e-7
    (the mean in units of the std, the variance relative) plus half a unit in the last place of
    ``dtype`` at the reference value (none for float64)."""
    half = (lambda v: 0.5 * ulp(v, dtype)) if dtype != torch.float64 else (lambda v: torch.zeros_like(v))
    return 1e-7 * ref_var.sqrt() + half(ref_mean), 1e-7 * ref_var + half(ref_var)


def assert_close_exact(mean, var, ref_mean, ref_var, what: str = "") -> None:
    """The promise: the float64 population statistics, within 1e-7 (the mean in units of the
    std, the variance relative), correctly rounded to the dtype of ``mean``/``var`` (half a unit
    in its last place more; none for float64). A dead channel is exactly 0."""
    mean_tol, var_tol = exact_tolerance(ref_mean, ref_var, var.dtype)
    mean, var = mean.double().cpu(), var.double().cpu()
    _check(mean, var, ref_mean, ref_var, mean_tol, var_tol, what)


def _check(mean, var, ref_mean, ref_var, mean_tol, var_tol, what):
    assert torch.isfinite(var).all() and (var >= 0).all(), "{}: bad variance {}".format(what, var)
    dead = ref_var == 0
    assert (var[dead] == 0).all(), "{}: dead channel variance not exactly 0: {}".format(what, var[dead])
    mean_err = (mean - ref_mean).abs()
    var_err = (var - ref_var).abs()
    assert (mean_err <= mean_tol).all(), "{}: mean error {} > tol {}".format(
        what, mean_err.max().item(), mean_tol[mean_err.argmax()].item()
    )
    assert (var_err <= var_tol).all(), "{}: var error {} > tol {} (ref {})".format(
        what, var_err.max().item(), var_tol[var_err.argmax()].item(), ref_var[var_err.argmax()].item()
    )
