"""atomic_write: all or nothing, with the permissions a plain write would give."""
from __future__ import annotations

import os
import stat

import pytest

from precise_bn.atomic import atomic_write


def test_new_file_gets_umask_permissions_and_replaced_file_keeps_its_own(tmp_path):
    target = tmp_path / "out.bin"
    atomic_write(target, lambda f: f.write(b"one"))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    os.chmod(target, 0o640)
    atomic_write(target, lambda f: f.write(b"two"))
    assert target.read_bytes() == b"two"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt()])
def test_failure_mid_write_leaves_old_file_and_no_temporary(tmp_path, exc):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")

    def write(handle):
        handle.write(b"partial")
        raise exc

    with pytest.raises(type(exc)):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["ckpt.pt"]
