"""Generated inputs built to defeat the exact bound and the default path's stated precision.

One seed gives one case: a small model whose BN layer sees a chosen layout, a chosen number of
calls per forward, ragged batches, and per-channel means that start, stop, grow or jump, dead
channels that come alive (and live ones that die), sorted batches, a late outlier batch. The
suite runs a few hundred seeds (``tests/test_exact_attack.py``); ``benchmarks/exact_attack.py``
runs thousands. Everything is drawn from the seed, so a failing case is reproduced by its seed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List

import torch
from torch import nn

LAYOUTS = ("contiguous", "channels-last", "(N, C)", "(N, C, L)", "3-D", "3-D channels-last")
PATTERNS = ("constant", "starts", "stops", "grows", "jumps", "sorted", "late outlier", "standardised first")


@dataclass
class Case:
    seed: int
    layout: str
    pattern: str
    reuse: int
    model: nn.Module
    batches: List[torch.Tensor]

    def __str__(self) -> str:
        return "seed {} ({}, {}, {} call(s) per forward, {} batches)".format(
            self.seed, self.layout, self.pattern, self.reuse, len(self.batches))


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


def make_case(seed: int) -> Case:
    """The case of ``seed`` (see the module docstring)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layout, pattern = rng.choice(LAYOUTS), rng.choice(PATTERNS)
    reuse = rng.choice((1, 1, 2, 3))
    channels = rng.randint(2, 6)
    calls = rng.randint(2, 14)
    jump = rng.randint(1, calls - 1)
    size = rng.choice((1.0, 30.0, 1e3))
    ratio = torch.tensor([rng.choice((0.0, 1.0, 1e2, 1e3, 1e4)) for _ in range(channels)], dtype=torch.float64)
    std = torch.tensor([rng.choice((1e-3, 1.0, 1e3)) for _ in range(channels)], dtype=torch.float64)
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
            if call < dead_until[c] or call >= dies_at[c]:
                x[:, c] = 0.0
        batches.append(x.float())
    if pattern == "sorted":
        batches.sort(key=lambda b: float(b.double().mean()))
    batches = [_arrange(b, layout) for b in batches]
    dims = len(batches[0].shape)
    bn_class = nn.BatchNorm1d if dims <= 3 else nn.BatchNorm2d if dims == 4 else nn.BatchNorm3d
    model = Reused(bn_class(channels), reuse)
    return Case(seed, layout, pattern, reuse, model, batches)
