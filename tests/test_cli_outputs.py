"""The command never destroys what it did not mean to write: every output is checked before the
pass, links and owners are kept, and temporary files are recognisable."""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import factories
from factories import batches, trained_net
from cli_helpers import TRUST, assert_same_except, bn_paths, load, run_cli, without
from precise_bn.atomic import SUFFIX, TAG
from reference import assert_close_exact, float64_reference

COUNTED = ["--model", "factories:small_net", "--data", "factories:counted_batches"]
BN_NAMES = ("1", "4", "9")


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint of small_net with stats a few training batches left."""
    net = trained_net()
    path = tmp_path / "c.pt"
    torch.save({"model": net.state_dict(), "epoch": 4}, str(path))
    factories.READ["batches"] = 0
    return path, net


def _refused(capsys, ckpt_path, *args):
    """Run ``recompute`` expecting a refusal before the first batch; return the error line."""
    before = ckpt_path.read_bytes()
    result = run_cli(capsys, "recompute", ckpt_path, *COUNTED, *args, "-q", *TRUST)
    assert result.returncode == 1, result
    assert factories.READ["batches"] == 0, "the pass ran before the refusal"
    assert ckpt_path.read_bytes() == before
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("precise-bn: error: "), result.stderr
    return lines[0]


def _check_stats(state, net, prefix=""):
    for name, (mean, var, _) in float64_reference(net, batches()).items():
        assert_close_exact(state[prefix + name + ".running_mean"], state[prefix + name + ".running_var"], mean, var, name)


def test_outputs_that_would_destroy_an_input_or_each_other_are_refused(ckpt, tmp_path, capsys):
    path, _ = ckpt
    (tmp_path / "link.pt").symlink_to(path.name)
    os.link(path, tmp_path / "hard.pt")
    np.savez(str(tmp_path / "d.npz"), x=np.zeros((4, 3, 8, 8), np.float32))
    cases = [
        (["--report", path], "--report {}: refusing to overwrite the checkpoint".format(path)),
        (["--output", tmp_path / "link.pt"], "(through a link); pass --in-place"),
        (["--output", tmp_path / "hard.pt"], "refusing to overwrite the checkpoint"),
        (["--output", tmp_path / "o.pt", "--report", tmp_path / "o.pt"], "are the same file"),
        (["--report", tmp_path / "c.precise_bn.pt"], "--output {} and --report".format(tmp_path / "c.precise_bn.pt")),
        (["--in-place", "--break-hardlinks", "--report", tmp_path / "link.pt"], "refusing to overwrite the checkpoint"),
        (["--output", tmp_path], "is a folder"),
    ]
    for args, needle in cases:
        assert needle in _refused(capsys, path, *args), args
    npz_args = ["--model", "factories:small_net", "--data", "npz:{}".format(tmp_path / "d.npz"),
                "--report", tmp_path / "d.npz", "-q", *TRUST]
    result = run_cli(capsys, "recompute", path, *npz_args)
    assert result.returncode == 1 and "refusing to overwrite --data" in result.stderr
    assert np.load(str(tmp_path / "d.npz"))["x"].shape == (4, 3, 8, 8)
    assert sorted(os.listdir(tmp_path)) == ["c.pt", "d.npz", "hard.pt", "link.pt"]


@contextlib.contextmanager
def _unprivileged():
    """Act as a user without root's right to write anywhere (root itself ignores permissions)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_unwritable_outputs_are_refused_before_the_pass(ckpt, tmp_path, capsys):
    path, _ = ckpt
    limit = os.pathconf(str(tmp_path), "PC_NAME_MAX")
    too_long = tmp_path / ("n" * (limit - 2) + ".pt")
    assert "does not exist" in _refused(capsys, path, "--output", tmp_path / "missing" / "o.pt")
    assert "longer than this file system allows" in _refused(capsys, path, "--output", too_long)
    assert "the folder {} does not exist".format(path) in _refused(capsys, path, "--report", path / "r.json")
    shared = tempfile.mkdtemp()  # reachable by any user: the test's own folder may not be
    try:
        os.chmod(shared, 0o755)
        readonly = os.path.join(shared, "ro")
        os.mkdir(readonly, 0o555)
        shutil.copy(str(path), os.path.join(shared, "c.pt"))
        os.chmod(os.path.join(shared, "c.pt"), 0o644)
        with _unprivileged():
            line = _refused(capsys, Path(shared) / "c.pt", "--output", os.path.join(readonly, "o.pt"))
        assert "cannot write in {} (Permission denied)".format(readonly) in line
    finally:
        os.chmod(os.path.join(shared, "ro"), 0o755)
        shutil.rmtree(shared)


def test_a_file_of_another_user_is_refused_unless_root(ckpt, tmp_path, capsys, monkeypatch):
    path, _ = ckpt
    (tmp_path / "c.precise_bn.pt").write_bytes(b"someone's file")
    owner = os.stat(tmp_path / "c.precise_bn.pt").st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # anyone but root and the owner
    assert "belongs to user id {}".format(owner) in _refused(capsys, path, "--overwrite")
    assert (tmp_path / "c.precise_bn.pt").read_bytes() == b"someone's file"


def test_in_place_through_a_link_rewrites_the_target_and_keeps_mode_and_owner(ckpt, tmp_path, capsys):
    path, net = ckpt
    original = load(path)
    os.chmod(path, 0o640)
    owner = (1234, 1234) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    os.chown(path, *owner)
    link = tmp_path / "last.ckpt"
    link.symlink_to(path.name)
    result = run_cli(capsys, "recompute", link, "--model", "factories:small_net", "--data", "factories:batches",
                     "--in-place", "-q", *TRUST)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == path.name
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o640 and (st.st_uid, st.st_gid) == owner
    written = load(path)
    assert_same_except(original, without(written, "precise_bn"), bn_paths(("model",), "", BN_NAMES))
    _check_stats(written["model"], net)
    assert sorted(os.listdir(tmp_path)) == ["c.pt", "last.ckpt"]


def test_a_hard_linked_output_needs_break_hardlinks(ckpt, tmp_path, capsys):
    path, net = ckpt
    out, other = tmp_path / "out.pt", tmp_path / "backup.pt"
    out.write_bytes(b"previous result")
    os.link(out, other)
    line = _refused(capsys, path, "--output", out, "--overwrite")
    assert "2 hard links" in line and "--break-hardlinks" in line
    result = run_cli(capsys, "recompute", path, *COUNTED, "--output", out, "--overwrite", "--break-hardlinks", "-q",
                     *TRUST)
    assert result.returncode == 0, result.stderr
    assert other.read_bytes() == b"previous result" and out.stat().st_nlink == 1
    _check_stats(load(out)["model"], net)


def test_stale_temporaries_are_reported_and_kept_and_each_file_is_announced_once(ckpt, tmp_path, capsys):
    path, _ = ckpt
    stale = tmp_path / (".c.precise_bn.pt" + TAG + "k9x2m4q1" + SUFFIX)
    stale.write_bytes(b"\0" * 2048)
    result = run_cli(capsys, "recompute", path, *COUNTED, "--report", tmp_path / "r.json", *TRUST)
    assert result.returncode == 0, result.stderr
    assert str(stale) in result.stderr and "did not finish" in result.stderr and stale.exists()
    for written in (tmp_path / "c.precise_bn.pt", tmp_path / "r.json"):
        assert result.stderr.count("wrote {}".format(written)) == 1, result.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["c.pt", "c.precise_bn.pt", "r.json", stale.name])


@pytest.mark.main_env
def test_inspect_plot_over_an_input_is_refused_before_loading(ckpt, tmp_path, capsys):
    path, _ = ckpt
    other = tmp_path / "other.png"
    other.write_bytes(b"not a checkpoint: inspect never reads it before checking the plot path")
    before = path.read_bytes()
    result = run_cli(capsys, "inspect", path, "--against", other, "--plot", other, *TRUST)
    assert result.returncode == 1 and "--plot {}: refusing to overwrite --against".format(other) in result.stderr
    assert path.read_bytes() == before and result.stdout == ""


@pytest.mark.parametrize("flag", ["--output", "--report"])
def test_an_existing_output_is_refused_before_the_pass_unless_overwrite(ckpt, tmp_path, capsys, flag):
    path, net = ckpt
    existing = tmp_path / ("other.pt" if flag == "--output" else "other.json")
    existing.write_bytes(b"someone's work")
    line = _refused(capsys, path, flag, existing)
    assert "{} {}: the file exists; pass --overwrite".format(flag, existing) in line
    assert existing.read_bytes() == b"someone's work"
    assert not (tmp_path / "c.precise_bn.pt").exists()  # nothing else written either
    result = run_cli(capsys, "recompute", path, *COUNTED, flag, existing, "--overwrite", "-q", *TRUST)
    assert result.returncode == 0, result.stderr
    assert existing.read_bytes() != b"someone's work"


def test_the_default_output_of_an_earlier_run_is_kept_unless_overwrite(ckpt, tmp_path, capsys):
    path, _ = ckpt
    assert run_cli(capsys, "recompute", path, *COUNTED, "-q", *TRUST).returncode == 0
    first = (tmp_path / "c.precise_bn.pt").read_bytes()
    factories.READ["batches"] = 0
    assert "c.precise_bn.pt: the file exists" in _refused(capsys, path)
    assert (tmp_path / "c.precise_bn.pt").read_bytes() == first


def test_inspect_plot_refuses_an_existing_file_before_reading_anything(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    torch.save(trained_net().state_dict(), str(tmp_path / "a.pt"))
    plot = tmp_path / "drift.png"
    plot.write_bytes(b"old")
    result = run_cli(capsys, "inspect", tmp_path / "a.pt", "--against", tmp_path / "a.pt", "--plot", plot, *TRUST)
    assert result.returncode == 1 and result.stdout == ""  # refused before the checkpoints were read
    assert result.stderr.strip() == "precise-bn: error: --plot {}: the file exists; pass --overwrite to replace " \
                                    "it, or choose another name".format(plot)
    assert plot.read_bytes() == b"old"
