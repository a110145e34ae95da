"""Changes no signal can split or leave half-made: an interrupt never leaves a model half-changed.

A signal's Python handler (Ctrl-C's ``KeyboardInterrupt``) runs at whatever bytecode the main
thread is at. For the length of a call, :class:`Relays` replace every handler by a relay that
only records a signal inside a :class:`critical` section and hands it over when the section
ends. :func:`all_or_nothing` decorates each entry point that changes a model for its caller;
inside it, :func:`write` makes a change whose undo runs if the outermost such call raises,
whatever and wherever (signals stay deferred from the write until that call returns), so no
statement has to be a call's last. :func:`checkpoint` raises what a handler raised inside a
finaliser, which Python would have swallowed. Why each piece is built as it is, and the window
left on Python 3.9: docs/interrupts.md ("How it works").
"""
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

#: Signals whose default action ends the process, turned into :class:`Terminated` where a
#: caller asks (``Relays(terminate=True)``).
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

_originals: Dict[int, Any] = {}  # what each relayed signal had: a handler, or SIG_DFL
_pending: List[Tuple[int, Any]] = []
_holders: Set["Relays"] = set()
_depth = 0
_raised: List[BaseException] = []  # what the last handler called from here raised
_rescued: List[BaseException] = []  # of those, what a finaliser swallowed
_unraisable_hooks: List[Callable[[Any], Any]] = []  # the hook ours replaced


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived while relayed with ``terminate=True``; the exit code is 128 +
    the signal number, as a shell reports a process the signal ended."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def _handler(signum: int, original: Any) -> Any:
    """The handler a relayed signal goes to: its own, or :func:`_terminate` for one of
    :data:`TERMINATING` at its default action."""
    return _terminate if signum in TERMINATING and original == _raw.SIG_DFL else original


def in_critical_section() -> bool:
    """True while the main thread defers signals: inside :class:`critical`, or between a
    :func:`write` and the end of its outermost all-or-nothing call."""
    return _depth > 0


def _relay(signum: int, frame: Any) -> None:
    """Defer the signal inside a critical section, else pass it on; a relay that no call holds
    any more (a release was cut short) first puts its original back."""
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
    """``sys.unraisablehook`` while relays are installed: keeps what a relayed handler raised
    inside a finaliser for :func:`checkpoint`; anything else goes to the hook it replaced."""
    if _holders and _raised and unraisable.exc_value is _raised[0]:
        _rescued.append(_raised.pop())
    elif _unraisable_hooks:
        _unraisable_hooks[0](unraisable)


def checkpoint() -> None:
    """Raise what a relayed handler raised inside a finaliser since the last checkpoint (the
    first, if several were), instead of losing it."""
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
    """The relays of one call: :meth:`install` at its start (inside the ``try`` that releases),
    :meth:`release` at its end; both may be called again. Nested calls share the relays of the
    outermost; ``terminate``: also relay SIGTERM and SIGHUP left at their default action, as
    :class:`Terminated` (for a call that must clean up, such as a file write).

    A call holds the relays while it is in ``_holders``: adding and discarding is one
    operation each, which a signal cannot split.
    """

    def __init__(self, terminate: bool = False):
        self.terminate = terminate

    def install(self) -> "Relays":
        """Relay every Python signal handler. If a handler raises meanwhile (an original not
        relayed yet, or a relay passing a signal on), what was done is undone before the
        exception leaves. Not a critical section (docs/interrupts.md)."""
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
        """Give the original handlers back once no call holds the relays.

        Not a critical section (docs/interrupts.md): a handler that raises half-way
        leaves some relays in place, and the caller's ``except``, calling this again,
        finishes the job.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        _holders.discard(self)
        if not _holders:
            _put_back()


@contextlib.contextmanager
def relayed(terminate: bool = False) -> Iterator[None]:
    """``with relayed(terminate=True):`` the block runs with the relays installed: SIGTERM and
    SIGHUP at their default action raise :class:`Terminated` (so ``finally`` blocks and cleanup
    run) where they would end the process at once; other handlers behave as before."""
    relays = Relays(terminate)
    try:
        relays.install()
        yield
    finally:
        relays.release()


class critical:
    """``with critical():`` defers signals for the block and hands them to their handlers when
    the outermost block ends; a handler that raises then raises there. Entered only while the
    call's relays are installed (docs/interrupts.md)."""

    def __enter__(self) -> "critical":
        _enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        _leave()


class _Call:
    """One all-or-nothing call's place among the thread's open ones. The outermost (``root``)
    keeps every write's undo and the deferral that started with the first write; a nested call
    remembers where its own undos start (``mark``)."""

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
        """The call returned: the outermost hands the deferred signals over (a handler that
        raises lands in the caller's ``except``, which undoes); a nested one only leaves."""
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
    """Decorate a function that changes a model for its caller: if it raises, whatever and
    wherever (a signal's handler included, up to its last bytecodes: docs/interrupts.md),
    every :func:`write` made inside it is undone before the exception leaves."""

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
    """Make ``change()`` now, undone by ``undo()`` if the outermost all-or-nothing call around
    it raises. Signals are deferred from here to that call's end, so ``change`` is never split
    and nothing after it can leave it half-made or outliving a failed call. ``undo`` must put
    back what ``change`` may have changed, whether it ran whole, in part, or not at all."""
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
