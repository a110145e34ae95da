"""Every failure of the command is one line naming the file, layer or argument, and for the
user's own code the exception's type, message and origin; ``--debug`` adds the traceback."""
from __future__ import annotations

import os
import resource
import signal

import numpy as np
import pytest
import torch

import factories
from factories import OneSampleHead, batches, small_net
from cli_helpers import TRUST, load, run_cli
from precise_bn.checkpoint.formats import detect_format
from precise_bn.cli.failures import one_line
from precise_bn.report import table
from reference import assert_close_exact, float64_reference

FACTORIES = ["--model", "factories:small_net", "--data", "factories:batches"]


def _one_line_error(result, code=1):
    """The error line: the last one on stderr (log lines may come before it), and no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and lines and lines[-1].startswith("precise-bn: error: "), result
    assert "Traceback" not in result.stderr and sum(line.startswith("precise-bn: error") for line in lines) == 1
    return lines[-1]


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "c.pt"
    torch.save({"model": small_net().state_dict()}, str(path))
    return path


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_file_size_limit_during_the_save_is_one_line_and_leaves_nothing(ckpt, tmp_path, capsys, legacy):
    path = tmp_path / "old.pt"
    torch.save({"model": small_net().state_dict()}, str(path), _use_new_zipfile_serialization=not legacy)
    out = tmp_path / "out.pt"
    out.write_bytes(b"previous")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # smaller than the checkpoint: EFBIG
    try:
        result = run_cli(capsys, "recompute", path, *FACTORIES, "--output", out, "--overwrite", "-q", *TRUST)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    line = _one_line_error(result)
    assert "{}: writing failed (File too large)".format(out) in line
    assert out.read_bytes() == b"previous" and sorted(os.listdir(tmp_path)) == ["c.pt", "old.pt", "out.pt"]


def test_malformed_provenance_is_shown_not_fatal(tmp_path, capsys):
    from safetensors.torch import save_file

    state = small_net().state_dict()
    torch.save({"model": state, "precise_bn": "recomputed, trust me"}, str(tmp_path / "a.pt"))
    torch.save({"model": state, "precise_bn": {"iterations": torch.tensor(3)}}, str(tmp_path / "b.pt"))
    save_file(dict(state), str(tmp_path / "c.safetensors"), metadata={"precise_bn": "{not json"})
    for name, shown in (("a.pt", "'recomputed, trust me'"), ("b.pt", "'iterations': tensor(3)"),
                        ("c.safetensors", "'{not json'")):
        result = run_cli(capsys, "inspect", tmp_path / name, *TRUST)
        assert result.returncode == 0 and result.stderr == "", result
        assert "precise_bn entry, not in the form precise-bn writes" in result.stdout and shown in result.stdout
        assert "3 BatchNorm layers" in result.stdout


def test_cuda_without_cuda_is_refused_before_anything_runs(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    factories.READ["batches"] = 0
    result = run_cli(capsys, "recompute", ckpt, "--model", "factories:small_net", "--data",
                     "factories:counted_batches", "--device", "cuda", *TRUST)
    assert result.returncode == 2  # a usage error naming the flag
    assert result.stderr.strip().splitlines()[-1].startswith(
        "precise-bn recompute: error: argument --device: device 'cuda': this machine or torch build has no CUDA device")
    assert factories.READ["batches"] == 0


def test_a_batch_the_model_rejects_names_model_batch_origin_and_fix(ckpt, tmp_path, capsys):
    np.savez(str(tmp_path / "d.npz"), x=np.random.default_rng(0).normal(size=(9, 3, 8, 8)).astype(np.float32))
    result = run_cli(capsys, "recompute", ckpt, "--model", "factories:small_net", "--data",
                     "npz:{}".format(tmp_path / "d.npz"), "--batch-size", "4", *TRUST)
    line = _one_line_error(result)
    assert "--model 'factories:small_net' on batch 3 raised ValueError: Expected more than 1 value per channel" in line
    assert "(raised at torch/nn/functional.py:" in line and '"drop_last": true' in line
    assert not (tmp_path / "c.precise_bn.pt").exists()
    result = run_cli(capsys, "recompute", ckpt, "--model", "factories:small_net", "--data",
                     "npz:{}".format(tmp_path / "d.npz"), "--batch-size", "4", "--data-kwargs", '{"drop_last": true}',
                     "-q", *TRUST)
    assert result.returncode == 0, result.stderr


def test_the_users_own_line_is_named_when_a_library_raised(tmp_path, capsys):
    path = tmp_path / "h.pt"
    torch.save(OneSampleHead().state_dict(), str(path))
    result = run_cli(capsys, "recompute", path, "--model", "factories:one_sample_head", "--data",
                     "factories:batches", *TRUST)
    line = _one_line_error(result)
    source, number = OneSampleHead.forward.__code__.co_filename, OneSampleHead.forward.__code__.co_firstlineno
    here = "from {}:{} in forward".format(os.path.relpath(source), number + 2)
    assert "on batch 1 raised ValueError" in line and "functional.py" in line and here in line


@pytest.mark.parametrize("model,data,needle", [
    ("factories:small_net", "factories:broken_batches",
     "--data 'factories:broken_batches' (reading batch 3) raised OSError: [Errno 5] Input/output error reading "
     "shard 2 (raised at {factories}:"),
    ("factories:broken_factory", "factories:batches",
     "--model 'factories:broken_factory' raised RuntimeError: weights server unreachable (raised at "
     "{factories}:"),
], ids=["data", "model factory"])
def test_errors_of_the_users_data_and_factories_name_them(ckpt, tmp_path, capsys, model, data, needle):
    result = run_cli(capsys, "recompute", ckpt, "--model", model, "--data", data, *TRUST)
    assert needle.format(factories=os.path.relpath(factories.__file__)) in _one_line_error(result)
    assert not (tmp_path / "c.precise_bn.pt").exists()


def test_debug_adds_the_traceback(ckpt, capsys):
    result = run_cli(capsys, "recompute", ckpt, "--model", "factories:small_net", "--data",
                     "factories:broken_batches", "--debug", *TRUST)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr and "in broken_batches" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("precise-bn: error: --data")


def test_files_that_are_not_checkpoints_say_what_they_are(tmp_path, capsys):
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "run.ckpt").mkdir()
    (tmp_path / "gone.pt").symlink_to("nowhere.pt")
    for name, needle in (("empty.pt", "the file is empty (0 bytes)"), ("run.ckpt", "is a folder, not a checkpoint"),
                         ("gone.pt", "no such checkpoint file")):
        for command in (["recompute", tmp_path / name, *FACTORIES], ["inspect", tmp_path / name]):
            assert "{}: {}".format(tmp_path / name, needle) in _one_line_error(run_cli(capsys, *command, *TRUST))


def test_a_legacy_torch_file_named_pkl_is_read_as_one(tmp_path, capsys):
    torch.manual_seed(0)
    net = small_net()
    path = tmp_path / "model.pkl"
    torch.save({"state_dict": net.state_dict(), "epoch": 9}, str(path), _use_new_zipfile_serialization=False)
    result = run_cli(capsys, "recompute", path, *FACTORIES, "-q", *TRUST)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "model.precise_bn.pkl"
    assert out.read_bytes()[:2] == b"\x80\x02"  # still a legacy torch.save file, as the input
    written = load(out)
    assert written["epoch"] == 9
    for name, (mean, var, _) in float64_reference(net, batches()).items():
        assert_close_exact(written["state_dict"][name + ".running_mean"], written["state_dict"][name + ".running_var"],
                             mean, var, name)
    assert detect_format(str(out)) == "torch"  # and read back as one, not as a Caffe2 pickle


def test_ctrl_c_and_sigterm_stop_with_their_exit_status_and_write_nothing(ckpt, tmp_path, capsys):
    result = run_cli(capsys, "recompute", ckpt, "--model", "factories:small_net", "--data",
                     "factories:interrupted_batches", *TRUST)
    assert result.returncode == 130 and result.stderr.strip().endswith("precise-bn: interrupted")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    result = run_cli(capsys, "recompute", ckpt, "--model", "factories:small_net", "--data",
                     "factories:terminated_batches", *TRUST)
    assert result.returncode == 128 + signal.SIGTERM and "stopped by a termination signal" in result.stderr
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert sorted(os.listdir(tmp_path)) == ["c.pt"]


def test_an_error_inside_precise_bn_is_one_line_with_its_place():
    with pytest.raises(IndexError) as raised:
        table([])
    line = one_line(raised.value)
    assert line.startswith("IndexError: list index out of range (raised at precise_bn/report.py:")
    assert line.endswith("; --debug shows the traceback")


@pytest.mark.parametrize("content", [b"epoch: 12\nlr: 0.1\n", b"\x00\x01binary junk of no known kind"])
def test_a_file_in_no_known_format_is_called_so_with_its_first_bytes(tmp_path, capsys, content):
    path = tmp_path / "notes.pt"
    path.write_bytes(content)
    for command in (["recompute", path, *FACTORIES], ["inspect", path]):
        line = _one_line_error(run_cli(capsys, *command))
        assert line == "precise-bn: error: {}: neither a PyTorch checkpoint (a zip archive or a pickle), a pickle nor " \
                       "a safetensors file; it begins with {!r}".format(path, content[:16])
        assert "trust" not in line


def test_a_safetensors_file_is_recognised_by_its_header_whatever_its_name(tmp_path, capsys):
    safetensors = pytest.importorskip("safetensors.torch")
    state = small_net().state_dict()
    path = tmp_path / "model.pt"
    path.write_bytes(safetensors.save({k: v.contiguous() for k, v in state.items()}))
    assert detect_format(str(path)) == "safetensors" and detect_format(str(tmp_path / "new.pt")) == "torch"
    result = run_cli(capsys, "inspect", path)
    assert result.returncode == 0 and "safetensors checkpoint" in result.stdout, result


def test_ctrl_c_while_the_package_is_still_importing_is_one_line_and_130(capsys, monkeypatch):
    import importlib.abc
    import sys

    from precise_bn.__main__ import main  # the console script's entry point

    class Interrupted(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "precise_bn.cli":
                raise KeyboardInterrupt  # as Ctrl-C would, in the middle of ``import torch``
            return None

    monkeypatch.delitem(sys.modules, "precise_bn.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted()] + sys.meta_path)
    monkeypatch.setattr(sys, "argv", ["precise-bn", "inspect", "x.pt"])
    assert main() == 130
    out, err = capsys.readouterr()
    assert out == "" and err == "precise-bn: interrupted\n"


def test_a_closed_pipe_ends_inspect_quietly_with_status_0(ckpt, tmp_path):
    import subprocess
    import sys

    path = ckpt
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write meets EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "precise_bn", "inspect", str(path), *TRUST], stdout=write,
                              stderr=subprocess.PIPE, timeout=600, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    finally:
        os.close(write)
    assert done.returncode == 0 and done.stderr == b"", done.stderr.decode()


@pytest.mark.parametrize("flag, value, says", [
    ("--rtol", "2", "expected a number between 0 and 1, such as 0.01, got 2"), ("--rtol", "0", "between 0 and 1"),
    ("--rtol", "nan", "between 0 and 1"), ("--rtol", "x", "expected a number between 0 and 1, such as 0.01, got 'x'"),
    ("--device", "gpu7", "device 'gpu7' is not a device"), ("--min-batches", "0", "expected a positive integer"),
    ("--timeout", "-1", "expected a positive number"),
])
def test_a_bad_option_value_is_a_usage_error_naming_the_flag(ckpt, capsys, flag, value, says):
    factories.READ["batches"] = 0
    result = run_cli(capsys, "recompute", ckpt, "--model", "factories:small_net", "--data",
                     "factories:counted_batches", flag, value, *TRUST)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last.startswith("precise-bn recompute: error: argument {}: ".format(flag)), last
    assert says in last and factories.READ["batches"] == 0
    assert "None" not in last  # a command line has no None


@pytest.mark.parametrize("sub, output", [("recompute", "--output"), ("check", "--report")])
def test_a_malformed_spec_is_a_usage_error_before_any_file_is_looked_at(ckpt, tmp_path, capsys, sub, output):
    """Exit 2 with the spec's one line and hint, in the same run as an output that exists (which
    would be refused too): nothing read, nothing written."""
    existing = tmp_path / "out"
    existing.write_bytes(b"work")
    (tmp_path / "imgs").mkdir()
    cases = [
        (["--model", "build", "--data", "factories:counted_batches"],
         "--model 'build': expected package.module:callable, torchvision:NAME or timm:NAME"),
        (["--model", "factories:small_net", "--data", str(tmp_path / "imgs")],
         "--data {!r}: expected package.module:callable, imagefolder:DIR or npz:FILE[:KEY]; did you mean "
         "imagefolder:{}?".format(str(tmp_path / "imgs"), tmp_path / "imgs")),
        (["--model", "factories:small_net", "--data", "npz:"], "--data 'npz:': expected package.module:callable"),
        (["--model", "factories:small_net", "--data", "factories:counted_batches", "--augment"],
         "--augment: only imagefolder: data have built-in augmentation"),
        (["--model", "factories:small_net", "--data", "factories:counted_batches", "--forward-fn", "image_forward"],
         "--forward-fn 'image_forward': expected 'package.module:name'"),
        (["--model", "factories:small_net", "--data", "factories:counted_batches", "--caffe2-rules", "rules"],
         "--caffe2-rules 'rules': expected 'package.module:name'"),
    ]
    for args, says in cases:
        factories.READ["batches"] = 0
        result = run_cli(capsys, sub, ckpt, *args, output, existing, *TRUST)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and lines[0].startswith("usage: precise-bn {}".format(sub)), result
        assert lines[-1].startswith("precise-bn {}: error: {}".format(sub, says)), lines[-1]
        assert "refusing" not in result.stderr and factories.READ["batches"] == 0
    assert existing.read_bytes() == b"work"


@pytest.mark.parametrize("sub", ["inspect", "convert"])
def test_a_malformed_rules_spec_is_a_usage_error_of_inspect_and_convert(ckpt, tmp_path, capsys, sub):
    args = [ckpt, tmp_path / "out.pkl"] if sub == "convert" else [ckpt]
    result = run_cli(capsys, sub, *args, "--caffe2-rules", "rules", *TRUST)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last == "precise-bn {}: error: --caffe2-rules 'rules': expected " \
        "'package.module:name'".format(sub), result
    assert not (tmp_path / "out.pkl").exists()


def test_a_short_pass_of_the_commands_default_budget_says_it_was_the_default(ckpt, tmp_path, capsys):
    result = run_cli(capsys, "recompute", ckpt, *FACTORIES, "--output", tmp_path / "out.pt", "-q", *TRUST)
    assert result.returncode == 0, result.stderr
    assert "the data ran out after 5 batches, before the default --num-batches=200" in result.stderr
    result = run_cli(capsys, "recompute", ckpt, *FACTORIES, "--num-batches", "200", "--output", tmp_path / "o2.pt",
                     "-q", *TRUST)
    assert "the data ran out after 5 batches; --num-batches=200 was asked for" in result.stderr, result.stderr
