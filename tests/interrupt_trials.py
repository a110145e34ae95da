"""The trials that attack a call with interrupts, shared by ``tests/test_interrupts.py`` and
``benchmarks/interrupts.py``.

Every trial runs one call (``recompute``, ``update_bn_stats``, a hook's recomputation, a hook's
re-apply of cached stats) with a signal or an exception placed somewhere inside it, and checks:
if the call raised, the model is bit-identical to before (every buffer and parameter, by value
and by tensor object; every module's class, train flag, momentum, hook dicts and instance
attribute names; the hook's cache) and a plain forward works; if it returned, the model holds
exactly what an undisturbed call writes. After every trial the signal handlers are the test's
own again (no relay is left behind), no critical section is open and autograd is on.

Three ways to place the interrupt:

* random-timed signals (:func:`timed_trials`): ``SIGALRM`` from ``setitimer`` at a random
  instant spread over the whole call (its duration measured first), with a handler that raises
  ``KeyboardInterrupt`` whenever a frame of the package is on the stack (a signal handled after
  the call returned is only recorded);
* an exception at every line (:func:`line_trials`): ``sys.settrace`` raises
  ``KeyboardInterrupt`` at the N-th line event of the package's code, for every N up to the
  number a whole call runs. Lines run while :func:`precise_bn.signals.in_critical_section` is
  True are skipped: a real signal is only recorded there, and handed to its handler where the
  section ends, a point that is tried on its own (the line after the ``with`` block, or a raise
  from ``__exit__``). A trace function that raises stands for "a signal handler raised here":
  CPython runs handlers only between bytecodes, and a line boundary is one such place;
* a real signal at every line (``line_trials(send=True)``): the trace function sends
  ``SIGALRM`` to the process at the N-th line event, critical sections included, so the relays'
  deferral is what is tested; with a handler that raises, and with one that only counts (the
  call must then return with its stats, and the handler must have run exactly once).
"""
from __future__ import annotations

import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import precise_bn
from interrupt_cases import Case, all_handlers, first_difference, make_batches
from precise_bn.signals import in_critical_section

PACKAGE_DIR = os.path.dirname(os.path.abspath(precise_bn.__file__)) + os.sep


def in_package(frame: Any) -> bool:
    return frame.f_code.co_filename.startswith(PACKAGE_DIR)


def frame_name(frame: Any) -> str:
    code = frame.f_code
    return "{}:{}".format(os.path.basename(code.co_filename), getattr(code, "co_qualname", code.co_name))


# --------------------------------------------------------------------------------------------
# Trials


@dataclass
class Trial:
    """One trial: ``where`` the interrupt was raised, or the signal handled; ``arrived``: the
    package functions on the stack, innermost first, when the signal was first handled (a
    deferred signal is handed to its handler later, elsewhere); ``failure``: what went wrong,
    or ""."""

    case: str
    raised: bool
    landed: bool
    where: str = ""
    arrived: str = ""
    deferred: bool = False
    failure: str = ""


#: What a driver of trials does when one fails: nothing (None: the test fails at once), or
#: repair and return the case to go on with (the benchmark counts failures).
OnFailure = Optional[Callable[[Case, Dict[int, Any]], Case]]


def trial_failure(case: Case, before: Any, raised: bool, handlers: Dict[int, Any], where: str) -> str:
    """What is wrong after a trial (``where``: its interrupt, for the message), or ""."""
    after = case.state()
    if raised and after != before:
        return "{}, interrupted at {}: the call raised and changed the model: {}".format(
            case.name, where, first_difference(before[0], after[0]) or "the hook's cache changed")
    if not raised and after != case.expected:
        return "{}, interrupted at {}: the call returned without its stats: {}".format(
            case.name, where, first_difference(case.expected[0], after[0]) or "the hook's cache differs")
    if all_handlers() != handlers:
        return "{}, interrupted at {}: signal handlers left changed".format(case.name, where)
    if not torch.is_grad_enabled():
        return "{}, interrupted at {}: autograd left switched off".format(case.name, where)
    if in_critical_section():
        return "{}, interrupted at {}: left inside a critical section".format(case.name, where)
    if raised:
        try:
            with torch.no_grad():
                case.model(make_batches(1, seed=9)[0])
        except Exception as exc:  # noqa: BLE001 - any error is the finding
            return "{}, interrupted at {}: a plain forward fails: {!r}".format(case.name, where, exc)
    return ""


def _settle(trial: Trial, case: Case, handlers: Dict[int, Any], on_failure: OnFailure) -> Case:
    if trial.failure:
        if on_failure is None:
            raise AssertionError(trial.failure)
        return on_failure(case, handlers)
    return case


def _arrival(frame: Any, depth: int = 6) -> str:
    """The package functions on the stack at ``frame``, innermost first (``a < b``), up to
    ``depth`` of them, comprehensions and lambdas left out; "" when outside the package."""
    names: List[str] = []
    while frame is not None and len(names) < depth:
        if in_package(frame) and not frame.f_code.co_name.startswith("<"):
            names.append(frame_name(frame))
        frame = frame.f_back
    return " < ".join(names)


def handed_over_late(frame: Any) -> bool:
    """True when the relays recorded the signal and handed it to its handler later (the
    innermost package frames are the relay module's, ``_deliver`` among them), False when a
    relay passed it straight on or no relay was involved."""
    while frame is not None and frame.f_code.co_filename.endswith("signals.py"):
        if frame.f_code.co_name == "_deliver":
            return True
        frame = frame.f_back
    return False


class Alarm:
    """The test's ``SIGALRM`` handler: with ``raising``, raises ``KeyboardInterrupt`` while the
    package is on the stack; else only counts. Remembers where the last signal was handled."""

    def __init__(self, raising: bool = True):
        self.raising = raising
        self.previous: Any = None
        self.count = 0
        self.landed: Optional[Tuple[str, str, bool]] = None

    def __enter__(self) -> "Alarm":
        self.previous = signal.signal(signal.SIGALRM, self.handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)

    def handler(self, signum: int, frame: Any) -> None:
        here = sys._getframe(1)
        deferred = handed_over_late(here)
        self.count += 1
        self.landed = (_arrival(frame), _arrival(here) or frame_name(here), deferred)
        if self.raising and _arrival(here):
            raise KeyboardInterrupt("alarm")


def call_duration(case: Case, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        case.reset()
        start = time.perf_counter()
        case.call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_trials(case: Case, count: int, seed: int, raising: bool = True, spread: float = 1.15,
                 on_failure: OnFailure = None) -> List[Trial]:
    """``count`` trials of ``case``, each with SIGALRM at a uniform random time in
    ``[0, spread * T]``, T the call's median duration."""
    duration = call_duration(case)
    rng = random.Random(seed)
    trials = []
    with Alarm(raising) as alarm:
        handlers = all_handlers()
        for _ in range(count):
            case.reset()
            before = case.state()
            delay = rng.uniform(0, spread * duration)
            alarm.landed = None
            raised = False
            try:
                signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
                case.call()
            except KeyboardInterrupt:
                raised = True
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            arrived, where, deferred = alarm.landed or ("", "", False)
            trial = Trial(case.name, raised, alarm.landed is not None, where, arrived, deferred)
            trial.failure = trial_failure(case, before, raised, handlers, "{} (arrived in {})".format(where, arrived))
            trials.append(trial)
            case = _settle(trial, case, handlers, on_failure)
    return trials


class LineInjector:
    """A trace function acting at the ``at``-th counted line event of the package: it raises
    ``KeyboardInterrupt`` (lines in critical sections not counted: see the module docstring),
    or with ``send`` sends SIGALRM to the process (every line counted)."""

    def __init__(self, at: Optional[int] = None, send: bool = False):
        self.at = at
        self.send = send
        self.seen = 0
        self.where = ""

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self.local if in_package(frame) else None

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and (self.send or not in_critical_section()):
            self.seen += 1
            if self.seen == self.at:
                self.where = "{}:{}".format(frame_name(frame), frame.f_lineno)
                if self.send:
                    signal.raise_signal(signal.SIGALRM)
                else:
                    raise KeyboardInterrupt("injected at line event {}".format(self.at))
        return self.local


def traced(case: Case, injector: LineInjector) -> bool:
    """Run the call under ``injector``; True when it raised."""
    previous = sys.gettrace()
    sys.settrace(injector)
    try:
        case.call()
        return False
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(previous)


def line_trials(case: Case, send: bool = False, raising: bool = True, stride: int = 1,
                on_failure: OnFailure = None) -> List[Trial]:
    """Act at every ``stride``-th counted line event of a whole call of ``case``; with ``send``,
    through a SIGALRM handler that raises or not (``raising``)."""
    with Alarm(raising) as alarm:
        handlers = all_handlers()
        # Once untraced-for-counting first: what the package does once per process (a layer
        # class made, a form of the float64 sums noted) must not shift the lines counted below.
        case.reset()
        traced(case, LineInjector(send=send))
        case.reset()
        counter = LineInjector(send=send)
        assert not traced(case, counter), "{}: the call raised with nothing injected".format(case.name)
        trials = []
        for at in range(1, counter.seen + 1, stride):
            case.reset()
            before = case.state()
            injector = LineInjector(at, send)
            alarm.count, alarm.landed = 0, None
            raised = traced(case, injector)
            arrived, _, deferred = alarm.landed or ("", "", False)
            trial = Trial(case.name, raised, bool(injector.where), injector.where, arrived, deferred)
            trial.failure = trial_failure(case, before, raised, handlers, injector.where)
            if send and alarm.count != 1 and not trial.failure:
                trial.failure = "{}, signal sent at {}: the handler ran {} times".format(
                    case.name, injector.where, alarm.count)
            trials.append(trial)
            case = _settle(trial, case, handlers, on_failure)
    return trials
