"""When the float64 sums (``moments``) run compiled: a package is loaded at first sight once
its record vouches for it, and made on the caller's thread once the eager seconds its program
has cost this machine reach about its compile time (rent or buy; ``PRECISE_BN_COMPILE=always``:
at once, ``never``: never). Until then, and where none can be made, the eager form runs: the
same numbers within float64 rounding. Why: docs/numerics.md ("The package cache").
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Dict, List, Sequence, Set, Tuple

import torch

from . import aoti
from . import package_cache as cache
from .aoti import PROGRAMS, Key, Run, Where, kernel_name, package_path

logger = logging.getLogger("precise_bn")

#: Seconds a compile is taken to cost until one is recorded in the cache (a cold compile of one
#: program measured 10 to 25 s on two cores).
COMPILE_SECONDS = 30.0
#: Eager seconds per element assumed where they cannot be timed (a GPU runs asynchronously).
EAGER_SECONDS_PER_ELEMENT = 2e-10


def compile_cost(folder: str, device_type: str) -> float:
    """Seconds a compile takes on this machine: the mean of those recorded in ``folder`` for
    ``device_type``, else :data:`COMPILE_SECONDS`."""
    seen = []
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if name.endswith(".json") and "-{}-pbn".format(device_type) in name:
                seconds = (cache.recorded(os.path.join(folder, name[: -len(".json")] + ".pt2")) or {}).get("compile_seconds")
                if isinstance(seconds, (int, float)) and seconds > 0:
                    seen.append(float(seconds))
    return sum(seen) / len(seen) if seen else COMPILE_SECONDS


class Kernels:
    """The process's compiled programs; :meth:`run` calls one where it is loaded, its eager
    form before. :meth:`expect` charges each pass to the cache's ledger and compiles what has
    paid for itself; one process compiles a package at a time, the others stay eager and load
    it once it is there. A compile says so in one line; a failure says why, once."""

    def __init__(self) -> None:
        self.ready: Dict[Where, Run] = {}
        self.eager_elements = 0
        self.eager_seconds = 0.0
        #: Seconds spent compiling and loading packages, and the keys compiled, in this process.
        self.compile_seconds = 0.0
        self.compiled: List[Key] = []
        self.failures: List[str] = []
        self._seen: Dict[Where, Key] = {}
        self._unpaid: Dict[Where, int] = {}  # eager elements since the ledger was last told
        self._paid_here: Dict[Key, float] = {}  # what a ledger we cannot write would hold
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
        self._unpaid[where] = self._unpaid.get(where, 0) + inputs[0].numel()
        if inputs[0].device.type != "cpu":
            return PROGRAMS[name].eager(*inputs)
        start = time.perf_counter()
        try:
            return PROGRAMS[name].eager(*inputs)
        finally:
            self.eager_seconds += time.perf_counter() - start

    def _first_sight(self, where: Where) -> None:
        key = self._seen[where] = (where[0], where[1], where[2].type)
        choice = cache.policy()
        if choice == "always" or (choice == "auto" and os.path.exists(package_path(key, where[2]))
                                  and aoti.loadable()):
            self._prepare(where, key, build=choice == "always")

    def expect(self, elements: int) -> None:
        """A pass is about to run about ``elements`` more elements through the programs seen so
        far. A package another process made meanwhile is loaded; under ``auto`` each program
        still missing is charged its share of the pass's eager seconds in the cache's ledger,
        and compiled once the total reaches its compile time."""
        choice = cache.policy()
        if choice == "never":
            return
        unpaid, self._unpaid = self._unpaid, {}
        total = sum(unpaid.values())
        per_element = self.eager_seconds / self.eager_elements if self.eager_seconds else EAGER_SECONDS_PER_ELEMENT
        with self._lock:
            for where, key in self._missing():
                path = package_path(key, where[2])
                if choice == "always" or os.path.exists(path):
                    self._prepare(where, key, build=True)
                elif total:
                    share = unpaid.get(where, 0)
                    self._charge(where, key, path, (share + elements * share / total) * per_element)

    def _charge(self, where: Where, key: Key, path: str, seconds: float) -> None:
        folder = os.path.dirname(path)
        if cache.writable(folder):
            paid = cache.pay(path, seconds)
        else:
            self._paid_here[key] = self._paid_here.get(key, 0.0) + seconds
            paid = cache.paid(path) + self._paid_here[key]
        cost = compile_cost(folder, key[2])
        if paid >= cost:
            self._prepare(where, key, build=True)
        else:
            logger.debug("precise-bn: %s stays eager: %.1f s of eager sums paid, compiling takes about %.1f s",
                         kernel_name(key), paid, cost)

    def _missing(self) -> List[Tuple[Where, Key]]:
        return [(where, key) for where, key in self._seen.items() if where not in self.ready and key not in self._given_up]

    def compile_seen(self) -> None:
        """Load or compile every program seen so far that is not ready (unless ``never``)."""
        if cache.policy() == "never":
            return
        with self._lock:
            for where, key in self._missing():
                self._prepare(where, key, build=True)

    def _prepare(self, where: Where, key: Key, build: bool) -> None:
        """Load ``where``'s package (``key``) if its record vouches for it, else set it aside;
        compile it first where it is missing and ``build`` (unless another process is)."""
        self._seen[where] = key
        device = where[2]
        path = package_path(key, device)
        start = time.perf_counter()
        built = False
        try:
            if os.path.exists(path):
                self._check(key, path)
            if not os.path.exists(path):
                if not build or not self._build(key, device, path):
                    return
                built = True
            self.ready[where] = aoti.load_package(key, device, path)
        except Exception as exc:  # any failure leaves the eager form, which is always right
            self._given_up.add(key)
            text = str(exc).strip()
            self._fail("{}: {}".format(type(exc).__name__, text.splitlines()[0] if text else ""))
            return
        except BaseException:
            del self._seen[where]  # a Ctrl-C: tried again at its next sight
            raise
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        if built:
            self.compiled.append(key)
            logger.warning("precise-bn: compiled %s in %.1f s, once for this machine (kept in %s)",
                           kernel_name(key), seconds, os.path.dirname(path))

    def _check(self, key: Key, path: str) -> None:
        """Set ``path`` aside, saying so, if its record does not vouch for it."""
        why = cache.mismatch(path)
        if why is None:
            return
        bad = cache.set_aside(path)
        if bad is None:
            self._given_up.add(key)
            fix = "this process cannot rename it: remove {} and its .json, or ask the cache's owner to".format(path)
        else:
            fix = "set aside as {}; a new one is compiled when a pass pays for it".format(os.path.basename(bad))
        logger.warning("precise-bn: the package %s was not loaded: %s; %s (the eager sums run meanwhile)", path, why, fix)

    def _build(self, key: Key, device: torch.device, path: str) -> bool:
        """Compile ``path`` unless another process holds its lock (False: eager meanwhile)."""
        if not cache.writable(os.path.dirname(path)):
            raise RuntimeError("the package cache {} cannot be written by this process: make it writable, or fill "
                               "it with python -m precise_bn.moments where it can be".format(os.path.dirname(path)))
        with cache.locked(path) as holder:
            if holder is not None:
                logger.info("precise-bn: %s is being compiled by process %s on %s; eager sums meanwhile",
                            kernel_name(key), holder.get("pid"), holder.get("host"))
                return False
            cache.clean_partials(os.path.dirname(path))
            if not os.path.exists(path):
                aoti.compile_package(key, device, path)
        return True

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
                self._prepare((key[0], key[1], device), key, build=True)
        return [package_path(key, device) for key in keys]


KERNELS = Kernels()
