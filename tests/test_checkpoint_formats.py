"""Checkpoint formats live in one registry (:data:`precise_bn.checkpoint.formats.FORMATS`): a
format added there is recognised, read, matched and written back with nothing else changed."""
from __future__ import annotations

import numpy as np
import torch

from factories import trained_net
from cli_helpers import TRUST, run_cli
from precise_bn.checkpoint import formats
from precise_bn.checkpoint.state import Checkpoint


def test_a_new_format_is_one_class_listed_in_formats(tmp_path, monkeypatch, capsys):
    class NpzFormat(formats.Format):
        name, extensions = "npz", (".npz",)

        def load(self, path, key, trust, rules):
            with np.load(path) as arrays:
                state = {k: torch.from_numpy(arrays[k]) for k in arrays.files}
            return Checkpoint(path, self.name, state, state)

        def writer(self, ckpt):
            return lambda handle: np.savez(handle, **{k: v.numpy() for k, v in ckpt.state_dict.items()})

    monkeypatch.setattr(formats, "FORMATS", (NpzFormat(),) + formats.FORMATS)
    net = trained_net()
    path, out = tmp_path / "c.npz", tmp_path / "c.precise_bn.npz"
    np.savez(str(path), **{k: v.numpy() for k, v in net.state_dict().items()})
    assert run_cli(capsys, "inspect", path).stdout.startswith("{}: npz checkpoint".format(path))
    result = run_cli(capsys, "recompute", path, "--model", "factories:small_net", "--data", "factories:batches", "-q", *TRUST)
    assert result.returncode == 0, result.stderr
    with np.load(str(out)) as written:
        assert sorted(written.files) == sorted(net.state_dict())
        assert not np.array_equal(written["1.running_var"], net.state_dict()["1.running_var"].numpy())
