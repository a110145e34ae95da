"""``precise-bn demo``: end to end as a command, and the pieces the benchmarks reuse."""
from __future__ import annotations

import re
import sys

import pytest
import torch

from cli_helpers import load, run_cli
from precise_bn.errors import BackendUnavailableError
from reference import assert_close_default, float64_reference


@pytest.mark.main_env
def test_demo_command_end_to_end(tmp_path):
    from precise_bn.cli.demo import evaluate, load_digits_splits, make_model
    from precise_bn.cli.specs import resolve_data

    result = run_cli("demo", "--steps", "60", "--workdir", tmp_path)
    assert result.returncode == 0, result.stderr
    found = {
        kind: (float(acc), float(loss))
        for kind, acc, loss in re.findall(r"accuracy with the (EMA|precise) .*?([\d.]+)% \(loss ([\d.]+)\)", result.stdout)
    }
    assert set(found) == {"EMA", "precise"}, result.stdout
    # 60 steps of training already separate the ten digits well: the network did learn.
    assert found["EMA"][0] > 80 and found["precise"][0] > 80
    assert "mean drift" in result.stdout and "4 layers" in result.stdout

    original, written = load(tmp_path / "digits_cnn.pt"), load(tmp_path / "digits_cnn.precise_bn.pt")
    assert written["steps"] == 60 and written["seed"] == 0
    _, _, test_x, test_y = load_digits_splits(0)
    for kind, state in (("EMA", original["model"]), ("precise", written["model"])):
        net = make_model()
        net.load_state_dict(state)
        accuracy, loss = evaluate(net, test_x, test_y)
        assert found[kind][0] == round(100 * accuracy, 2), kind
        assert abs(found[kind][1] - loss) <= 6e-5, kind
    net = make_model()
    net.load_state_dict(original["model"])
    used = list(resolve_data("npz:{}:x".format(tmp_path / "digits_train.npz"), batch_size=32))
    assert sum(len(b[0]) for b in used) == len(load_digits_splits(0)[0])
    ref = float64_reference(net, used)
    assert len(ref) == 4
    for name, (mean, var, _) in ref.items():
        assert_close_default(written["model"][name + ".running_mean"], written["model"][name + ".running_var"], mean, var, name)


@pytest.mark.main_env
def test_digits_splits_are_stratified_and_seeded():
    from precise_bn.cli.demo import load_digits_splits

    train_x, train_y, test_x, test_y = load_digits_splits(0)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    assert train_x.shape[1:] == (1, 8, 8) and len(train_x) + len(test_x) == 1797
    assert 0.0 <= float(train_x.min()) and float(train_x.max()) <= 1.0
    per_class_test = torch.bincount(test_y, minlength=10).double() / torch.bincount(torch.cat([train_y, test_y])).double()
    assert ((per_class_test - 0.25).abs() < 0.02).all()
    assert torch.equal(load_digits_splits(0)[3], test_y)
    assert not torch.equal(load_digits_splits(1)[3], test_y)


def test_demo_without_scikit_learn_says_how_to_install(monkeypatch):
    from precise_bn.cli.demo import load_digits_splits

    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install precise-bn\[demo\]"):
        load_digits_splits()
