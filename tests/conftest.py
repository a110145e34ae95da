"""Keep each environment from importing test modules written for the other one.

A module whose every test needs packages of one environment marks itself with
``pytestmark = pytest.mark.main_env`` (or ``caffe2_env``) and may import those packages at the
top. Deselecting by marker happens only after a module is imported, so such a module is not
even collected when the run's ``-m`` expression excludes its marker.
"""
from __future__ import annotations

import os

import torch

# Compiling the float64 sums happens in a background thread once a process has measured enough;
# the suite's passes are small, and the tests that exercise the compiled loop ask for it
# themselves (tests/test_moments.py), so that no other test depends on when a compile ends.
os.environ.setdefault("PRECISE_BN_COMPILE", "never")

# The tests' tensors are small: one thread each. Several threads per process spin-wait for one
# another, which on a loaded machine (other jobs, or CI's two cores) makes them many times slower.
torch.set_num_threads(1)

ENV_MARKERS = ("main_env", "caffe2_env")


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    markexpr = config.getoption("markexpr") or ""
    text = collection_path.read_text(encoding="utf-8")
    for marker in ENV_MARKERS:
        if "pytestmark = pytest.mark." + marker in text and "not " + marker in markexpr:
            return True
    return None
