"""One BN call's float64 mean and biased variance, measured from its input in one read around
a per-channel shift ``c`` near its mean: ``mean = c + sum(y) / n``, ``var = (sum(y^2) - sum(y)^2
/ n) / n`` with ``y = x - c`` in float64; on the CPU a call whose shift was more than a std off
is measured again around its own mean (docs/numerics.md derives the bound). The sums are one
fused loop per layout, compiled (:mod:`precise_bn.compiled`), eager operators until then.
``python -m precise_bn.moments`` compiles them ahead of time (a cluster's image or shared cache).
"""
from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import aoti, compiled
from .aoti import Program

#: Float64 values an eager chunk forms at a time (CPU: still in cache; GPU: enough to keep it busy).
CHUNK = {"cpu": 1 << 15, "other": 1 << 24}
#: Devices where reading the far-shift flag costs nothing: the host is the device.
HOST_DEVICES = ("cpu",)
FORM_NAMES = ("channels_first", "channels_last")


def _finish(c: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(2, C)`` float64 mean and variance from the shifted sums, and whether some channel's
    shift was more than a std from its mean (0-dim bool)."""
    d = s1 / n
    var = (s2 - s1 * d).clamp(min=0) / n
    return torch.stack([c + d, var]), (d * d > var).any()


def _clean(shift: torch.Tensor) -> torch.Tensor:
    # A shift that overflowed (a float32 mean of huge values) still measures, around 0.
    return torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift)).double()


class _Sums(torch.nn.Module):
    """What is compiled, one form: ``x`` viewed ``(N, C, L)`` (channels first) or ``(A, B, C)``
    (channels last), contiguous, and its shift; returns :func:`_finish`'s pair."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        c = _clean(shift)
        if self.form == "channels_first":
            y = x.double() - c.view(1, -1, 1)
            return _finish(c, y.sum((0, 2)), (y * y).sum((0, 2)), x.shape[0] * x.shape[2])
        y = x.double() - c
        # Over B first, a few rows that stay in cache for every channel, then over A.
        return _finish(c, y.sum(1).sum(0), (y * y).sum(1).sum(0), x.shape[0] * x.shape[1])


def view_for_sums(x: torch.Tensor) -> Tuple[str, torch.Tensor]:
    """The form and 3-D view the sums read ``x`` through (a copy only for other layouts)."""
    if x.dim() == 2:
        return "channels_last", x.contiguous().unsqueeze(0)
    if x.is_contiguous():
        return "channels_first", x.view(x.shape[0], x.shape[1], -1)
    last = x.movedim(1, -1)
    if last.is_contiguous():
        return "channels_last", last.view(-1, last.shape[-2], last.shape[-1])
    return "channels_first", x.contiguous().view(x.shape[0], x.shape[1], -1)


class _Scratch(threading.local):
    """One float64 buffer per thread and device, reused: a fresh large CPU allocation costs a
    page fault per 4 KiB every time."""

    def __init__(self) -> None:
        self.buffers: Dict[torch.device, torch.Tensor] = {}


_SCRATCH = _Scratch()


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    flat = _SCRATCH.buffers.get(device)
    if flat is None or flat.numel() < numel:
        flat = _SCRATCH.buffers[device] = torch.empty(numel, dtype=torch.float64, device=device)
    return flat


def _eager(form: str, x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same sums as :class:`_Sums`, with eager operators over chunks of rows."""
    c = _clean(shift)
    if form == "channels_first":
        rows, dims, centre = x, (0, 2), c.view(1, -1, 1)
    else:
        rows, dims, centre = x.reshape(-1, x.shape[-1]), (0,), c
    per_row = max(1, rows[:1].numel())
    step = max(1, CHUNK["cpu" if x.device.type == "cpu" else "other"] // per_row)
    buffer = _scratch(min(rows.shape[0], step) * per_row, x.device)
    s1 = torch.zeros_like(c)
    s2 = torch.zeros_like(c)
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        y = torch.sub(part, centre, out=buffer[: part.numel()].view(part.shape))
        s1.add_(y.sum(dims))
        s2.add_(torch.linalg.vector_norm(y, dim=dims).square_())
    return _finish(c, s1, s2, x.numel() // max(c.numel(), 1))


def measure(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``(2, C)`` float64 mean and biased variance of each channel of ``x`` (dim 1), measured
    around ``shift`` (one value per channel, any float dtype). ``x`` must hold elements. On a
    GPU nothing here waits for the device."""
    form, view = view_for_sums(x)
    stats, far = compiled.KERNELS.run(form, (view, shift))
    if far.device.type in HOST_DEVICES and far.item():
        stats, _ = _eager(form, view, stats[0])  # rare: a shift a std or more from the mean
    return stats


def _example(dtypes: Tuple[torch.dtype, ...], device: torch.device, form: str) -> Tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 7, generator=gen) * 4 + 100).to(device=device, dtype=dtypes[0])
    shift = x.double().mean((0, 1) if form == "channels_last" else (0, 2)).to(dtypes[1])
    return x, shift


def _dynamic(form: str) -> Tuple[Dict[int, Any], ...]:
    dims = [torch.export.Dim("d{}".format(i), min=1) for i in range(3)]
    return {0: dims[0], 1: dims[1], 2: dims[2]}, {0: dims[1] if form == "channels_first" else dims[2]}


SOURCE = "".join(inspect.getsource(part) for part in (_finish, _clean, _Sums))
for _form in FORM_NAMES:
    aoti.PROGRAMS[_form] = Program(
        module=lambda form=_form: _Sums(form), example=lambda dtypes, device, form=_form: _example(dtypes, device, form),
        dynamic=lambda form=_form: _dynamic(form), eager=lambda x, shift, form=_form: _eager(form, x, shift),
        source=SOURCE)

#: (input, shift) dtypes a model gives the sums: a layer's own, and half inputs beside float32 buffers.
AHEAD = ("float32:float32", "float16:float32", "bfloat16:float32", "float16:float16", "bfloat16:bfloat16",
         "float64:float64")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Compile the float64 sums of every layout ahead of time, for every (input, shift) dtype
    pair a model gives them, into the cache (``PRECISE_BN_CACHE``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m precise_bn.moments", description=main.__doc__)
    parser.add_argument("--device", default="cpu", help="the device to compile for (default: cpu)")
    parser.add_argument("--dtypes", default=",".join(AHEAD),
                        help="INPUT:SHIFT dtype pairs, comma-separated (a lone INPUT: its shift is float32); "
                        "default: " + ",".join(AHEAD))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    keys: List[aoti.Key] = []
    for pair in filter(None, (p.strip() for p in args.dtypes.split(","))):
        names = (pair.split(":") + ["float32"])[:2]
        dtypes = tuple(getattr(torch, name.strip(), None) for name in names)
        if not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
            parser.error("--dtypes: {!r} is not INPUT:SHIFT floating dtypes (e.g. bfloat16:float32)".format(pair))
        keys += [(form, dtypes, device.type) for form in FORM_NAMES]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for key, path in zip(keys, compiled.KERNELS.compile_ahead(keys, device)):
        print("{}: {}".format(aoti.kernel_name(key), path))
    return 1 if compiled.KERNELS.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
