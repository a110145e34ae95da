"""Changes no signal can split or leave half-made: relays that defer a signal's handler inside a
:class:`critical` section, and :func:`all_or_nothing` calls whose every :func:`write` is undone
if they raise, whatever and wherever. How and why: docs/interrupts.md ("How it works")."""
from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, TypeVar, cast

try:
    # The C module behind ``signal``: the same calls without converting every number to an
    # enum, which over every signal an install looks at costs more than the rest of it.
    import _signal as _raw
except ImportError:  # another Python implementation
    _raw = signal  # type: ignore[misc]

F = TypeVar("F", bound=Callable[..., Any])

#: Signals ending the process by default, raised as :class:`Terminated` where asked.
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

_originals: Dict[int, Any] = {}  # what each relayed signal had: a handler, or SIG_DFL
_pending: List[Tuple[int, Any]] = []
_holders: Set["Relays"] = set()
_depth = 0
_raised: List[BaseException] = []  # what the last handler called from here raised
_rescued: List[BaseException] = []  # of those, what a finaliser swallowed
_unraisable_hooks: List[Callable[[Any], Any]] = []  # the hook ours replaced


class Terminated(SystemExit):
    """SIGTERM or SIGHUP while relayed with ``terminate=True``; ``code`` is 128 + the signal, as a shell's."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def _handler(signum: int, original: Any) -> Any:
    """The handler a relayed signal goes to: its own, or :func:`_terminate` at the default action."""
    return _terminate if signum in TERMINATING and original == _raw.SIG_DFL else original


def in_critical_section() -> bool:
    """True while the main thread defers signals: inside :class:`critical`, or between a
    :func:`write` and the end of its outermost all-or-nothing call."""
    return _depth > 0


def _relay(signum: int, frame: Any) -> None:
    """Defer the signal inside a critical section, else pass it on (an unheld relay first gives
    its original back)."""
    original = _originals.get(signum)
    if original is None:
        return
    if _depth:
        _pending.append((signum, frame))
        return
    if not _holders:
        _raw.signal(signum, original)
        _originals.pop(signum, None)
    _call(_handler(signum, original), signum, frame)


def _call(handler: Callable[..., Any], signum: int, frame: Any) -> None:
    try:
        handler(signum, frame)
    except BaseException as exc:
        _raised[:] = [exc]
        raise


def _rescue(unraisable: Any) -> None:
    """``sys.unraisablehook`` while relayed: keeps a handler's exception in a finaliser for :func:`checkpoint`."""
    if _holders and _raised and unraisable.exc_value is _raised[0]:
        _rescued.append(_raised.pop())
    elif _unraisable_hooks:
        _unraisable_hooks[0](unraisable)


def checkpoint() -> None:
    """Raise what a relayed handler raised inside a finaliser since the last checkpoint (Python drops it)."""
    if _rescued:
        exc = _rescued[0]
        _rescued.clear()
        raise exc


def _put_back() -> None:
    # Each original is forgotten only once it is back: cut short anywhere (a relay may give its
    # own original back in between, see ``_relay``), this can run again and finish.
    if sys.unraisablehook is _rescue and _unraisable_hooks:
        sys.unraisablehook = _unraisable_hooks[0]
    _raised.clear()
    for signum in list(_originals):
        original = _originals.get(signum)
        if original is not None and _raw.getsignal(signum) is _relay:
            _raw.signal(signum, original)
        _originals.pop(signum, None)


def _deliver() -> None:
    checkpoint()
    while _pending:
        signum, frame = _pending.pop(0)
        original = _originals.get(signum)
        handler = _handler(signum, _raw.getsignal(signum) if original is None else original)
        if callable(handler) and handler is not _relay:
            _call(handler, signum, frame)


def _enter() -> None:
    global _depth
    _depth += 1


def _leave() -> None:
    """End one level of deferral; at the outermost, hand the deferred signals over."""
    global _depth
    _depth -= 1
    if not _depth:
        _deliver()


class Relays:
    """The relays of one call: :meth:`install` at its start, :meth:`release` at its end (both
    repeatable), shared by nested calls; ``terminate`` also relays SIGTERM and SIGHUP at their
    default action as :class:`Terminated`. Holding is one set operation a signal cannot split."""

    def __init__(self, terminate: bool = False):
        self.terminate = terminate

    def install(self) -> "Relays":
        """Relay every Python signal handler; a handler raising meanwhile undoes it first."""
        if threading.current_thread() is not threading.main_thread() or self in _holders:
            return self
        try:
            first = not _holders
            _holders.add(self)
            if first:
                _pending.clear()
                _rescued.clear()
                if sys.unraisablehook is not _rescue:
                    _unraisable_hooks[:] = [sys.unraisablehook]
                    sys.unraisablehook = _rescue
                for signum in _raw.valid_signals():
                    try:
                        handler = _raw.getsignal(signum)
                    except (OSError, ValueError):
                        continue
                    if callable(handler) and handler is not _relay:
                        _originals[signum] = handler
                        _raw.signal(signum, _relay)
            for signum in TERMINATING if self.terminate else ():
                if _raw.getsignal(signum) == _raw.SIG_DFL:
                    _originals[signum] = _raw.SIG_DFL
                    _raw.signal(signum, _relay)
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        """Give the original handlers back once no call holds the relays (cut short, a second call
        finishes the job)."""
        if threading.current_thread() is not threading.main_thread():
            return
        _holders.discard(self)
        if not _holders:
            _put_back()


@contextlib.contextmanager
def relayed(terminate: bool = False) -> Iterator[None]:
    """``with relayed(terminate=True):`` the block runs relayed, SIGTERM and SIGHUP raising
    :class:`Terminated` (so cleanup runs) where they would end the process."""
    relays = Relays(terminate)
    try:
        relays.install()
        yield
    finally:
        relays.release()


class critical:
    """``with critical():`` defers signals to the end of the outermost block (relays installed)."""

    def __enter__(self) -> "critical":
        _enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        _leave()


class _Call:
    """One all-or-nothing call among the thread's open ones: the outermost keeps every undo and
    the deferral, a nested one where its own undos start (``mark``)."""

    def __init__(self) -> None:
        self.relays = Relays()
        self.root: Optional[_Call] = None
        self.mark = 0
        self.undos: List[Callable[[], Any]] = []
        self.deferring = False

    def begin(self) -> None:
        stack = _local.calls
        self.root = stack[0] if stack else self
        self.mark = len(self.root.undos)
        stack.append(self)
        self.relays.install()

    def commit(self) -> None:
        """The call returned: the outermost hands the deferred signals over; a nested one leaves."""
        if self.root is self:
            self.stop_deferring()
        _leave_stack(self)
        self.relays.release()

    def abort(self) -> None:
        """The call raised: undo its writes, newest first, and leave; idempotent."""
        try:
            root = self.root
            if root is not None:
                undos = root.undos[self.mark:]
                try:
                    if undos:
                        with critical():
                            for undo in reversed(undos):
                                undo()
                finally:
                    del root.undos[self.mark:]
                    _leave_stack(self)
                if root is self or not root.undos:
                    root.stop_deferring()
        finally:
            self.relays.release()

    def stop_deferring(self) -> None:
        if self.deferring:
            self.deferring = False
            _leave()


class _Local(threading.local):
    def __init__(self) -> None:
        self.calls: List[_Call] = []


_local = _Local()


def _leave_stack(call: _Call) -> None:
    stack = _local.calls
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] is call:
            del stack[index:]
            return


def all_or_nothing(fn: F) -> F:
    """Decorate a function that changes a model: if it raises, whatever and wherever (a signal's
    handler too), every :func:`write` made inside it is undone before the exception leaves."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        this = _Call()
        try:
            this.begin()
            value = fn(*args, **kwargs)
            this.commit()
            return value  # inside the ``try``: an exception on this line still undoes
        except BaseException:
            this.abort()
            raise

    return cast(F, call)


def write(change: Callable[[], Any], undo: Callable[[], Any]) -> None:
    """Make ``change()`` now, undone by ``undo()`` if the outermost all-or-nothing call raises;
    signals wait from here to that call's end. ``undo`` must work after a partial ``change``."""
    stack = _local.calls
    if not stack:
        raise RuntimeError("signals.write() outside an all-or-nothing call: decorate the function "
                           "that changes the model with @all_or_nothing")
    root = stack[0]
    if not root.deferring and threading.current_thread() is threading.main_thread():
        _enter()
        root.deferring = True
    root.undos.append(undo)
    change()
