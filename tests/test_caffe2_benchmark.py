"""benchmarks/caffe2_overhead.py runs in quick mode without the original's checkout, says the
comparison was skipped, and still checks precise-bn's own figures (caffe2 environment)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.caffe2_env, pytest.mark.filterwarnings(r"ignore::DeprecationWarning:caffe2\.python")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import caffe2_overhead  # noqa: E402


def test_quick_run_without_the_original_writes_its_section_and_says_it_skipped(tmp_path):
    threads = torch.get_num_threads()
    try:
        caffe2_overhead.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "CAFFE2_RESULTS.md").read_text()
    assert text.count("<!-- BEGIN caffe2-overhead -->") == 1 and "was skipped: no `--original`" in text
    for net in caffe2_overhead.QUICK:
        assert re.search(r"\| {} \| .* \| skipped \| skipped \|".format(net.name), text), net.name
    errors = re.findall(r"^\| (10000|100) \| skipped \| ([0-9.e+-]+) \|$", text, re.M)
    assert len(errors) == 2 and all(float(e) < 1e-7 for _, e in errors)


def test_a_path_that_is_not_the_original_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no lib/utils/bn_helper.py"):
        caffe2_overhead.main(["--quick", "--out", str(tmp_path), "--original", str(tmp_path)])
