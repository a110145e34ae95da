"""Changes no signal can split or leave half-made: an interrupt never leaves a model half-changed.

Why this is needed: a signal with a Python handler (Ctrl-C's ``KeyboardInterrupt``, or any
handler that raises) runs in the main thread at whatever bytecode is executing when it arrives.
While precise-bn changes a model (swapping layer classes in, restoring buffers, writing the new
statistics) an exception at the wrong bytecode would leave some layers changed and others not.

How, in three parts:

* **Relays.** For the length of a call, a :class:`Relays` object replaces every Python signal
  handler by a relay (and, where the caller asks, SIGTERM and SIGHUP left at their default
  action, which would end the process on the spot, by one that raises :class:`Terminated`, so
  that cleanup runs: one mechanism for every signal). Outside critical sections the relay hands
  the signal straight to its handler. Inside one it only records the signal; when the outermost
  section ends the recorded signals go to their handlers in order, so whatever they raise is
  raised at a point where the model is whole. Entering and leaving a section is one integer
  store, which a signal cannot split. Blocking signals at the OS level (``pthread_sigmask``)
  would not do: the kernel then hands a process signal to another thread, and CPython still
  runs the handler in the main thread at once.
* **Critical sections** (:class:`critical`): a change made whole or not at all, such as
  attaching the captures or putting the model back.
* **All-or-nothing calls** (:func:`all_or_nothing`, a decorator on every function that changes
  a model for its caller). Inside one, :func:`write` makes a change that must not outlive a call
  that raises: it registers the change's undo, and signals stay deferred from the write until
  the *outermost* all-or-nothing call returns. Whatever that call raises meanwhile (the code
  after the write, a caller's, a deferred signal's handler, a signal handled once the original
  handlers are back) undoes every write before the exception leaves. So code placed after a
  write, at any depth, cannot reopen a window: nothing has to be a call's last statement. A
  nested all-or-nothing call that returns hands its writes to the outermost; one that raises
  undoes its own. The deferral ends where the outermost call returns, so a write is followed
  only by the few statements that finish the call, never by a long operation.

What is left, and why: the last bytecodes of the outermost call. CPython 3.11 and later handle a
signal only on entering a function, on a loop's back-edge and after a call to C, and none of
those come after the decorator's final bookkeeping returns. Python 3.9 checks at nearly every
bytecode, also at the decorator's ``return`` and while its frame's objects are freed: a signal
handled there raises with the new statistics in place. Python code cannot close that window;
``benchmarks/INTERRUPTS.md`` measures how rarely it is hit (none of 3,500 random-timed trials).

The decorator is a ``try``/``except`` around the call, not a ``with`` block, on purpose: a
signal handled on entering a context manager's ``__exit__`` skips it, while an ``except``
clause is entered without a check. For the same reason the relays are installed inside that
``try``, and installing undoes itself if a handler raises half-way; a release that a handler cut
short is finished by the next call to it, which the ``except`` makes. A critical section is
entered only while the relays are installed (or on the way out of a call that is already
raising, where it would take a second signal): a handler that is not relayed could raise between
``critical.__enter__`` counting the section and returning, and the count would never come down.

A handler can also run while a finaliser does (``__del__``, a weakref callback such as a
``WeakKeyDictionary``'s), where Python prints what it raises ("Exception ignored") and goes on:
the interrupt would be lost. While the relays are installed, what a handler called by them
raises and a finaliser swallows is kept instead, and raised at the call's next checkpoint
(:func:`checkpoint`: every batch of a PyTorch pass, and the end of every critical section).

Signal handlers only ever run in the main thread; called from another thread, nothing here
changes any handler or defers anything, and a raising call still undoes its writes.
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
        exception leaves. Not a critical section (see the module docstring)."""
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

        Not a critical section (see the module docstring): a handler that raises half-way
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
    call's relays are installed (see the module docstring)."""

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
    wherever (a signal's handler included, up to its last bytecodes: see the module docstring),
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
