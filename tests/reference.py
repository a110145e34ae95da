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
) -> Reference:
    """Run a copy of ``model`` (BN layers in train mode) and keep every BN input of every call.

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
    with torch.no_grad():
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


def ulp32(x: torch.Tensor) -> torch.Tensor:
    """One float32 ulp at |x| (float64 result)."""
    x32 = x.abs().to(torch.float32)
    return (torch.nextafter(x32, torch.full_like(x32, float("inf"))) - x32).to(torch.float64)


def assert_close_default(mean, var, ref_mean, ref_var, what: str = "") -> None:
    """The default path's bound: float32 kernel stats, merged exactly.

    Mean within 1e-5 of the channel's std or 2 float32 ulps; variance within 1e-5 relative plus
    what a float32 batch mean can represent (the between-batch term moves by up to
    2 * std * ulp(mean) + ulp(mean)^2) plus the float32 rounding of the stored value.
    """
    mean, var = mean.double().cpu(), var.double().cpu()
    std = ref_var.sqrt()
    mean_tol = torch.maximum(1e-5 * std, 2 * ulp32(ref_mean))
    u = ulp32(ref_mean)
    var_tol = 1e-5 * ref_var + 2 * std * u + u * u + ulp32(ref_var)
    _check(mean, var, ref_mean, ref_var, mean_tol, var_tol, what)


def assert_close_exact(mean, var, ref_mean, ref_var, what: str = "") -> None:
    """The exact path's bound: variance within 1e-7 relative, mean within 1e-7 std or 1 ulp.

    Values stored in float32 buffers may further differ by the rounding of the store itself.
    """
    stored32 = var.dtype == torch.float32
    mean, var = mean.double().cpu(), var.double().cpu()
    mean_tol = torch.maximum(1e-7 * ref_var.sqrt(), ulp32(ref_mean))
    var_tol = 1e-7 * ref_var + (ulp32(ref_var) if stored32 else 0.0)
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
