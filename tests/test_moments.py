"""One call's float64 moments (``precise_bn.moments``): every form and dtype against a float64
two-pass reference, a shift far from the mean, the compiled loop against the eager one, and
when and how the compiled loop is made."""
from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

from precise_bn import moments, recompute
from precise_bn.errors import ConfigError
from reference import assert_close_exact, float64_reference


def _reference(x):
    rows = x.double().movedim(1, 0).reshape(x.shape[1], -1)
    mean = rows.mean(1)
    return mean, (rows - mean[:, None]).square().mean(1)


def _inputs():
    """Every form the sums read, in every dtype, sizes of 1 included, means up to 1e4 stds."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape in ((4, 3, 5, 5), (1, 3, 1, 1), (6, 4), (1, 4), (2, 5, 7), (2, 3, 2, 3, 4), (3, 1, 4, 4)):
        view = [1, shape[1]] + [1] * (len(shape) - 2)
        ratios = torch.logspace(0, 4, shape[1], dtype=torch.float64).view(view)
        base = (torch.randn(shape, generator=gen, dtype=torch.float64) + ratios)
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            x = (base / 1e3 if dtype == torch.float16 else base).to(dtype)
            out.append(x)
            if len(shape) == 4:
                out.append(x.contiguous(memory_format=torch.channels_last))
            if len(shape) == 5:
                out.append(x.contiguous(memory_format=torch.channels_last_3d))
            out.append(x.transpose(0, 1).contiguous().transpose(0, 1))  # neither layout: copied
    return out


def _shifts(x):
    mean, _ = _reference(x)
    return {"its mean": mean.to(x.dtype), "zero": torch.zeros_like(mean, dtype=x.dtype),
            "not finite": torch.full_like(mean, float("nan"), dtype=torch.float32),
            "1e3 stds off": (mean + 1e3 * _reference(x)[1].sqrt() + 1.0).float()}


def _assert_exact(stats, x, what):
    mean, var = _reference(x)
    assert stats.dtype == torch.float64 and stats.shape == (2, x.shape[1])
    assert_close_exact(stats[0], stats[1], mean, var, what)


def test_every_form_and_dtype_matches_the_float64_reference_whatever_the_shift():
    for x in _inputs():
        for name, shift in _shifts(x).items():
            _assert_exact(moments.measure(x, shift), x, "{} {} {} shift {}".format(
                tuple(x.shape), x.dtype, x.stride(), name))


def test_a_shift_far_from_the_mean_is_flagged_and_measured_again():
    x = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 1e-3 + 1e4
    form, view = moments.view_for_sums(x)
    once, far = moments._eager(form, view, torch.zeros(3))
    assert bool(far)
    mean, var = _reference(x)
    assert ((once[1] - var).abs() / var).max() > 1e-7  # one pass around 0 cancels ...
    _assert_exact(moments.measure(x, torch.zeros(3)), x, "far shift")  # ... the second does not
    assert not bool(moments._eager(form, view, mean.float())[1])


def test_a_constant_channel_is_exactly_0_whatever_its_shift():
    x = torch.full((8, 2, 5, 5), 3.7).contiguous(memory_format=torch.channels_last)
    for shift in (torch.full((2,), 3.7), torch.full((2,), 3.7000003), torch.zeros(2)):
        assert moments.measure(x, shift)[1].tolist() == [0.0, 0.0]


def test_the_policy_comes_from_the_environment_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "sometimes")
    with pytest.raises(ConfigError, match="PRECISE_BN_COMPILE must be auto, always or never, got 'sometimes'"):
        moments.Kernels().start()
    monkeypatch.setenv("PRECISE_BN_COMPILE", "never")
    kernels = moments.Kernels()
    kernels.start()
    kernels.sums("channels_first", torch.randn(2, 3, 4), torch.zeros(3))
    assert kernels._thread is None and not kernels.ready


needs_compile = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile came with torch 2.0")


@needs_compile
def test_auto_compiles_once_enough_was_measured_eagerly_or_is_expected(monkeypatch):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "auto")
    monkeypatch.setattr(moments, "COMPILE_AFTER", 1000)
    compiled = []
    monkeypatch.setattr(moments.Kernels, "_compile", lambda self, key: compiled.append(key))
    kernels = moments.Kernels()
    x = torch.randn(4, 3, 8)  # 96 elements a call
    for _ in range(10):
        kernels.sums("channels_first", x, torch.zeros(3))
    kernels.wait()
    assert compiled == [] and kernels._thread is None  # 960 elements: not yet
    kernels.sums("channels_first", x, torch.zeros(3))
    kernels.wait()
    assert compiled == [("channels_first", torch.float32, torch.float32, "cpu", False)]
    kernels.sums("channels_last", x, torch.zeros(8, dtype=torch.float64))  # new forms are compiled once seen
    kernels.wait()
    assert compiled[1:] == [("channels_last", torch.float32, torch.float64, "cpu", False)]

    expecting = moments.Kernels()
    expecting.sums("channels_first", x, torch.zeros(3))
    expecting.expect(500)
    assert expecting._thread is None
    expecting.expect(1000)
    expecting.wait()
    assert compiled[2:] == [("channels_first", torch.float32, torch.float32, "cpu", False)]


def test_a_compiler_that_fails_leaves_the_eager_sums_and_says_why_once(monkeypatch, caplog):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "always")
    if not hasattr(torch, "compile"):
        return _without_torch_compile(caplog)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    kernels = moments.Kernels()
    x = torch.randn(4, 3, 8)
    with caplog.at_level(logging.WARNING, logger="precise_bn"):
        for form in ("channels_first", "channels_last"):
            kernels.sums(form, x, torch.zeros(x.shape[1 if form == "channels_first" else 2]))
        kernels.wait()
        stats, _ = kernels.sums("channels_first", x, torch.zeros(3))
    assert not kernels.ready and len(kernels.failures) == 2
    lines = [r.getMessage() for r in caplog.records if "eager" in r.getMessage()]
    assert lines == ["precise-bn: float64 sums run as eager operators (the same numbers, slower): compiling "
                     "them failed: RuntimeError: no C++ compiler found"]
    _assert_exact(stats, x.view(4, 3, 8), "after the failure")


def _without_torch_compile(caplog):
    """torch 1.10: one line says why, and the eager sums measure."""
    kernels = moments.Kernels()
    x = torch.randn(4, 3, 8)
    with caplog.at_level(logging.WARNING, logger="precise_bn"):
        stats, _ = kernels.sums("channels_first", x, torch.zeros(3))
        kernels.sums("channels_first", x, torch.zeros(3))
    assert kernels.failures == ["this torch ({}) has no torch.compile".format(torch.__version__)]
    assert [r.getMessage() for r in caplog.records if "eager" in r.getMessage()] == [
        "precise-bn: float64 sums run as eager operators (the same numbers, slower): compiling them failed: "
        + kernels.failures[0]]
    _assert_exact(stats, x, "without torch.compile")


@pytest.fixture(scope="module")
def compiled_kernels():
    """A Kernels object with every form of ``_inputs()`` compiled (tens of seconds on a cold cache)."""
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():  # as in a pass
        patch.setenv("PRECISE_BN_COMPILE", "always")
        kernels = moments.Kernels()
        for x in _inputs():
            form, view = moments.view_for_sums(x)
            for shift in _shifts(x).values():
                kernels.sums(form, view, shift)
            kernels.sums(form, view, torch.zeros(x.shape[1], dtype=torch.float64))
        kernels.wait()
    return kernels


@needs_compile
@torch.no_grad()
def test_the_compiled_sums_agree_with_the_eager_ones_for_any_size(compiled_kernels, monkeypatch):
    assert not compiled_kernels.failures, compiled_kernels.failures
    assert compiled_kernels._thread is not None and compiled_kernels._thread.name == "precise-bn compile"
    monkeypatch.setattr(moments, "KERNELS", compiled_kernels)
    for x in _inputs():
        form, view = moments.view_for_sums(x)
        for name, shift in _shifts(x).items():
            key = (form, view.dtype, shift.dtype, "cpu", False)
            assert key in compiled_kernels.ready, key
            run, state = compiled_kernels.ready[key]
            assert state.matches()
            got, far = run(view, shift)
            want, far_eager = moments._eager(form, view, shift)
            assert bool(far) == bool(far_eager), (key, name)
            if not far:  # around a far shift both cancel, differently, and are measured again
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)
            _assert_exact(moments.measure(x, shift), x, "compiled {} {} shift {}".format(tuple(x.shape), x.dtype, name))


@needs_compile
def test_a_pass_with_compiled_sums_writes_the_float64_statistics(compiled_kernels, monkeypatch):
    monkeypatch.setattr(moments, "KERNELS", compiled_kernels)
    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.BatchNorm1d(4 * 36))
    data = [(torch.randn(5, 3, 8, 8, generator=gen) * 50 + 1e3).contiguous(memory_format=torch.channels_last)
            for _ in range(6)]
    reference = float64_reference(model, data)
    eager_before = compiled_kernels.eager_elements
    recompute(model, data, progress=False)
    assert compiled_kernels.eager_elements == eager_before  # every call went through the compiled loop
    with torch.enable_grad():  # another state than the one compiled for: the eager sums, not a new compile
        moments.measure(data[0], torch.zeros(3))
    assert compiled_kernels.eager_elements > eager_before
    for name in ("1", "4"):
        layer = model.get_submodule(name)
        assert_close_exact(layer.running_mean, layer.running_var, *reference[name][:2], name)


def test_data_parallel_threads_measure_while_the_compile_thread_works():
    """The eager sums are thread-safe: replicas in threads share nothing but the thread-local scratch."""
    x = torch.randn(16, 8, 6, 6) + 5
    results = [None] * 4

    def run(i):
        results[i] = moments.measure(x * (i + 1), torch.zeros(8))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, stats in enumerate(results):
        _assert_exact(stats, x * (i + 1), "thread {}".format(i))
