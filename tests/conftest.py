"""Keep each environment from importing test modules written for the other one.

A module whose every test needs packages of one environment marks itself with
``pytestmark = pytest.mark.main_env`` (or ``caffe2_env``) and may import those packages at the
top. Deselecting by marker happens only after a module is imported, so such a module is not
even collected when the run's ``-m`` expression excludes its marker.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

# The suite's passes are small and measure with the eager float64 sums; the tests that exercise
# the compiled ones ask for them (tests/test_moments.py, tests/test_benchmarks.py) and keep the
# packages in a folder of this run's own, never the user's cache.
os.environ.setdefault("PRECISE_BN_COMPILE", "never")
os.environ["PRECISE_BN_CACHE"] = tempfile.mkdtemp(prefix="precise-bn-tests-")

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


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(os.environ["PRECISE_BN_CACHE"], ignore_errors=True)
