"""A training loader handed to a hook through a wrapper (timm's ``PrefetchLoader``, which holds
the DataLoader as ``.loader`` and normalises its batches): training reads the same batches,
in the same order, with recomputations in the middle of its epochs as without them, and the
recomputations read the batches as the wrapper makes them."""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from precise_bn.hooks import PreciseBNHook

pytestmark = pytest.mark.main_env

SAMPLES, BATCH = 40, 4


def _wrapped(workers: int):
    from timm.data.loader import PrefetchLoader

    images = torch.arange(SAMPLES, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 1, 2, 2).contiguous()
    loader = DataLoader(TensorDataset(images, torch.arange(SAMPLES)), batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(7), num_workers=workers,
                        persistent_workers=workers > 0)
    # (x - 1) / 2: the wrapper's normalisation, in its units of 1/255
    return PrefetchLoader(loader, mean=(1 / 255,), std=(2 / 255,), channels=1, device=torch.device("cpu"))


def _train(workers: int, recompute_at: List[int]) -> Tuple[List[List[List[int]]], float]:
    """The sample indices training reads, per epoch, with the hook recomputing (a whole pass)
    before the evaluations at ``recompute_at`` (steps of each epoch); the mean it wrote last."""
    torch.manual_seed(0)
    model = nn.BatchNorm2d(1)
    wrapper = _wrapped(workers)
    hook = PreciseBNHook(model, wrapper, num_batches=SAMPLES // BATCH)
    epochs = []
    for _ in range(3):
        read = []
        for step, (_, target) in enumerate(wrapper):
            read.append(target.tolist())
            if step in recompute_at:
                hook.forget()
                hook.before_eval(0)
        epochs.append(read)
    return epochs, model.running_mean.item()


@pytest.mark.parametrize("workers", [0, 1])
def test_training_reads_what_it_would_without_the_recomputations(workers):
    plain, untouched = _train(workers, [])
    assert sorted(i for batch in plain[0] for i in batch) == list(range(SAMPLES))
    assert plain[0] != plain[1]  # shuffled anew each epoch: an order that could change
    assert untouched == 0.0
    read, mean = _train(workers, [1, 4, 9])
    assert read == plain
    assert mean == ((SAMPLES - 1) / 2 - 1) / 2  # every sample once, normalised by the wrapper
