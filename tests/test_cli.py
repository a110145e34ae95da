"""The ``precise-bn`` command: model specs, torchvision image and video models, Lightning, Caffe2
pickles, ``inspect``, ``convert``, usage errors, the standalone script and the console script.

Every test runs the command in-process (``main``); only the console-script test starts one."""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from cli_factories import batches, small_net
from cli_helpers import REPO, TESTS, TRUST, assert_same_except, bn_paths, load, run_cli, without
from precise_bn.checkpoint.state import bn_layers
from precise_bn.cli import main
from precise_bn.cli.data_specs import resolve_data
from precise_bn.cli.inspect_cmd import drift_figure, plot_drift
from precise_bn.cli.specs import resolve_model
from precise_bn.errors import BackendUnavailableError, ConfigError
from precise_bn.report import DEFINITIONS, LayerReport
from reference import assert_close_exact, float64_reference


def _check_against_reference(state, prefix, net, data):
    ref = float64_reference(net, data)
    assert ref, "no BN layer ran in the reference"
    for name, (mean, var, _) in ref.items():
        assert_close_exact(state[prefix + name + ".running_mean"], state[prefix + name + ".running_var"], mean, var, name)
    return ref


@pytest.mark.main_env
def test_torchvision_resnet18_end_to_end(tmp_path, capsys):
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet18(weights=None)
    root = {"model": net.state_dict(), "epoch": 1, "best_acc1": 0.5}
    path, out = tmp_path / "resnet18.pth", tmp_path / "out.pth"
    torch.save(root, str(path))
    images = np.random.default_rng(0).normal(0.5, 1.5, size=(8, 3, 32, 32)).astype(np.float32)
    np.savez(str(tmp_path / "images.npz"), x=images)
    spec = "npz:{}".format(tmp_path / "images.npz")
    result = run_cli(
        capsys, "recompute", path, "--model", "torchvision:resnet18", "--data", spec,
        "--batch-size", "4", "--num-iters", "2", "--output", out, *TRUST,
    )
    assert result.returncode == 0, result.stderr
    written = load(out)
    names = [n for n, m in net.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(names) == 20
    assert_same_except(root, without(written, "precise_bn"), bn_paths(("model",), "", names))
    ref = _check_against_reference(written["model"], "", net, list(resolve_data(spec, batch_size=4)))
    assert sorted(ref) == sorted(names)


@pytest.mark.main_env
def test_torchvision_video_model_on_clips(tmp_path, capsys):
    import torchvision
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    net = torchvision.models.get_model("mc3_18", weights=None)
    path, out = tmp_path / "mc3.safetensors", tmp_path / "mc3_precise.safetensors"
    save_file(dict(net.state_dict()), str(path))
    clips = np.random.default_rng(1).normal(size=(4, 3, 4, 32, 32)).astype(np.float32)
    np.save(str(tmp_path / "clips.npy"), clips)
    spec = "npz:{}".format(tmp_path / "clips.npy")
    result = run_cli(
        capsys, "recompute", path, "--model", "torchvision:mc3_18", "--data", spec,
        "--batch-size", "2", "--num-iters", "2", "--output", out, "--report", tmp_path / "r.json", *TRUST,
    )
    assert result.returncode == 0, result.stderr
    state = load_file(str(out))
    names = [n for n, m in net.named_modules() if isinstance(m, torch.nn.BatchNorm3d)]
    assert_same_except(dict(sorted(net.state_dict().items())), dict(sorted(state.items())), bn_paths((), "", names))
    _check_against_reference(state, "", net, list(resolve_data(spec, batch_size=2)))
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["samples"] == 4 and report["batches"] == 2


@pytest.mark.main_env
def test_lightning_checkpoint_reloads_with_users_code(tmp_path, capsys):
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self, lr: float = 0.05):
            super().__init__()
            self.save_hyperparameters()
            self.model = small_net()
            self.criterion = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 1.0]))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.criterion(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    torch.manual_seed(0)
    module = Classifier()
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    data = batches(n=3)
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(dataset, batch_size=6))
    path, out = tmp_path / "last.ckpt", tmp_path / "last.precise.ckpt"
    trainer.save_checkpoint(str(path))
    original = load(path)
    result = run_cli(capsys, "recompute", path, "--model", "cli_factories:small_net", "--data", "cli_factories:batches", "--output", out)
    assert result.returncode == 0, result.stderr
    assert "prefix 'model.'" in result.stderr
    written = load(out)
    assert written["precise_bn"]["iterations"] == 5
    names = ("1", "4", "9")
    assert_same_except(original, without(written, "precise_bn"), bn_paths(("state_dict",), "model.", names))
    reloaded = Classifier.load_from_checkpoint(str(out))
    assert reloaded.hparams.lr == 0.05
    net = small_net()
    net.load_state_dict({k[len("model."):]: v for k, v in original["state_dict"].items() if k.startswith("model.")})
    _check_against_reference({k: v for k, v in reloaded.model.state_dict().items()}, "", net, batches())


def test_inspect_lists_layers_and_drift(tmp_path, capsys):
    torch.manual_seed(0)
    net = small_net()
    torch.save({"model": net.state_dict()}, str(tmp_path / "a.pt"))
    with torch.no_grad():
        for x, _ in batches():
            net(x)
    torch.save({"state_dict": {"module." + k: v for k, v in net.state_dict().items()}}, str(tmp_path / "b.pt"))
    assert main(["inspect", str(tmp_path / "a.pt"), *TRUST]) == 0
    out = capsys.readouterr().out
    assert "3 BatchNorm layers" in out and "under 'model'" in out
    assert main(["inspect", str(tmp_path / "a.pt"), "--against", str(tmp_path / "b.pt"), *TRUST]) == 0
    out = capsys.readouterr().out
    assert "3 BatchNorm layers in both" in out
    assert DEFINITIONS["mean_drift"] in out and DEFINITIONS["var_drift"] in out
    old = bn_layers(load(tmp_path / "a.pt")["model"])
    new = net.state_dict()
    for name, (mean, var) in old.items():
        layer = LayerReport(name, 0, 0, mean.double(), var.double(),
                            new[name + ".running_mean"].double(), new[name + ".running_var"].double())
        row = [line.split() for line in out.splitlines() if line.split()[:1] == [name]][0]
        assert row[2:] == ["{:.4g}".format(layer.mean_drift), "{:.4g}".format(layer.var_drift)]


def test_a_lightning_files_layers_have_the_same_names_in_recompute_and_inspect(tmp_path, capsys):
    """The LightningModule's ``model.`` prefix is no part of a layer's name, in the report printed,
    the JSON report, and ``inspect`` with or without ``--against``."""
    torch.manual_seed(0)
    state = {"model." + k: v for k, v in small_net().state_dict().items()}
    torch.save({"state_dict": state, "pytorch-lightning_version": "2.6.0", "global_step": 3}, str(tmp_path / "l.ckpt"))
    result = run_cli(capsys, "recompute", tmp_path / "l.ckpt", "--model", "cli_factories:small_net", "--data",
                     "cli_factories:batches", "--report", tmp_path / "r.json", *TRUST)
    assert result.returncode == 0, result.stderr
    names = [layer["name"] for layer in json.loads((tmp_path / "r.json").read_text())["layers"]]
    assert names == ["1", "4", "9"]
    printed = [line.split()[0] for line in result.stdout.splitlines()[2:2 + len(names)]]
    listed = run_cli(capsys, "inspect", tmp_path / "l.ckpt", *TRUST).stdout.splitlines()
    drift = run_cli(capsys, "inspect", tmp_path / "l.ckpt", "--against", tmp_path / "l.precise_bn.ckpt", *TRUST)
    drift = drift.stdout.splitlines()
    for lines in (listed, drift):
        table = lines[[i for i, line in enumerate(lines) if line.startswith("layer ")][0] + 1:]
        assert [line.split()[0] for line in table[:len(names)]] == names == printed, lines
        assert sum("every BatchNorm layer sits under 'model.'" in line for line in lines) == (2 if lines is drift else 1)


def test_inspect_after_a_recompute_says_what_was_measured(tmp_path, capsys):
    from cli_factories import Caffe2StyleNet

    torch.manual_seed(0)
    torch.save({"model": Caffe2StyleNet().state_dict()}, str(tmp_path / "one.pt"))
    args = ["recompute", tmp_path / "one.pt", "--model", "cli_factories:caffe2_style_net", "--data",
            "cli_factories:batches", "-q", *TRUST]
    assert run_cli(capsys, *args).returncode == 0
    result = run_cli(capsys, "inspect", tmp_path / "one.precise_bn.pt", *TRUST)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert "1 BatchNorm layer" in lines and "num_batches_tracked" in lines[lines.index("1 BatchNorm layer") + 1]
    entry = [line for line in lines if line.startswith("precise_bn entry (the last recompute): ")]
    assert len(entry) == 1 and "iterations=5" in entry[0] and "samples=27" in entry[0] and "layers=1" in entry[0]
    result = run_cli(capsys, "inspect", tmp_path / "one.pt", "--against", tmp_path / "one.precise_bn.pt", *TRUST)
    assert ": 1 BatchNorm layer in both" in result.stdout


@pytest.mark.main_env
def test_inspect_plot_writes_a_png_through_a_link(tmp_path):
    torch.manual_seed(0)
    net = small_net()
    torch.save(net.state_dict(), str(tmp_path / "a.pt"))
    with torch.no_grad():
        net(batches()[0][0])
    torch.save(net.state_dict(), str(tmp_path / "b.pt"))
    plot, link = tmp_path / "drift.png", tmp_path / "latest.png"
    plot.write_bytes(b"old")
    link.symlink_to(plot.name)
    assert main(["inspect", str(tmp_path / "a.pt"), "--against", str(tmp_path / "b.pt"), "--plot", str(link), "--overwrite", *TRUST]) == 0
    assert link.is_symlink() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.main_env
def test_drift_figure_is_log_scaled_with_readable_names():
    gen = torch.Generator().manual_seed(0)
    layers = []
    for i in range(60):
        old = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
        new = old * (1 + 10.0 ** (i % 5 - 3)) if i != 7 else old.clone()
        layers.append(LayerReport("stage{}.block.bn".format(i), 1, 1, old, old, new, new))
    layers[3].new_mean = layers[3].new_mean + 1e3  # one layer far off, which a linear scale would let flatten the rest
    fig = drift_figure(layers, "title")
    mean_axes, var_axes = fig.axes
    assert mean_axes.get_xscale() == var_axes.get_xscale() == "log"
    names = [label.get_text() for label in mean_axes.get_yticklabels()]
    assert names == [layer.name for layer in layers]
    assert min(label.get_fontsize() for label in mean_axes.get_yticklabels()) >= 8
    low, high = mean_axes.get_xlim()
    assert low <= min(l.mean_drift for l in layers if l.mean_drift > 0) and high >= layers[3].mean_drift
    assert [t.get_text() for t in mean_axes.texts] == ["0"]  # layer 7 did not move: no bar, a 0
    height = fig.get_size_inches()[1] * fig.dpi
    assert height / len(layers) >= 20  # pixels per name, at 8 points a line


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install '\.\[plot\]'"):
        plot_drift([], str(tmp_path / "x.png"), "title")


def test_usage_errors_exit_2(tmp_path, capsys):
    torch.save(small_net().state_dict(), str(tmp_path / "a.pt"))
    base = ["recompute", str(tmp_path / "a.pt"), "--model", "cli_factories:small_net", "--data", "cli_factories:batches"]
    assert main(base + ["--num-iters", "0"]) == 2
    assert main(base + ["--num-iters", "3", "--num-samples", "3"]) == 2
    assert main(base + ["--output", "x.pt", "--in-place"]) == 2
    assert main(base + ["--model-kwargs", "{width: 3}"]) == 2
    assert main(base + ["--model-kwargs", "[3]"]) == 2
    assert main(["recompute", str(tmp_path / "a.pt"), "--data", "cli_factories:batches"]) == 2
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "JSON" in err
    assert main(["inspect", str(tmp_path / "a.pt"), "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: precise-bn inspect") and "--plot draws the drift" in err and "--against" in err


def test_spec_errors_name_the_spec(tmp_path, capsys):
    torch.save(small_net().state_dict(), str(tmp_path / "a.pt"))
    cases = [
        (["--model", "cli_factories:nope", "--data", "cli_factories:batches"], "has no attribute 'nope'"),
        (["--model", "no_such_module_xyz:f", "--data", "cli_factories:batches"], "cannot import no_such_module_xyz"),
        (["--model", "cli_factories:small_net", "--model-kwargs", '{"depth": 3}', "--data", "cli_factories:batches"], "depth"),
        (["--model", "cli_factories:small_net", "--data", "cli_factories:fixed_batches", "--batch-size", "4"], "batch_size"),
        (["--model", "cli_factories:small_net", "--data", "npz:{}".format(tmp_path / "none.npz")], "none.npz"),
    ]
    for args, needle in cases:
        assert main(["recompute", str(tmp_path / "a.pt"), "-q"] + args + TRUST) == 1
        assert needle in capsys.readouterr().err


def test_batch_size_reaches_a_factory_that_takes_it():
    data = resolve_data("cli_factories:batches", {"n": 2}, batch_size=3)
    assert [len(x) for x, _ in data] == [3, 2]


def test_timm_missing_and_present(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(BackendUnavailableError, match="pip install timm"):
        resolve_model("timm:resnet18")
    calls = []
    fake = types.SimpleNamespace(
        list_models=lambda: ["resnet18", "resnet34"],
        create_model=lambda name, **kw: calls.append((name, kw)) or small_net(),
    )
    monkeypatch.setitem(sys.modules, "timm", fake)
    assert isinstance(resolve_model("timm:resnet18", {"num_classes": 3}), torch.nn.Module)
    assert calls == [("resnet18", {"num_classes": 3, "pretrained": False})]
    with pytest.raises(ConfigError, match="resnet34"):
        resolve_model("timm:resnet43")


def test_torchvision_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(BackendUnavailableError, match="pip install torchvision"):
        resolve_model("torchvision:resnet18")


@pytest.mark.main_env
def test_torchvision_unknown_name_suggests_close_ones():
    with pytest.raises(ConfigError, match="resnet18"):
        resolve_model("torchvision:resnet81")


def test_standalone_script_is_the_whole_command(tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    net = small_net()
    torch.save({"model": net.state_dict()}, str(tmp_path / "a.pt"))
    script = str(REPO / "scripts" / "recompute_precise_bn.py")
    for args in (["recompute", str(tmp_path / "a.pt"), "--model", "cli_factories:small_net", "--data",
                  "cli_factories:batches", "-q", *TRUST], ["inspect", str(tmp_path / "a.precise_bn.pt"), *TRUST]):
        monkeypatch.setattr(sys, "argv", [script] + args)
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(script, run_name="__main__")
        assert exit_.value.code == 0
    assert "3 BatchNorm layers" in capsys.readouterr().out
    written = load(tmp_path / "a.precise_bn.pt")
    _check_against_reference(written["model"], "", net, batches())


def test_quiet_recompute_prints_nothing(tmp_path, capsys):
    torch.manual_seed(0)
    torch.save({"model": small_net().state_dict()}, str(tmp_path / "a.pt"))
    result = run_cli(capsys, "recompute", tmp_path / "a.pt", "--model", "cli_factories:small_net", "--data",
                     "cli_factories:batches", "--num-batches", "5", "-q", *TRUST)
    assert result.returncode == 0 and (tmp_path / "a.precise_bn.pt").exists()
    assert result.stdout == "" and result.stderr == ""
    result = run_cli(capsys, "recompute", tmp_path / "a.pt", "--model", "cli_factories:small_net", "--data",
                     "cli_factories:batches", "--overwrite", *TRUST)
    assert result.returncode == 0 and "mean drift" in result.stdout  # what -q leaves out


def test_installed_console_script(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "precise-bn")
    assert os.path.isfile(script), "the package is not installed in this environment (pip install -e .)"
    torch.manual_seed(0)
    net = small_net()
    torch.save({"model": net.state_dict()}, str(tmp_path / "a.pt"))
    env = dict(os.environ, PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [script, "recompute", str(tmp_path / "a.pt"), "--model", "cli_factories:small_net", "--data",
         "cli_factories:batches", "--output", str(tmp_path / "out.pt"), *TRUST],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "3 BatchNorm layers" in result.stdout and "wrote {}".format(tmp_path / "out.pt") in result.stderr
    _check_against_reference(load(tmp_path / "out.pt")["model"], "", net, batches())
