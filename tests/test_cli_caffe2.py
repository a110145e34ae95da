"""``precise-bn`` on Caffe2 ``.pkl`` checkpoints: ``recompute`` writes back only the BN blobs and
keeps every other entry and the layout; custom name rules; ``convert`` round trips."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from factories import Caffe2StyleNet, batches, small_net
from cli_helpers import TRUST, assert_same_except, load, run_cli
from precise_bn.checkpoint.state import STAT_SUFFIXES
from precise_bn.cli import main
from reference import assert_close_exact, float64_reference


def _check_against_reference(state, net):
    mean, var, _ = float64_reference(net, batches())["bn1"]
    assert_close_exact(state["bn1.running_mean"], state["bn1.running_var"], mean, var, "bn1")


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


def test_caffe2_pickle_recompute_keeps_every_other_blob(tmp_path, capsys):
    from precise_bn.caffe2.checkpoint import read_caffe2_pickle, save_caffe2_pickle

    torch.manual_seed(0)
    net = Caffe2StyleNet()
    with torch.no_grad():
        net(batches(n=1, seed=9)[0][0])
    blobs = _caffe2_blobs(net)
    path, out = tmp_path / "model_final.pkl", tmp_path / "model_final.precise.pkl"
    save_caffe2_pickle(blobs, str(path))
    result = run_cli(
        capsys, "recompute", path, "--model", "factories:caffe2_style_net", "--data", "factories:batches", "--output", out,
    )
    assert result.returncode == 0, result.stderr
    written = read_caffe2_pickle(str(out))[1]
    assert sorted(written) == sorted(blobs)
    for name, value in blobs.items():
        if name not in ("res_conv1_bn_rm", "res_conv1_bn_riv"):
            assert written[name].dtype == value.dtype and written[name].tobytes() == value.tobytes(), name
    state = {"bn1.running_mean": torch.from_numpy(written["res_conv1_bn_rm"]), "bn1.running_var": torch.from_numpy(written["res_conv1_bn_riv"])}
    _check_against_reference(state, net)


def test_caffe2_pickle_with_custom_name_rules(tmp_path):
    from precise_bn.caffe2.checkpoint import read_caffe2_pickle, save_caffe2_pickle

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
    args = ["recompute", str(path), "--model", "factories:caffe2_style_net", "--data", "factories:batches",
            "--output", str(out), "-q"]
    assert main(args) == 1
    assert main(args + ["--caffe2-rules", "factories:STEM_RULES"]) == 0
    written = read_caffe2_pickle(str(out))[1]
    assert sorted(written) == sorted(blobs) and written["stem_w_momentum"].tobytes() == blobs["stem_w_momentum"].tobytes()
    state = {"bn1.running_mean": torch.from_numpy(written["stem_bn_rm"]), "bn1.running_var": torch.from_numpy(written["stem_bn_riv"])}
    _check_against_reference(state, net)


def test_convert_caffe2_torch_safetensors_round_trip(tmp_path):
    from precise_bn.caffe2.checkpoint import read_caffe2_pickle, save_caffe2_pickle
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
    back = read_caffe2_pickle(str(tmp_path / "out.pkl"))[1]
    model_blobs = {k: v for k, v in blobs.items() if k not in ("conv1_w_momentum", "lr")}
    assert sorted(back) == sorted(model_blobs)
    assert all(back[k].tobytes() == v.tobytes() for k, v in model_blobs.items())


def test_convert_refuses_same_format_and_same_file(tmp_path, capsys):
    torch.save(small_net().state_dict(), str(tmp_path / "a.pt"))
    assert main(["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pth"), "-q"]) == 1
    assert "both torch files" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "a.pt"), str(tmp_path / "a.pt"), "-q"]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err


BN_BLOBS = ("res_conv1_bn_rm", "res_conv1_bn_riv")


def _caffe2_root(layout: str):
    """(net, root): a Caffe2StyleNet checkpoint as Detectron (``nested``: blobs, cfg text, iteration) or
    older tools (``flat``) pickle it, with optimizer blobs, a float64 running mean and entries
    among the blobs that are not arrays."""
    torch.manual_seed(0)
    net = Caffe2StyleNet()
    with torch.no_grad():
        net(batches(n=1, seed=9)[0][0])
    sd = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    blobs = {
        "conv1_w": sd["conv1.weight"], "res_conv1_bn_s": sd["bn1.weight"], "res_conv1_bn_b": sd["bn1.bias"],
        "res_conv1_bn_rm": sd["bn1.running_mean"].astype(np.float64), "res_conv1_bn_riv": sd["bn1.running_var"],
        "pred_w": sd["fc.weight"], "pred_b": sd["fc.bias"],
        "conv1_w_momentum": np.full((4, 3, 3, 3), -0.0, np.float32), "lr": np.array([0.02], np.float32),
        "model_name": "stem-net", "solver": {"base_lr": 0.02, "steps": [0, 60000, 80000]},
    }
    if layout == "flat":
        return net, blobs
    return net, {"blobs": blobs, "cfg": "MODEL:\n  TYPE: generalized_rcnn\nSOLVER:\n  MAX_ITER: 90000\n", "iter": 90000}


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_caffe2_recompute_keeps_every_other_entry_and_the_layout(layout, tmp_path):
    net, root = _caffe2_root(layout)
    path, out = tmp_path / "model_final.pkl", tmp_path / "model_final.precise.pkl"
    path.write_bytes(pickle.dumps(root, protocol=2))
    args = ["recompute", str(path), "--model", "factories:caffe2_style_net", "--data", "factories:batches",
            "--output", str(out), "-q"]
    assert main(args) == 0
    written = pickle.loads(out.read_bytes())
    assert type(written) is dict and list(written) == list(root)
    table, written_table = (root["blobs"], written["blobs"]) if layout == "nested" else (root, written)
    assert list(written_table) == list(table)
    others = [(key, value, written[key]) for key, value in root.items() if key != "blobs"] if layout == "nested" else []
    for name, value in table.items():
        new = written_table[name]
        if isinstance(value, np.ndarray):
            assert new.dtype == value.dtype and new.shape == value.shape, name
            assert (new.tobytes() == value.tobytes()) == (name not in BN_BLOBS), name
        else:
            others.append((name, value, new))
    assert len(others) == (4 if layout == "nested" else 2)
    for key, value, new in others:
        assert type(new) is type(value) and new == value, key
    state = {"bn1." + stat: torch.from_numpy(written_table[blob].astype(np.float32))
             for stat, blob in zip(STAT_SUFFIXES, BN_BLOBS)}
    _check_against_reference(state, net)
