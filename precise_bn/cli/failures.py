"""Every failure of the command as one line: what failed, where, what to do. An error from the
user's code (model, data, ``--forward-fn``) becomes a :class:`UserCodeError` naming which raised,
where, and the user's last line before a library (``--debug``: the whole traceback)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import site
import sysconfig
import traceback
from typing import Any, Iterable, Iterator, List

from ..errors import CheckpointError, Fix, PreciseBNError, join_fixes

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Messages of well-known failures, and what fixes them.
_HINTS = (
    ("Expected more than 1 value per channel when training",
     "a batch of one sample cannot be normalised in training mode: drop it with --data-kwargs "
     "'{\"drop_last\": true}' (npz:, imagefolder:) or in the data factory, or change --batch-size"),
)


class UserCodeError(PreciseBNError):
    """An exception raised by the user's model, data or factory while the command ran it."""


@functools.lru_cache(maxsize=None)
def _library_roots() -> List[str]:
    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    with contextlib.suppress(AttributeError):
        roots += site.getsitepackages() + [site.getusersitepackages()]
    return sorted({os.path.realpath(r) for r in roots} | {_PACKAGE}, key=len, reverse=True)


def _root_of(filename: str) -> str:
    path = os.path.realpath(filename)
    for root in _library_roots():
        if path.startswith(root + os.sep):
            return root
    return ""


def _short(filename: str) -> str:
    """A library file relative to its library folder, the user's relative to the current one."""
    root = _root_of(filename)
    if root == _PACKAGE:
        root = os.path.dirname(root)
    path = os.path.realpath(filename)
    if root:
        return os.path.relpath(path, root)
    return os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else filename


def origin(exc: BaseException) -> str:
    """Where ``exc`` was raised, and the user's last line on the way there if that differs."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "raised in code without a traceback"
    last = frames[-1]
    text = "raised at {}:{} in {}".format(_short(last.filename), last.lineno, last.name)
    user = [f for f in frames if not _root_of(f.filename)]
    if user and user[-1] is not last:
        text += ", from {}:{} in {}".format(_short(user[-1].filename), user[-1].lineno, user[-1].name)
    return text


def raised_in_package(exc: BaseException) -> bool:
    """True when the innermost frame of ``exc`` is precise-bn's own code."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and _root_of(frames[-1].filename) == _PACKAGE


def summary(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(exc).strip().splitlines()
    return "{}: {}".format(type(exc).__name__, lines[0]) if lines else type(exc).__name__


def blame(what: str, exc: BaseException) -> UserCodeError:
    """``what`` raised ``exc``: the one-line error, with a hint for well-known messages."""
    hints = [hint for needle, hint in _HINTS if needle in str(exc)]
    return UserCodeError("{} raised {} ({}){}".format(what, summary(exc), origin(exc),
                                                      "".join("; " + h for h in hints)))


@contextlib.contextmanager
def blamed_on(what: str) -> Iterator[None]:
    """Re-raise any exception of the block that is not the package's own as :func:`blame`."""
    try:
        yield
    except PreciseBNError:
        raise
    except Exception as exc:
        raise blame(what, exc) from exc


class BlamedBatches:
    """``data``'s batches; an exception reading one is blamed on ``what``, with its number."""

    def __init__(self, data: Iterable[Any], what: str):
        self.data, self.what, self.read = data, what, 0

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]  # TypeError when it has none, as len() would

    def __iter__(self) -> Iterator[Any]:
        with blamed_on(self.what):
            batches = iter(self.data)
        while True:
            with blamed_on("{} (reading batch {})".format(self.what, self.read + 1)):
                try:
                    batch = next(batches)
                except StopIteration:
                    return
            self.read += 1
            yield batch


#: Keyword arguments whose flag is not ``--`` and the name with dashes.
_FLAGS = {"trust": "--trust-checkpoint"}


def as_flag(fix: Fix) -> str:
    """A :class:`~precise_bn.errors.Fix` as the flag that makes it, quoted for a shell."""
    name = _FLAGS.get(fix.option, "--" + fix.option.replace("_", "-"))
    if fix.value is True:
        return name
    text = json.dumps(fix.value) if isinstance(fix.value, (dict, list)) else str(fix.value)
    return "{} {}".format(name, shlex.quote(text))


def one_line(exc: BaseException) -> str:
    """The message ``precise-bn: error:`` is followed by (a checkpoint error's fixes as flags)."""
    if isinstance(exc, CheckpointError):
        return join_fixes(exc.message, [as_flag(f) for f in exc.fixes], exc.fixes)
    if isinstance(exc, PreciseBNError):
        return str(exc)
    return "{} ({}); --debug shows the traceback".format(summary(exc), origin(exc))
