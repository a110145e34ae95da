"""Generated inputs built to defeat the promise that the written statistics are the float64
population statistics, correctly rounded into the buffers.

One seed gives one case: a small model whose BN layer sees a chosen layout, model dtype (float32,
float64, bfloat16, float16, or float32 under bfloat16 autocast), BN class (the stock one, or a
subclass computing ``E[x^2] - E[x]^2`` in float32 as custom BN code often does), a chosen number
of calls per forward, ragged batches, and per-channel means that start, stop, grow or jump, dead
channels that come alive (and live ones that die), channels constant but for one rare jump,
sorted batches, a late outlier batch. The suite runs a few hundred seeds
(``tests/test_exact_attack.py``); ``benchmarks/exact_attack.py`` runs thousands. Everything is
drawn from the seed, so a failing case is reproduced by its seed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

LAYOUTS = ("contiguous", "channels-last", "(N, C)", "(N, C, L)", "3-D", "3-D channels-last")
PATTERNS = ("constant", "starts", "stops", "grows", "jumps", "sorted", "late outlier", "standardised first",
            "rare jump")
#: Model dtypes; "autocast" is a float32 model run under bfloat16 autocast behind a 1x1 layer.
DTYPES = ("float32", "float64", "bfloat16", "float16", "autocast")
KINDS = ("stock", "naive subclass")


@dataclass
class Case:
    seed: int
    layout: str
    pattern: str
    reuse: int
    dtype: str
    kind: str
    model: nn.Module
    batches: List[torch.Tensor]

    @property
    def autocast(self) -> Optional[torch.dtype]:
        return torch.bfloat16 if self.dtype == "autocast" else None

    @property
    def bn_name(self) -> str:
        """The BN layer's qualified name in ``model``."""
        return "1.bn" if self.dtype == "autocast" else "bn"

    def __str__(self) -> str:
        return "seed {} ({}, {}, {}, {}, {} call(s) per forward, {} batches)".format(
            self.seed, self.layout, self.pattern, self.dtype, self.kind, self.reuse, len(self.batches))


class _NaiveMoments:
    """A BN forward of its own: ``E[x^2] - E[x]^2`` in float32, running stats updated in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()
        mean = xf.mean(dims)
        var = (xf * xf).mean(dims) - mean * mean
        if self.training:
            momentum = 0.1 if self.momentum is None else self.momentum
            n = x.numel() // x.shape[1]
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(momentum * mean.to(self.running_mean.dtype))
                unbiased = var * n / max(n - 1, 1)
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased.to(self.running_var.dtype))
        out = (xf - mean.view(shape)) / (var.clamp(min=0).view(shape) + self.eps).sqrt()
        return (out * self.weight.float().view(shape) + self.bias.float().view(shape)).to(x.dtype)


NaiveBatchNorm1d = type("NaiveBatchNorm1d", (_NaiveMoments, nn.BatchNorm1d), {})
NaiveBatchNorm2d = type("NaiveBatchNorm2d", (_NaiveMoments, nn.BatchNorm2d), {})
NaiveBatchNorm3d = type("NaiveBatchNorm3d", (_NaiveMoments, nn.BatchNorm3d), {})


def _front(dims: int, channels: int) -> nn.Module:
    """An identity 1x1 layer, so that under autocast the BN layer sees a bfloat16 input."""
    layer = nn.Linear(channels, channels) if dims == 2 else (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 3](
        channels, channels, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(channels).view(layer.weight.shape))
        layer.bias.zero_()
    return layer


class Reused(nn.Module):
    """One BN layer called ``reuse`` times per forward, on shifted copies of the input."""

    def __init__(self, bn: nn.Module, reuse: int):
        super().__init__()
        self.bn = bn
        self.reuse = reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(x)
        for i in range(1, self.reuse):
            out = out + self.bn(x * (1 + i) - 3.0 * i)
        return out


def _shape(layout: str, samples: int, channels: int, rng: random.Random) -> List[int]:
    if layout == "(N, C)":
        return [max(samples, 2), channels]
    if layout == "(N, C, L)":
        return [samples, channels, rng.randint(2, 9)]
    if layout.startswith("3-D"):
        return [samples, channels, rng.randint(1, 3), rng.randint(2, 4), rng.randint(2, 4)]
    return [samples, channels, rng.randint(2, 6), rng.randint(2, 6)]


def _arrange(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels-last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "3-D channels-last":
        return x.contiguous(memory_format=torch.channels_last_3d)
    return x.contiguous()


def _offset(pattern: str, call: int, calls: int, jump: int, size: float) -> float:
    """The per-call offset of the moving channels, in units of their std."""
    if pattern == "starts":
        return size if call >= jump else 0.0
    if pattern == "stops":
        return size if call < jump else 0.0
    if pattern == "grows":
        return size * call / max(calls - 1, 1)
    if pattern == "jumps":
        return size * (1 + (call == jump))
    if pattern == "late outlier":
        return 8192.0 if call == calls - 1 else 0.0
    return 0.0


#: Scales each dtype can hold: a float16 variance must stay below 65504.
_SCALES = {
    "float16": dict(ratios=(0.0, 1.0, 1e2), stds=(1e-2, 1.0), sizes=(1.0, 30.0)),
    "default": dict(ratios=(0.0, 1.0, 1e2, 1e3, 1e4), stds=(1e-3, 1.0, 1e3), sizes=(1.0, 30.0, 1e3)),
}


def make_case(seed: int) -> Case:
    """The case of ``seed`` (see the module docstring)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layout, pattern = rng.choice(LAYOUTS), rng.choice(PATTERNS)
    dtype = rng.choice(("float32",) * 4 + DTYPES)
    kind = rng.choice(KINDS + ("stock",))
    if dtype == "float16" and pattern == "late outlier":
        pattern = "jumps"
    scales = _SCALES.get(dtype, _SCALES["default"])
    reuse = rng.choice((1, 1, 2, 3))
    channels = rng.randint(2, 6)
    calls = rng.randint(2, 14)
    jump = rng.randint(1, calls - 1)
    size = rng.choice(scales["sizes"])
    ratio = torch.tensor([rng.choice(scales["ratios"]) for _ in range(channels)], dtype=torch.float64)
    std = torch.tensor([rng.choice(scales["stds"]) for _ in range(channels)], dtype=torch.float64)
    dead_until = [rng.choice((0, 0, 1, jump)) for _ in range(channels)]
    dies_at = [rng.choice((calls, calls, jump)) for _ in range(channels)]
    moving = torch.tensor([rng.random() < 0.5 for _ in range(channels)])
    batches = []
    for call in range(calls):
        shape = _shape(layout, rng.randint(1, 6), channels, rng)
        view = [1, channels] + [1] * (len(shape) - 2)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        if pattern == "standardised first" and call == 0:
            x = (x - x.mean()) / x.std().clamp(min=1e-12)
        offset = _offset(pattern, call, calls, jump, size)
        shift = ratio + torch.where(moving, torch.full_like(ratio, offset), torch.zeros_like(ratio))
        x = (x + shift.view(view)) * std.view(view)
        for c in range(channels):
            if pattern == "rare jump" and bool(moving[c]):
                x[:, c] = 3.7
                if call == jump:
                    x[(0, c) + (0,) * (x.dim() - 2)] = 3.7 + float(size)
            elif call < dead_until[c] or call >= dies_at[c]:
                x[:, c] = 0.0
        batches.append(x.to(torch.float32 if dtype == "autocast" else getattr(torch, dtype)))
    if pattern == "sorted":
        batches.sort(key=lambda b: float(b.double().mean()))
    batches = [_arrange(b, layout) for b in batches]
    dims = len(batches[0].shape)
    stock = nn.BatchNorm1d if dims <= 3 else nn.BatchNorm2d if dims == 4 else nn.BatchNorm3d
    naive = {nn.BatchNorm1d: NaiveBatchNorm1d, nn.BatchNorm2d: NaiveBatchNorm2d, nn.BatchNorm3d: NaiveBatchNorm3d}
    bn_class = stock if kind == "stock" else naive[stock]
    model: nn.Module = Reused(bn_class(channels), reuse)
    if dtype == "autocast":
        model = nn.Sequential(_front(dims, channels), model)
        if layout.endswith("channels-last"):
            model = model.to(memory_format=torch.channels_last if dims == 4 else torch.channels_last_3d)
    else:
        model = model.to(getattr(torch, dtype))
    return Case(seed, layout, pattern, reuse, dtype, kind, model, batches)
