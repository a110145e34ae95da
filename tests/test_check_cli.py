"""``precise-bn check``: exit 0 when the checkpoint's BN statistics fit, 1 when a layer is stale
(named, with its worst channel and the ``recompute`` command that fixes it), 2 when the data
could not test every channel (one line says which and what data would) and on a usage error;
nothing written but the report; under ``torchrun`` the ranks merge as ``recompute``'s do."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

from cli_helpers import REPO, TESTS, TRUST, load, run_cli, torchrun
from precise_bn import recompute
from precise_bn.cli import main
from precise_bn.digits import load_digits, make_model, train
from precise_bn.staleness import MIN_CALLS
from reference import assert_close_exact, float64_reference

MODEL = "precise_bn.digits:make_model"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A checkpoint with the EMA statistics 100 training steps left, the same weights with the
    statistics recomputed on the training images (``good.pt``) and with those variances 40 times
    too large (``var40.pt``), and the training images."""
    folder = tmp_path_factory.mktemp("check")
    train_x, train_y, _, _ = load_digits()
    torch.manual_seed(0)
    model = train(make_model(), train_x, train_y, steps=100, batch_size=32, seed=0)
    torch.save({"model": model.state_dict(), "epoch": 3}, str(folder / "ema.pt"))
    recompute(model, list(train_x.split(32)), progress=False)
    torch.save({"model": model.state_dict()}, str(folder / "good.pt"))
    state = {key: value * 40 if key.endswith(".running_var") else value for key, value in model.state_dict().items()}
    torch.save({"model": state}, str(folder / "var40.pt"))
    np.savez(str(folder / "train.npz"), x=train_x.numpy())
    return folder


def _args(folder, checkpoint="ema.pt", budget=("--num-samples", "1347")):
    return [folder / checkpoint, "--model", MODEL, "--data", "npz:{}:x".format(folder / "train.npz"),
            *budget, "-q", *TRUST]


def _listing(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_stale_statistics_exit_1_naming_each_layer_and_the_fix_that_works(files, capsys, tmp_path):
    before = _listing(files)
    result = run_cli(capsys, "check", *_args(files))
    assert result.returncode == 1, result
    assert _listing(files) == before, "check wrote a file"
    lines = result.stdout.splitlines()
    stale = [line for line in lines if line.startswith("stale: layer ")]
    summary = lines[0]
    assert "stale: " in summary and stale
    for line in stale:
        name = line.split("'")[1]
        assert name in summary.split("stale: ")[1].split(", ")
        assert "channel" in line and "stored" in line and "measured" in line and "p = " in line
    fix = [line for line in lines if line.startswith("to fix: ")]
    assert len(fix) == 1 and fix[0].startswith("to fix: precise-bn recompute ")
    words = shlex.split(fix[0][len("to fix: "):])
    assert "--num-samples" in words and "--tolerance" not in words and "-q" not in words
    output = tmp_path / "fixed.pt"
    assert words[:2] == ["precise-bn", "recompute"]
    assert main(words[1:] + ["--output", str(output), "-q"] + TRUST) == 0
    capsys.readouterr()
    fixed = run_cli(capsys, "check", output, *_args(files)[1:])
    assert fixed.returncode == 0, fixed
    assert fixed.stdout.splitlines()[0].endswith("every layer fits") and "stale: layer" not in fixed.stdout
    assert len(fixed.stdout.splitlines()) == 1  # -q: the verdict, without the table
    table = run_cli(capsys, "check", output, *[a for a in _args(files)[1:] if a != "-q"])
    assert table.returncode == 0 and any(line.split()[-1] == "fits" for line in table.stdout.splitlines()[2:6])


def test_the_report_is_the_only_write_and_refuses_to_replace_a_file(files, capsys, tmp_path):
    report = tmp_path / "verdict.json"
    result = run_cli(capsys, "check", *_args(files), "--report", report, "--tolerance", "0.5", "1", "--alpha", "0.05")
    assert result.returncode in (0, 1)
    body = json.loads(report.read_text())
    assert body["checkpoint"] == str(files / "ema.pt") and body["tolerance"] == {"mean": 0.5, "var": 1.0}
    assert body["alpha"] == 0.05 and [layer["name"] for layer in body["layers"]] == ["1", "4", "7", "11"]
    assert body["stale"] == [layer["name"] for layer in body["layers"] if layer["verdict"] == "stale"]
    assert result.returncode == {"fits": 0, "stale": 1, "untested": 2}[body["verdict"]]
    before = report.read_bytes()
    again = run_cli(capsys, "check", *_args(files), "--report", report)
    assert again.returncode == 1 and "--overwrite" in again.stderr and report.read_bytes() == before
    assert run_cli(capsys, "check", *_args(files), "--report", report, "--overwrite").returncode == 1
    assert json.loads(report.read_text())["tolerance"]["mean"] == 0.05
    refused = run_cli(capsys, "check", *_args(files), "--report", files / "ema.pt")
    assert refused.returncode == 1 and "refusing to overwrite the checkpoint" in refused.stderr


def _one_batch_line(files):
    """The line one batch of the training images must give: every channel with a variance on
    that batch (a float64 reference), by layer, and the batches a verdict needs."""
    model = make_model()
    model.load_state_dict(load(files / "good.pt")["model"])
    reference = float64_reference(model, [load_digits()[0][:32]])
    counts = {name: int((var > 0).sum()) for name, (_, var, _) in reference.items()}
    total = sum(counts.values())
    return counts, ("untested: {} channels could not be tested (layers {}): too few calls ({}): a verdict needs "
                    "at least {} batches ({} calls of each layer); this run read 1").format(
        total, ", ".join("'{}' {}".format(name, count) for name, count in counts.items()), total, MIN_CALLS,
        MIN_CALLS)


@pytest.mark.parametrize("checkpoint", ["var40.pt", "good.pt"])
def test_one_batch_is_no_verdict_exit_2_even_on_variances_40_times_too_large(files, capsys, tmp_path, checkpoint):
    counts, expected = _one_batch_line(files)
    assert sorted(counts) == ["1", "11", "4", "7"] and sum(counts.values()) == 176
    report = tmp_path / "verdict.json"
    result = run_cli(capsys, "check", *_args(files, checkpoint, ("--num-batches", "1")), "--report", report)
    assert result.returncode == 2, result
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[1] == expected, lines  # -q: the summary, then the one line
    assert lines[0].endswith("no verdict: 176 channels untested in 4 layers") and "every layer fits" not in lines[0]
    assert not result.stderr.strip()
    body = json.loads(report.read_text())
    assert body["verdict"] == "untested" and body["untested"] == counts and body["stale"] == []
    assert body["min_calls"] == MIN_CALLS and {layer["verdict"] for layer in body["layers"]} == {"untested"}
    table = run_cli(capsys, "check", *[a for a in _args(files, checkpoint, ("--num-batches", "1")) if a != "-q"])
    assert table.returncode == 2 and table.stdout.splitlines().count(expected) == 1
    assert [line.split()[-1] for line in table.stdout.splitlines()[2:6]] == ["untested"] * 4


def test_enough_batches_fit_and_stale_wins_over_untested(files, capsys, tmp_path):
    """The good statistics, checked on every image, fit; the variances 40 times too large are
    stale on 8 batches, too few calls for any layer to be tested fit (MIN_CALLS): stale decides, and the untested line is left out, as recomputing fixes every channel alike."""
    good = run_cli(capsys, "check", *_args(files, "good.pt"))
    assert good.returncode == 0 and len(good.stdout.splitlines()) == 1, good
    assert good.stdout.rstrip().endswith("every layer fits")
    report = tmp_path / "verdict.json"
    stale = run_cli(capsys, "check", *_args(files, "var40.pt", ("--num-batches", "8")), "--report", report)
    assert stale.returncode == 1, stale
    body = json.loads(report.read_text())
    assert body["verdict"] == "stale" and body["untested"], body["untested"]
    lines = stale.stdout.splitlines()
    assert lines[0].endswith("4 stale: 1, 4, 7, 11") and not [line for line in lines if line.startswith("untested")]
    assert [line.split("'")[1] for line in lines if line.startswith("stale: layer ")] == ["1", "4", "7", "11"]
    assert all("channel" in line and "variance" in line for line in lines[1:5])


@pytest.mark.parametrize("flags, message", [
    (["--tolerance", "-0.1", "0.1"], "argument --tolerance: tolerance must be two numbers >= 0"),
    (["--tolerance", "0.1"], "argument --tolerance: expected 2 arguments"),
    (["--alpha", "0"], "argument --alpha: alpha must be a number in (0, 1)"),
    (["--rtol", "2"], "argument --rtol: expected a number between 0 and 1, such as 0.01, got 2"),
    (["--prior", "10"], "unrecognized arguments: --prior"),
    (["--output", "x.pt"], "unrecognized arguments: --output"),
])
def test_usage_errors_exit_2(files, capsys, flags, message):
    result = run_cli(capsys, "check", *_args(files), *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_under_torchrun_the_ranks_merge_and_agree(tmp_path):
    """Two gloo ranks read 12 digits each; the statistics they measured together are those of
    the union of their batches, every rank exits 1 on the stale file, and rank 0 alone prints
    and writes. The subprocess's timeout bounds the test, should a rank hang."""
    train_x, train_y, _, _ = load_digits()
    torch.manual_seed(1)
    model = train(make_model(), train_x, train_y, steps=30, batch_size=32, seed=1)
    torch.save({"model": model.state_dict()}, str(tmp_path / "c.pt"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, *torchrun(2), "-m", "precise_bn",
         "check", str(tmp_path / "c.pt"), "--model", MODEL, "--data", "factories:digit_shard",
         "--report", str(tmp_path / "r.json"), "-q", *TRUST],
        capture_output=True, text=True, env=env, timeout=600, cwd=str(TESTS))
    assert result.returncode == 1, result.stderr
    assert result.stdout.count("precise-bn check:") == 1 and "world size 2" in result.stdout, result.stdout
    assert result.stdout.count("to fix: precise-bn recompute") == 1
    body = json.loads((tmp_path / "r.json").read_text())
    assert body["measurement"]["world_size"] == 2 and body["measurement"]["samples"] == 24 and body["stale"]
    reference = float64_reference(model, list(train_x[:24].split(4)))
    for layer in body["measurement"]["layers"]:
        mean, var, _ = reference[layer["name"]]
        assert_close_exact(torch.tensor(layer["new_mean"]), torch.tensor(layer["new_var"]), mean, var, layer["name"])
        state = load(tmp_path / "c.pt")["model"]
        assert torch.equal(torch.tensor(layer["old_mean"], dtype=torch.float32), state[layer["name"] + ".running_mean"])
