"""One pass at a time per module: a pass on a model that another pass is running on is refused.

Two passes cannot share a module. The second would keep, as the state to put back, the first
one's capturing classes and ``momentum = 1``, and its forwards would run into the first one's
captures (whose lock the first pass holds: a deadlock, in another thread or in this one). So a
pass claims every module of its model, under one lock for the whole process, before it keeps
the model's state, and gives them back once it has put the model back: the check and the claim
are one step, whatever the threads. Models that share a module (a backbone, one BN layer) count
as the same model. ``nn.DataParallel``'s replicas are made inside the pass's own forwards and
are never claimed: they run in threads of the pass that holds their original.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Dict, List

from torch import nn

from ..errors import ConcurrentPassError

_LOCK = threading.Lock()
#: The pass holding each module, and each pass's claim; weak, so that a pass dropped without
#: putting its model back (an interpreter shutting down) keeps nothing alive.
_HELD: "weakref.WeakKeyDictionary[nn.Module, _Claim]" = weakref.WeakKeyDictionary()
_CLAIMS: "weakref.WeakKeyDictionary[object, _Claim]" = weakref.WeakKeyDictionary()


class _Claim:
    """The modules one pass holds, and where and since when (for the refusal's message)."""

    def __init__(self, modules: List[nn.Module]):
        self.modules = modules
        self.thread = threading.current_thread()
        self.since = time.monotonic()


def claim(owner: object, model: nn.Module, names: Dict[int, str]) -> None:
    """Claim every module of ``model`` for the pass ``owner`` until :func:`release` (``names``:
    each module's name, by id), or raise :class:`~precise_bn.ConcurrentPassError`, claiming
    nothing, if another pass holds any of them."""
    modules = list(model.modules())
    with _LOCK:
        for module in modules:
            other = _HELD.get(module)
            if other is not None:
                raise ConcurrentPassError(_refusal(model, names.get(id(module), ""), other))
        held = _CLAIMS[owner] = _Claim(modules)
        for module in modules:
            _HELD[module] = held


def release(owner: object) -> None:
    """Give back what the pass ``owner`` claimed (idempotent; nothing if it claimed nothing)."""
    with _LOCK:
        held = _CLAIMS.pop(owner, None)
        for module in held.modules if held is not None else ():
            if _HELD.get(module) is held:
                del _HELD[module]


def _refusal(model: nn.Module, name: str, other: _Claim) -> str:
    where = ("further up this thread's stack (a forward_fn or hook that recomputes the model it runs in?)"
             if other.thread is threading.current_thread() else "in thread {!r}".format(other.thread.name))
    return (
        "another precise-bn pass is running on {} ({}, for {:.1f} s{}): passes on one model cannot overlap, "
        "and this one changed nothing. Wait for that pass to finish (one lock around the calls), or give "
        "each pass its own copy of the model".format(
            type(model).__name__, where, time.monotonic() - other.since,
            "; it holds module {!r}".format(name) if name else ""))
