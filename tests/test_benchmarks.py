"""The benchmark scripts run end to end in quick mode, in this process, and their shared pieces
measure what they claim (the incumbents' estimators, the streaming float64 reference, the
RESULTS.md sections, the attack's unit of error, the switch to the eager float64 sums).

Nothing here asserts a timing: the quick runs only prove that the scripts cannot rot.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from precise_bn import recalibrated
from reference import assert_close_exact, exact_tolerance, float64_reference

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import budget  # noqa: E402
import calibration  # noqa: E402
import check as check_study  # noqa: E402
import common  # noqa: E402
import compare  # noqa: E402
import cost  # noqa: E402
import demo_seeds  # noqa: E402
import exact_attack  # noqa: E402
import fresh_process  # noqa: E402
import gpu  # noqa: E402
import interleaved  # noqa: E402
import memory  # noqa: E402
import methods  # noqa: E402
import overhead  # noqa: E402
import rent_or_buy  # noqa: E402
from precise_bn import compiled  # noqa: E402

pytestmark = pytest.mark.main_env

PNG = b"\x89PNG\r\n\x1a\n"
SECTIONS = {"overhead": overhead, "compare": compare, "interleaved": interleaved, "budget": budget,
            "cost": cost, "attack": exact_attack, "demo": demo_seeds, "fresh process": fresh_process, "memory": memory,
            "rent or buy": rent_or_buy}


@pytest.fixture
def own_kernels(monkeypatch):
    """A Kernels of the test's own, so that what the benchmarks compile does not change how the
    rest of the suite measures."""
    kernels = compiled.Kernels()
    monkeypatch.setattr(compiled, "KERNELS", kernels)
    return kernels


def test_the_calibration_study_runs_quick_and_writes_its_page(tmp_path):
    calibration.main(["--quick", "--out", str(tmp_path)])
    text = (tmp_path / "CALIBRATION.md").read_text(encoding="utf-8")
    assert all("| {} |".format(kind) in text for kind in calibration.KINDS + calibration.ORDER_KINDS)
    assert "| 0.3 |" in text and (tmp_path / "calibration.png").read_bytes().startswith(PNG)

def test_the_check_study_runs_quick_and_writes_its_page(tmp_path):
    check_study.main(["--quick", "--out", str(tmp_path)])
    text = (tmp_path / "CHECK.md").read_text(encoding="utf-8")
    assert "Command: `python " in text and " --quick --out " in text
    for row in ("| pruned conv 6 | 7, 11 |", "| noisy conv 0 |", "| 1 | ", "| Holm, alpha 0.01 |", "| log var ratio |"):
        assert row in text, row


def test_every_script_runs_quick_and_writes_its_own_section(tmp_path, own_kernels):
    threads = torch.get_num_threads()
    try:
        for script in SECTIONS.values():
            script.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "RESULTS.md").read_text()
    for key in SECTIONS:
        assert text.count("<!-- BEGIN {} -->".format(key)) == 1 and text.count("<!-- END {} -->".format(key)) == 1
    assert text.count("Machine: ") == 1 and "Ran on another machine" not in text
    for name in ("resnet_style_2d", "bn_mlp"):
        assert "| {} |".format(name) in text
    for method in methods.METHODS:
        assert "| {} |".format(method) in text
    assert "| seed | EMA accuracy |" in text and "Over 2 seeds" in text
    for variant in ("| identical |", "| empty hook |", "| capture |", "| rtol=0.01 |", "| 1 process |",
                    "| 32x32, batch 2 | warm | 1 |", "| 32x32, batch 2 | cold | 1 |"):
        assert variant in text
    # cost.py reached the steady state: its second call measured nothing eagerly.
    steady = [line for line in text.splitlines() if line.startswith("- steady state on bn_mlp: compiled ")]
    assert len(steady) == 1 and "channels_last(float32, float32) on cpu" in steady[0] and steady[0].endswith("**met**"), steady
    assert "- every case ran and every written channel is within the promise, compiled sums (0 outside, 0 raised): **met**" in text
    assert "- the compiled runs measured every call with the compiled sums: **met**" in text
    assert own_kernels.ready and not own_kernels.failures
    assert "| bn_mlp + 1 MiB buffer |" in text
    assert "- every prefix of the sequence costs at most 2x the better fixed choice: worst " in text
    for png in ("scaling.png", "memory.png", "budget.png", "pass_memory.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG


@pytest.mark.skipif(torch.cuda.is_available(), reason="what the GPU benchmark does without a GPU")
def test_the_gpu_benchmark_says_it_has_no_device_and_writes_nothing(tmp_path, capsys):
    gpu.main(["--quick", "--out", str(tmp_path)])
    assert capsys.readouterr().out == "benchmarks/gpu.py: no CUDA device here; nothing measured\n"
    assert not (tmp_path / "RESULTS.md").exists()


def test_write_section_replaces_only_its_own_block(tmp_path):
    path = tmp_path / "RESULTS.md"
    common.write_section(path, "a", "## A\nfirst A")
    common.write_section(path, "b", "## B\nfirst B")
    path.write_text(path.read_text() + "\nhand-written notes\n")
    common.write_section(path, "a", "## A\nsecond A")
    text = path.read_text()
    assert "second A" in text and "first A" not in text and "first B" in text and "hand-written notes" in text
    assert text.index("second A") < text.index("first B")


def test_a_page_states_its_machine_once_and_a_section_run_elsewhere_names_its_own(tmp_path, monkeypatch):
    path = tmp_path / "SHIFT_RESULTS.md"
    common.write_section(path, "a", "## A\n\nfirst A")
    common.write_section(path, "b", "## B\n\nfirst B")
    text = path.read_text()
    assert text.startswith("# Recalibration under distribution shift\n")
    assert text.count("Machine: ") == 1 and text.index(common.machine_text()) < text.index("<!-- BEGIN a -->")
    monkeypatch.setattr(common, "machine_text", lambda: "another CPU (3 logical cores)")
    common.write_section(path, "b", "## B\n\nsecond B")
    text = path.read_text()
    section_b = text[text.index("<!-- BEGIN b -->"):]
    assert text.count("Machine: ") == 1 and text.count("another CPU") == 1
    assert "## B\n\nRan on another machine than the rest of this page: another CPU (3 logical cores).\n" in section_b


def test_a_page_written_before_gets_its_machine_stated_once():
    def old(key, where, versions, run):
        return ("<!-- BEGIN {0} -->\n## {0}\n\nCommand: `python x.py`. Machine: {1}; torch.set_num_threads(2). {2}. "
                "Run {3}.\n\n| a |\n<!-- END {0} -->\n").format(key, where, versions, run)

    here, there = "CPU A (2 logical cores), Linux-1", "CPU B (4 logical cores), Linux-2"
    page = "# Page\n\nintro\n\n" + "\n".join([
        old("one", here, "Python 3.13.0, precise-bn 0.2.0", "2026-12-01 10:00"),
        old("two", there, "Python 3.11.7, precise-bn 0.2.0", "2026-12-01 11:00"),
        old("three", here, "Python 3.13.0, precise-bn 0.2.0", "2026-12-01 12:00; 1-minute load average 1.00")])
    text = common.machine_once(page)
    assert common.machine_once(text) == text
    assert text.count("Machine: ") == 1 and text.index("intro") < text.index("<!-- BEGIN machine -->")
    assert "Machine: {}; Python 3.13.0, precise-bn 0.2.0. Every section".format(here) in text
    assert "Command: `python x.py`. torch.set_num_threads(2). Run 2026-12-01 12:00; 1-minute load average 1.00." in text
    two = text[text.index("<!-- BEGIN two -->"):text.index("<!-- END two -->")]
    assert "Ran on another machine than the rest of this page: {}; Python 3.11.7, precise-bn 0.2.0.".format(there) in two
    assert text.count("Ran on another machine") == 1 and text.count("| a |") == 3


def _bn_only_batches():
    gen = torch.Generator().manual_seed(0)
    sizes = (5, 9, 3)
    return [torch.randn(n, 4, 3, 3, generator=gen) * 2 + torch.tensor([0.0, 1.0, -3.0, 50.0]).view(1, 4, 1, 1) for n in sizes]


def test_incumbent_estimators_compute_what_they_are_described_as():
    batches = _bn_only_batches()
    per_batch = [x.double().transpose(0, 1).reshape(4, -1) for x in batches]
    means = torch.stack([x.mean(1) for x in per_batch])
    unbiased = torch.stack([x.var(1, unbiased=True) for x in per_batch])
    biased = torch.stack([x.var(1, unbiased=False) for x in per_batch])

    pycls = nn.Sequential(nn.BatchNorm2d(4))
    methods.METHODS["pycls/mmpretrain"](pycls, batches)
    torch.testing.assert_close(pycls[0].running_mean.double(), means.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pycls[0].running_var.double(), unbiased.mean(0), rtol=1e-5, atol=1e-6)
    assert pycls[0].momentum == 0.1 and not pycls[0]._forward_pre_hooks

    caffe2 = nn.Sequential(nn.BatchNorm2d(4))
    methods.METHODS["Caffe2 formula (float32)"](caffe2, batches)
    second = (biased + means ** 2).mean(0)
    # float32 E[x^2] - E[x]^2: the error scales with E[x^2], not with the variance.
    torch.testing.assert_close(caffe2[0].running_var.double(), second - means.mean(0) ** 2, rtol=0, atol=1e-6 * float(second.max()))


def test_streaming_reference_matches_the_test_suites_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 5, 1), nn.BatchNorm2d(5))
    batches = _bn_only_batches()
    ours = methods.float64_reference(model, batches)
    theirs = float64_reference(model, batches)
    assert set(ours) == set(theirs) == {"1", "4"}
    for name, (mean, var) in ours.items():
        torch.testing.assert_close(mean, theirs[name][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(var, theirs[name][1], rtol=1e-12, atol=1e-12)


def test_the_shift_and_compression_scripts_run_quick_and_undo_every_recalibration(tmp_path):
    import compression
    import shift

    threads = torch.get_num_threads()
    try:
        shift.main(["--quick", "--out", str(tmp_path)])
        compression.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "SHIFT_RESULTS.md").read_text()
    assert "| contrast | 3 |" in text and "76.7% to 62.2%" in text
    assert (tmp_path / "shift.png").read_bytes()[:8] == PNG
    text = (tmp_path / "COMPRESSION_RESULTS.md").read_text()
    assert "| fixed 2,000 samples |" in text and "every bit it started with: **yes**" in text
    assert text.startswith("# Recalibrating pruned subnets\n") and text.count("Machine: ") == 1


def test_the_distributed_merge_runs_quick_on_two_ranks_and_writes_its_page(tmp_path):
    import distributed_merge

    threads = torch.get_num_threads()
    try:
        distributed_merge.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "DISTRIBUTED_RESULTS.md").read_text()
    assert text.startswith("# Merging statistics across ranks\n") and text.count("Machine: ") == 1
    for row in ("| 2 | gather all |", "| 2 | sliced |", "| 2 | rtol round |", "| 8 | "):
        assert row in text, row


def test_robustas_mixing_in_the_shift_benchmark_is_what_it_is_described_as():
    import shift

    model = nn.Sequential(nn.BatchNorm2d(4))
    with torch.no_grad():
        model[0].running_mean.fill_(1.0)
        model[0].running_var.fill_(2.0)
    batches = _bn_only_batches()
    with recalibrated(model, batches) as report:
        shift._robusta(model, report, 0.25)
        target = float64_reference(model, batches)["0"]
        assert torch.allclose(model[0].running_mean.double(), 0.25 * 1.0 + 0.75 * target[0], rtol=1e-6)
        assert torch.allclose(model[0].running_var.double(), 0.25 * 2.0 + 0.75 * target[1], rtol=1e-6)


def test_the_attack_counts_errors_in_units_of_the_promises_tolerance():
    ref_mean = torch.tensor([1e4, 3.0, 0.0, 5.0], dtype=torch.float64)
    ref_var = torch.tensor([4.0, 1e-6, 2.0, 0.0], dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        mean_tol, var_tol = exact_tolerance(ref_mean, ref_var, dtype)
        mean = ref_mean + torch.tensor([0.5, 2.0, 0.9, 0.0], dtype=torch.float64) * mean_tol
        var = ref_var + torch.tensor([0.25, 0.5, 3.0, 0.0], dtype=torch.float64) * var_tol
        got = exact_attack.in_tolerance_units(mean, var, ref_mean, ref_var, dtype)
        torch.testing.assert_close(got, torch.tensor([0.5, 2.0, 3.0, 0.0], dtype=torch.float64), rtol=1e-4, atol=0)
    # In float64 (no rounding of the store) a ratio within 1 is what the suite's check accepts.
    for c in range(4):
        try:
            assert_close_exact(mean[c:c + 1], var[c:c + 1], ref_mean[c:c + 1], ref_var[c:c + 1])
            accepted = True
        except AssertionError:
            accepted = False
        assert accepted == bool(got[c] <= 1), c
    # A dead channel whose variance is not exactly 0 breaks the promise however small it is.
    dead = exact_attack.in_tolerance_units(ref_mean, torch.tensor([4.0, 1e-6, 2.0, 1e-30], dtype=torch.float64),
                                           ref_mean, ref_var, torch.float32)
    assert dead[3] == float("inf") and (dead[:3] == 0).all()


def test_eager_sums_measure_eagerly_and_put_everything_back(own_kernels, monkeypatch):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "auto")
    model = nn.Sequential(nn.BatchNorm2d(4))
    batches = _bn_only_batches()
    with common.eager_sums() as kernels:
        assert compiled.KERNELS is kernels and kernels is not own_kernels
        assert os.environ["PRECISE_BN_COMPILE"] == "never"
        methods.precise_default(model, batches)
        assert kernels.eager_elements == sum(x.numel() for x in batches) and not kernels.ready
    assert compiled.KERNELS is own_kernels and own_kernels.eager_elements == 0
    assert os.environ["PRECISE_BN_COMPILE"] == "auto"
