"""One BN call's float64 mean and biased variance, measured from its input in one read.

A call's input ``x`` (channels on dim 1, any layout) is measured around a per-channel shift ``c``
near its mean: ``y = x - c`` in float64, ``mean = c + sum(y) / n``, ``var = (sum(y^2) -
sum(y)^2 / n) / n``. Nothing cancels while ``c`` is within a few stds of the mean; on the CPU a
call whose shift was further is measured again around its own mean, so the result is exact
whatever the shift (docs/numerics.md derives the bound). The sums run as one fused loop compiled
by ``torch.compile`` (C++ on the CPU, Triton on a GPU), made in a background thread once a
process has enough to measure (:data:`COMPILE_AFTER`); until then, and wherever no compiler
works, eager float64 operators give the same numbers within float64 rounding, slower.
``PRECISE_BN_COMPILE`` = ``auto`` (default), ``always`` or ``never`` chooses.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import types
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from .errors import ConfigError

logger = logging.getLogger("precise_bn")

#: Elements a process measures with eager operators before the compiled loop is made.
COMPILE_AFTER = 1 << 27
#: Float64 values an eager chunk forms at a time: on the CPU few enough to be summed while still
#: in cache, on a GPU enough to keep it busy.
CHUNK = {"cpu": 1 << 15, "other": 1 << 24}

Key = Tuple[str, torch.dtype, torch.dtype, str, bool]
Sums = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def _clean(shift: torch.Tensor) -> torch.Tensor:
    # A shift that overflowed (a float32 mean of huge values) still measures, around 0.
    return torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift)).double()


def _finish(c: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(2, C)`` float64 mean and variance from the shifted sums, and whether some channel's
    shift was more than a std from its mean (0-dim bool)."""
    d = s1 / n
    var = (s2 - s1 * d).clamp(min=0) / n
    return torch.stack([c + d, var]), (d * d > var).any()


def _channels_first(x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` viewed ``(N, C, L)``, contiguous."""
    c = _clean(shift)
    y = x.double() - c.view(1, -1, 1)
    return _finish(c, y.sum((0, 2)), (y * y).sum((0, 2)), x.shape[0] * x.shape[2])


def _channels_last(x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` viewed ``(A, B, C)``, contiguous: summed over ``B`` first, a few rows that stay
    in cache for every channel, then over ``A``."""
    c = _clean(shift)
    y = x.double() - c
    return _finish(c, y.sum(1).sum(0), (y * y).sum(1).sum(0), x.shape[0] * x.shape[1])


FORMS: Dict[str, Sums] = {"channels_first": _channels_first, "channels_last": _channels_last}


def view_for_sums(x: torch.Tensor) -> Tuple[str, torch.Tensor]:
    """The form and 3-D view the sums read ``x`` through (a copy only for other layouts)."""
    if x.dim() == 2:
        return "channels_last", x.contiguous().unsqueeze(0)
    if x.is_contiguous():
        return "channels_first", x.view(x.shape[0], x.shape[1], -1)
    last = x.movedim(1, -1)
    if last.is_contiguous():
        return "channels_last", last.view(-1, last.shape[-2], last.shape[-1])
    return "channels_first", x.contiguous().view(x.shape[0], x.shape[1], -1)


class _Scratch(threading.local):
    """One float64 buffer per thread and device, reused: a fresh large CPU allocation costs a
    page fault per 4 KiB every time."""

    def __init__(self) -> None:
        self.buffers: Dict[torch.device, torch.Tensor] = {}


_SCRATCH = _Scratch()


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    flat = _SCRATCH.buffers.get(device)
    if flat is None or flat.numel() < numel:
        flat = _SCRATCH.buffers[device] = torch.empty(numel, dtype=torch.float64, device=device)
    return flat


def _eager(form: str, x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same sums as :data:`FORMS`, with eager operators over chunks of rows."""
    c = _clean(shift)
    if form == "channels_first":
        rows, dims, centre = x, (0, 2), c.view(1, -1, 1)
    else:
        rows, dims, centre = x.reshape(-1, x.shape[-1]), (0,), c
    per_row = max(1, rows[:1].numel())
    step = max(1, CHUNK["cpu" if x.device.type == "cpu" else "other"] // per_row)
    buffer = _scratch(min(rows.shape[0], step) * per_row, x.device)
    s1 = torch.zeros_like(c)
    s2 = torch.zeros_like(c)
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        y = torch.sub(part, centre, out=buffer[: part.numel()].view(part.shape))
        s1.add_(y.sum(dims))
        s2.add_(torch.linalg.vector_norm(y, dim=dims).square_())
    return _finish(c, s1, s2, x.numel() // max(c.numel(), 1))


def measure(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``(2, C)`` float64 mean and biased variance of each channel of ``x`` (dim 1), measured
    around ``shift`` (one value per channel, any float dtype). ``x`` must hold elements."""
    form, view = view_for_sums(x)
    stats, far = KERNELS.sums(form, view, shift)
    if far.device.type == "cpu" and bool(far):
        stats, _ = KERNELS.sums(form, view, stats[0])
    return stats


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device: what it says is the CUDA flag
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _copy_of(fn: Callable[..., object], tag: str) -> Callable[..., object]:
    """``fn`` with a code object of its own: torch.compile keeps its compiled variants on the
    code object, so each variant compiled here never shares a cache another thread is using."""
    code = fn.__code__.replace(co_name="{}_{}".format(fn.__name__, tag))
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _policy() -> str:
    value = os.environ.get("PRECISE_BN_COMPILE", "auto").strip().lower()
    if value not in ("auto", "always", "never"):
        raise ConfigError("PRECISE_BN_COMPILE must be auto, always or never, got {!r}".format(value))
    return value


class _State:
    """The calling thread's state that compiled code depends on (grad mode, autocast, threads,
    ...): recorded where a form is first seen, reproduced in the compiling thread, and checked
    before each call, so that compiled code only ever runs in the state it was made for."""

    def __init__(self, device: torch.device):
        self.guard = torch._C._dynamo.guards.GlobalStateGuard()
        self.grad = torch.is_grad_enabled()
        self.autocast = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                         for kind in {"cpu", device.type}}

    def matches(self) -> bool:
        return not torch._C._is_torch_function_mode_enabled() and self.guard.check()

    def entered(self, stack: "contextlib.ExitStack") -> bool:
        """Enter the recorded state on this thread; whether it now matches."""
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for kind, (enabled, dtype) in self.autocast.items():
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        return self.matches()


class Kernels:
    """The process's compiled sums, one per (form, input dtype, shift dtype, device type),
    compiled in one background thread; :meth:`sums` uses them once ready, eager operators before.

    The thread starts once the process has measured :data:`COMPILE_AFTER` elements eagerly (or
    :meth:`expect` says a pass will), or at once with ``PRECISE_BN_COMPILE=always``. Compiled
    code is called through dynamo's run-only mode: it never compiles on the caller's thread."""

    def __init__(self) -> None:
        self.ready: Dict[Key, Tuple[Sums, _State]] = {}
        self.eager_elements = 0
        self._seen: Dict[Key, Tuple[torch.device, Optional[_State]]] = {}
        self._asked: Set[Key] = set()
        self._queue: "queue.Queue[Key]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.failures: List[str] = []
        self._on = False
        self._closing = False

    def sums(self, form: str, x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (form, x.dtype, shift.dtype, x.device.type, _autocast_on(x.device.type))
        entry = self.ready.get(key)
        if entry is not None and entry[1].matches():
            return entry[0](x, shift)
        if key not in self._seen:
            self._note(key, x.device)
        self.eager_elements += x.numel()
        if not self._on and self.eager_elements >= COMPILE_AFTER:
            self.start()
        return _eager(form, x, shift)

    def _note(self, key: Key, device: torch.device) -> None:
        try:
            state: Optional[_State] = _State(device)
        except (AttributeError, TypeError, RuntimeError):  # a torch without what compiling needs
            state = None
        with self._lock:
            self._seen[key] = (device, state)
        if self._on:
            self._ask(key)
        elif _policy() == "always":
            self.start()

    def expect(self, elements: int) -> None:
        """A pass is about to measure about ``elements`` more elements: compile now if that
        takes the process past :data:`COMPILE_AFTER`."""
        if not self._on and self.eager_elements + elements >= COMPILE_AFTER:
            self.start()

    def start(self) -> None:
        """Compile every form seen so far, and each new one as it is seen, in the background."""
        policy = _policy()
        if self._on or policy == "never":
            return
        self._on = True
        if not hasattr(torch, "compile"):
            self._fail("this torch ({}) has no torch.compile".format(torch.__version__))
            return
        with self._lock:
            seen = list(self._seen)
        for key in seen:
            self._ask(key)
        if seen and all(self._seen[key][1] is None for key in seen):
            self._fail("this torch ({}) lacks what compiling needs".format(torch.__version__))

    def _ask(self, key: Key) -> None:
        with self._lock:
            if key in self._asked or self._seen[key][1] is None:
                return
            self._asked.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="precise-bn compile", daemon=True)
                self._thread.start()
                atexit.register(self._close)
        self._queue.put(key)

    def _close(self) -> None:
        """At exit: wait for the compile under way and drop the others. A compile left running
        while the interpreter and torch shut down crashes the process."""
        self._closing = True
        self.wait()

    def _work(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if not self._closing:
                    self._compile(key)
            except Exception as exc:  # any failure leaves the eager path, which is always right
                self._fail("{}: {}".format(type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""))
            finally:
                self._queue.task_done()

    def _compile(self, key: Key) -> None:
        import torch._dynamo

        form, dtype, shift_dtype = key[:3]
        device, state = self._seen[key]
        assert state is not None
        options: Dict[str, object] = {"compile_threads": 1}
        if device.type == "cpu":
            # Inductor's 512-bit float64 reductions run slower than its 256-bit ones.
            options["cpp.simdlen"] = 256
        fn = _copy_of(FORMS[form], "_".join(map(str, key)))
        compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=options)
        gen = torch.Generator().manual_seed(0)
        example = (torch.randn(3, 5, 7, generator=gen) * 4 + 100).to(device=device, dtype=dtype)
        shift = example.double().mean((0, 1) if form == "channels_last" else (0, 2)).to(shift_dtype)
        for dim in range(3):
            torch._dynamo.decorators.mark_unbacked(example, dim)  # any size, 1 included: one compile
        torch._dynamo.decorators.mark_unbacked(shift, 0)
        with contextlib.ExitStack() as stack:
            if not state.entered(stack):
                logger.debug("precise-bn: not compiling %s: the calling thread's state cannot be reproduced", key)
                return
            got, _ = compiled(example, shift)
            want, _ = _eager(form, example, shift)
        if not torch.allclose(got, want, rtol=1e-12, atol=0):
            raise RuntimeError("the compiled sums disagree with the eager ones: {} vs {}".format(got, want))
        self.ready[key] = (torch._dynamo.run(fn), state)
        logger.debug("precise-bn: compiled the float64 sums for %s", key)

    def _fail(self, why: str) -> None:
        if not self.failures:
            logger.warning("precise-bn: float64 sums run as eager operators (the same numbers, slower): "
                           "compiling them failed: %s", why)
        self.failures.append(why)

    def wait(self) -> None:
        """Block until every compile asked for so far is done (tests and benchmarks)."""
        if self._thread is not None:
            self._queue.join()


KERNELS = Kernels()
