"""The path of one call: ``recompute`` reaches the write of ``running_var`` through the api, the
driver and the backend, a few frames down (docs/ARCHITECTURE.md, "One call, start to end")."""
import os
import sys

import torch
from torch import nn

from precise_bn import recompute


def _frames_to_write(call, target: torch.Tensor):
    """The frames between this function and each ``copy_`` into ``target`` made while ``call()``
    runs, innermost first: ``(file, function)`` pairs, one list per ``copy_``."""
    here = sys._getframe()
    chains = []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "copy_" and getattr(arg, "__self__", None) is target:
            chain, f = [], frame
            while f is not None and f is not here:
                chain.append((os.path.basename(f.f_code.co_filename), f.f_code.co_name))
                f = f.f_back
            chains.append(chain[:-1])  # ``call`` itself, the lambda below, is not the package's

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return chains


def test_recompute_writes_running_var_within_six_frames_and_four_files():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    batches = [torch.randn(4, 3, 6, 6) for _ in range(3)]
    target = model[1].running_var
    reports = []
    chains = _frames_to_write(lambda: reports.append(recompute(model, batches, progress=False)), target)
    assert chains, "no copy_ into running_var was seen"
    assert torch.equal(target, reports[0].layers[0].new_var.float())  # the last copy_ was the write
    write = chains[-1]
    assert write[-1] == ("api.py", "recompute") or write[-2] == ("api.py", "recompute"), write
    assert len(write) <= 6, "running_var written {} frames below recompute: {}".format(len(write), write)
    assert len({file for file, _ in write}) <= 4, write
