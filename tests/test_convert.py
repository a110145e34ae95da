"""``precise-bn convert`` and :func:`convert_checkpoint`: no tensor is left out unless asked.

numpy and torch only: runs in both environments.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from cli_helpers import TRUST, load
from precise_bn.caffe2.checkpoint import read_caffe2_pickle, save_caffe2_pickle
from precise_bn.cli import main
from precise_bn.cli.convert import convert_checkpoint
from precise_bn.errors import CheckpointError

BN = ("_s", "_b", "_rm", "_riv")
NOT_STATE = ("conv1_w_momentum", "lr")
NONLOCAL = ["nonlocal_conv3_1", "nonlocal_conv3_3", "nonlocal_conv4_1", "nonlocal_conv4_3", "nonlocal_conv4_5"]


def nl_video_blobs():
    """A video non-local ResNet checkpoint as the Caffe2 video models save it: 5-D convolution
    weights, one ResNet block, five non-local blocks (theta/phi/g/out convolutions and a BN
    each), optimizer state. Small shapes, same names."""
    rng = np.random.RandomState(0)

    def rand(*shape):
        return rng.randn(*shape).astype(np.float32)

    blobs = {"conv1_w": rand(4, 3, 3, 3, 3), "pred_w": rand(3, 8), "pred_b": rand(3)}
    blobs.update({"res_conv1_bn" + s: rand(4) for s in BN})
    for branch, shape in (("2a", (2, 4, 3, 1, 1)), ("2b", (2, 2, 1, 3, 3)), ("2c", (8, 2, 1, 1, 1)),
                          ("1", (8, 4, 1, 1, 1))):
        blobs["res2_0_branch{}_w".format(branch)] = rand(*shape)
        blobs.update({"res2_0_branch{}_bn{}".format(branch, s): rand(shape[0]) for s in BN})
    for block in NONLOCAL:
        for part in ("theta", "phi", "g", "out"):
            blobs["{}_{}_w".format(block, part)] = rand(4, 8, 1, 1, 1)
            blobs["{}_{}_b".format(block, part)] = rand(4)
        blobs.update({block + "_bn" + s: rand(8) for s in BN})
    blobs.update({"conv1_w_momentum": rand(4, 3, 3, 3, 3), "lr": np.array([0.1], np.float32)})
    return blobs


def nonlocal_names(blobs):
    return sorted(k for k in blobs if k.startswith("nonlocal_"))


def test_nl_video_checkpoint_fails_unless_told_what_to_do_with_nonlocal_blocks(tmp_path, capsys):
    blobs = nl_video_blobs()
    src, out = tmp_path / "nl.pkl", tmp_path / "nl.pt"
    save_caffe2_pickle(blobs, src)
    assert len(nonlocal_names(blobs)) == 60

    assert main(["convert", str(src), str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert "60 tensor(s) have names no rule maps" in err and "nonlocal_conv3_1_theta_w" in err
    assert "--keep-unmapped" in err and "--drop-unmapped" in err and not out.exists()

    assert main(["convert", str(src), str(out), "-q", "--keep-unmapped"]) == 0
    printed = capsys.readouterr().out
    assert "60 kept under their own names" in printed and "2 left out, not model state: conv1_w_momentum, lr" in printed
    state = load(out)
    assert state["conv1.weight"].shape == (4, 3, 3, 3, 3)  # 5-D convolutions map by the ResNet rules
    assert state["layer1.0.downsample.1.running_var"].numpy().tobytes() == blobs["res2_0_branch1_bn_riv"].tobytes()
    for name in nonlocal_names(blobs):
        assert state[name].numpy().tobytes() == blobs[name].tobytes(), name
    assert len(state) == len(blobs) - len(NOT_STATE)

    back = tmp_path / "back.pkl"
    assert main(["convert", str(out), str(back), "-q", "--keep-unmapped", *TRUST]) == 0
    written = read_caffe2_pickle(back)[1]
    assert sorted(written) == sorted(k for k in blobs if k not in NOT_STATE)
    for name, value in written.items():
        assert value.dtype == blobs[name].dtype and value.tobytes() == blobs[name].tobytes(), name


def test_drop_unmapped_drops_and_says_so(tmp_path, capsys):
    blobs = nl_video_blobs()
    src, out = tmp_path / "nl.pkl", tmp_path / "nl.safetensors"
    save_caffe2_pickle(blobs, src)
    assert main(["convert", str(src), str(out), "-q", "--drop-unmapped"]) == 0
    assert "60 dropped (--drop-unmapped): nonlocal_conv3_1_theta_w" in capsys.readouterr().out
    from safetensors.torch import load_file

    assert not any(k.startswith("nonlocal_") for k in load_file(str(out)))
    assert main(["convert", str(src), str(out), "--drop-unmapped", "--keep-unmapped"]) == 2


def test_torch_names_no_rule_maps_fail_instead_of_an_empty_pickle(tmp_path, capsys):
    state = {"encoder.0.weight": torch.randn(4, 3), "encoder.1.running_mean": torch.randn(4),
             "encoder.1.running_var": torch.rand(4), "encoder.1.weight": torch.randn(4),
             "encoder.1.bias": torch.randn(4), "bn1.running_mean": torch.randn(2),
             "bn1.running_var": torch.rand(2), "bn1.weight": torch.randn(2), "bn1.bias": torch.randn(2)}
    src, out = tmp_path / "enc.pt", tmp_path / "enc.pkl"
    torch.save(state, str(src))
    assert main(["convert", str(src), str(out), "-q", *TRUST]) == 1
    assert "5 tensor(s) have names no rule maps: encoder.0.weight" in capsys.readouterr().err and not out.exists()

    with pytest.raises(CheckpointError, match="no rule maps"):
        convert_checkpoint(src, out, trust=bool(TRUST))
    report = convert_checkpoint(src, out, unmapped="keep", trust=bool(TRUST))
    assert sorted(report.kept) == sorted(k for k in state if k.startswith("encoder."))
    written = read_caffe2_pickle(out)[1]
    assert written["res_conv1_bn_riv"].tobytes() == state["bn1.running_var"].numpy().tobytes()
    assert written["encoder.1.running_var"].tobytes() == state["encoder.1.running_var"].numpy().tobytes()
    assert len(written) == len(state)


def test_python_api_refuses_bad_policy_and_writes_nothing(tmp_path):
    src, out = tmp_path / "nl.pkl", tmp_path / "nl.pt"
    save_caffe2_pickle(nl_video_blobs(), src)
    with pytest.raises(CheckpointError, match="unmapped must be one of"):
        convert_checkpoint(src, out, unmapped="ignore")
    with pytest.raises(CheckpointError, match="nonlocal_conv4_5_bn_riv"):
        convert_checkpoint(src, out)
    assert not out.exists()
    report = convert_checkpoint(src, out, unmapped="drop")
    assert len(report.dropped) == 60 and not report.ok and "dropped: nonlocal_conv3_1_theta_w" in str(report)


def test_a_hard_linked_output_is_refused_unless_break_hardlinks(tmp_path, capsys):
    src, out, other = tmp_path / "nl.pkl", tmp_path / "nl.pt", tmp_path / "elsewhere.pt"
    save_caffe2_pickle(nl_video_blobs(), src)
    other.write_bytes(b"previous result")
    os.link(other, out)
    assert main(["convert", str(src), str(out), "-q", "--keep-unmapped", "--overwrite"]) == 1
    line = capsys.readouterr().err.strip()
    assert "2 hard links" in line and "--break-hardlinks" in line and len(line.splitlines()) == 1
    assert out.read_bytes() == b"previous result"
    assert main(["convert", str(src), str(out), "-q", "--keep-unmapped", "--overwrite", "--break-hardlinks"]) == 0
    assert other.read_bytes() == b"previous result" and out.stat().st_nlink == 1
    assert "nonlocal_conv3_1_bn_rm" in load(out)


def test_an_existing_out_is_refused_unless_overwrite_and_python_callers_get_the_keyword(tmp_path, capsys):
    src, out = tmp_path / "nl.pkl", tmp_path / "nl.pt"
    save_caffe2_pickle(nl_video_blobs(), src)
    out.write_bytes(b"previous result")
    assert main(["convert", str(src), str(out), "-q", "--keep-unmapped"]) == 1
    assert capsys.readouterr().err.strip() == "precise-bn: error: the output {}: the file exists; pass --overwrite " \
                                              "to replace it, or choose another name".format(out)
    with pytest.raises(CheckpointError) as caught:
        convert_checkpoint(str(src), str(out), unmapped="keep")
    assert [(f.option, f.value) for f in caught.value.fixes] == [("overwrite", True)]
    assert "overwrite=True" in str(caught.value) and "--" not in str(caught.value).replace(str(out), "")
    assert out.read_bytes() == b"previous result"
    assert main(["convert", str(src), str(out), "-q", "--keep-unmapped", "--overwrite"]) == 0
    assert "nonlocal_conv3_1_bn_rm" in load(out)


def test_a_wrapper_prefix_left_in_the_keys_is_pointed_out_with_strip_prefix(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from factories import small_net

    src = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"model." + k: v for k, v in small_net().state_dict().items()}, "epoch": 1}, str(src))
    assert main(["convert", str(src), str(tmp_path / "a.safetensors"), "-q", *TRUST]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "  hint: pass --strip-prefix model. (every key starts with 'model.', the prefix " \
                                   "a wrapper adds)"
    assert main(["convert", str(src), str(tmp_path / "b.safetensors"), "--strip-prefix", "model.", "-q", *TRUST]) == 0
    assert "hint" not in capsys.readouterr().out


def test_torch_to_caffe2_failing_on_a_wrapper_prefix_names_strip_prefix(tmp_path, capsys):
    from factories import caffe2_style_net

    src = tmp_path / "ddp.pt"
    torch.save({"module." + k: v for k, v in caffe2_style_net().state_dict().items()}, str(src))
    assert main(["convert", str(src), str(tmp_path / "out.pkl"), "-q", *TRUST]) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith("; pass --strip-prefix module. (every key starts with 'module.', the prefix a wrapper adds)")
    assert not (tmp_path / "out.pkl").exists()
    assert main(["convert", str(src), str(tmp_path / "out.pkl"), "-q", "--keep-unmapped", "--strip-prefix", "module.",
                 *TRUST]) == 0, capsys.readouterr().err
    blobs = read_caffe2_pickle(tmp_path / "out.pkl")[1]
    assert "conv1_w" in blobs and not any(name.startswith("module") for name in blobs)


@pytest.mark.parametrize("direction", ["pt to pkl", "pkl to pt"])
def test_convert_lists_each_name_left_out_once(tmp_path, capsys, direction):
    torch.manual_seed(0)
    state = {k: v for k, v in torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)).state_dict().items()}
    if direction == "pt to pkl":
        src, out = tmp_path / "m.pt", tmp_path / "m.pkl"
        torch.save(state, str(src))
        left_out = ["1.num_batches_tracked"]
    else:
        src, out = tmp_path / "m.pkl", tmp_path / "m.pt"
        save_caffe2_pickle(dict(nl_video_blobs(), lr=np.array([0.1], np.float32)), src)
        left_out = list(NOT_STATE)
    assert main(["convert", str(src), str(out), "--keep-unmapped", *TRUST]) == 0
    captured = capsys.readouterr()
    both = captured.out + captured.err
    assert "not model state" in captured.out
    assert all(len(re.findall(r"(?<![\w.]){}(?![\w.])".format(re.escape(name)), both)) == 1 for name in left_out), both
