"""What the command reads: the same command writes the same bits, ``imagefolder:`` without
randomness unless ``--augment`` (seeded), specs that suggest the fix, batch conventions."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from factories import batches, dict_batches, small_net
from cli_helpers import TRUST, load, run_cli
from precise_bn.cli import job
from precise_bn.cli.data_specs import SeededSamples, resolve_data
from precise_bn.errors import ConfigError
from reference import assert_close_exact, float64_reference

BN_NAMES = ("1", "4", "9")


def _check_stats(state, net, data):
    ref = float64_reference(net, data)
    assert sorted(ref) == sorted(BN_NAMES)
    for name, (mean, var, _) in ref.items():
        assert_close_exact(state[name + ".running_mean"], state[name + ".running_var"], mean, var, name)


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    net = small_net()
    path = tmp_path / "c.pt"
    torch.save({"model": net.state_dict(), "epoch": 2}, str(path))
    return path, net


def test_the_same_command_writes_the_same_bytes(ckpt, tmp_path, capsys, monkeypatch):
    path, _ = ckpt
    np.savez(str(tmp_path / "d.npz"), x=np.random.default_rng(1).normal(size=(40, 3, 8, 8)).astype(np.float32))
    args = ["recompute", path, "--model", "factories:small_net", "--data", "npz:{}".format(tmp_path / "d.npz"),
            "--batch-size", "8", "-q", *TRUST]
    written = []
    for run in range(3):
        if run == 2:
            monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
        out = tmp_path / "out{}.pt".format(run)
        assert run_cli(capsys, *args, "--output", out).returncode == 0
        written.append(load(out))
    first, second, dated = written
    dates = [w["precise_bn"].pop("date") for w in written]
    assert dates[2] == "2023-11-14T22:13:20+00:00"
    for other in (second, dated):  # everything but the time of the run has the same bits
        assert first["precise_bn"] == other["precise_bn"] and first["epoch"] == other["epoch"]
        assert all(torch.equal(first["model"][k], other["model"][k]) for k in first["model"])
    assert run_cli(capsys, *args, "--output", tmp_path / "out3.pt").returncode == 0
    assert (tmp_path / "out3.pt").read_bytes() == (tmp_path / "out2.pt").read_bytes()


def _image_folder(root, classes=("cat", "dog"), per_class=3):
    from PIL import Image

    rng = np.random.default_rng(2)
    for label in classes:
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(str(root / label / "{}.png".format(i)))


def _eval_transform_by_hand(path, size):
    """Shorter side to round(size / 0.875), centre crop, ImageNet normalisation: built here, not by the package."""
    from PIL import Image

    image = Image.open(path).convert("RGB")
    w, h = image.size
    short = round(size / 0.875)
    image = image.resize((int(w * short / h), short) if w > h else (short, int(h * short / w)), Image.BILINEAR)
    w, h = image.size
    left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))
    pixels = np.asarray(image.crop((left, top, left + size, top + size)), np.float32) / 255.0
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    return torch.from_numpy(((pixels - mean) / std).transpose(2, 0, 1).copy())


@pytest.mark.main_env
def test_imagefolder_reads_every_image_without_randomness(ckpt, tmp_path, capsys):
    path, net = ckpt
    _image_folder(tmp_path / "train")
    spec = "imagefolder:{}".format(tmp_path / "train")
    args = ["recompute", path, "--model", "factories:small_net", "--data", spec, "--data-kwargs", '{"size": 8}',
            "--batch-size", "4", "-q", *TRUST]
    for out in ("a.pt", "b.pt"):
        assert run_cli(capsys, *args, "--output", tmp_path / out, "--report", tmp_path / (out + ".json")).returncode == 0
    used = list(resolve_data(spec, {"size": 8}, batch_size=4))
    assert [len(x) for x, _ in used] == [4, 2]
    by_hand = sorted(_eval_transform_by_hand(p, 8).flatten().tolist() for p in sorted((tmp_path / "train").rglob("*.png")))
    got = sorted(x.flatten().tolist() for batch, _ in used for x in batch)
    np.testing.assert_allclose(np.array(got), np.array(by_hand), rtol=0, atol=1e-6)
    a, b = load(tmp_path / "a.pt")["model"], load(tmp_path / "b.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    _check_stats(a, net, used)
    report = json.loads((tmp_path / "a.pt.json").read_text())
    assert report["samples"] == 6 and "mean_drift" in report["definitions"]


@pytest.mark.main_env
def test_augment_is_seeded_per_image(ckpt, tmp_path, capsys):
    path, net = ckpt
    _image_folder(tmp_path / "train")
    spec = "imagefolder:{}".format(tmp_path / "train")
    plain = [x for batch, _ in resolve_data(spec, {"size": 8, "shuffle": False}, batch_size=6) for x in batch]
    augmented = {seed: [x for batch, _ in resolve_data(spec, {"size": 8, "shuffle": False}, batch_size=6, seed=seed,
                                                       augment=True) for x in batch] for seed in (0, 0, 1)}
    again = [x for batch, _ in resolve_data(spec, {"size": 8, "shuffle": False}, batch_size=6, seed=0, augment=True)
             for x in batch]
    assert all(torch.equal(x, y) for x, y in zip(augmented[0], again))
    assert not all(torch.equal(x, y) for x, y in zip(augmented[0], augmented[1]))
    assert not all(torch.equal(x, y) for x, y in zip(augmented[0], plain))
    # The draw of an image depends on the seed and its index only, not on what was read before.
    loader = resolve_data(spec, {"size": 8}, batch_size=6, seed=0, augment=True)
    dataset = loader.dataset
    assert isinstance(dataset, SeededSamples)
    torch.manual_seed(123)
    assert torch.equal(dataset[4][0], augmented[0][4]) and torch.equal(dataset[4][0], dataset[4][0])
    args = ["recompute", path, "--model", "factories:small_net", "--data", spec, "--data-kwargs", '{"size": 8}',
            "--batch-size", "4", "--augment", "-q", *TRUST]
    for name, seed in (("s0.pt", "0"), ("s0b.pt", "0"), ("s1.pt", "1")):
        assert run_cli(capsys, *args, "--seed", seed, "--output", tmp_path / name).returncode == 0
    s0, s0b, s1 = (load(tmp_path / n)["model"] for n in ("s0.pt", "s0b.pt", "s1.pt"))
    assert all(torch.equal(s0[k], s0b[k]) for k in s0) and not torch.equal(s0["1.running_var"], s1["1.running_var"])
    _check_stats(s1, net, list(resolve_data(spec, {"size": 8}, batch_size=4, seed=1, augment=True)))


def test_specs_without_a_scheme_suggest_one(ckpt, tmp_path, capsys):
    path, _ = ckpt
    (tmp_path / "imgs").mkdir()
    np.save(str(tmp_path / "x.npy"), np.zeros((4, 3, 8, 8), np.float32))
    cases = [
        (["--model", "factories:small_net", "--data", str(tmp_path / "imgs")],
         "did you mean imagefolder:{}?".format(tmp_path / "imgs")),
        (["--model", "factories:small_net", "--data", str(tmp_path / "x.npy")],
         "did you mean npz:{}?".format(tmp_path / "x.npy")),
        (["--model", "nosuchmodel", "--data", "factories:batches"],
         "--model 'nosuchmodel': expected package.module:callable, torchvision:NAME or timm:NAME"),
    ]
    for args, needle in cases:
        result = run_cli(capsys, "recompute", path, *args, "-q", *TRUST)
        assert result.returncode == 2 and needle in result.stderr, result.stderr


@pytest.mark.main_env
def test_a_bare_torchvision_name_suggests_the_spec():
    from precise_bn.cli.specs import resolve_model

    with pytest.raises(ConfigError, match="did you mean torchvision:resnet18"):
        resolve_model("resnet18")


@pytest.mark.main_env
def test_a_flat_folder_of_images_is_read_as_it_is_and_nothing_else(ckpt, tmp_path, capsys):
    path, net = ckpt
    _image_folder(tmp_path / "train", classes=("calib",), per_class=5)
    flat = tmp_path / "train" / "calib"
    (flat / "labels.txt").write_text("not an image")
    (flat / "notes.png.bak").write_bytes(b"nor this")
    spec = "imagefolder:{}".format(flat)
    used = list(resolve_data(spec, {"size": 8, "shuffle": False}, batch_size=2))
    assert [tuple(batch.shape) for batch in used] == [(2, 3, 8, 8), (2, 3, 8, 8), (1, 3, 8, 8)]  # images, no labels
    by_hand = [_eval_transform_by_hand(p, 8) for p in sorted(flat.glob("*.png"))]
    got = [x for batch in used for x in batch]
    assert len(got) == len(by_hand) == 5
    for x, y in zip(got, by_hand):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=0, atol=1e-6)
    out = tmp_path / "out.pt"
    result = run_cli(capsys, "recompute", path, "--model", "factories:small_net", "--data", spec, "--data-kwargs",
                     '{"size": 8, "drop_last": true}', "--batch-size", "2", "--output", out, "-q", *TRUST)
    assert result.returncode == 0, result.stderr
    read = list(resolve_data(spec, {"size": 8, "drop_last": True}, batch_size=2))
    assert sum(len(b) for b in read) == 4
    _check_stats(load(out)["model"], net, read)


@pytest.mark.main_env
def test_images_beside_class_folders_are_reported_and_an_empty_folder_refused(tmp_path, caplog):
    _image_folder(tmp_path / "train")
    _image_folder(tmp_path / "stray", classes=("",), per_class=1)  # one image directly in the folder
    (tmp_path / "stray" / "0.png").rename(tmp_path / "train" / "stray.png")
    with caplog.at_level("WARNING", logger="precise_bn"):
        data = resolve_data("imagefolder:{}".format(tmp_path / "train"), {"size": 8}, batch_size=8)
    assert len(data.dataset) == 6
    assert "the 1 image(s) directly in {} are not read".format(tmp_path / "train") in caplog.text
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("")
    with pytest.raises(ConfigError, match="holds neither images .* nor class subfolders"):
        resolve_data("imagefolder:{}".format(tmp_path / "empty"))


def test_seed_reaches_a_factory_and_augment_only_imagefolder():
    with pytest.raises(ConfigError, match="--seed: the data factory 'factories:fixed_batches' takes no seed"):
        resolve_data("factories:fixed_batches", seed=3)
    assert [len(x) for x, _ in resolve_data("factories:batches", {"n": 2}, seed=3)] == [6, 3]
    assert torch.equal(resolve_data("factories:batches", seed=3)[0][0], batches(seed=3)[0][0])
    with pytest.raises(ConfigError, match="--augment: only imagefolder"):
        resolve_data("factories:batches", augment=True)


def test_unrecognised_batches_are_one_line_and_input_key_or_forward_fn_fix_them(ckpt, tmp_path, capsys):
    path, net = ckpt
    base = ["recompute", path, "--model", "factories:small_net", "--data", "factories:dict_batches", "-q",
            *TRUST]
    result = run_cli(capsys, *base)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr
    assert "'image': Tensor[6, 3, 8, 8] float32" in lines[0] and "--input-key KEY" in lines[0]
    for extra in (["--input-key", "image"], ["--forward-fn", "factories:image_forward"]):
        out = tmp_path / "out.pt"
        assert run_cli(capsys, *base, *extra, "--output", out, "--overwrite").returncode == 0
        _check_stats(load(out)["model"], net, [(b["image"], b["label"]) for b in dict_batches()])


def test_budget_precision_and_timeout_options_reach_the_pass(ckpt, tmp_path, capsys, monkeypatch):
    path, _ = ckpt
    seen = []
    real = job.recalibrate
    monkeypatch.setattr(job, "recalibrate",
                        lambda backend, data, opts, **kw: seen.append(opts) or real(backend, data, opts, **kw))
    result = run_cli(capsys, "recompute", path, "--model", "factories:small_net", "--data",
                     "factories:batches", "--rtol", "0.5", "--min-batches", "2", "--timeout", "42",
                     "--report", tmp_path / "r.json", "-q", *TRUST)
    assert result.returncode == 0, result.stderr
    (opts,) = seen
    assert (opts.rtol, opts.min_batches, opts.timeout, opts.num_batches) == (0.5, 2, 42.0, None)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rtol"] == 0.5 and report["stop"] in ("rtol", "data")
    assert run_cli(capsys, "recompute", path, "--model", "m:f", "--data", "d:f", "--timeout", "0").returncode == 2
