"""A checkpoint that does not fit: each error carries the arguments that fix it, as fields for
Python callers and as flags on the command line, one line each."""
from __future__ import annotations

import pytest
import torch

from factories import small_net, trained_net
from cli_helpers import TRUST, run_cli
from precise_bn.checkpoint.formats import load_checkpoint
from precise_bn.checkpoint.state import match_model
from precise_bn.errors import CheckpointError, Fix

DATA = ["--data", "factories:batches", "-q", *TRUST]


def _fixes(capsys, *args):
    result = run_cli(capsys, "recompute", *args)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    return [line.strip()[len("likely fix: pass "):] for line in result.stderr.splitlines()
            if line.strip().startswith("likely fix: ")]


def test_another_head_size_names_num_classes_read_from_the_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    path = tmp_path / "ft.pt"
    torch.save({"state_dict": {"model." + k: v for k, v in small_net(num_classes=7).state_dict().items()}}, str(path))
    fixes = _fixes(capsys, path, "--model", "factories:small_net", "--model-kwargs", '{"width": 4}', *DATA)
    assert fixes == ["--model-kwargs '{\"width\": 4, \"num_classes\": 7}' (the checkpoint's 10.weight has 7 outputs, "
                     "the model's 3)"]
    out = tmp_path / "out.pt"
    result = run_cli(capsys, "recompute", path, "--model", "factories:small_net", "--model-kwargs",
                     '{"width": 4, "num_classes": 7}', "--output", out, *DATA)
    assert result.returncode == 0, result.stderr


def test_python_callers_get_fields_and_keyword_arguments_not_flags(tmp_path):
    path = tmp_path / "ft.pt"
    torch.save(small_net(num_classes=7).state_dict(), str(path))
    with pytest.raises(CheckpointError) as caught:
        match_model(load_checkpoint(str(path), trust=bool(TRUST)), small_net().state_dict())
    assert caught.value.fixes == (Fix("model_kwargs", {"num_classes": 7}, caught.value.fixes[0].why),)
    assert "pass model_kwargs={'num_classes': 7}" in str(caught.value) and "--" not in str(caught.value)


def test_a_difference_beyond_the_head_suggests_no_head_size(tmp_path, capsys):
    path = tmp_path / "c.pt"
    torch.save(small_net(width=5, num_classes=7).state_dict(), str(path))
    assert _fixes(capsys, path, "--model", "factories:small_net", *DATA) == []


def test_a_wrong_prefix_names_the_prefix_that_matches(tmp_path, capsys):
    path = tmp_path / "c.pt"
    torch.save({"state_dict": {"model." + k: v for k, v in trained_net().state_dict().items()}}, str(path))
    assert _fixes(capsys, path, "--model", "factories:small_net", "--prefix", "module.", *DATA) == [
        "--prefix model. (every model key is there)"]


def test_several_prefixes_and_nested_state_dicts_are_offered_by_name(tmp_path, capsys):
    state = {p + k: v for p in ("student.", "teacher.") for k, v in trained_net().state_dict().items()}
    torch.save({"state_dict": state}, str(tmp_path / "two.pt"))
    result = run_cli(capsys, "recompute", tmp_path / "two.pt", "--model", "factories:small_net", *DATA)
    assert result.stderr.strip().endswith("choose one; pass --prefix student.; pass --prefix teacher.")
    torch.save({"ema": {"weights": trained_net().state_dict()}, "epoch": 2}, str(tmp_path / "nested.pt"))
    result = run_cli(capsys, "recompute", tmp_path / "nested.pt", "--model", "factories:small_net", *DATA)
    count = len(trained_net().state_dict())
    assert result.stderr.strip().endswith("; pass --key ema/weights ({} tensors)".format(count)), result.stderr


@pytest.mark.main_env
def test_another_architecture_is_named_when_its_keys_and_shapes_match(tmp_path, capsys):
    torchvision = pytest.importorskip("torchvision")
    path = tmp_path / "ft.ckpt"
    torch.save({"state_dict": {"model." + k: v for k, v in torchvision.models.resnet18(num_classes=4).state_dict().items()}},
               str(path))
    fixes = _fixes(capsys, path, "--model", "torchvision:resnet34", *DATA)
    assert fixes == ["--model torchvision:resnet18 (with num_classes=4, its keys and shapes match the checkpoint)",
                     "--model-kwargs '{\"num_classes\": 4}' (with that model)"]

