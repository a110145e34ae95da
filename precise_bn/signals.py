"""Critical sections that no signal can split, so an interrupt never leaves a model half-changed.

Why this is needed: a signal with a Python handler (Ctrl-C's ``KeyboardInterrupt``, or any
handler that raises) runs in the main thread at whatever bytecode is executing when it arrives.
While precise-bn changes a model (swapping layer classes in, restoring buffers, writing the new
statistics) an exception at the wrong bytecode would leave some layers changed and others not.

How: for the length of a recalibration, a :class:`Relays` object replaces every Python signal
handler by a relay. Outside critical sections the relay hands the signal straight to the
original handler. Inside :func:`critical` it only records the signal; when the outermost
section ends the recorded signals go to their handlers in order, so whatever they raise is
raised at a point where the model is whole. Entering and leaving a section is one integer
store, which a signal cannot split. Blocking signals at the OS level (``pthread_sigmask``)
would not do: the kernel then hands a process signal to another thread, and CPython still runs
the handler in the main thread at once.

The last write of a call is made inside a section that also takes the relays away
(:meth:`Relays.release`), and is undone if anything is raised before the call returns (see
:meth:`precise_bn.pytorch.bn_pass.BNPass.finish`): once the originals are back, a signal is
handled at the next check CPython makes, which is still inside that guarded code. A relay
left behind (a signal cut the restoring loop short) puts its original back when it next fires.

Signal handlers only ever run in the main thread; called from another thread, nothing here
changes any handler and sections need no protection.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

T = TypeVar("T")

_originals: Dict[int, Callable[..., Any]] = {}
_pending: List[Tuple[int, Any]] = []
_owners = 0
_depth = 0


def in_critical_section() -> bool:
    """True while the main thread is inside :func:`critical` (signals are then deferred)."""
    return _depth > 0


def _relay(signum: int, frame: Any) -> None:
    original = _originals.get(signum)
    if original is None:
        return
    if _depth:
        _pending.append((signum, frame))
        return
    if not _owners:
        signal.signal(signum, original)
        del _originals[signum]
    original(signum, frame)


class Relays:
    """The relays of one call: :meth:`install` at its start, :meth:`release` exactly once at
    its end (further calls do nothing). Nested calls share the relays of the outermost."""

    def __init__(self) -> None:
        self._held = False

    def install(self) -> "Relays":
        global _owners
        if threading.current_thread() is not threading.main_thread() or self._held:
            return self
        if not _owners:
            _pending.clear()
            for signum in signal.valid_signals():
                try:
                    handler = signal.getsignal(signum)
                except (OSError, ValueError):
                    continue
                if callable(handler) and handler is not _relay:
                    _originals[signum] = handler
                    signal.signal(signum, _relay)
        _owners += 1
        self._held = True
        return self

    def release(self) -> None:
        global _owners
        if not self._held:
            return
        self._held = False
        _owners -= 1
        if not _owners:
            for signum in list(_originals):
                if signal.getsignal(signum) is _relay:
                    signal.signal(signum, _originals[signum])
                del _originals[signum]


class critical:
    """``with critical() as section:`` defers signals for the block and hands them to their
    handlers when the outermost block ends; a handler that raises then raises there.

    ``section.interrupted`` tells, inside the block, that a signal is waiting: work that must
    not survive an interrupted call can be undone before the block ends.
    """

    def __enter__(self) -> "critical":
        global _depth
        _depth += 1
        return self

    @property
    def interrupted(self) -> bool:
        return bool(_pending)

    def __exit__(self, *exc: Any) -> None:
        global _depth
        _depth -= 1
        if not _depth:
            while _pending:
                signum, frame = _pending.pop(0)
                handler = _originals.get(signum) or signal.getsignal(signum)
                if callable(handler) and handler is not _relay:
                    handler(signum, frame)


def write_last(write: Callable[[], Any], undo: Callable[[], Any], relays: Optional[Relays] = None,
               value: T = None) -> T:
    """Make ``write()`` a call's last change, never left behind by a call that raises.

    ``write`` runs in one critical section that also releases the call's ``relays``. If a
    signal arrived meanwhile, or anything is raised before this function returns (a handler
    run at CPython's next check, once the original handlers are back), ``undo()`` runs before
    the exception leaves. Returns ``value``: callers end with ``return write_last(...)``, so
    that none of their code runs after the write.
    """
    try:
        with critical() as section:
            write()
            if relays is not None:
                relays.release()
            if section.interrupted:
                undo()
        return value
    except BaseException:
        with critical():
            undo()
        raise
