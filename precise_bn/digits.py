"""The demo's task: 8x8 handwritten digits, shipped with the package (``digits.npz``, UCI, CC BY
4.0; source and split in docs/cli.md), a small BatchNorm CNN, its training and evaluation."""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import ConfigError

DATA_FILE = Path(__file__).with_name("digits.npz")
BATCH_SIZE = 32
LEARNING_RATE = 0.1


def load_digits() -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(train_x, train_y, test_x, test_y)``: 1347 training and 450 held-out (always the same)
    float32 ``(N, 1, 8, 8)`` images scaled to [0, 1], int64 labels."""
    with np.load(DATA_FILE, allow_pickle=False) as arrays:
        parts = [torch.from_numpy(arrays[name]) for name in ("train_images", "train_labels", "test_images", "test_labels")]
    train_x, train_y, test_x, test_y = parts
    return _images(train_x), train_y.long(), _images(test_x), test_y.long()


def _images(pixels: Tensor) -> Tensor:
    return pixels.float().unsqueeze(1) / 16.0


class _DigitsCNN(nn.Sequential):
    """Casts its input to its parameters' dtype (pixels, multiples of 1/16, are exact in both)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self[0].weight.dtype))


def make_model(dtype: str = "float32") -> nn.Module:
    """A small CNN for 8x8 digits with four BatchNorm layers, in ``dtype`` (a name, for ``--model-kwargs``)."""
    if dtype not in ("float32", "float64"):
        raise ConfigError("make_model(dtype={!r}): expected 'float32' or 'float64'".format(dtype))
    kind = {"dtype": getattr(torch, dtype)}  # drawn in this dtype: a cast would keep a float32 kernel's last bits
    return _DigitsCNN(
        nn.Conv2d(1, 16, 3, padding=1, bias=False, **kind),
        nn.BatchNorm2d(16, **kind),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False, **kind),
        nn.BatchNorm2d(32, **kind),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False, **kind),
        nn.BatchNorm2d(64, **kind),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, 64, bias=False, **kind),
        nn.BatchNorm1d(64, **kind),
        nn.ReLU(),
        nn.Linear(64, 10, **kind),
    )


def train(model: nn.Module, train_x: Tensor, train_y: Tensor, *, steps: int, batch_size: int, seed: int) -> nn.Module:
    """``steps`` of SGD (momentum 0.9) on mini-batches shuffled by ``seed``; BN keeps its EMA stats."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9, weight_decay=5e-4)
    model.train()
    order = torch.randperm(len(train_x), generator=generator)
    position = 0
    for _ in range(steps):
        if position + batch_size > len(order):
            order = torch.randperm(len(train_x), generator=generator)
            position = 0
        index = order[position : position + batch_size]
        position += batch_size
        loss = F.cross_entropy(model(train_x[index]), train_y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def evaluate(model: nn.Module, x: Tensor, y: Tensor) -> Tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` in eval mode (BN uses its running stats)."""
    model.eval()
    with torch.no_grad():
        logits = model(x)
    return float((logits.argmax(1) == y).double().mean()), float(F.cross_entropy(logits, y))
