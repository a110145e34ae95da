"""atomic_write: all or nothing, with the permissions and owner the file had, through links,
and never a temporary file left behind by a failure, SIGTERM included."""
from __future__ import annotations

import os
import signal
import stat

import pytest

from precise_bn.atomic import SUFFIX, TAG, atomic_write, name_max, probe, stale_temporaries
from precise_bn.signals import Terminated


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


def test_a_link_is_written_through_and_stays_a_link(tmp_path):
    target, link = tmp_path / "epoch=3.ckpt", tmp_path / "last.ckpt"
    target.write_bytes(b"old")
    link.symlink_to(target.name)
    atomic_write(link, lambda f: f.write(b"new"))
    assert link.is_symlink() and os.readlink(link) == target.name
    assert target.read_bytes() == b"new"


def test_replaced_file_keeps_its_owner(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    owner = (1234, 1234) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    os.chown(target, *owner)  # only root can give a file away; anyone else keeps their own
    atomic_write(target, lambda f: f.write(b"new"))
    st = target.stat()
    assert (st.st_uid, st.st_gid) == owner and stat.S_IMODE(st.st_mode) == 0o640


def test_temporary_name_is_recognisable_and_fits_the_name_limit(tmp_path):
    seen = []
    long_name = "m" * (name_max(str(tmp_path)) - 3) + ".pt"

    def write(handle):
        seen.extend(n for n in os.listdir(tmp_path) if n.startswith("."))
        handle.write(b"x")

    for name in ("ckpt.pt", long_name):
        atomic_write(tmp_path / name, write)
    short, long_ = seen
    assert short.startswith(".ckpt.pt" + TAG) and short.endswith(SUFFIX)
    assert long_.startswith(".mmm") and TAG in long_ and len(long_.encode()) <= name_max(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", long_name])


def test_stale_temporaries_are_found_for_their_target_only(tmp_path):
    target = tmp_path / "ckpt.pt"
    stale = tmp_path / (".ckpt.pt" + TAG + "abcd1234" + SUFFIX)
    for name in (stale.name, ".other.pt" + TAG + "abcd1234" + SUFFIX, ".ckpt.pt.swp"):
        (tmp_path / name).write_bytes(b"")
    assert stale_temporaries(target) == [str(stale)]


def test_sigterm_during_a_write_removes_the_temporary_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")

    def write(handle):
        handle.write(b"partial")
        # Inside the write SIGTERM raises instead of killing (checked first, so that a broken
        # handler fails this test rather than ending the test process).
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)

    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with pytest.raises(Terminated) as stopped:
        atomic_write(target, write)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["ckpt.pt"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_probe_meets_what_a_write_would(tmp_path):
    probe(tmp_path / "ok.pt")
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        probe(tmp_path / "missing" / "x.pt")
