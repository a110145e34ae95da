"""``precise-bn recompute`` on every checkpoint layout, run as a command (in-process) on files the tests write.

Each layout test checks the three promises of a write: the BN stats equal a float64 reference
over the very batches the command used, every other key keeps its exact bits, and the result
loads the way the user's code loads the input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile

import pytest
import torch

from factories import batches, trained_net
from cli_helpers import TRUST, assert_same_except, bn_paths, load, run_cli, without
from precise_bn import __version__
from precise_bn.checkpoint.serializers import SAFE_LOAD_AVAILABLE
from precise_bn.cli import main
from precise_bn.cli.data_specs import resolve_data
from reference import assert_close_exact, float64_reference

BN_NAMES = ("1", "4", "9")
FACTORIES = ["--model", "factories:small_net", "--data", "factories:batches"]


def optimizer_state(net: torch.nn.Module) -> dict:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(batches(n=1)[0][0]).sum().backward()
    opt.step()
    net.zero_grad()
    return opt.state_dict()


def check_stats(state: dict, prefix: str, net: torch.nn.Module, data, exact: bool = False) -> None:
    """The written running stats against the float64 reference of ``net`` over ``data``."""
    ref = float64_reference(net, data)
    assert sorted(ref) == sorted(BN_NAMES)
    check = assert_close_exact
    for name, (mean, var, _) in ref.items():
        check(state[prefix + name + ".running_mean"], state[prefix + name + ".running_var"], mean, var, name)


def _layout(kind: str, tmp_path):
    """(file, root object or None, where, prefix, extra args) for one layout."""
    net = trained_net()
    sd = net.state_dict()
    if kind == "bare":
        return tmp_path / "bare.pt", sd, (), "", []
    if kind == "model":
        other = trained_net(seed=1).state_dict()
        root = {
            "model": sd,
            "optimizer": optimizer_state(trained_net(seed=2)),
            "epoch": 7,
            "ema": {k: v.half() if v.is_floating_point() else v for k, v in other.items()},
        }
        return tmp_path / "ckpt.pth", root, ("model",), "", []
    if kind == "lightning":
        state = {"model." + k: v for k, v in sd.items()}
        state["criterion.weight"] = torch.tensor([1.0, 2.0, 0.5])
        root = {
            "epoch": 3,
            "global_step": 120,
            "pytorch-lightning_version": "2.6.0",
            "state_dict": state,
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.25)}},
            "optimizer_states": [optimizer_state(trained_net(seed=2))],
            "lr_schedulers": [],
            "hparams_name": "kwargs",
            "hyper_parameters": {"lr": 0.1, "width": 4, "name": "net"},
        }
        return tmp_path / "last.ckpt", root, ("state_dict",), "model.", []
    if kind == "ddp":
        root = {"model_state": {"module." + k: v for k, v in sd.items()}, "cfg": "MODEL: {DEPTH: 50}"}
        return tmp_path / "ddp.pyth", root, ("model_state",), "module.", []
    if kind == "nested_key":
        root = {"ema": {"weights": sd}, "model": trained_net(seed=1).state_dict()}
        return tmp_path / "nested.pt", root, ("ema", "weights"), "", ["--key", "ema/weights"]
    if kind == "safetensors":
        return tmp_path / "model.safetensors", None, (), "", []
    raise AssertionError(kind)


LAYOUTS = [("bare", False), ("model", False), ("lightning", False), ("ddp", True), ("nested_key", False), ("safetensors", False)]


@pytest.mark.parametrize("kind,exact", LAYOUTS, ids=[k for k, _ in LAYOUTS])
def test_recompute_layout_keeps_other_keys_and_matches_reference(kind, exact, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    path, root, where, prefix, extra = _layout(kind, tmp_path)
    net = trained_net()
    if kind == "safetensors":
        save_file(dict(net.state_dict()), str(path), metadata={"format": "pt", "note": "kept"})
    else:
        torch.save(root, str(path))
    out, report_file = tmp_path / ("out" + path.suffix), tmp_path / "report.json"
    result = run_cli(
        capsys, "recompute", path, *FACTORIES, "--num-iters", "5", "--output", out, "--report", report_file,
        *(["--exact"] if exact else []), *extra, *TRUST,
    )
    assert result.returncode == 0, result.stderr
    assert "mean drift" in result.stdout and "Traceback" not in result.stderr
    assert ("--exact is deprecated and ignored" in result.stderr) == exact
    data = batches()
    samples = sum(len(x) for x, _ in data)
    if kind == "safetensors":
        from safetensors import safe_open

        state = load_file(str(out))
        with safe_open(str(out), framework="pt") as handle:
            metadata = handle.metadata()
        assert metadata["note"] == "kept" and metadata["format"] == "pt"
        provenance = json.loads(metadata["precise_bn"])
        # safetensors stores tensors sorted by dtype and name: compare in one order.
        changed = assert_same_except(dict(sorted(net.state_dict().items())), dict(sorted(state.items())), bn_paths((), "", BN_NAMES))
    else:
        written = load(out)
        if where:
            provenance = written["precise_bn"]
            written = without(written, "precise_bn")
        else:
            provenance = None
            assert "precise_bn" not in written
        changed = assert_same_except(root, written, bn_paths(where, prefix, BN_NAMES))
        state = written
        for key in where:
            state = state[key]
    assert changed == bn_paths(where if kind != "safetensors" else (), prefix, BN_NAMES)
    check_stats(state, prefix, net, data, exact)
    old = net.state_dict()["1.running_var"]
    assert not torch.equal(state[prefix + "1.running_var"], old), "the stats did not change"
    if provenance is not None:
        assert provenance["samples"] == samples and provenance["iterations"] == len(data)
        assert provenance["version"] == __version__ and provenance["world_size"] == 1
        assert provenance["estimator"] == "float64" and provenance["layers"] == 3
    report = json.loads(report_file.read_text())
    assert report["samples"] == samples and report["prefix"] == prefix
    assert [layer["name"] for layer in report["layers"]] == list(BN_NAMES)
    assert all(layer["mean_drift"] > 0 for layer in report["layers"])


def test_legacy_format_is_written_back_in_legacy_format(tmp_path):
    net = trained_net()
    path, out = tmp_path / "old.pth", tmp_path / "new.pth"
    torch.save({"state_dict": net.state_dict(), "arch": "small"}, str(path), _use_new_zipfile_serialization=False)
    code = main(["recompute", str(path), *FACTORIES, "--output", str(out), "-q", *TRUST])
    assert code == 0
    assert not zipfile.is_zipfile(str(out))
    written = load(out)
    assert written["arch"] == "small"
    check_stats(written["state_dict"], "", net, batches())


def test_npz_data_with_and_without_key(tmp_path, capsys):
    gen = torch.Generator().manual_seed(3)
    images = (torch.randn(22, 3, 8, 8, generator=gen) * 3 - 2).double()
    import numpy as np

    np.savez(str(tmp_path / "one.npz"), images=images.numpy())
    np.savez(str(tmp_path / "two.npz"), images=images.numpy(), labels=np.arange(22))
    net = trained_net()
    torch.save({"model": net.state_dict()}, str(tmp_path / "c.pt"))
    for spec in ("npz:{}".format(tmp_path / "one.npz"), "npz:{}:images".format(tmp_path / "two.npz")):
        out = tmp_path / "out.pt"
        args = ["recompute", str(tmp_path / "c.pt"), "--model", "factories:small_net", "--data", spec,
                "--batch-size", "4", "--num-samples", "22", "--output", str(out), "--overwrite", "-q", *TRUST]
        assert main(args) == 0
        used = list(resolve_data(spec, batch_size=4))
        assert [len(b[0]) for b in used] == [4, 4, 4, 4, 4, 2]
        assert torch.equal(torch.cat([b[0] for b in used]).sort(0)[0], images.float().sort(0)[0])
        check_stats(load(out)["model"], "", net, used)
    spec = "npz:{}".format(tmp_path / "two.npz")
    assert main(["recompute", str(tmp_path / "c.pt"), "--model", "factories:small_net", "--data", spec, "-q", *TRUST]) == 1
    assert "images, labels" in capsys.readouterr().err


def test_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "code_ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    path = tmp_path / "evil.pt"
    torch.save({"model": trained_net().state_dict(), "extra": Payload()}, str(path))
    result = run_cli(capsys, "recompute", path, *FACTORIES, "--output", tmp_path / "out.pt")
    assert result.returncode == 1
    assert str(path) in result.stderr and "--trust-checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
    if SAFE_LOAD_AVAILABLE:
        assert "posix.mkdir" in result.stderr or "os.mkdir" in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def test_plain_checkpoint_loads_untrusted_only_where_torch_can_do_it_safely(tmp_path, capsys):
    path = tmp_path / "c.pt"
    torch.save({"model": trained_net().state_dict()}, str(path))
    code = main(["recompute", str(path), *FACTORIES, "-q"])
    if SAFE_LOAD_AVAILABLE:
        assert code == 0
    else:
        assert code == 1 and "needs torch >= 1.13" in capsys.readouterr().err
        assert not (tmp_path / "c.precise_bn.pt").exists()


def test_trust_checkpoint_loads_and_keeps_arbitrary_objects(tmp_path, capsys):
    net = trained_net()
    path, out = tmp_path / "ns.pt", tmp_path / "out.pt"
    torch.save({"model": net.state_dict(), "args": argparse.Namespace(lr=0.1, arch="small")}, str(path))
    assert main(["recompute", str(path), *FACTORIES, "--output", str(out), "-q"]) == 1
    assert "--trust-checkpoint" in capsys.readouterr().err
    assert not out.exists()
    assert main(["recompute", str(path), *FACTORIES, "--output", str(out), "-q", "--trust-checkpoint"]) == 0
    written = load(out, trusted=True)
    assert written["args"] == argparse.Namespace(lr=0.1, arch="small")
    check_stats(written["model"], "", net, batches())


def test_missing_key_lists_what_is_there(tmp_path, capsys):
    path = tmp_path / "c.pt"
    torch.save({"model": trained_net().state_dict(), "epoch": 2}, str(path))
    result = run_cli(capsys, "recompute", path, *FACTORIES, "--key", "ema", *TRUST)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert str(path) in result.stderr and "'ema'" in result.stderr
    assert "'model'" in result.stderr and "'epoch'" in result.stderr


def test_no_state_dict_found_suggests_key(tmp_path, capsys):
    path = tmp_path / "c.pt"
    torch.save({"weights": trained_net().state_dict(), "epoch": 2}, str(path))
    assert main(["recompute", str(path), *FACTORIES, "-q", *TRUST]) == 1
    err = capsys.readouterr().err
    assert "'weights'" in err and "--key" in err


def test_model_keys_not_matching_are_listed(tmp_path, capsys):
    path = tmp_path / "c.pt"
    torch.save(trained_net().state_dict(), str(path))
    result = run_cli(
        capsys, "recompute", path, "--model", "factories:small_net", "--model-kwargs", '{"extra_layer": true}',
        "--data", "factories:batches", *TRUST,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "missing from the checkpoint" in result.stderr and "11.running_mean" in result.stderr
    assert main(["recompute", str(path), *FACTORIES[2:], "--model", "factories:small_net",
                 "--model-kwargs", '{"width": 5}', "-q", *TRUST]) == 1
    err = capsys.readouterr().err
    assert "different shapes" in err and "0.weight (checkpoint (4, 3, 3, 3), model (5, 3, 3, 3))" in err


def test_ambiguous_prefix_needs_prefix_and_then_touches_only_it(tmp_path, capsys):
    a, b = trained_net(seed=0), trained_net(seed=1)
    state = {**{"student." + k: v for k, v in a.state_dict().items()}, **{"teacher." + k: v for k, v in b.state_dict().items()}}
    path, out = tmp_path / "two.pt", tmp_path / "out.pt"
    torch.save({"state_dict": state}, str(path))
    assert main(["recompute", str(path), *FACTORIES, "-q", *TRUST]) == 1
    assert "--prefix" in capsys.readouterr().err
    assert main(["recompute", str(path), *FACTORIES, "--prefix", "teacher.", "--output", str(out), "-q", *TRUST]) == 0
    written = load(out)
    changed = assert_same_except({"state_dict": state}, without(written, "precise_bn"), bn_paths(("state_dict",), "teacher.", BN_NAMES))
    assert len(changed) == 2 * len(BN_NAMES)
    check_stats(written["state_dict"], "teacher.", b, batches())


def test_refuses_to_overwrite_input_without_in_place(tmp_path, capsys):
    path = tmp_path / "c.pt"
    torch.save({"model": trained_net().state_dict()}, str(path))
    before = path.read_bytes()
    assert main(["recompute", str(path), *FACTORIES, "--output", str(path), "-q", *TRUST]) == 1
    assert "--in-place" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_in_place_replaces_the_file(tmp_path):
    net = trained_net()
    path = tmp_path / "c.pt"
    torch.save({"model": net.state_dict(), "epoch": 5}, str(path))
    assert main(["recompute", str(path), *FACTORIES, "--in-place", "-q", *TRUST]) == 0
    written = load(path)
    assert written["epoch"] == 5 and "precise_bn" in written
    check_stats(written["model"], "", net, batches())
    assert sorted(os.listdir(str(tmp_path))) == ["c.pt"]


def test_in_place_failure_mid_write_leaves_the_original(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.pt"
    torch.save({"model": trained_net().state_dict(), "epoch": 5}, str(path))
    before = path.read_bytes()
    real_save = torch.save

    def save_then_fail(obj, handle, **kwargs):
        real_save(obj, handle, **kwargs)
        handle.truncate(len(before) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", save_then_fail)
    assert main(["recompute", str(path), *FACTORIES, "--in-place", "-q", *TRUST]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(path) in err
    assert path.read_bytes() == before
    assert sorted(os.listdir(str(tmp_path))) == ["c.pt"]


def test_model_without_bn_is_a_failure(tmp_path, capsys):
    from factories import no_bn_net

    path = tmp_path / "c.pt"
    torch.save(no_bn_net().state_dict(), str(path))
    args = ["recompute", str(path), "--model", "factories:no_bn_net", "--data", "factories:batches", "-q"]
    assert main(args + TRUST) == 1
    assert "no BatchNorm layer" in capsys.readouterr().err
    assert not (tmp_path / "c.precise_bn.pt").exists()


def test_safetensors_missing_says_how_to_install(tmp_path, monkeypatch):
    from precise_bn.checkpoint.formats import load_checkpoint
    from precise_bn.errors import BackendUnavailableError

    path = tmp_path / "m.safetensors"
    path.write_bytes(b"{}")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(BackendUnavailableError, match="pip install safetensors"):
        load_checkpoint(str(path))
