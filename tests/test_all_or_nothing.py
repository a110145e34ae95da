"""The interrupt mechanism on its own (``precise_bn.signals``): a write made inside an
all-or-nothing call is undone by anything that call raises, wherever it is raised, also by code
placed after the write, in the same function or in a caller, and by a signal sent at any line;
SIGTERM goes through the same relays. The trials of whole calls are ``tests/test_interrupts.py``.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List

import pytest

from interrupt_cases import all_handlers
from precise_bn.signals import Terminated, all_or_nothing, critical, in_critical_section, relayed, write

logger = logging.getLogger("precise_bn.test")


class Model:
    """Stands for a model: ``values`` is what a write changes."""

    def __init__(self) -> None:
        self.values = [0, 0, 0]

    def writer(self, index: int, value: int) -> Callable[[], None]:
        old = self.values[index]

        def change() -> None:
            self.values[index] = value

        def undo() -> None:
            self.values[index] = old

        return lambda: write(change, undo)


@pytest.fixture
def alarm() -> Iterator[List[str]]:
    """SIGALRM raises KeyboardInterrupt; the list records where its handler ran."""
    ran: List[str] = []

    def handler(signum: int, frame: Any) -> None:
        ran.append(frame.f_code.co_name if frame is not None else "")
        raise KeyboardInterrupt("alarm")

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        yield ran
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_code_after_a_write_that_raises_undoes_it():
    model = Model()

    @all_or_nothing
    def change() -> None:
        model.writer(0, 1)()
        logger.info("written")  # code after the write, as a maintainer might add
        raise ValueError("after the write")

    with pytest.raises(ValueError):
        change()
    assert model.values == [0, 0, 0] and not in_critical_section()


def test_a_caller_that_raises_after_a_nested_call_returned_undoes_its_writes():
    model = Model()

    @all_or_nothing
    def inner(index: int) -> str:
        model.writer(index, 7)()
        return "done"

    @all_or_nothing
    def outer() -> None:
        assert inner(0) == "done" and inner(1) == "done"
        assert model.values == [7, 7, 0]
        raise RuntimeError("the caller fails after both nested calls returned")

    with pytest.raises(RuntimeError):
        outer()
    assert model.values == [0, 0, 0] and not in_critical_section()


def test_a_nested_call_that_raises_undoes_only_its_own_writes():
    model = Model()

    @all_or_nothing
    def inner() -> None:
        model.writer(1, 5)()
        raise KeyError("inner")

    @all_or_nothing
    def outer() -> None:
        model.writer(0, 3)()
        with pytest.raises(KeyError):
            inner()
        assert model.values == [3, 0, 0]
        model.writer(2, 4)()

    outer()
    assert model.values == [3, 0, 4] and not in_critical_section()


def test_a_signal_after_the_write_is_deferred_to_the_end_of_the_outermost_call_then_undoes(alarm):
    model = Model()
    seen: List[bool] = []

    @all_or_nothing
    def inner() -> None:
        model.writer(0, 1)()
        os.kill(os.getpid(), signal.SIGALRM)
        for _ in range(100):  # loop back-edges: where every Python version checks for signals
            pass
        seen.append(in_critical_section())

    @all_or_nothing
    def outer() -> None:
        inner()
        model.writer(1, 2)()  # still running: the handler has not raised yet
        seen.append(True)

    with pytest.raises(KeyboardInterrupt):
        outer()
    assert seen == [True, True] and len(alarm) == 1
    assert model.values == [0, 0, 0] and not in_critical_section()


def test_a_handler_that_does_not_raise_leaves_the_writes():
    model = Model()
    ran: List[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: ran.append(signum))

    @all_or_nothing
    def change() -> int:
        model.writer(0, 1)()
        os.kill(os.getpid(), signal.SIGALRM)
        for _ in range(100):
            pass
        assert ran == []
        return 42

    try:
        assert change() == 42
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert ran == [signal.SIGALRM] and model.values == [1, 0, 0]


def _lines_after_the_write(model: Model) -> Callable[[], int]:
    """A decorated call with a good deal of code after its write: calls, a loop, logging,
    a helper of its own, an exception raised and caught."""

    def helper(values: List[int]) -> int:
        total = 0
        for value in values:
            total += value
        return total

    @all_or_nothing
    def change() -> int:
        model.writer(0, 9)()
        total = helper(model.values)
        logger.debug("total %d", total)
        try:
            {}["missing"]
        except KeyError:
            total += 1
        for index in range(3):
            total += index
        return total

    return change


class SignalAtLine:
    """A trace function sending SIGALRM at the ``at``-th line event of this file's code."""

    def __init__(self, at: int = 0):
        self.at, self.seen = at, 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self.local if frame.f_code.co_filename == __file__ else None

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.seen += 1
            if self.seen == self.at:
                signal.raise_signal(signal.SIGALRM)
        return self.local


def _traced(call: Callable[[], Any], tracer: Any) -> bool:
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        call()
        return False
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(previous)


def test_a_signal_at_every_line_of_code_after_a_write_undoes_it_or_the_call_completes(alarm):
    model = Model()
    call = _lines_after_the_write(model)
    counter = SignalAtLine()
    assert not _traced(call, counter)
    handlers = all_handlers()
    for at in range(1, counter.seen + 1):
        model.values = [0, 0, 0]
        alarm.clear()
        raised = _traced(call, SignalAtLine(at))
        assert len(alarm) == 1, at
        assert model.values == ([0, 0, 0] if raised else [9, 0, 0]), at
        assert not in_critical_section() and all_handlers() == handlers, at


def test_a_write_outside_an_all_or_nothing_call_is_refused():
    model = Model()
    with pytest.raises(RuntimeError, match="all_or_nothing"):
        model.writer(0, 1)()
    assert model.values == [0, 0, 0]


def test_in_another_thread_a_raising_call_undoes_and_no_handler_changes():
    model = Model()
    handlers = all_handlers()
    outcome: Dict[str, Any] = {}

    @all_or_nothing
    def change() -> None:
        model.writer(0, 1)()
        outcome["deferring"] = in_critical_section()
        raise ValueError("in a thread")

    def run() -> None:
        try:
            change()
        except ValueError as exc:
            outcome["raised"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert "raised" in outcome and outcome["deferring"] is False
    assert model.values == [0, 0, 0] and all_handlers() == handlers


def test_sigterm_at_its_default_action_raises_terminated_deferred_inside_a_critical_section():
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    order: List[str] = []
    with pytest.raises(Terminated) as stopped:
        with relayed(terminate=True):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # checked before sending
            with critical():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(100):
                    pass
                order.append("section finished")
    assert order == ["section finished"] and stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sigterm_after_a_write_undoes_it_when_terminate_is_relayed():
    model = Model()

    @all_or_nothing
    def change() -> None:
        model.writer(0, 1)()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            pass

    with pytest.raises(Terminated):
        with relayed(terminate=True):
            change()
    assert model.values == [0, 0, 0] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_without_terminate_sigterm_keeps_its_default_action_and_a_handler_of_its_own_stays():
    with relayed():
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ran: List[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ran.append(signum))
    try:
        with relayed(terminate=True):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                pass
        assert ran == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
