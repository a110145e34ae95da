"""``precise-bn demo``: the whole job on a real, small, offline data set, in seconds on a CPU.

It trains a small BatchNorm CNN briefly on scikit-learn's bundled 8x8 handwritten digits,
saves a checkpoint, recalibrates it through :func:`precise_bn.cli.job.recompute_checkpoint` (the code path of
``precise-bn recompute``, on files in a temporary folder), and evaluates both checkpoints on
held-out digits.

What it measures: a BN layer's running stats after training are an exponential moving average
(momentum 0.1, so mostly the last ~10 batches) of batch stats taken while the weights were
still moving; the recomputed ones are the population stats of the final weights over the
whole training set. Whether that changes held-out accuracy depends on how fast the weights
moved at the end: the demo prints what it finds, whichever way it goes.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint.formats import SAFE_LOAD_AVAILABLE
from ..errors import BackendUnavailableError
from ..report import BNReport
from .job import recompute_checkpoint

DEFAULT_STEPS = 300
BATCH_SIZE = 32
LEARNING_RATE = 0.1
TEST_FRACTION = 0.25


def load_digits_splits(seed: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 1797 digits as ``(train_x, train_y, test_x, test_y)``.

    Images are float32 ``(N, 1, 8, 8)`` scaled to [0, 1], labels int64; a stratified quarter
    is held out, chosen by ``seed``.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise BackendUnavailableError(
            "the demo uses scikit-learn's bundled digits: pip install precise-bn[demo]"
        ) from exc
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        list(range(len(y))), test_size=TEST_FRACTION, stratify=digits.target, random_state=seed
    )
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def make_model() -> nn.Module:
    """A small CNN for 8x8 digits with four BatchNorm layers (three 2d, one 1d)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, 64, bias=False),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def train(model: nn.Module, train_x: Tensor, train_y: Tensor, *, steps: int, batch_size: int, seed: int) -> nn.Module:
    """``steps`` of SGD (momentum 0.9, constant learning rate) on shuffled mini-batches.

    The BN layers keep their default EMA running stats, as in any training run; batches are
    drawn by a generator seeded with ``seed``, epoch after epoch.
    """
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


def _load(path: str) -> nn.Module:
    model = make_model()
    model.load_state_dict(torch.load(path, map_location="cpu")["model"])
    return model


@dataclass
class DemoResult:
    """Held-out accuracy and loss with the EMA stats and with the recomputed ones."""

    ema_accuracy: float
    ema_loss: float
    precise_accuracy: float
    precise_loss: float
    report: BNReport
    seconds: float


def run_demo(
    steps: int = DEFAULT_STEPS, seed: int = 0, workdir: Optional[str] = None, progress: Optional[bool] = None
) -> DemoResult:
    """Train, save, recompute through the ``recompute`` command's function, evaluate, print.

    Runs on one CPU thread: for tensors this small, more threads only add synchronisation, and
    on a busy machine their spinning makes training many times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_demo(steps, seed, workdir, progress)
    finally:
        torch.set_num_threads(threads)


def _run_demo(steps: int, seed: int, workdir: Optional[str], progress: Optional[bool]) -> DemoResult:
    started = time.perf_counter()
    train_x, train_y, test_x, test_y = load_digits_splits(seed)
    torch.manual_seed(seed)
    model = train(make_model(), train_x, train_y, steps=steps, batch_size=BATCH_SIZE, seed=seed)
    trained = time.perf_counter()
    print(
        "precise-bn demo: scikit-learn digits, {} training / {} held-out images; CNN with 4 BatchNorm "
        "layers trained for {} steps (batch {}, SGD lr {}) in {:.1f} s".format(
            len(train_x), len(test_x), steps, BATCH_SIZE, LEARNING_RATE, trained - started
        ),
        flush=True,
    )
    folder_context = tempfile.TemporaryDirectory() if workdir is None else contextlib.nullcontext(workdir)
    with folder_context as folder:
        os.makedirs(folder, exist_ok=True)
        checkpoint = os.path.join(folder, "digits_cnn.pt")
        data = os.path.join(folder, "digits_train.npz")
        torch.save({"model": model.state_dict(), "steps": steps, "seed": seed}, checkpoint)
        np.savez(data, x=train_x.numpy())
        command = "precise-bn recompute {} --model precise_bn.cli.demo:make_model --data npz:{}:x " \
                  "--num-samples {} --batch-size {}".format(checkpoint, data, len(train_x), BATCH_SIZE)
        if workdir is None:
            command = "the recompute command on files in a temporary folder, deleted at the end (precise-bn demo " \
                      "--workdir DIR keeps them and shows the command)"
        print("recompute: " + command, flush=True)
        report, output = recompute_checkpoint(
            checkpoint,
            "precise_bn.cli.demo:make_model",
            "npz:{}:x".format(data),
            num_samples=len(train_x),
            batch_size=BATCH_SIZE,
            # The demo wrote this file a moment ago; a torch without weights_only needs the flag.
            trust=not SAFE_LOAD_AVAILABLE,
            progress=progress,
            overwrite=True,  # the output of an earlier demo in the same --workdir
        )
        ema_accuracy, ema_loss = evaluate(_load(checkpoint), test_x, test_y)
        precise_accuracy, precise_loss = evaluate(_load(output), test_x, test_y)
    result = DemoResult(ema_accuracy, ema_loss, precise_accuracy, precise_loss, report, time.perf_counter() - started)
    print(report)
    print("held-out accuracy with the EMA running stats: {:6.2%} (loss {:.4f})".format(ema_accuracy, ema_loss))
    print("held-out accuracy with the precise stats:     {:6.2%} (loss {:.4f})".format(precise_accuracy, precise_loss))
    print("total {:.1f} s".format(result.seconds))
    return result
