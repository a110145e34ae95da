"""The folder of compiled packages (``PRECISE_BN_CACHE``), shared by every process and user that
can read it: each package's record, the eager seconds each program has cost, the lock of a
compile under way, and what a killed compile left. Every file is written whole by a rename, with
the mode any new file gets (``0666 & ~umask``); a folder we cannot write is read, never written.
The rules and how to prepare a cache for a cluster: docs/numerics.md ("The package cache").
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from typing import Any, Dict, Iterator, Optional

from .atomic import atomic_write
from .errors import ConfigError

POLICIES = ("auto", "always", "never")
#: A lock older than this is taken over: its compile died without removing it.
LOCK_SECONDS = 900.0
#: A partial package of another host is removed once this old (its process cannot be asked).
PARTIAL_SECONDS = 3600.0
PARTIAL = ".partial-"


def policy() -> str:
    """``PRECISE_BN_COMPILE``: ``auto`` (also when unset or empty), ``always`` or ``never``."""
    value = os.environ.get("PRECISE_BN_COMPILE", "").strip().lower() or "auto"
    if value not in POLICIES:
        raise ConfigError("PRECISE_BN_COMPILE must be auto, always or never (or unset: auto), got {!r}; "
                          "fix or unset it".format(os.environ["PRECISE_BN_COMPILE"]))
    return value


def cache_dir() -> str:
    """``PRECISE_BN_CACHE`` (``~`` expanded), else ``precise_bn`` in ``XDG_CACHE_HOME`` or ``~/.cache``."""
    chosen = os.environ.get("PRECISE_BN_CACHE", "").strip()
    if chosen:
        return os.path.abspath(os.path.expanduser(chosen))
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
    return os.path.abspath(os.path.join(os.path.expanduser(base), "precise_bn"))


def check_environment() -> None:
    """Both variables, before a pass's first batch: a :class:`~precise_bn.ConfigError` naming
    the fix for a bad policy, or a cache path that is a file."""
    policy()
    folder = cache_dir()
    if os.path.exists(folder) and not os.path.isdir(folder):
        if os.environ.get("PRECISE_BN_CACHE", "").strip():
            raise ConfigError("PRECISE_BN_CACHE is {}, a file, not a folder: point it at a folder "
                              "(or unset it for ~/.cache/precise_bn)".format(folder))
        raise ConfigError("the package cache {} is a file, not a folder: remove it, or set PRECISE_BN_CACHE "
                          "to a folder".format(folder))


def writable(folder: str) -> bool:
    """Whether packages can be added to ``folder`` (made if missing)."""
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
    return os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)


def file_mode() -> int:
    """The mode ``open()`` gives a new file under the process's umask (read without setting it
    where Linux says it: setting it, even back, races with other threads' new files)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as status:
            return 0o666 & ~int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def digest(path: str) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def _write_json(path: str, value: Dict[str, Any]) -> None:
    atomic_write(path, lambda handle: handle.write(json.dumps(value, sort_keys=True).encode()))


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, "rb") as handle:
            value = json.loads(handle.read().decode())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def record_path(package: str) -> str:
    return package[: -len(".pt2")] + ".json"


def publish(partial: str, package: str, made_by: Dict[str, Any]) -> None:
    """Move the finished ``partial`` to ``package``: its record (content hash, size, and
    ``made_by``) first, then the package itself, renamed whole with the umask's mode."""
    os.chmod(partial, file_mode())
    made_by = dict(made_by, sha256=digest(partial), bytes=os.path.getsize(partial),
                   host=socket.gethostname(), pid=os.getpid(), at=time.time())
    _write_json(record_path(package), made_by)
    os.replace(partial, package)


def recorded(package: str) -> Optional[Dict[str, Any]]:
    return _read_json(record_path(package))


def mismatch(package: str) -> Optional[str]:
    """Why ``package`` must not be loaded (no record, or other bytes than recorded), or None."""
    record = recorded(package)
    if record is None:
        return "it has no record ({})".format(os.path.basename(record_path(package)))
    try:
        size, sha = os.path.getsize(package), digest(package)
    except OSError as exc:
        return "it cannot be read ({})".format(exc.strerror or exc)
    if size != record.get("bytes") or sha != record.get("sha256"):
        return "its content is not what its record says ({} bytes, recorded {})".format(size, record.get("bytes"))
    return None


def set_aside(package: str) -> Optional[str]:
    """Rename a package that must not be loaded to ``NAME.bad`` (the last one kept); returns
    the new name, or None where the folder cannot be written."""
    bad = package + ".bad"
    try:
        os.replace(package, bad)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.unlink(record_path(package))
    return bad


def partial_path(package: str) -> str:
    """Where a compile writes ``package`` before it is whole: named by host and process, so
    that :func:`clean_partials` can tell a dead writer's file."""
    folder, name = os.path.split(package)
    return os.path.join(folder, "{}{}@{}@{}.pt2".format(PARTIAL, name[: -len(".pt2")], socket.gethostname(), os.getpid()))


def _alive(host: Any, pid: Any) -> bool:
    """False only for a process of this host that is gone."""
    if host != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return time.time()


def clean_partials(folder: str) -> None:
    """Remove partial packages whose process died (this host) or that are older than
    :data:`PARTIAL_SECONDS` (another host's), as a ``kill -9`` leaves them."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if not name.startswith(PARTIAL) or not name.endswith(".pt2"):
                continue
            parts = name[: -len(".pt2")].rsplit("@", 2)
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError, ValueError, IndexError):
                if not _alive(parts[1], int(parts[2])) or time.time() - os.path.getmtime(path) > PARTIAL_SECONDS:
                    os.unlink(path)


def ledger_path(package: str) -> str:
    return package[: -len(".pt2")] + ".paid"


def paid(package: str) -> float:
    """Eager seconds recorded for ``package``'s program on this machine."""
    value = (_read_json(ledger_path(package)) or {}).get("eager_seconds", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def pay(package: str, seconds: float) -> float:
    """Add ``seconds`` to the ledger (skipped where the folder cannot be written); the new total."""
    total = paid(package) + seconds
    with contextlib.suppress(OSError):
        _write_json(ledger_path(package), {"eager_seconds": total})
    return total


@contextlib.contextmanager
def locked(package: str) -> Iterator[Optional[Dict[str, Any]]]:
    """``with locked(path) as holder:`` holder is None while this process holds the lock of
    ``package`` (its pid, host and time, linked into place whole, removed at the end), else
    the holder's. A lock whose process died (this host) or older than :data:`LOCK_SECONDS` is
    taken over."""
    path = package[: -len(".pt2")] + ".lock"
    mine = partial_path(package[: -len(".pt2")] + "-lock.pt2")
    for _ in range(2):
        _write_json(mine, {"pid": os.getpid(), "host": socket.gethostname(), "at": time.time()})
        try:
            os.link(mine, path)
        except FileExistsError:
            holder = _read_json(path) or {"at": _mtime(path)}
            if _alive(holder.get("host"), holder.get("pid")) and time.time() - float(holder.get("at") or 0) <= LOCK_SECONDS:
                yield holder
                return
            with contextlib.suppress(OSError):
                os.unlink(path)  # stale: taken over
            continue
        finally:
            os.unlink(mine)
        try:
            yield None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return
    yield {"pid": "?", "host": "?"}
