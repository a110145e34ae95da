"""Functions of tensors compiled ahead of use by AOTInductor into packages on disk, and called
with no Python wrapper: the float64 sums of each BN call (``moments``).

A package is made once per machine, on the caller's thread, where a pass pays for it (or at
once with ``PRECISE_BN_COMPILE=always``; ``never``: never), kept in ``PRECISE_BN_CACHE``
(default ``~/.cache/precise_bn``) under a name that says torch's version and the processor it
was built for, written whole or not at all, and loaded by the next process in milliseconds.
Until it is there, and where none can be made (torch before 2.6, no C++ compiler), the
program's eager form runs: the same numbers within float64 rounding, slower. Nothing runs in
the background and nothing waits at exit. Why: docs/numerics.md ("What the measurement costs").
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import logging
import os
import platform
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Sequence, Set, Tuple

import torch

from .errors import ConfigError

logger = logging.getLogger("precise_bn")

#: Seconds a compile is taken to cost (a cold compile of one program measured 10 to 25 s on two
#: cores): a pass compiles when its planned eager work would take longer than that.
COMPILE_SECONDS = 30.0
#: Eager seconds per element assumed where they cannot be timed (a GPU runs asynchronously).
EAGER_SECONDS_PER_ELEMENT = 2e-10

#: (program, input dtypes, device type): one package each.
Key = Tuple[str, Tuple[torch.dtype, ...], str]
#: (program, input dtypes, device): one loaded package each.
Where = Tuple[str, Tuple[torch.dtype, ...], torch.device]
Run = Callable[[List[torch.Tensor]], List[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Program:
    """What can be compiled: ``module()`` builds it, ``example(dtypes, device)`` gives inputs to
    trace it with, ``dynamic()`` the dynamic dimensions of each input (``torch.export.Dim``),
    and ``eager(*inputs)`` computes the same outputs with eager operators."""

    module: Callable[[], torch.nn.Module]
    example: Callable[[Tuple[torch.dtype, ...], torch.device], Tuple[torch.Tensor, ...]]
    dynamic: Callable[[], Tuple[Dict[int, Any], ...]]
    eager: Callable[..., Sequence[torch.Tensor]]


PROGRAMS: Dict[str, Program] = {}


def policy() -> str:
    """``PRECISE_BN_COMPILE``, checked: ``auto``, ``always`` or ``never``."""
    value = os.environ.get("PRECISE_BN_COMPILE", "auto").strip().lower()
    if value not in ("auto", "always", "never"):
        raise ConfigError("PRECISE_BN_COMPILE must be auto, always or never, got {!r}".format(value))
    return value


def cache_dir() -> str:
    """Where packages are kept: ``PRECISE_BN_CACHE``, else ``precise_bn`` in the user's cache
    directory (``XDG_CACHE_HOME`` or ``~/.cache``)."""
    chosen = os.environ.get("PRECISE_BN_CACHE")
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "precise_bn")


def _machine(device: torch.device) -> str:
    """What a package depends on besides its key: torch, and the processor it was built for
    (C++ for the host's instruction set, Triton for the GPU's)."""
    if device.type == "cuda":
        hardware = "{}-{}".format(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    else:
        flags = ""
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo") as info:
                flags = next((line for line in info if line.startswith("flags")), "")
        hardware = "{}-{}".format(platform.machine(), flags)
    return "{}-{}".format(torch.__version__, hardware)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def kernel_name(key: Key) -> str:
    """A key in words: ``channels_first(float32, float32) on cpu``."""
    return "{}({}) on {}".format(key[0], ", ".join(_short(d) for d in key[1]), key[2])


def package_path(key: Key, device: torch.device) -> str:
    """The file the package of ``key`` compiled for ``device``'s kind is kept in."""
    digest = hashlib.sha256(_machine(device).encode()).hexdigest()[:16]
    parts = [key[0]] + [_short(d) for d in key[1]] + [key[2], digest]
    return os.path.join(cache_dir(), "-".join(parts) + ".pt2")


def _aoti() -> Any:
    """torch's AOTInductor entry points, or None where this torch lacks them (before 2.6)."""
    try:
        importlib.import_module("torch.export")
        inductor = importlib.import_module("torch._inductor")
    except ImportError:
        return None
    return inductor if hasattr(inductor, "aoti_load_package") else None


def _require_aoti() -> Any:
    aoti = _aoti()
    if aoti is None:
        raise RuntimeError("this torch ({}) has no AOTInductor (torch 2.6 or later)".format(torch.__version__))
    return aoti


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


def compile_package(key: Key, device: torch.device, path: str) -> None:
    """Compile ``key``'s program for ``device`` into ``path`` (written whole, or not at all)."""
    aoti = _require_aoti()
    program = PROGRAMS[key[0]]
    options: Dict[str, Any] = {"compile_threads": 1}
    if device.type == "cpu":
        options["cpp.simdlen"] = 256  # measured 2.6x faster than 512-bit float64 reductions
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".pt2", dir=os.path.dirname(path))
    os.close(handle)
    try:
        with _quiet_torch(), torch.no_grad():
            exported = torch.export.export(program.module().to(device), program.example(key[1], device),
                                           dynamic_shapes=program.dynamic())
            aoti.aoti_compile_and_package(exported, package_path=partial, inductor_configs=options)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)


def load_package(key: Key, device: torch.device, path: str) -> Run:
    """The compiled program in ``path``, checked against its eager form on its example; called
    as ``run([inputs...]) -> [outputs...]``, straight into the compiled code."""
    aoti = _require_aoti()
    with _quiet_torch():
        if device.type == "cpu":
            package = aoti.aoti_load_package(path)
        else:
            package = aoti.aoti_load_package(path, device_index=device.index if device.index is not None else -1)
    run: Run = package.loader.run
    program = PROGRAMS[key[0]]
    example = program.example(key[1], device)
    for got, want in zip(run(list(example)), program.eager(*example)):
        if got.shape != want.shape or not torch.allclose(got.double(), want.double(), rtol=1e-10, atol=1e-300):
            raise RuntimeError("the compiled {} in {} disagrees with its eager form".format(key[0], path))
    return run


class Kernels:
    """The process's compiled programs; :meth:`run` calls one where it is loaded, its eager
    form before.

    A package on disk is loaded the first time its key is seen. A missing one is compiled on
    the caller's thread: at once with ``PRECISE_BN_COMPILE=always``, or when :meth:`expect`
    says that a pass's planned eager work would take longer than :data:`COMPILE_SECONDS` per
    missing program. Each compile says so in one line, with how long it took; a failure says
    why, once, and the eager forms go on (the same numbers)."""

    def __init__(self) -> None:
        self.ready: Dict[Where, Run] = {}
        self.eager_elements = 0
        self.eager_seconds = 0.0
        #: Seconds spent compiling and loading packages, and the keys compiled, in this process.
        self.compile_seconds = 0.0
        self.compiled: List[Key] = []
        self.failures: List[str] = []
        self._seen: Dict[Where, Key] = {}
        self._given_up: Set[Key] = set()
        self._lock = threading.Lock()  # DataParallel's threads may see a new program together
        self._subclasses: Set[type] = set()

    def run(self, name: str, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """``name``'s outputs for ``inputs`` (their first one says the device and the elements)."""
        where = (name, tuple(t.dtype for t in inputs), inputs[0].device)
        run = self.ready.get(where)
        if run is not None:
            if type(inputs[0]) is torch.Tensor:
                return run(list(inputs))
            self._note_subclass(type(inputs[0]))
        if where not in self._seen:
            with self._lock:
                if where not in self._seen:
                    self._first_sight(where)
            if where in self.ready:
                return self.run(name, inputs)
        self.eager_elements += inputs[0].numel()
        if inputs[0].device.type != "cpu":
            return PROGRAMS[name].eager(*inputs)
        start = time.perf_counter()
        try:
            return PROGRAMS[name].eager(*inputs)
        finally:
            self.eager_seconds += time.perf_counter() - start

    def _first_sight(self, where: Where) -> None:
        key = self._seen[where] = (where[0], where[1], where[2].type)
        choice = policy()
        # The file first: importing torch's compiler takes about a second, for nothing if it is absent.
        if choice == "always" or (choice == "auto" and os.path.exists(package_path(key, where[2]))
                                  and _aoti() is not None):
            self._prepare(where, key)

    def expect(self, elements: int) -> None:
        """A pass is about to run about ``elements`` more elements through the programs seen so
        far: compile those not ready if their eager forms would take longer than the compiles."""
        if policy() != "auto" or not self.eager_elements:
            return
        missing = self._missing()
        per_element = self.eager_seconds / self.eager_elements if self.eager_seconds else EAGER_SECONDS_PER_ELEMENT
        if missing and elements * per_element > COMPILE_SECONDS * len(missing):
            self.compile_seen()
        elif missing:
            logger.debug("precise-bn: the pass stays eager: about %.1f s of eager work, less than compiling",
                         elements * per_element)

    def _missing(self) -> List[Tuple[Where, Key]]:
        return [(where, key) for where, key in self._seen.items() if where not in self.ready and key not in self._given_up]

    def compile_seen(self) -> None:
        """Load or compile every program seen so far that is not ready (unless ``never``)."""
        if policy() == "never":
            return
        with self._lock:
            for where, key in self._missing():
                self._prepare(where, key)

    def _prepare(self, where: Where, key: Key) -> None:
        """Load ``where``'s package (``key``), compiling it first if it is not on disk."""
        self._seen[where] = key
        if key in self._given_up:
            return
        device = where[2]
        path = package_path(key, device)
        start = time.perf_counter()
        try:
            built = not os.path.exists(path)
            if built:
                compile_package(key, device, path)
            self.ready[where] = load_package(key, device, path)
        except Exception as exc:  # any failure leaves the eager form, which is always right
            self._given_up.add(key)
            text = str(exc).strip()
            self._fail("{}: {}".format(type(exc).__name__, text.splitlines()[0] if text else ""))
            return
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        if built:
            self.compiled.append(key)
            logger.warning("precise-bn: compiled %s in %.1f s, once for this machine (kept in %s)",
                           kernel_name(key), seconds, os.path.dirname(path))

    def _note_subclass(self, kind: type) -> None:
        if kind not in self._subclasses:
            self._subclasses.add(kind)
            logger.warning("precise-bn: inputs of type %s, a tensor subclass that compiled code cannot read, "
                           "are measured by eager operators (the same numbers, slower)", kind.__name__)

    def _fail(self, why: str) -> None:
        if not self.failures:
            logger.warning("precise-bn: float64 sums run as eager operators (the same numbers, slower): "
                           "compiling them failed: %s", why)
        self.failures.append(why)

    def compile_ahead(self, keys: Sequence[Key], device: torch.device) -> List[str]:
        """Compile (if not on disk) and load every key in ``keys`` for ``device`` now; returns
        the package paths (``python -m precise_bn.moments`` does this)."""
        with self._lock:
            for key in keys:
                self._prepare((key[0], key[1], device), key)
        return [package_path(key, device) for key in keys]


KERNELS = Kernels()
