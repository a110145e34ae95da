"""``precise-bn demo`` end to end as a command, its bundled digits (no scikit-learn), the pieces the
benchmarks reuse, and the example training script."""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import REPO, load, run_cli
from precise_bn.cli.demo import MODEL_KWARGS
from precise_bn.digits import DATA_FILE, evaluate, load_digits, make_model
from reference import assert_close_exact, float64_reference


def test_demo_command_end_to_end(tmp_path, capsys):
    from precise_bn.cli.data_specs import resolve_data

    result = run_cli(capsys, "demo", "--steps", "60", "--workdir", tmp_path)
    assert result.returncode == 0, result.stderr
    found = {
        kind: (float(acc), float(loss))
        for kind, acc, loss in re.findall(r"accuracy with the (EMA|precise) .*?([\d.]+)% \(loss ([\d.]+)\)", result.stdout)
    }
    assert set(found) == {"EMA", "precise"}, result.stdout
    # 60 steps of training already separate the ten digits well: the network did learn.
    assert found["EMA"][0] > 80 and found["precise"][0] > 80
    assert "mean drift" in result.stdout and "4 BatchNorm layers" in result.stdout

    original, written = load(tmp_path / "digits_cnn.pt"), load(tmp_path / "digits_cnn.precise_bn.pt")
    assert written["steps"] == 60 and written["seed"] == 0
    _, _, test_x, test_y = load_digits()
    assert all(t.dtype == torch.float64 for t in written["model"].values() if t.is_floating_point())
    for kind, state in (("EMA", original["model"]), ("precise", written["model"])):
        net = make_model(**MODEL_KWARGS)
        net.load_state_dict(state)
        accuracy, loss = evaluate(net, test_x, test_y)
        assert found[kind][0] == round(100 * accuracy, 2), kind
        assert abs(found[kind][1] - loss) <= 6e-5, kind
    net = make_model(**MODEL_KWARGS)
    net.load_state_dict(original["model"])
    used = list(resolve_data("npz:{}:x".format(tmp_path / "digits_train.npz"), batch_size=32))
    assert sum(len(b[0]) for b in used) == len(load_digits()[0])
    ref = float64_reference(net, used)
    assert len(ref) == 4
    for name, (mean, var, _) in ref.items():
        assert_close_exact(written["model"][name + ".running_mean"], written["model"][name + ".running_var"], mean, var, name)


def test_bundled_digits_are_a_fixed_stratified_split():
    train_x, train_y, test_x, test_y = load_digits()
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    assert train_x.shape == (1347, 1, 8, 8) and test_x.shape == (450, 1, 8, 8)
    assert len(train_y) == 1347 and len(test_y) == 450
    assert torch.equal(torch.unique(train_x * 16), torch.arange(17.0))  # the pixel levels 0-16, scaled to [0, 1]
    per_class_test = torch.bincount(test_y, minlength=10).double() / torch.bincount(torch.cat([train_y, test_y])).double()
    assert ((per_class_test - 0.25).abs() < 0.02).all()
    assert all(torch.equal(a, b) for a, b in zip(load_digits(), (train_x, train_y, test_x, test_y)))


def test_demo_runs_without_scikit_learn(monkeypatch, capsys):
    for name in ("sklearn", "sklearn.datasets", "sklearn.model_selection"):
        monkeypatch.setitem(sys.modules, name, None)  # any import of them now raises ImportError
    result = run_cli(capsys, "demo", "--steps", "5", "-q")
    assert result.returncode == 0, result.stderr
    assert "held-out accuracy with the precise stats" in result.stdout


@pytest.mark.main_env
def test_bundled_digits_are_scikit_learns_and_ship_with_the_package():
    """The file ``scripts/export_digits.py`` wrote holds scikit-learn's digits in its split, and
    the wheel carries it (package data)."""
    import numpy as np
    import tomllib

    export = runpy.run_path(str(REPO / "scripts" / "export_digits.py"))
    assert Path(export["TARGET"]) == DATA_FILE
    with np.load(DATA_FILE, allow_pickle=False) as shipped:
        expected = export["digits_arrays"]()
        assert sorted(shipped.files) == sorted(expected)
        for name, array in expected.items():
            assert shipped[name].dtype == array.dtype and np.array_equal(shipped[name], array), name
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert DATA_FILE.name in package_data["precise_bn"]


def test_demo_prints_a_command_only_for_files_that_stay(capsys):
    result = run_cli(capsys, "demo", "--steps", "5", "-q")
    assert result.returncode == 0, result.stderr
    assert "precise-bn recompute" not in result.stdout and "--workdir DIR" in result.stdout


def test_the_printed_command_pasted_into_a_shell_writes_the_same_bits(tmp_path, capsys):
    workdir = tmp_path / "a folder"  # a space: the command quotes its paths
    result = run_cli(capsys, "demo", "--steps", "5", "--workdir", workdir, "-q")
    command = re.search(r"^recompute: (.*precise-bn recompute .*)$", result.stdout, re.M).group(1)
    first = load(workdir / "digits_cnn.precise_bn.pt")["model"]
    pasted = command.replace("precise-bn", "{} -m precise_bn".format(shlex.quote(sys.executable)), 1)
    done = subprocess.run(pasted, shell=True, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr  # over the output the demo wrote: --overwrite is in it
    again = load(workdir / "digits_cnn.precise_bn.pt")["model"]
    assert all(torch.equal(again[k], first[k]) for k in first)
    args = shlex.split(command)
    assert int(args[args.index("--num-samples") + 1]) == len(load_digits()[0])


def test_demo_quiet_prints_the_accuracies_and_no_report(capsys):
    result = run_cli(capsys, "demo", "--steps", "5", "-q")
    assert result.returncode == 0 and "held-out accuracy with the precise stats" in result.stdout
    assert "mean drift" not in result.stdout + result.stderr and "BatchNorm layers," not in result.stdout


def _demo_section(path, start):
    text = path.read_text(encoding="utf-8")
    return text[text.index(start):]


def _quoted_row():
    """docs/cli.md's quoted figures, checked to be seed 0's row of the table benchmarks/demo_seeds.py
    wrote and its summary."""
    doc = _demo_section(REPO / "docs" / "cli.md", "## `precise-bn demo`")
    results = _demo_section(REPO / "benchmarks" / "RESULTS.md", "<!-- BEGIN demo -->")
    results = results[:results.index("<!-- END demo -->")]
    quoted = re.findall(r"accuracy with the (?:EMA running|precise) stats: +([\d.]+%) \(loss ([\d.]+)\)", doc)
    row = re.search(r"^\| 0 \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|$", results, re.M).groups()
    assert [cell for pair in quoted for cell in pair] == list(row)
    summary = re.search(r'"(Over 10 seeds: .*?)"', " ".join(doc.split())).group(1)
    assert summary in " ".join(results.split())
    return row


def test_the_demo_figures_in_the_docs_are_the_seeds_tables_and_this_machine_prints_them():
    from precise_bn.cli.demo import run_demo

    row = _quoted_row()
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_demo(seed=0, quiet=True)
    assert ("{:.2%}".format(result.ema_accuracy), "{:.4f}".format(result.ema_loss),
            "{:.2%}".format(result.precise_accuracy), "{:.4f}".format(result.precise_loss)) == row


def test_other_cpu_kernels_print_the_same_figures(tmp_path):
    """Another machine, as near as one gets on this one: ATen's portable kernels instead of its
    vectorised ones, and older instructions for oneDNN and MKL (a float32 demo prints other figures
    under these)."""
    kernels = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    done = subprocess.run([sys.executable, "-m", "precise_bn", "demo", "-q"], capture_output=True, text=True,
                          timeout=600, cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(REPO), **kernels))
    assert done.returncode == 0, done.stderr
    printed = re.findall(r"accuracy with the (?:EMA running|precise) stats: +([\d.]+%) \(loss ([\d.]+)\)", done.stdout)
    assert [cell for pair in printed for cell in pair] == list(_quoted_row())


def test_example_training_script_leaves_no_files_behind(tmp_path, monkeypatch, capsys):
    script = REPO / "scripts" / "train_with_precise_bn.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "--steps", "10", "--eval-every", "5", "--save-every", "5",
                                      "--bn-batches", "2"])
    runpy.run_path(str(script), run_name="__main__")
    saved = re.findall(r"saved (\S+)", capsys.readouterr().out)
    assert len(saved) == 2 and not any(Path(p).exists() for p in saved)
    assert list(tmp_path.iterdir()) == []
