"""Where a command may write: a pass writes at its end, hours in, so every output is resolved and
checked before the first batch, a refusal naming the option and the fix (docs/cli.md, "Outputs")."""
from __future__ import annotations

import logging
import os
import time
from typing import List, Sequence, Tuple

from ..atomic import name_max, probe, stale_temporaries
from ..errors import CheckpointError, Fix

logger = logging.getLogger("precise_bn")

#: ``(label, path)``: the label is how the user named the file (``--report``, ``the checkpoint``).
Named = Tuple[str, str]


def _same(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _how(a: str, b: str) -> str:
    if os.path.abspath(a) == os.path.abspath(b):
        return ""
    return " (through a link)"


def _check_file(label: str, path: str, break_hardlinks: bool, overwrite: bool) -> None:
    """An existing output: a file we were asked to replace and may replace without harm."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if os.path.isdir(path):
        raise CheckpointError("{} {}: is a folder; name a file to write".format(label, path))
    if not overwrite:
        raise CheckpointError("{} {}: the file exists".format(label, path),
                              Fix("overwrite", True, "to replace it, or choose another name"))
    if st.st_nlink > 1 and not break_hardlinks:
        raise CheckpointError(
            "{} {}: the file has {} hard links, and replacing it would leave the other names with the old "
            "content".format(label, path, st.st_nlink), Fix("break_hardlinks", True, "to replace this name only"))
    if os.geteuid() != 0 and st.st_uid != os.geteuid():
        raise CheckpointError(
            "{} {}: the file belongs to user id {}; replacing it would make it yours and could lock its owner "
            "out: run as its owner (or root), or write elsewhere".format(label, path, st.st_uid))


def _check_folder(label: str, path: str) -> None:
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise CheckpointError("{} {}: the folder {} does not exist".format(label, path, folder))
    limit = name_max(folder)
    if len(os.fsencode(os.path.basename(path))) > limit:
        raise CheckpointError("{} {}: the file name is {} bytes, longer than this file system allows ({}); "
                              "choose a shorter name".format(label, path, len(os.fsencode(os.path.basename(path))),
                                                             limit))
    try:
        probe(path)
    except OSError as exc:
        raise CheckpointError("{} {}: cannot write in {} ({}); choose another folder".format(
            label, path, folder, exc.strerror or exc)) from exc


def _report_stale(label: str, path: str) -> None:
    for tmp in stale_temporaries(path):
        try:
            st = os.stat(tmp)
        except OSError:
            continue
        logger.warning("%s %s: a temporary file of an earlier write that did not finish is still there: %s "
                       "(%.1f MB, %.1f h old); delete it unless another precise-bn is writing %s now",
                       label, path, tmp, st.st_size / 1e6, (time.time() - st.st_mtime) / 3600, path)


def check_paths(inputs: Sequence[Named], outputs: Sequence[Named], *, in_place: bool = False,
                break_hardlinks: bool = False, overwrite: bool = False) -> List[str]:
    """Check ``outputs`` against ``inputs`` and each other; return each resolved through links.
    ``in_place``: the first output replaces the first input without ``overwrite``."""
    resolved = [os.path.realpath(path) for _, path in outputs]
    for i, (label, path) in enumerate(outputs):
        for j, (in_label, source) in enumerate(inputs):
            if in_place and i == 0 and j == 0:
                if not _same(path, source):
                    raise CheckpointError("{}: {} writes the checkpoint itself, not {}".format(source, label, path))
            elif _same(path, source):
                fixes = [Fix("in_place", True, "to replace it, or choose another output")] \
                    if label == "--output" and j == 0 else []
                raise CheckpointError("{} {}: refusing to overwrite {} {}{}{}".format(
                    label, path, in_label, source, _how(path, source), "" if fixes else "; choose another file"),
                    *fixes)
        for other_label, other in outputs[:i]:
            if _same(path, other):
                raise CheckpointError("{} {} and {} {} are the same file{}; give each its own".format(
                    other_label, other, label, path, _how(path, other)))
        _check_folder(label, resolved[i])
        _check_file(label, resolved[i], break_hardlinks, overwrite or (in_place and i == 0))
        _report_stale(label, resolved[i])
    return resolved


def check_output(source: str, output: str, in_place: bool, *, break_hardlinks: bool = False,
                 overwrite: bool = False) -> str:
    """:func:`check_paths` for one ``output`` and its ``source``; the file that will be written."""
    return check_paths([("the input", source)], [("the output", output)], in_place=in_place,
                       break_hardlinks=break_hardlinks, overwrite=overwrite)[0]
