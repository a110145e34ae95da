"""Atomic file replacement: a crash mid-write leaves the old file, never a torn one."""
from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable, Union

PathLike = Union[str, "os.PathLike[str]"]


def _mode_for(path: str) -> int:
    """The replaced file's permissions, or for a new file what ``open()`` would give it
    (``mkstemp`` creates its file private, 0600)."""
    if os.path.exists(path):
        return os.stat(path).st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(fileobj)`` into a temporary file in the same folder,
    fsync it, then rename it over ``path`` (atomic on POSIX) and fsync the folder.

    The temporary file is removed if ``write`` fails, whatever the exception.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
