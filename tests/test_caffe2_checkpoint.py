"""Caffe2 ``.pkl`` checkpoints: safe loading, saving, and the Caffe2 <-> PyTorch name mapping.

numpy and torch only: these run in both environments (the torchvision check only in main).
"""
from __future__ import annotations

import builtins
import io
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from precise_bn.caffe2.checkpoint import read_caffe2_pickle, save_caffe2_pickle
from precise_bn.caffe2.names import caffe2_to_torch, torch_to_caffe2
from precise_bn.errors import CheckpointError, UnsafeCheckpointError

BN_SUFFIXES = ("_s", "_b", "_rm", "_riv")
OPTIMIZER_BLOBS = ("conv1_w_momentum", "lr", "optimizer_iteration", "res_conv1_bn_sm", "res_conv1_bn_siv")


def zoo_blobs(seed=0):
    """A two-stage Caffe2 model-zoo ResNet checkpoint with optimizer state, in float32.

    Values include -0.0, a subnormal and a NaN with a payload, so "bit-exact" means bits.
    """
    rng = np.random.RandomState(seed)

    def rand(*shape):
        value = rng.randn(*shape).astype(np.float32)
        flat = value.reshape(-1)
        flat[:3] = np.array([0x80000000, 0x00000001, 0x7FC00123], np.uint32).view(np.float32)
        return value

    blobs = {"conv1_w": rand(4, 3, 3, 3)}
    blobs.update({"res_conv1_bn" + s: rand(4) for s in BN_SUFFIXES})
    for stage, (cin, cout) in ((2, (4, 8)), (3, (8, 8))):
        for block in (0, 1):
            width = cin if block == 0 else cout
            shapes = (("2a", (cout, width, 1, 1)), ("2b", (cout, cout, 3, 3)), ("2c", (cout, cout, 1, 1)))
            for branch, shape in shapes:
                name = "res{}_{}_branch{}".format(stage, block, branch)
                blobs[name + "_w"] = rand(*shape)
                blobs.update({name + "_bn" + s: rand(cout) for s in BN_SUFFIXES})
        name = "res{}_0_branch1".format(stage)
        blobs[name + "_w"] = rand(cout, cin, 1, 1)
        blobs.update({name + "_bn" + s: rand(cout) for s in BN_SUFFIXES})
    blobs.update({"pred_w": rand(3, 8), "pred_b": rand(3)})
    blobs.update({"conv1_w_momentum": rand(4, 3, 3, 3), "lr": np.array([0.1], np.float32),
                  "optimizer_iteration": np.array([1234], np.int64),
                  "res_conv1_bn_sm": rand(4), "res_conv1_bn_siv": rand(4)})
    return blobs


def assert_same_bits(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert got[key].tobytes() == value.tobytes(), key


def test_round_trip_caffe2_torch_caffe2_is_bit_exact(tmp_path):
    blobs = zoo_blobs()
    state, forward = caffe2_to_torch(blobs)
    assert sorted(forward.skipped) == sorted(OPTIMIZER_BLOBS) and not forward.unmatched
    assert forward.mapped["res3_1_branch2c_bn_riv"] == "layer2.1.bn3.running_var"
    assert forward.mapped["res2_0_branch1_bn_rm"] == "layer1.0.downsample.1.running_mean"
    assert forward.mapped["res2_0_branch1_w"] == "layer1.0.downsample.0.weight"
    assert forward.mapped["res_conv1_bn_s"] == "bn1.weight" and forward.mapped["pred_w"] == "fc.weight"
    assert state["layer2.1.bn3.running_var"].numpy().tobytes() == blobs["res3_1_branch2c_bn_riv"].tobytes()

    back, backward = torch_to_caffe2(state)
    assert not backward.unmatched
    assert_same_bits(back, {k: v for k, v in blobs.items() if k not in OPTIMIZER_BLOBS})
    with_base, _ = torch_to_caffe2(state, base=blobs)
    assert_same_bits(with_base, blobs)

    path = tmp_path / "model.pkl"
    save_caffe2_pickle(with_base, path)
    assert_same_bits(read_caffe2_pickle(path)[1], blobs)
    assert os.listdir(tmp_path) == ["model.pkl"]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("layout", ["blobs", "flat"])
def test_loads_python3_pickles_of_every_protocol(tmp_path, protocol, layout):
    blobs = {"conv1_w": np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7,
             "optimizer_iteration": np.array([5], np.int64), "scale": np.float64(2.5)}
    content = {"blobs": blobs, "cfg": "MODEL:\n  TYPE: generalized_rcnn\n"} if layout == "blobs" else blobs
    path = tmp_path / "ckpt.pkl"
    path.write_bytes(pickle.dumps(content, protocol=protocol))
    loaded = read_caffe2_pickle(path)[1]
    assert set(loaded) == set(blobs)
    for key, value in blobs.items():
        want = np.asarray(value)
        assert loaded[key].tobytes() == want.tobytes() and loaded[key].dtype == want.dtype


def _py2_str(text: bytes) -> bytes:
    """A Python 2 ``str`` as cPickle writes it: SHORT_BINSTRING, or BINSTRING past 255 bytes."""
    if len(text) < 256:
        return b"U" + bytes([len(text)]) + text
    return b"T" + struct.pack("<i", len(text)) + text


def _py2_array(array: np.ndarray) -> bytes:
    """An ndarray in the opcodes Python 2 numpy's ``__reduce__`` produces under protocol 2."""
    dtype = (b"cnumpy\ndtype\n" + _py2_str(array.dtype.str[1:].encode()) + b"K\x00K\x01\x87R"
             + b"(K\x03" + _py2_str(b"<") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
    shape = b"(" + b"".join(b"K" + bytes([d]) for d in array.shape) + b"t"
    data = _py2_str(array.astype("<" + array.dtype.str[1:]).tobytes())
    return (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + _py2_str(b"b") + b"\x87R"
            + b"(K\x01" + shape + dtype + b"\x89" + data + b"tb")


def test_loads_python2_protocol2_pickle(tmp_path):
    blobs = {"res_conv1_bn_riv": np.linspace(0.5, 2.0, 4).astype(np.float32),
             "conv1_w": np.random.RandomState(0).randn(2, 3, 3, 3).astype(np.float32),
             "optimizer_iteration": np.array([77], np.int64)}
    body = b"".join(_py2_str(k.encode()) + _py2_array(v) + b"s" for k, v in blobs.items())
    data = b"\x80\x02}" + _py2_str(b"blobs") + b"}" + body + b"s."
    path = tmp_path / "py2.pkl"
    path.write_bytes(data)
    assert_same_bits(read_caffe2_pickle(path)[1], blobs)


class _Evil:
    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.parametrize("attack", ["system", "open", "exec"])
def test_malicious_pickle_refused_and_nothing_runs(tmp_path, attack):
    marker = tmp_path / "pwned"
    payload = {
        "system": _Evil(os.system, ("touch {}".format(marker),)),
        "open": _Evil(builtins.open, (str(marker), "w")),
        "exec": _Evil(builtins.exec, ("open({!r}, 'w').close()".format(str(marker)),)),
    }[attack]
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"blobs": {"w": np.ones(3, np.float32), "x": payload}}, protocol=2))
    with pytest.raises(UnsafeCheckpointError) as info:
        read_caffe2_pickle(path)[1]
    assert str(path) in str(info.value) and attack in str(info.value) and "nothing was run" in str(info.value)
    assert not marker.exists()


def test_unreadable_files_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="missing.pkl"):
        read_caffe2_pickle(tmp_path / "missing.pkl")[1]
    path = tmp_path / "garbage.pkl"
    path.write_bytes(b"\x00not a pickle at all")
    with pytest.raises(CheckpointError, match="garbage.pkl"):
        read_caffe2_pickle(path)[1]
    path.write_bytes(pickle.dumps([np.zeros(2)]))
    with pytest.raises(CheckpointError, match="expected"):
        read_caffe2_pickle(path)[1]


def test_folded_bn_checkpoint_refused_for_precise_bn():
    blobs = {k: v for k, v in zoo_blobs().items()
             if not (k.startswith("res2_0_branch2b_bn_r") or k.startswith("res_conv1_bn_r"))}
    with pytest.raises(CheckpointError) as info:
        caffe2_to_torch(blobs, source="r50_affine.pkl")
    message = str(info.value)
    assert "r50_affine.pkl" in message and "AffineChannel" in message
    assert "res2_0_branch2b_bn" in message and "res_conv1_bn" in message and "2 layer(s)" in message
    state, _ = caffe2_to_torch(blobs, require_bn_stats=False)
    assert "bn1.weight" in state and "bn1.running_var" not in state


def test_user_rules_target_checks_and_report():
    blobs = {"stem_w": np.ones((4, 3, 3, 3), np.float32), "stem_bn_s": np.ones(4, np.float32),
             "stem_bn_b": np.zeros(4, np.float32), "stem_bn_rm": np.zeros(4, np.float32),
             "stem_bn_riv": np.ones(4, np.float32), "head_w": np.ones((2, 5), np.float32),
             "extra_w": np.ones(1, np.float32)}
    nn = torch.nn
    target = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Linear(4, 2))
    rules = [(r"stem", "0"), (r"stem_bn", "1"), (r"head", "2")]
    with pytest.raises(CheckpointError, match=r"r50\.pkl: 1 tensor\(s\) have names no rule maps: extra_w"):
        caffe2_to_torch(blobs, rules=rules, target=target, source="r50.pkl")
    state, report = caffe2_to_torch(blobs, rules=rules, target=target, unmapped="drop")
    assert report.unmatched == ["extra_w"] and report.dropped == ["extra_w"] and "extra_w" not in state
    assert report.shape_mismatches == [("head_w", "2.weight", (2, 5), (2, 4))]
    assert sorted(report.missing) == ["2.bias"] and "2.weight" not in state
    assert not report.ok and "head_w" in str(report)
    names = {"stem": "conv", "stem_bn": "bn"}
    callable_state, callable_report = caffe2_to_torch(blobs, rules=names.get, unmapped="keep")
    assert sorted(callable_report.unmatched) == sorted(callable_report.kept) == ["extra_w", "head_w"]
    assert callable_report.ok and callable_state["head_w"].numpy().tobytes() == blobs["head_w"].tobytes()
    assert callable_state["bn.running_var"].numpy().tobytes() == blobs["stem_bn_riv"].tobytes()
    with pytest.raises(CheckpointError, match="both map to"):
        caffe2_to_torch(blobs, rules=[(r"stem.*", "0")], require_bn_stats=False)


def test_save_to_open_file_and_refuse_non_numeric(tmp_path):
    blobs = {"pred_b": torch.arange(3, dtype=torch.float32), "pred_w": np.eye(3, dtype=np.float32)}
    handle = io.BytesIO()
    save_caffe2_pickle(blobs, handle)
    path = tmp_path / "stream.pkl"
    path.write_bytes(handle.getvalue())
    loaded = read_caffe2_pickle(path)[1]
    assert loaded["pred_b"].tobytes() == blobs["pred_b"].numpy().tobytes()
    with pytest.raises(CheckpointError, match="'cfg'"):
        save_caffe2_pickle({"cfg": {"a": 1}}, path)
    assert read_caffe2_pickle(path)[1].keys() == loaded.keys()


@pytest.mark.main_env
@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_builtin_rules_cover_torchvision_resnets(arch):
    import torchvision

    model = getattr(torchvision.models, arch)()
    blobs, to_caffe2 = torch_to_caffe2(model.state_dict())
    assert not to_caffe2.unmatched and "res5_1_branch2b_bn_riv" in blobs and "pred_w" in blobs
    state, to_torch = caffe2_to_torch(blobs, target=model)
    assert to_torch.ok, str(to_torch)
    for key, value in state.items():
        assert value.numpy().tobytes() == model.state_dict()[key].numpy().tobytes(), key


def test_write_back_into_python2_pickle_keeps_its_other_entries(tmp_path):
    blobs = {"res_conv1_bn_riv": np.linspace(0.5, 2.0, 4).astype(np.float32),
             "conv1_w": np.random.RandomState(1).randn(2, 3, 3, 3).astype(np.float32),
             "optimizer_iteration": np.array([77], np.int64)}
    body = b"".join(_py2_str(k.encode()) + _py2_array(v) + b"s" for k, v in blobs.items())
    cfg = b"MODEL:\n  TYPE: generalized_rcnn\nTRAIN:\n  WEIGHTS: ''\n"
    data = (b"\x80\x02}" + _py2_str(b"blobs") + b"}" + body + b"s" + _py2_str(b"cfg") + _py2_str(cfg) + b"s"
            + _py2_str(b"iter") + b"J" + struct.pack("<i", 90000) + b"s.")
    path, out = tmp_path / "py2.pkl", tmp_path / "out.pkl"
    path.write_bytes(data)
    root, loaded = read_caffe2_pickle(path)
    new_var = loaded["res_conv1_bn_riv"].astype(np.float64) * 3 + 1e-9
    save_caffe2_pickle({"res_conv1_bn_riv": new_var}, out, root=root)

    assert root["blobs"]["res_conv1_bn_riv"].tobytes() == blobs["res_conv1_bn_riv"].tobytes()
    written, written_blobs = read_caffe2_pickle(out)
    assert list(written) == ["blobs", "cfg", "iter"] and list(written["blobs"]) == list(blobs)
    assert written["cfg"] == cfg.decode("latin1") and written["iter"] == 90000 and type(written["iter"]) is int
    assert_same_bits(written_blobs, dict(blobs, res_conv1_bn_riv=new_var.astype(np.float32)))


def test_write_back_keeps_bytes_keys_scalars_and_refuses_unknown_blobs(tmp_path):
    root = {b"conv1_w": np.arange(6, dtype=np.float16).reshape(2, 3), b"res_conv1_bn_rm": np.float32(1.5),
            b"note": b"trained on 8 GPUs"}
    path, out = tmp_path / "flat.pkl", tmp_path / "out.pkl"
    path.write_bytes(pickle.dumps(root, protocol=3))
    loaded_root, blobs = read_caffe2_pickle(path)
    assert sorted(blobs) == ["conv1_w", "res_conv1_bn_rm"]
    save_caffe2_pickle({"conv1_w": torch.ones(6, dtype=torch.float64), "res_conv1_bn_rm": np.array([2.5])},
                       out, root=loaded_root)
    written = pickle.loads(out.read_bytes())
    assert list(written) == list(root) and written[b"note"] == root[b"note"]
    assert written[b"conv1_w"].dtype == np.float16 and written[b"conv1_w"].shape == (2, 3)
    assert written[b"conv1_w"].tobytes() == np.ones((2, 3), np.float16).tobytes()
    assert type(written[b"res_conv1_bn_rm"]) is np.float32 and written[b"res_conv1_bn_rm"] == 2.5
    with pytest.raises(CheckpointError, match="no blob note, pred_w"):
        save_caffe2_pickle({"pred_w": np.ones(2), "note": np.ones(1)}, tmp_path / "bad.pkl", root=loaded_root)
    assert not (tmp_path / "bad.pkl").exists()


def _globals_named(data: bytes):
    """Every module.name a pickle stream refers to (GLOBAL, or the two strings before STACK_GLOBAL)."""
    import pickletools

    names, strings = set(), []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL":
            names.add(".".join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return names


def _py2_era_root(protocol):
    """A file as the Caffe2 era's tools leave them: blobs plus builtin containers that
    protocol-2 pickles name under ``__builtin__``."""
    blobs = {"res_conv1_bn_riv": np.linspace(0.5, 2.0, 4).astype(np.float32),
             "res_conv1_bn_rm": np.float32(0.25), "conv1_w": np.ones((4, 3, 1, 1), np.float16)}
    return {"blobs": blobs, "tags": {"kinetics", "c2d"}, "frozen": frozenset([1, 2]), "z": complex(1, 2),
            "raw": bytearray(b"\x00\xff")}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_write_back_keeps_protocol_and_loads_where_numpy_1_runs(tmp_path, protocol):
    from precise_bn.caffe2.checkpoint import pickle_protocol
    from precise_bn.checkpoint.formats import load_checkpoint, save_checkpoint

    src, out = tmp_path / "in.pkl", tmp_path / "out.pkl"
    root = _py2_era_root(protocol)
    src.write_bytes(pickle.dumps(root, protocol=protocol))
    if protocol == 2:
        assert "__builtin__.set" in _globals_named(src.read_bytes())
    ckpt = load_checkpoint(str(src))  # the safe loader takes protocol-2 builtin aliases
    assert ckpt.root["tags"] == root["tags"] and ckpt.root["raw"] == root["raw"]
    ckpt.state_dict["bn1.running_var"].mul_(3)
    ckpt.updated.append("bn1.running_var")
    save_checkpoint(ckpt, str(out))

    data = out.read_bytes()
    assert pickle_protocol(out) == protocol
    assert not [name for name in _globals_named(data) if name.startswith("numpy._core")]
    written, blobs = read_caffe2_pickle(out)  # every file written loads through the safe loader
    assert {k: v for k, v in written.items() if k != "blobs"} == {k: v for k, v in root.items() if k != "blobs"}
    assert blobs["res_conv1_bn_riv"].tobytes() == (root["blobs"]["res_conv1_bn_riv"] * 3).tobytes()
    assert type(written["blobs"]["res_conv1_bn_rm"]) is np.float32
    assert blobs["conv1_w"].dtype == np.float16


@pytest.mark.main_env
def test_pickle_written_here_loads_with_plain_pickle_in_the_caffe2_environment(tmp_path):
    import subprocess

    from cli_helpers import REPO

    python = REPO / ".venv-caffe2" / "bin" / "python"
    if not python.exists():
        pytest.skip("the caffe2 environment is not built here (bash scripts/dev.sh setup builds it)")
    blobs = {"conv1_w": np.random.RandomState(0).randn(2, 3, 3, 3).astype(np.float32),
             "res_conv1_bn_rm": np.float32(1.5), "optimizer_iteration": np.array([7], np.int64)}
    path = tmp_path / "here.pkl"
    save_caffe2_pickle(blobs, path, root={"blobs": blobs, "tags": {"a"}})
    script = ("import pickle, sys, numpy; d = pickle.load(open(sys.argv[1], 'rb')); "
              "print(numpy.__version__); print(sorted(d['tags'])); "
              "[print(k, type(v).__name__, v.dtype, v.tobytes().hex()) for k, v in sorted(d['blobs'].items())]")
    result = subprocess.run([str(python), "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("1.") and lines[1] == "['a']"
    want = ["{} {} {} {}".format(k, type(v).__name__, v.dtype, v.tobytes().hex()) for k, v in sorted(blobs.items())]
    assert lines[2:] == want
