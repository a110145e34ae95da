"""The ``precise-bn`` command: model and data specs, torchvision image and video models, Lightning,
Caffe2 pickles, ``inspect``, ``convert``, usage errors and the standalone script."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from cli_factories import Caffe2StyleNet, batches, small_net
from cli_helpers import REPO, TRUST, assert_same_except, bn_paths, load, run_cli, without
from precise_bn.checkpoint.state import bn_layers
from precise_bn.cli import main
from precise_bn.cli.inspect import plot_drift
from precise_bn.errors import BackendUnavailableError, ConfigError
from precise_bn.report import LayerReport
from precise_bn.cli.specs import resolve_data, resolve_model
from reference import assert_close_default, float64_reference


def _check_against_reference(state, prefix, net, data):
    ref = float64_reference(net, data)
    assert ref, "no BN layer ran in the reference"
    for name, (mean, var, _) in ref.items():
        assert_close_default(state[prefix + name + ".running_mean"], state[prefix + name + ".running_var"], mean, var, name)
    return ref


@pytest.mark.main_env
def test_torchvision_resnet18_end_to_end(tmp_path):
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
        "recompute", path, "--model", "torchvision:resnet18", "--data", spec,
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
def test_torchvision_video_model_on_clips(tmp_path):
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
        "recompute", path, "--model", "torchvision:mc3_18", "--data", spec,
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
def test_imagefolder_with_training_transforms(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(2)
    for label in ("cat", "dog"):
        (tmp_path / "train" / label).mkdir(parents=True)
        for i in range(3):
            pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(str(tmp_path / "train" / label / "{}.png".format(i)))
    torch.manual_seed(0)
    net = small_net()
    root = {"model": net.state_dict(), "classes": ["cat", "dog"]}
    path, out = tmp_path / "c.pt", tmp_path / "out.pt"
    torch.save(root, str(path))
    result = run_cli(
        "recompute", path, "--model", "cli_factories:small_net", "--data", "imagefolder:{}".format(tmp_path / "train"),
        "--data-kwargs", '{"size": 8}', "--batch-size", "4", "--output", out, "--report", tmp_path / "r.json", *TRUST,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["samples"] == 6 and report["batches"] == 2
    elements = {layer["name"]: layer["elements"] for layer in report["layers"]}
    assert elements == {"1": 6 * 8 * 8, "4": 6 * 3 * 3, "9": 6}
    written = load(out)
    assert_same_except(root, without(written, "precise_bn"), bn_paths(("model",), "", ("1", "4", "9")))
    # Normalised pixels: the recomputed means sit near the conv of ~N(0, 1) inputs, not at the old 0.
    assert not torch.equal(written["model"]["1.running_mean"], root["model"]["1.running_mean"])


@pytest.mark.main_env
def test_lightning_checkpoint_reloads_with_users_code(tmp_path):
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
    result = run_cli("recompute", path, "--model", "cli_factories:small_net", "--data", "cli_factories:batches", "--output", out)
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


def _caffe2_blobs(net: Caffe2StyleNet):
    sd = net.state_dict()
    return {
        "conv1_w": sd["conv1.weight"].numpy(),
        "res_conv1_bn_s": sd["bn1.weight"].numpy(),
        "res_conv1_bn_b": sd["bn1.bias"].numpy(),
        "res_conv1_bn_rm": sd["bn1.running_mean"].numpy(),
        "res_conv1_bn_riv": sd["bn1.running_var"].numpy(),
        "pred_w": sd["fc.weight"].numpy(),
        "pred_b": sd["fc.bias"].numpy(),
        "conv1_w_momentum": np.full((4, 3, 3, 3), 0.125, dtype=np.float32),
        "lr": np.array([0.1], dtype=np.float32),
    }


def test_caffe2_pickle_recompute_keeps_every_other_blob(tmp_path):
    from precise_bn.caffe2.checkpoint import load_caffe2_pickle, save_caffe2_pickle

    torch.manual_seed(0)
    net = Caffe2StyleNet()
    with torch.no_grad():
        net(batches(n=1, seed=9)[0][0])
    blobs = _caffe2_blobs(net)
    path, out = tmp_path / "model_final.pkl", tmp_path / "model_final.precise.pkl"
    save_caffe2_pickle(blobs, str(path))
    result = run_cli(
        "recompute", path, "--model", "cli_factories:caffe2_style_net", "--data", "cli_factories:batches", "--output", out,
    )
    assert result.returncode == 0, result.stderr
    written = load_caffe2_pickle(str(out))
    assert sorted(written) == sorted(blobs)
    for name, value in blobs.items():
        if name not in ("res_conv1_bn_rm", "res_conv1_bn_riv"):
            assert written[name].dtype == value.dtype and written[name].tobytes() == value.tobytes(), name
    state = {"bn1.running_mean": torch.from_numpy(written["res_conv1_bn_rm"]), "bn1.running_var": torch.from_numpy(written["res_conv1_bn_riv"])}
    _check_against_reference(state, "", net, batches())


def test_caffe2_pickle_with_custom_name_rules(tmp_path):
    from precise_bn.caffe2.checkpoint import load_caffe2_pickle, save_caffe2_pickle

    torch.manual_seed(0)
    net = Caffe2StyleNet()
    renamed = {"conv1": "stem", "res_conv1_bn": "stem_bn", "pred": "head"}
    blobs = {}
    for name, value in _caffe2_blobs(net).items():
        for old, new in renamed.items():
            if name.startswith(old + "_"):
                name = new + name[len(old):]
                break
        blobs[name] = value
    path, out = tmp_path / "stem.pkl", tmp_path / "stem.precise.pkl"
    save_caffe2_pickle(blobs, str(path))
    args = ["recompute", str(path), "--model", "cli_factories:caffe2_style_net", "--data", "cli_factories:batches",
            "--output", str(out), "-q"]
    assert main(args) == 1
    assert main(args + ["--caffe2-rules", "cli_factories:STEM_RULES"]) == 0
    written = load_caffe2_pickle(str(out))
    assert sorted(written) == sorted(blobs) and written["stem_w_momentum"].tobytes() == blobs["stem_w_momentum"].tobytes()
    state = {"bn1.running_mean": torch.from_numpy(written["stem_bn_rm"]), "bn1.running_var": torch.from_numpy(written["stem_bn_riv"])}
    _check_against_reference(state, "", net, batches())


def test_convert_caffe2_torch_safetensors_round_trip(tmp_path):
    from precise_bn.caffe2.checkpoint import load_caffe2_pickle, save_caffe2_pickle
    from safetensors.torch import load_file

    torch.manual_seed(0)
    blobs = _caffe2_blobs(Caffe2StyleNet())
    save_caffe2_pickle(blobs, str(tmp_path / "in.pkl"))
    assert main(["convert", str(tmp_path / "in.pkl"), str(tmp_path / "a.pt"), "-q"]) == 0
    state = load(tmp_path / "a.pt")
    assert sorted(state) == sorted(Caffe2StyleNet().state_dict().keys() - {"bn1.num_batches_tracked"})
    assert state["bn1.running_var"].numpy().tobytes() == blobs["res_conv1_bn_riv"].tobytes()
    assert main(["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors"), "-q", *TRUST]) == 0
    assert_same_except(dict(sorted(state.items())), dict(sorted(load_file(str(tmp_path / "b.safetensors")).items())), set())
    assert main(["convert", str(tmp_path / "b.safetensors"), str(tmp_path / "out.pkl"), "-q"]) == 0
    back = load_caffe2_pickle(str(tmp_path / "out.pkl"))
    model_blobs = {k: v for k, v in blobs.items() if k not in ("conv1_w_momentum", "lr")}
    assert sorted(back) == sorted(model_blobs)
    assert all(back[k].tobytes() == v.tobytes() for k, v in model_blobs.items())


def test_convert_refuses_same_format_and_same_file(tmp_path, capsys):
    torch.save(small_net().state_dict(), str(tmp_path / "a.pt"))
    assert main(["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pth"), "-q"]) == 1
    assert "both torch files" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "a.pt"), str(tmp_path / "a.pt"), "-q"]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err


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
    old = bn_layers(load(tmp_path / "a.pt")["model"])
    new = net.state_dict()
    for name, (mean, var) in old.items():
        layer = LayerReport(name, 0, 0, mean.double(), var.double(),
                            new[name + ".running_mean"].double(), new[name + ".running_var"].double())
        row = [line.split() for line in out.splitlines() if line.split()[:1] == [name]][0]
        assert row[2:] == ["{:.4g}".format(layer.mean_drift), "{:.4g}".format(layer.var_drift)]


@pytest.mark.main_env
def test_inspect_plot_writes_a_png(tmp_path):
    torch.manual_seed(0)
    net = small_net()
    torch.save(net.state_dict(), str(tmp_path / "a.pt"))
    with torch.no_grad():
        net(batches()[0][0])
    torch.save(net.state_dict(), str(tmp_path / "b.pt"))
    plot = tmp_path / "drift.png"
    assert main(["inspect", str(tmp_path / "a.pt"), "--against", str(tmp_path / "b.pt"), "--plot", str(plot), *TRUST]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install precise-bn\[plot\]"):
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
    assert main(["inspect", str(tmp_path / "a.pt"), "--plot", "x.png"]) == 2
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "--against" in err and "JSON" in err


def test_spec_errors_name_the_spec(tmp_path, capsys):
    torch.save(small_net().state_dict(), str(tmp_path / "a.pt"))
    cases = [
        (["--model", "cli_factories:nope", "--data", "cli_factories:batches"], "has no attribute 'nope'"),
        (["--model", "no_such_module_xyz:f", "--data", "cli_factories:batches"], "cannot import no_such_module_xyz"),
        (["--model", "cli_factories:small_net", "--model-kwargs", '{"depth": 3}', "--data", "cli_factories:batches"], "depth"),
        (["--model", "cli_factories:small_net", "--data", "cli_factories:fixed_batches", "--batch-size", "4"], "batch_size"),
        (["--model", "cli_factories:small_net", "--data", "npz:{}".format(tmp_path / "none.npz")], "none.npz"),
        (["--model", "cli_factories:small_net", "--data", "cli_factories:batches", "--device", "gpu7"], "device 'gpu7'"),
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


def test_standalone_script(tmp_path):
    torch.manual_seed(0)
    net = small_net()
    torch.save({"model": net.state_dict()}, str(tmp_path / "a.pt"))
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "recompute_precise_bn.py"), str(tmp_path / "a.pt"),
         "--model", "cli_factories:small_net", "--data", "cli_factories:batches", "-q", *TRUST],
        capture_output=True, text=True, timeout=180, cwd=str(REPO / "tests"),
    )
    assert result.returncode == 0, result.stderr
    written = load(tmp_path / "a.precise_bn.pt")
    _check_against_reference(written["model"], "", net, batches())
