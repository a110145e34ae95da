"""``precise-bn demo``: train the digits CNN, save it, recalibrate the file with ``recompute``'s
code, evaluate both. In float64 throughout, so any CPU prints the same figures (docs/cli.md)."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from ..checkpoint.serializers import SAFE_LOAD_AVAILABLE
from ..digits import BATCH_SIZE, LEARNING_RATE, evaluate, load_digits, make_model, train
from ..report import BNReport
from .job import recompute_checkpoint

DEFAULT_STEPS = 300
MODEL_SPEC = "precise_bn.digits:make_model"
MODEL_KWARGS = {"dtype": "float64"}


def _load(path: str) -> nn.Module:
    model = make_model(**MODEL_KWARGS)
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


def run_demo(steps: int = DEFAULT_STEPS, seed: int = 0, workdir: Optional[str] = None,
             quiet: bool = False) -> DemoResult:
    """Train, save, recompute through the ``recompute`` command's function, evaluate, print
    (``quiet``: no progress bar and no report table, the accuracies still).

    Runs on one CPU thread: for tensors this small, more threads only add synchronisation, and
    on a busy machine their spinning makes training many times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_demo(steps, seed, workdir, quiet)
    finally:
        torch.set_num_threads(threads)


def _run_demo(steps: int, seed: int, workdir: Optional[str], quiet: bool) -> DemoResult:
    started = time.perf_counter()
    train_x, train_y, test_x, test_y = load_digits()
    torch.manual_seed(seed)
    model = train(make_model(**MODEL_KWARGS), train_x, train_y, steps=steps, batch_size=BATCH_SIZE, seed=seed)
    trained = time.perf_counter()
    print(
        "precise-bn demo: bundled digits, {} training / {} held-out images; CNN with 4 BatchNorm "
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
        # The demo wrote this file a moment ago; a torch without weights_only needs the flag.
        trust = not SAFE_LOAD_AVAILABLE
        # Pasted as printed, it writes the same bits again: one thread, as here, and over the
        # output this run wrote.
        command = "OMP_NUM_THREADS=1 precise-bn recompute {} --model {} --model-kwargs {} --data {} --num-samples {} " \
                  "--batch-size {} --overwrite{}".format(
                      shlex.quote(checkpoint), MODEL_SPEC, shlex.quote(json.dumps(MODEL_KWARGS)),
                      shlex.quote("npz:{}:x".format(data)), len(train_x), BATCH_SIZE,
                      " --trust-checkpoint" if trust else "")
        if workdir is None:
            command = "the recompute command on files in a temporary folder, deleted at the end (precise-bn demo " \
                      "--workdir DIR keeps them and shows the command)"
        print("recompute: " + command, flush=True)
        report, output = recompute_checkpoint(
            checkpoint,
            MODEL_SPEC,
            "npz:{}:x".format(data),
            model_kwargs=MODEL_KWARGS,
            num_samples=len(train_x),
            batch_size=BATCH_SIZE,
            trust=trust,
            progress=False if quiet else None,
            overwrite=True,  # the output of an earlier demo in the same --workdir
        )
        ema_accuracy, ema_loss = evaluate(_load(checkpoint), test_x, test_y)
        precise_accuracy, precise_loss = evaluate(_load(output), test_x, test_y)
    result = DemoResult(ema_accuracy, ema_loss, precise_accuracy, precise_loss, report, time.perf_counter() - started)
    if not quiet:
        print(report)
    print("held-out accuracy with the EMA running stats: {:6.2%} (loss {:.4f})".format(ema_accuracy, ema_loss))
    print("held-out accuracy with the precise stats:     {:6.2%} (loss {:.4f})".format(precise_accuracy, precise_loss))
    print("total {:.1f} s".format(result.seconds))
    return result
