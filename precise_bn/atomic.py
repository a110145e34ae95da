"""Atomic file replacement: a crash mid-write leaves the old file, never a torn one; a temporary
file next to the target, renamed over it, removed on any failure (rules: docs/cli.md, "Outputs")."""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import BinaryIO, Callable, List, Union

from .signals import relayed

PathLike = Union[str, "os.PathLike[str]"]

#: Marks our temporary files: ``.NAME`` + TAG + random characters + SUFFIX.
TAG = ".precise-bn-"
SUFFIX = ".tmp"
_RANDOM = 8  # characters tempfile adds to a name


def name_max(folder: str) -> int:
    """The longest file name, in bytes, the file system under ``folder`` accepts."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def _temp_prefix(path: str) -> str:
    """``.NAME.precise-bn-`` with NAME cut (in bytes) so that the whole temporary name fits."""
    room = name_max(os.path.dirname(path)) - (1 + len(TAG) + _RANDOM + len(SUFFIX))
    base = os.fsencode(os.path.basename(path))[: max(room, 1)]
    return "." + os.fsdecode(base) + TAG


def stale_temporaries(path: PathLike) -> List[str]:
    """Temporary files of ours for ``path`` still there (a write killed outright, or still running)."""
    path = os.path.realpath(os.fspath(path))
    folder, prefix = os.path.dirname(path), _temp_prefix(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(os.path.join(folder, n) for n in names
                  if n.startswith(prefix) and n.endswith(SUFFIX) and len(n) == len(prefix) + _RANDOM + len(SUFFIX))


def probe(path: PathLike) -> None:
    """Create and remove the temporary file :func:`atomic_write` would use: a write's ``OSError`` now."""
    path = os.path.realpath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=SUFFIX, dir=os.path.dirname(path))
    os.close(fd)
    os.unlink(tmp)


def _keep_mode_and_owner(path: str, tmp: str) -> None:
    """``tmp`` gets the replaced file's mode and owner, or ``open()``'s mode (``mkstemp``'s is 0600)."""
    try:
        old = os.stat(path)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        return
    new = os.stat(tmp)
    if (old.st_uid, old.st_gid) != (new.st_uid, new.st_gid):
        root = os.geteuid() == 0
        try:
            os.chown(tmp, old.st_uid if root else -1, old.st_gid)
        except PermissionError:
            if root:
                raise
    os.chmod(tmp, stat.S_IMODE(old.st_mode))  # after chown, which may clear set-id bits


def atomic_write(path: PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(fileobj)``: a temporary file in its folder, fsynced, renamed
    over it, the folder fsynced. A symbolic link's target is replaced; mode and owner kept."""
    path = os.path.realpath(os.fspath(path))
    folder = os.path.dirname(path)
    with relayed(terminate=True):
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=SUFFIX, dir=folder)
        try:
            with os.fdopen(fd, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            _keep_mode_and_owner(path, tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
