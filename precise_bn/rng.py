"""Every random generator a recomputation can draw from (shuffling, worker seeds, augmentations,
dropout), saved before it and put back after: training then draws what it would have drawn."""
from __future__ import annotations

import random
import sys
from typing import Any, List, Sequence

import torch


def loader_generators(loader: Any) -> List[torch.Generator]:
    """The ``torch.Generator`` objects iterating ``loader`` (or the DataLoader a wrapper holds as
    ``loader``) draws from besides the global ones: its own and its samplers'."""
    loader = getattr(loader, "loader", loader)
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    found: List[torch.Generator] = []
    for owner in owners:
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


class SavedRNG:
    """The global torch CPU and CUDA generators, numpy's and ``random``'s global state, and
    each of ``generators``, as they are now; :meth:`restore` puts them back (and may be called
    again). numpy is only saved when it was imported; CUDA is never initialised here, and a
    CUDA context initialised since is put back to its seed."""

    def __init__(self, generators: Sequence[torch.Generator] = ()):
        self.cpu = torch.get_rng_state()
        self.python = random.getstate()
        self.numpy = sys.modules.get("numpy")
        self.numpy_state = self.numpy.random.get_state() if self.numpy is not None else None
        self.cuda = torch.cuda.get_rng_state_all() if _cuda_up() else None
        self.own = [(g, g.get_state()) for g in generators]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        random.setstate(self.python)
        if self.numpy is not None:
            self.numpy.random.set_state(self.numpy_state)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        elif _cuda_up():
            torch.cuda.manual_seed_all(torch.cuda.initial_seed())
        for generator, state in self.own:
            generator.set_state(state)


def _cuda_up() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()
