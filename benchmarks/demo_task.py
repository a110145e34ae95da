"""The demo's model and data for ``shift.py`` and ``compression.py``, imported in this one place
so that a move of the demo's code only changes the import below."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn

from precise_bn.cli.demo import DEFAULT_STEPS
from precise_bn.digits import BATCH_SIZE, evaluate, load_digits, make_model, train

__all__ = ["BATCH_SIZE", "accuracy", "trained"]


def trained(steps: int = DEFAULT_STEPS, seed: int = 0) -> Tuple[nn.Module, Tensor, Tensor, Tensor, Tensor]:
    """The demo's CNN trained as the demo trains it, but in float32, the dtype these benchmarks are about:
    ``(model, train_x, train_y, test_x, test_y)``."""
    torch.manual_seed(seed)
    train_x, train_y, test_x, test_y = load_digits()  # the bundled, fixed split
    model = train(make_model(), train_x, train_y, steps=steps, batch_size=BATCH_SIZE, seed=seed)
    return model, train_x, train_y, test_x, test_y


def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Held-out accuracy with the model's running statistics (eval mode)."""
    return evaluate(model, x, y)[0]
