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

Installing the relays undoes itself if a handler raises half-way; a release that a handler cut
short is finished by the next call to it, which every caller's ``except`` makes. Callers install
inside the ``try`` whose ``except`` releases: a signal handled between the two would otherwise
leave the relays in place. Neither is a critical section, and a critical section is entered
only while the relays are installed (or on the way out of a call that is already raising,
where it would take a second signal): a handler that is not relayed could raise between
``critical.__enter__`` counting the section and returning, or on entering ``__exit__``, and the
count would never come down.

The last write of a call (:func:`write_last`) is one section; the signals deferred meanwhile
are handed to their handlers when it ends, while the relays are still installed and the write
can still be undone; the relays are released after it. Whatever is raised before
:func:`write_last` returns undoes the write. On CPython 3.11 a signal is handled only on
entering a function, on a loop's back-edge and after a call to C, so callers that end with
``return write_last(...)`` (and their callers, each ``return``-ing the call) run nothing after
it where a signal could be handled. Python 3.9 checks at nearly every bytecode, also between a
function's last call and its return and while a returning frame's objects are freed; the
PyTorch entry points put the model back if anything is raised before they return
(:func:`precise_bn.api.recalibrate_module`), which leaves the last few bytecodes of the entry point
and the freeing of its pass: a signal handled there raises with the new statistics in place
(``benchmarks/INTERRUPTS.md`` measures how often); Python code cannot close that window.

A handler can also run while a finaliser does (``__del__``, a weakref callback such as a
``WeakKeyDictionary``'s), where Python prints what it raises ("Exception ignored") and goes on:
the interrupt would be lost. While the relays are installed, what a handler called by them
raises and a finaliser swallows is kept instead, and raised at the call's next checkpoint
(:func:`checkpoint`: every batch of a PyTorch pass, and the end of every critical section).

Signal handlers only ever run in the main thread; called from another thread, nothing here
changes any handler and sections need no protection.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, TypeVar

try:
    # The C module behind ``signal``: the same calls without converting every number to an
    # enum, which over every signal an install looks at costs more than the rest of it.
    import _signal as _raw
except ImportError:  # another Python implementation
    _raw = signal

T = TypeVar("T")

_originals: Dict[int, Callable[..., Any]] = {}
_pending: List[Tuple[int, Any]] = []
_holders: Set["Relays"] = set()
_depth = 0
_raised: List[BaseException] = []  # what the last handler called from here raised
_rescued: List[BaseException] = []  # of those, what a finaliser swallowed
_unraisable_hooks: List[Callable[[Any], Any]] = []  # the hook ours replaced


def in_critical_section() -> bool:
    """True while the main thread is inside :func:`critical` (signals are then deferred)."""
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
    _call(original, signum, frame)


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
        handler = _originals.get(signum) or _raw.getsignal(signum)
        if callable(handler) and handler is not _relay:
            _call(handler, signum, frame)


class Relays:
    """The relays of one call: :meth:`install` at its start (inside the ``try`` that releases),
    :meth:`release` at its end; both may be called again. Nested calls share the relays of the
    outermost.

    A call holds the relays while it is in ``_holders``: adding and discarding is one
    operation each, which a signal cannot split.
    """

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


class critical:
    """``with critical():`` defers signals for the block and hands them to their handlers when
    the outermost block ends; a handler that raises then raises there. Entered only while the
    call's relays are installed (see the module docstring)."""

    def __enter__(self) -> "critical":
        global _depth
        _depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        global _depth
        _depth -= 1
        if not _depth:
            _deliver()


def write_last(write: Callable[[], Any], undo: Callable[[], Any], relays: Optional[Relays] = None,
               value: T = None) -> T:
    """Make ``write()`` a call's last change, never left behind by a call that raises.

    ``write`` runs in one critical section; the signals deferred meanwhile then go to their
    handlers, and the call's ``relays`` are released (None: relays are installed here, for the
    write alone). If anything is raised before this function returns (a handler, or a signal
    handled at CPython's next check once the original handlers are back), ``undo()`` runs
    before the exception leaves. A handler that does not raise leaves the write in place.
    Returns ``value``: callers end with ``return write_last(...)``, so that none of their code
    runs after the write.
    """
    if relays is None:
        relays = Relays()
    try:
        relays.install()  # does nothing when the call installed them
        with critical():
            write()
        relays.release()
        return value
    except BaseException:
        try:
            with critical():
                undo()
        finally:
            relays.release()
        raise
