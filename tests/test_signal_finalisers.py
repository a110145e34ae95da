"""A signal whose handler runs inside a finaliser, where Python would print what it raises and
go on, reaches the caller at the call's next checkpoint instead of being lost."""
from __future__ import annotations

import os
import signal
import sys
from typing import Any, Iterator, List

import pytest
import torch
from torch import nn

from precise_bn import recompute
from precise_bn.signals import Relays, critical


class SignalsWhenCollected:
    """Its finaliser sends SIGINT to the process; the handler then runs inside the finaliser."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):  # loop back-edges: where every Python version checks for signals
            pass


@pytest.fixture
def printed() -> Iterator[List[Any]]:
    """What Python would print as "Exception ignored"; SIGINT raises KeyboardInterrupt."""
    seen: List[Any] = []
    hook, handler = sys.unraisablehook, signal.getsignal(signal.SIGINT)
    sys.unraisablehook = lambda unraisable: seen.append(unraisable.exc_value)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield seen
    finally:
        sys.unraisablehook = hook
        signal.signal(signal.SIGINT, handler)


def test_without_relays_python_swallows_it(printed):
    """What the relays guard against (and proof that the finaliser's handler does run)."""
    SignalsWhenCollected()
    assert len(printed) == 1 and isinstance(printed[0], KeyboardInterrupt)


def test_a_signal_in_a_finaliser_is_raised_at_the_next_checkpoint(printed):
    relays = Relays()
    try:
        relays.install()
        SignalsWhenCollected()
        assert printed == []
        with pytest.raises(KeyboardInterrupt):
            with critical():
                pass
        with critical():  # raised once, not again
            pass
    finally:
        relays.release()
    assert sys.unraisablehook is not None and printed == []
    SignalsWhenCollected()  # relays released: Python's own behaviour again
    assert len(printed) == 1


def test_recompute_interrupted_in_a_finaliser_raises_and_leaves_the_model(printed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.randn(4, 3, 6, 6) for _ in range(4)]

    def forward(net: nn.Module, batch: torch.Tensor) -> Any:
        if batch is batches[1]:
            SignalsWhenCollected()
        return net(batch)

    with pytest.raises(KeyboardInterrupt):
        recompute(model, batches, forward_fn=forward)
    assert printed == []
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
