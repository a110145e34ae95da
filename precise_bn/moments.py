"""One BN call's float64 mean and biased variance, measured from its input in one read.

A call's input ``x`` (channels on dim 1, any layout) is measured around a per-channel shift ``c``
near its mean: ``y = x - c`` in float64, ``mean = c + sum(y) / n``, ``var = (sum(y^2) -
sum(y)^2 / n) / n``. Nothing cancels while ``c`` is within a few stds of the mean; on the CPU a
call whose shift was further is measured again around its own mean, so the result is exact
whatever the shift (docs/numerics.md derives the bound). The sums run as one fused loop that
AOTInductor compiles into a package on disk (C++ on the CPU, Triton on a GPU) and that is called
with no Python wrapper; until it exists, and wherever no compiler works, eager float64 operators
give the same numbers within float64 rounding, slower. Compiling happens on the caller's thread
when a pass is planned to be long enough for it to pay, and once per machine: the next process
loads the package in milliseconds. Nothing runs in the background and nothing waits at exit.
``PRECISE_BN_COMPILE`` = ``auto`` (default), ``always`` or ``never`` chooses;
``PRECISE_BN_CACHE`` says where the packages are kept. ``python -m precise_bn.moments`` compiles
them ahead of time (for a cluster image, or a CI cache).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import platform
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from .errors import ConfigError

logger = logging.getLogger("precise_bn")

#: Float64 values an eager chunk forms at a time: on the CPU few enough to be summed while still
#: in cache, on a GPU enough to keep it busy.
CHUNK = {"cpu": 1 << 15, "other": 1 << 24}
#: Seconds a compile is taken to cost (a cold compile of one form measured 14 to 24 s on two
#: cores): a pass compiles when its planned eager sums would take longer than that.
COMPILE_SECONDS = 30.0
#: Eager seconds per element assumed where they cannot be timed (a GPU runs asynchronously).
EAGER_SECONDS_PER_ELEMENT = 2e-10
#: Devices where reading the far-shift flag costs nothing: the host is the device.
HOST_DEVICES = ("cpu",)
FORM_NAMES = ("channels_first", "channels_last")

#: (form, input dtype, shift dtype, device type): one compiled package each.
Key = Tuple[str, torch.dtype, torch.dtype, str]
Run = Callable[[List[torch.Tensor]], List[torch.Tensor]]


def _finish(c: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(2, C)`` float64 mean and variance from the shifted sums, and whether some channel's
    shift was more than a std from its mean (0-dim bool)."""
    d = s1 / n
    var = (s2 - s1 * d).clamp(min=0) / n
    return torch.stack([c + d, var]), (d * d > var).any()


def _clean(shift: torch.Tensor) -> torch.Tensor:
    # A shift that overflowed (a float32 mean of huge values) still measures, around 0.
    return torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift)).double()


class _Sums(torch.nn.Module):
    """What is compiled, one form: ``x`` viewed ``(N, C, L)`` (channels first) or ``(A, B, C)``
    (channels last), contiguous, and its shift; returns :func:`_finish`'s pair."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        c = _clean(shift)
        if self.form == "channels_first":
            y = x.double() - c.view(1, -1, 1)
            return _finish(c, y.sum((0, 2)), (y * y).sum((0, 2)), x.shape[0] * x.shape[2])
        y = x.double() - c
        # Over B first, a few rows that stay in cache for every channel, then over A.
        return _finish(c, y.sum(1).sum(0), (y * y).sum(1).sum(0), x.shape[0] * x.shape[1])


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


def _eager(form: str, x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same sums as :class:`_Sums`, with eager operators over chunks of rows, in a scratch
    buffer allocated per call (a kept one would be shared by DataParallel's threads)."""
    c = _clean(shift)
    if form == "channels_first":
        rows, dims, centre = x, (0, 2), c.view(1, -1, 1)
    else:
        rows, dims, centre = x.reshape(-1, x.shape[-1]), (0,), c
    per_row = max(1, rows[:1].numel())
    step = max(1, CHUNK["cpu" if x.device.type == "cpu" else "other"] // per_row)
    buffer = torch.empty(min(rows.shape[0], step) * per_row, dtype=torch.float64, device=x.device)
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
    around ``shift`` (one value per channel, any float dtype). ``x`` must hold elements. On a
    GPU nothing here waits for the device."""
    form, view = view_for_sums(x)
    stats, far = KERNELS.sums(form, view, shift)
    if far.device.type in HOST_DEVICES and far.item():
        stats, _ = _eager(form, view, stats[0])  # rare: a shift a std or more from the mean
    return stats


def policy() -> str:
    """``PRECISE_BN_COMPILE``, checked: ``auto``, ``always`` or ``never``."""
    value = os.environ.get("PRECISE_BN_COMPILE", "auto").strip().lower()
    if value not in ("auto", "always", "never"):
        raise ConfigError("PRECISE_BN_COMPILE must be auto, always or never, got {!r}".format(value))
    return value


def cache_dir() -> str:
    """Where compiled packages are kept: ``PRECISE_BN_CACHE``, else ``precise_bn`` in the
    user's cache directory (``XDG_CACHE_HOME`` or ``~/.cache``)."""
    chosen = os.environ.get("PRECISE_BN_CACHE")
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "precise_bn")


def _machine(device: torch.device) -> str:
    """What a package compiled here depends on besides its key: torch, and the processor it was
    compiled for (C++ is built for the host's instruction set, Triton for the GPU's)."""
    if device.type == "cuda":
        hardware = "{}-{}".format(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    else:
        flags = ""
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo") as info:
                flags = next((line for line in info if line.startswith("flags")), "")
        hardware = "{}-{}".format(platform.machine(), flags)
    return "{}-{}".format(torch.__version__, hardware)


def package_path(key: Key, device: torch.device) -> str:
    """The file the package of ``key`` compiled for ``device``'s kind is kept in."""
    form, dtype, shift_dtype, kind = key
    digest = hashlib.sha256(_machine(device).encode()).hexdigest()[:16]
    name = "sums-{}-{}-{}-{}-{}.pt2".format(form, str(dtype)[6:], str(shift_dtype)[6:], kind, digest)
    return os.path.join(cache_dir(), name)


def _aoti() -> Any:
    """torch's AOTInductor entry points, or None where this torch lacks them (before 2.6)."""
    try:
        importlib.import_module("torch.export")
        inductor = importlib.import_module("torch._inductor")
    except ImportError:
        return None
    return inductor if hasattr(inductor, "aoti_load_package") else None


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """torch's own loggers at ERROR while compiling or loading: their notes (no CUDA runtime on
    a CPU machine, an instruction-set label) describe torch's set-up, not the user's run."""
    loggers = [logging.getLogger(name) for name in ("torch", "torch._inductor", "torch.export",
                                                    "torch.utils.cpp_extension")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _example(key: Key, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    form, dtype, shift_dtype, _ = key
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 7, generator=gen) * 4 + 100).to(device=device, dtype=dtype)
    shift = x.double().mean((0, 1) if form == "channels_last" else (0, 2)).to(shift_dtype)
    return x, shift


def compile_package(key: Key, device: torch.device, path: str) -> None:
    """Compile ``key``'s sums for ``device`` into ``path`` (written whole, or not at all)."""
    aoti = _aoti()
    if aoti is None:
        raise RuntimeError("this torch ({}) has no AOTInductor (torch 2.6 or later)".format(torch.__version__))
    form = key[0]
    x, shift = _example(key, device)
    dims = [torch.export.Dim("d{}".format(i), min=1) for i in range(3)]
    channels = dims[1] if form == "channels_first" else dims[2]
    options: Dict[str, Any] = {"compile_threads": 1}
    if device.type == "cpu":
        options["cpp.simdlen"] = 256  # measured 2.6x faster than 512-bit float64 reductions
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".pt2", dir=os.path.dirname(path))
    os.close(handle)
    try:
        with _quiet_torch(), torch.no_grad():
            program = torch.export.export(_Sums(form).to(device), (x, shift),
                                          dynamic_shapes=({0: dims[0], 1: dims[1], 2: dims[2]}, {0: channels}))
            aoti.aoti_compile_and_package(program, package_path=partial, inductor_configs=options)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)


def load_package(key: Key, device: torch.device, path: str) -> Run:
    """The compiled sums in ``path``, checked against the eager ones; called as
    ``run([x, shift]) -> [stats, far]``, straight into the compiled code."""
    aoti = _aoti()
    if aoti is None:
        raise RuntimeError("this torch ({}) has no AOTInductor (torch 2.6 or later)".format(torch.__version__))
    index = device.index if device.index is not None else -1
    with _quiet_torch():
        if device.type == "cpu":
            package = aoti.aoti_load_package(path)
        else:
            package = aoti.aoti_load_package(path, device_index=index)
    run: Run = package.loader.run
    x, shift = _example(key, device)
    got = run([x, shift])
    want = _eager(key[0], x, shift)
    if not torch.allclose(got[0], want[0], rtol=1e-12, atol=0) or bool(got[1]) != bool(want[1]):
        raise RuntimeError("the compiled sums in {} disagree with the eager ones".format(path))
    return run


class Kernels:
    """The process's compiled sums, one per (form, input dtype, shift dtype, device);
    :meth:`sums` uses them once loaded, eager operators before.

    A package on disk is loaded the first time its key is seen. A missing one is compiled on
    the caller's thread: at once with ``PRECISE_BN_COMPILE=always``, or when :meth:`expect`
    says that the pass's planned eager sums would take longer than :data:`COMPILE_SECONDS`.
    Each compile says so in one line, with how long it took; a failure says why, once, and the
    eager sums go on (the same numbers)."""

    def __init__(self) -> None:
        self.ready: Dict[Tuple[str, torch.dtype, torch.dtype, torch.device], Run] = {}
        self.eager_elements = 0
        self.eager_seconds = 0.0
        #: Seconds spent compiling and loading packages, and the keys compiled, in this process.
        self.compile_seconds = 0.0
        self.compiled: List[Key] = []
        self.failures: List[str] = []
        self._seen: Dict[Tuple[str, torch.dtype, torch.dtype, torch.device], Key] = {}
        self._given_up: Set[Key] = set()
        self._lock = threading.Lock()  # DataParallel's threads may see a new form together

    def sums(self, form: str, x: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Shifted float64 sums of ``x`` (viewed by :func:`view_for_sums`): ``((2, C), far)``."""
        where = (form, x.dtype, shift.dtype, x.device)
        run = self.ready.get(where)
        if run is not None and type(x) is torch.Tensor and not _modes_on():
            out = run([x, shift])
            return out[0], out[1]
        if where not in self._seen:
            with self._lock:
                if where not in self._seen:
                    self._first_sight(where)
            if where in self.ready:
                return self.sums(form, x, shift)
        self.eager_elements += x.numel()
        if x.device.type != "cpu":
            return _eager(form, x, shift)
        start = time.perf_counter()
        try:
            return _eager(form, x, shift)
        finally:
            self.eager_seconds += time.perf_counter() - start

    def _first_sight(self, where: Tuple[str, torch.dtype, torch.dtype, torch.device]) -> None:
        form, dtype, shift_dtype, device = where
        key = self._seen[where] = (form, dtype, shift_dtype, device.type)
        choice = policy()
        if choice == "never" or _aoti() is None:
            return
        if os.path.exists(package_path(key, device)) or choice == "always":
            self._prepare(where)

    def expect(self, elements: int) -> None:
        """A pass is about to measure about ``elements`` more elements through the forms seen
        so far: compile those not ready if their eager sums would take longer than a compile."""
        if policy() != "auto" or not self.eager_elements:
            return
        missing = self._missing()
        per_element = (self.eager_seconds / self.eager_elements if self.eager_seconds
                       else EAGER_SECONDS_PER_ELEMENT)
        if missing and elements * per_element > COMPILE_SECONDS * len(missing):
            self.compile_seen()
        elif missing:
            logger.debug("precise-bn: float64 sums stay eager for this pass: about %.1f s of them, "
                         "less than compiling", elements * per_element)

    def _missing(self) -> List[Tuple[str, torch.dtype, torch.dtype, torch.device]]:
        return [where for where, key in self._seen.items() if where not in self.ready and key not in self._given_up]

    def compile_seen(self) -> None:
        """Load or compile every form seen so far that is not ready (unless ``never``)."""
        if policy() == "never":
            return
        with self._lock:
            for where in self._missing():
                self._prepare(where)

    def _prepare(self, where: Tuple[str, torch.dtype, torch.dtype, torch.device]) -> None:
        """Load ``where``'s package, compiling it first if it is not on disk."""
        key, device = self._seen[where], where[3]
        if key in self._given_up:
            return
        path = package_path(key, device)
        start = time.perf_counter()
        try:
            built = not os.path.exists(path)
            if built:
                compile_package(key, device, path)
            self.ready[where] = load_package(key, device, path)
        except Exception as exc:  # any failure leaves the eager path, which is always right
            self._given_up.add(key)
            self._fail("{}: {}".format(type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else ""))
            return
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        if built:
            self.compiled.append(key)
            logger.warning("precise-bn: compiled the float64 sums for %s in %.1f s, once for this machine "
                           "(kept in %s)", kernel_name(key), seconds, os.path.dirname(path))

    def _fail(self, why: str) -> None:
        if not self.failures:
            logger.warning("precise-bn: float64 sums run as eager operators (the same numbers, slower): "
                           "compiling them failed: %s", why)
        self.failures.append(why)

    def compile_ahead(self, keys: Sequence[Key], device: torch.device) -> List[str]:
        """Compile and load every key in ``keys`` for ``device`` now (what ``python -m
        precise_bn.moments`` does); returns the package paths."""
        paths = []
        with self._lock:
            for key in keys:
                where = (key[0], key[1], key[2], device)
                self._seen.setdefault(where, key)
                self._prepare(where)
                paths.append(package_path(key, device))
        return paths


def _modes_on() -> bool:
    """Whether a torch function mode is active: it must see the eager operators."""
    return torch._C._is_torch_function_mode_enabled()


def kernel_name(key: Sequence[Any]) -> str:
    """A key in words: its layout, input dtype, shift dtype and device type."""
    form, dtype, shift_dtype, kind = key[:4]
    return "{} {} around {} on {}".format(form, str(dtype)[6:], str(shift_dtype)[6:], kind)


KERNELS = Kernels()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Compile the sums of every form for the usual dtypes ahead of time."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m precise_bn.moments", description=main.__doc__)
    parser.add_argument("--device", default="cpu", help="the device to compile for (default: cpu)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16",
                        help="input dtypes, comma-separated (default: float32,bfloat16,float16)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",") if name.strip()]
    keys = [(form, dtype, torch.float32, device.type) for form in FORM_NAMES for dtype in dtypes]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    KERNELS.compile_ahead(keys, device)
    for key in keys:
        print("{}: {}".format(kernel_name(key), package_path(key, device)))
    return 1 if KERNELS.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
