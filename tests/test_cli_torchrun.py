"""``precise-bn recompute`` under ``torchrun``: ranks merge exactly and rank 0 writes; a failure of
one rank during the setup fails every rank at once. Real ranks need real processes, so these
tests start the command through ``torch.distributed.run``."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cli_factories import small_net, trained_net
from cli_helpers import REPO, TESTS, TRUST, load
from reference import assert_close_exact, float64_reference


def _torchrun(*args, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "precise_bn",
         *[str(a) for a in args], *TRUST],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=str(TESTS),
    )


def test_two_ranks_merge_exactly_and_rank0_writes(tmp_path):
    net = trained_net()
    images = torch.randn(22, 3, 8, 8, generator=torch.Generator().manual_seed(5)) * 2 + 1
    np.savez(str(tmp_path / "d.npz"), x=images.numpy())
    path, out = tmp_path / "c.pt", tmp_path / "out.pt"
    torch.save({"model": net.state_dict()}, str(path))
    result = _torchrun("recompute", path, "--model", "cli_factories:small_net", "--data", "npz:{}".format(tmp_path / "d.npz"),
                       "--batch-size", "4", "--num-iters", "10", "--output", out, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("world size 2") == 1, result.stdout  # rank 0 alone prints the report
    used = []
    for rank in range(2):
        sampler = DistributedSampler(TensorDataset(images), num_replicas=2, rank=rank, shuffle=True, seed=0)
        used += list(DataLoader(TensorDataset(images), batch_size=4, sampler=sampler))
    written = load(out)
    assert written["precise_bn"]["world_size"] == 2 and written["precise_bn"]["iterations"] == 6
    for name, (mean, var, _) in float64_reference(net, used).items():
        assert_close_exact(written["model"][name + ".running_mean"], written["model"][name + ".running_var"],
                             mean, var, name)


def test_a_setup_failure_on_one_rank_fails_every_rank_at_once(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"model": small_net().state_dict()}, str(path))
    # The timeout is only a guard: rank 0 learns of rank 1's failure in the setup round, at once.
    result = _torchrun("recompute", path, "--model", "cli_factories:small_net", "--data", "cli_factories:fails_on_rank_1",
                       "--timeout", "600", "-q", timeout=1200)
    assert result.returncode != 0
    assert "precise-bn: error: --data 'cli_factories:fails_on_rank_1' raised FileNotFoundError" in result.stderr
    assert "precise-bn: error: rank(s) [1] failed" in result.stderr, result.stderr
    assert not (tmp_path / "c.precise_bn.pt").exists()
