"""``precise-bn recompute`` under ``torchrun``: the ranks read every sample once, in the batches one
process reads, and rank 0 writes what one process writes; a failure of one rank during the
setup fails every rank at once. Real ranks need real processes, so these tests start the
command through ``torch.distributed.run``."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from factories import small_net, trained_net
from cli_helpers import REPO, TESTS, TRUST, load, torchrun
from precise_bn.cli.data_specs import RankBatches
from reference import assert_close_exact, float64_reference

BATCH = 6


def _run(*args, timeout, ranks=2):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]), OMP_NUM_THREADS="1")
    launcher = torchrun(ranks) if ranks > 1 else []
    return subprocess.run(
        [sys.executable, *launcher, "-m", "precise_bn", *[str(a) for a in args], *TRUST],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=str(TESTS),
    )


@pytest.mark.parametrize("samples", [100, 101])
def test_two_ranks_read_each_sample_once_and_write_what_one_process_writes(tmp_path, samples):
    """No sample padded or repeated: 101 samples on 2 ranks are 101, in one process's batches,
    so the file equals one process's up to the rounding of the merge order, and both equal the
    float64 reference over one process's batches."""
    net = trained_net()
    images = torch.randn(samples, 3, 8, 8, generator=torch.Generator().manual_seed(5)) * 2 + 1
    np.savez(str(tmp_path / "d.npz"), x=images.numpy())
    path = tmp_path / "c.pt"
    torch.save({"model": net.state_dict()}, str(path))
    args = ["recompute", path, "--model", "factories:small_net", "--data", "npz:{}".format(tmp_path / "d.npz"),
            "--batch-size", BATCH, "--num-batches", 100]
    two = _run(*args, "--output", tmp_path / "two.pt", timeout=600)
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("world size 2") == 1, two.stdout  # rank 0 alone prints the report
    one = _run(*args, "--output", tmp_path / "one.pt", timeout=600, ranks=1)
    assert one.returncode == 0, one.stderr
    batches = [images[indices] for indices in RankBatches(samples, BATCH, True, 0, False)]
    reference = float64_reference(net, batches)
    written = {ranks: load(tmp_path / "{}.pt".format(name)) for ranks, name in ((1, "one"), (2, "two"))}
    for ranks, checkpoint in written.items():
        provenance = checkpoint["precise_bn"]
        assert (provenance["samples"], provenance["iterations"], provenance["world_size"]) == (
            samples, len(batches), ranks)
    for name, (mean, var, _) in reference.items():
        for key, expected in (("running_mean", mean), ("running_var", var)):
            ours, theirs = written[2]["model"][name + "." + key], written[1]["model"][name + "." + key]
            torch.testing.assert_close(ours, theirs, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
        assert_close_exact(written[2]["model"][name + ".running_mean"], written[2]["model"][name + ".running_var"],
                             mean, var, name)


def test_a_setup_failure_on_one_rank_fails_every_rank_at_once(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"model": small_net().state_dict()}, str(path))
    # The timeout is only a guard: rank 0 learns of rank 1's failure in the setup round, at once.
    result = _run("recompute", path, "--model", "factories:small_net", "--data", "factories:fails_on_rank_1",
                       "--timeout", "600", "-q", timeout=1200)
    assert result.returncode != 0
    assert "precise-bn: error: --data 'factories:fails_on_rank_1' raised FileNotFoundError" in result.stderr
    assert "precise-bn: error: rank(s) [1] failed" in result.stderr, result.stderr
    assert not (tmp_path / "c.precise_bn.pt").exists()
