"""Precise BN leaves the training run bit for bit as it would have been without it: the same
plain loop, trained with and without the hook, ends with identical parameters, and the loop
reads every one of its batches (the same Lightning run: ``tests/test_lightning.py``)."""
from __future__ import annotations

import random
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from factories import tiny_net
from precise_bn.hooks import PreciseBNHook


class Augmented(Dataset):
    """Each sample drawn with torch, numpy and ``random``, as augmentations do; records which
    indices were read (in the main process)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 3, 6, 6, generator=g) * 2 + 1
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.read: List[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        self.read.append(index)
        noise = torch.randn(3, 6, 6) * 0.1 + float(np.random.rand()) * 0.1 + random.random() * 0.1
        return self.x[index] + noise, self.y[index]


def make_net() -> nn.Module:
    return tiny_net(dropout=0.3)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def assert_same_parameters(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def plain_run(with_hook: bool, generator: Optional[torch.Generator], workers: int,
              device: str = "cpu") -> Dict[str, torch.Tensor]:
    seed_all(0)
    if device == "cuda":
        torch.cuda.manual_seed_all(0)
    if generator is not None:
        generator.manual_seed(7)
    net = make_net().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(Augmented(48), batch_size=8, shuffle=True, generator=generator, num_workers=workers,
                        persistent_workers=workers > 0)
    hook = PreciseBNHook(net, loader, num_batches=2, device=device) if with_hook else None
    step = 0
    for _ in range(2):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            net.train()
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
            step += 1
            if hook is not None and step % 2 == 0:
                hook.before_eval(step)
                hook.before_checkpoint(step)
    assert step == 12  # every batch of both epochs reached the loop
    if hook is not None:
        assert hook.recomputations == 6
    return {name: p.detach().clone() for name, p in net.named_parameters()}


@pytest.mark.parametrize("own_generator", [False, True])
def test_plain_loop_unchanged_by_the_hook(own_generator):
    generator = torch.Generator() if own_generator else None
    assert_same_parameters(plain_run(True, generator, 0), plain_run(False, generator, 0))


def test_plain_loop_with_persistent_workers_unchanged_by_the_hook():
    assert_same_parameters(plain_run(True, None, 1), plain_run(False, None, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (dropout's CUDA generator)")
def test_plain_loop_on_cuda_unchanged_by_the_hook():
    assert_same_parameters(plain_run(True, None, 0, "cuda"), plain_run(False, None, 0, "cuda"))

