"""Model and data factories that the command-line tests name in ``--model`` / ``--data`` specs."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn


def small_net(width: int = 4, extra_layer: bool = False) -> nn.Module:
    """Conv-BN-ReLU twice, pooled, then Linear-BN1d: three BN layers, a few hundred weights."""
    layers: List[nn.Module] = [
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, 3),
    ]
    if extra_layer:
        layers.append(nn.BatchNorm1d(3))
    return nn.Sequential(*layers)


def batches(n: int = 5, batch_size: int = 6, seed: int = 0, offset: float = 3.0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``(input, target)`` pairs of 3x8x8 images, mean ``offset``, std 2, with a ragged last batch."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = batch_size if i < n - 1 else max(2, batch_size // 2)
        x = torch.randn(size, 3, 8, 8, generator=generator) * 2.0 + offset
        out.append((x, torch.zeros(size, dtype=torch.int64)))
    return out


def no_bn_net() -> nn.Module:
    """A model without any BatchNorm layer."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))


class Caffe2StyleNet(nn.Module):
    """Module names that the model-zoo ResNet rules map to Caffe2 blobs: conv1, bn1, fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn1(self.conv1(x))).mean(dim=(2, 3)))


def caffe2_style_net() -> nn.Module:
    return Caffe2StyleNet()


def fixed_batches() -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`batches` with no parameters at all."""
    return batches()


# Caffe2 layer names of a non-zoo net -> Caffe2StyleNet's module names, for --caffe2-rules.
STEM_RULES = [(r"stem", "conv1"), (r"stem_bn", "bn1"), (r"head", "fc")]
