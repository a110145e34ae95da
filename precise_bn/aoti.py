"""One package of a :class:`Program`, made with torch's AOTInductor and loaded by its C++
loader (milliseconds: no compiler import, no CPU probe), named by what made it (torch,
precise-bn, the program's source, the processor). A compile leaves nothing behind: no
half-imported module after a Ctrl-C (imports run whole, signals deferred), no progress-bar
thread, no files in ``TMPDIR``. Why: docs/numerics.md ("The package cache").
"""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import importlib
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from . import package_cache as cache
from ._version import __version__
from .signals import critical, relayed


#: (program, input dtypes, device type): one package each.
Key = Tuple[str, Tuple[torch.dtype, ...], str]
#: (program, input dtypes, device): one loaded package each.
Where = Tuple[str, Tuple[torch.dtype, ...], torch.device]
Run = Callable[[List[torch.Tensor]], List[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Program:
    """What can be compiled: ``module()`` builds it, ``example(dtypes, device)`` gives inputs to
    trace it with, ``dynamic()`` the dynamic dimensions of each input (``torch.export.Dim``),
    ``eager(*inputs)`` computes the same outputs with eager operators, and ``source`` is the
    text the compiled code comes from (in the package's name: a change compiles anew)."""

    module: Callable[[], torch.nn.Module]
    example: Callable[[Tuple[torch.dtype, ...], torch.device], Tuple[torch.Tensor, ...]]
    dynamic: Callable[[], Tuple[Dict[int, Any], ...]]
    eager: Callable[..., Sequence[torch.Tensor]]
    source: str


PROGRAMS: Dict[str, Program] = {}


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


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).replace("torch.", "")


def kernel_name(key: Key) -> str:
    """A key in words: ``channels_first(float32, float32) on cpu``."""
    return "{}({}) on {}".format(key[0], ", ".join(dtype_name(d) for d in key[1]), key[2])


def _hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def package_path(key: Key, device: torch.device) -> str:
    """The file the package of ``key`` compiled for ``device``'s kind is kept in:
    ``FORM-DTYPES-DEVICE-pbnVERSION-SOURCE-MACHINE.pt2``."""
    parts = ([key[0]] + [dtype_name(d) for d in key[1]]
             + [key[2], "pbn" + __version__, _hash(PROGRAMS[key[0]].source, 8), _hash(_machine(device), 16)])
    return os.path.join(cache.cache_dir(), "-".join(parts) + ".pt2")


def _deferring(load: Callable[..., Any]) -> Callable[..., Any]:
    def whole(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():  # signals go to the main one
            return load(*args, **kwargs)
        with critical():
            return load(*args, **kwargs)
    return whole


@contextlib.contextmanager
def _whole_imports() -> Iterator[None]:
    """Every import in the block runs whole, signals deferred until it returns: a Ctrl-C inside
    one of the modules torch's compiler imports lazily would leave torch broken for good."""
    original, by_name = builtins.__import__, importlib.import_module
    with relayed():
        with critical():
            builtins.__import__, importlib.import_module = _deferring(original), _deferring(by_name)
        try:
            yield
        finally:
            with critical():
                builtins.__import__, importlib.import_module = original, by_name


def _aoti() -> Any:
    """torch's AOTInductor entry points, or None where this torch lacks them (before 2.6)."""
    try:
        with _whole_imports():
            importlib.import_module("torch.export")
            inductor = importlib.import_module("torch._inductor")
    except ImportError:
        return None
    return inductor if hasattr(inductor, "aoti_load_package") else None


def available() -> bool:
    """Whether this torch can make packages (2.6 or later)."""
    return _aoti() is not None


def _require_aoti() -> Any:
    aoti = _aoti()
    if aoti is None:
        raise RuntimeError("this torch ({}) has no AOTInductor (torch 2.6 or later)".format(torch.__version__))
    return aoti


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """torch's own loggers at ERROR (their notes describe torch's set-up, not the user's run),
    and no monitor thread of the progress bars torch's export makes outliving the call."""
    loggers = [logging.getLogger(name) for name in ("torch", "torch._inductor", "torch.export",
                                                    "torch.utils.cpp_extension")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    bar: Any = None
    with contextlib.suppress(ImportError):
        from tqdm import tqdm as bar
    interval = getattr(bar, "monitor_interval", None)
    if interval is not None:
        bar.monitor_interval = 0
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
        if interval is not None:
            bar.monitor_interval = interval


@contextlib.contextmanager
def _inductor_files(folder: str) -> Iterator[None]:
    """torch's inductor writes its files (objects, CPU probes) to ``folder`` for the block,
    instead of the machine-wide ``TMPDIR/torchinductor_USER``."""
    utils = importlib.import_module("torch._inductor.runtime.cache_dir_utils")
    with contextlib.ExitStack() as stack:
        if hasattr(utils, "temporary_cache_dir"):
            stack.enter_context(utils.temporary_cache_dir(folder))
        yield


def compile_package(key: Key, device: torch.device, path: str) -> None:
    """Compile ``key``'s program for ``device`` into ``path``, with its record (written whole,
    or not at all)."""
    aoti = _require_aoti()
    program = PROGRAMS[key[0]]
    # No precompiled headers: they would stay in TMPDIR (hundreds of MB) after the compile.
    options: Dict[str, Any] = {"compile_threads": 1, "aot_inductor.precompile_headers": False,
                               "cpp_cache_precompile_headers": False}
    if device.type == "cpu":
        options["cpp.simdlen"] = 256  # measured 2.6x faster than 512-bit float64 reductions
    config = importlib.import_module("torch._inductor.config")
    options = {name: value for name, value in options.items() if _has(config, name)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = cache.partial_path(path)
    start = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="precise-bn-compile-")
    try:
        with _quiet_torch(), _whole_imports(), torch.no_grad(), _inductor_files(scratch):
            exported = torch.export.export(program.module().to(device), program.example(key[1], device),
                                           dynamic_shapes=program.dynamic())
            aoti.aoti_compile_and_package(exported, package_path=partial, inductor_configs=options)
        cache.publish(partial, path, {"program": kernel_name(key), "torch": torch.__version__,
                                      "precise_bn": __version__, "compile_seconds": time.perf_counter() - start})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(partial)


def _native_loader() -> Any:
    return getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)


def loadable() -> bool:
    """Whether this torch can load packages: its C++ loader, which needs neither torch's
    compiler modules (a second or two to import) nor the compiler's CPU probes."""
    return _native_loader() is not None or available()


def load_package(key: Key, device: torch.device, path: str) -> Run:
    """The compiled program in ``path``, checked against its eager form on its example; called
    as ``run([inputs...]) -> [outputs...]``, straight into the compiled code."""
    index = -1 if device.index is None or device.type == "cpu" else device.index
    native = _native_loader()
    if native is not None:
        run: Run = native(path, "model", False, 1, index).run
    else:
        with _quiet_torch(), _whole_imports():
            run = _require_aoti().aoti_load_package(path, device_index=index).loader.run
    program = PROGRAMS[key[0]]
    example = program.example(key[1], device)
    for got, want in zip(run(list(example)), program.eager(*example)):
        if got.shape != want.shape or not torch.allclose(got.double(), want.double(), rtol=1e-10, atol=1e-300):
            raise RuntimeError("the compiled {} in {} disagrees with its eager form".format(key[0], path))
    return run


def _has(config: Any, name: str) -> bool:
    head, _, rest = name.partition(".")
    return hasattr(config, head) and (not rest or _has(getattr(config, head), rest))
