"""One call's float64 moments (``precise_bn.moments``): every form and dtype against a float64
two-pass reference, a shift far from the mean, the compiled loop against the eager one, and
when and how the compiled loop is made."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch
from torch import nn

from precise_bn import aoti, compiled, moments, package_cache, recompute
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


def test_the_policy_comes_from_the_environment_and_a_bad_value_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("PRECISE_BN_CACHE", str(tmp_path))
    monkeypatch.setenv("PRECISE_BN_COMPILE", "sometimes")
    with pytest.raises(ConfigError, match=r"PRECISE_BN_COMPILE must be auto, always or never \(or unset: auto\), "
                                          r"got 'sometimes'; fix or unset it"):
        compiled.Kernels().run("channels_first", (torch.randn(2, 3, 4), torch.zeros(3)))
    monkeypatch.setenv("PRECISE_BN_COMPILE", "never")
    kernels = compiled.Kernels()
    kernels.run("channels_first", (torch.randn(2, 3, 4), torch.zeros(3)))
    kernels.expect(10 ** 15)
    kernels.compile_seen()
    assert not kernels.ready and not kernels.compiled and not list(tmp_path.iterdir())


KEY = ("channels_first", (torch.float32, torch.float32), "cpu")


def fake_package(key, path):
    """A package file and its record, as a compile leaves them (contents of no use)."""
    partial = package_cache.partial_path(path)
    with open(partial, "wb") as handle:
        handle.write(b"a package " + repr(key).encode())
    package_cache.publish(partial, path, {"compile_seconds": 1.0})


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    """compile_package and load_package replaced by recorders (the thread each ran on)."""
    monkeypatch.setenv("PRECISE_BN_CACHE", str(tmp_path))
    calls = []

    def compile_package(key, device, path):
        calls.append(("compile", key, threading.current_thread()))
        fake_package(key, path)

    def load_package(key, device, path):
        calls.append(("load", key, threading.current_thread()))
        return lambda inputs: list(moments._eager(key[0], *inputs))

    monkeypatch.setattr(aoti, "compile_package", compile_package)
    monkeypatch.setattr(aoti, "load_package", load_package)
    monkeypatch.setattr(aoti, "available", lambda: True)
    return calls


def test_auto_compiles_on_the_callers_thread_once_the_eager_seconds_paid_reach_a_compile(
        fake_compiler, monkeypatch, caplog):
    """Rent or buy: each pass adds its planned eager seconds to the cache's ledger; the pass that
    brings the total to the compile time compiles, in this process or a later one."""
    monkeypatch.setenv("PRECISE_BN_COMPILE", "auto")
    x = torch.randn(4, 3, 8)
    path = compiled.package_path(KEY, torch.device("cpu"))
    for run in range(3):
        kernels = compiled.Kernels()  # a new process each time: only the ledger carries over
        kernels.run("channels_first", (x, torch.zeros(3)))
        assert kernels.eager_elements == 96
        per_element = kernels.eager_seconds / kernels.eager_elements
        before = package_cache.paid(path)
        with caplog.at_level(logging.WARNING, logger="precise_bn"):
            kernels.expect(int(compiled.COMPILE_SECONDS * 0.4 / per_element))  # 0.4 of a compile's worth
        if run < 2:
            assert fake_compiler == [] and not caplog.records
            assert compiled.COMPILE_SECONDS * 0.4 <= package_cache.paid(path) - before < compiled.COMPILE_SECONDS * 0.5
    assert [(what, key) for what, key, _ in fake_compiler] == [("compile", KEY), ("load", KEY)]
    assert all(thread is threading.current_thread() for _, _, thread in fake_compiler)
    assert threading.active_count() == 1 or all(t.name != "precise-bn compile" for t in threading.enumerate())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and re.match(r"precise-bn: compiled channels_first\(float32, float32\) on cpu in "
                                        r"\d+\.\d s, once for this machine \(kept in ", lines[0])
    before = kernels.eager_elements
    kernels.run("channels_first", (x, torch.zeros(3)))
    assert kernels.eager_elements == before  # the loaded package measured it


def test_a_package_on_disk_is_loaded_at_first_sight_whatever_the_pass(fake_compiler, monkeypatch):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "auto")
    fake_package(KEY, compiled.package_path(KEY, torch.device("cpu")))
    kernels = compiled.Kernels()
    kernels.run("channels_first", (torch.randn(4, 3, 8), torch.zeros(3)))
    assert [(what, key) for what, key, _ in fake_compiler] == [("load", KEY)] and kernels.eager_elements == 0
    assert not kernels.compiled


def test_always_compiles_at_first_sight(fake_compiler, monkeypatch):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "always")
    kernels = compiled.Kernels()
    kernels.run("channels_last", (torch.randn(1, 4, 3), torch.zeros(3, dtype=torch.float64)))
    key = ("channels_last", (torch.float32, torch.float64), "cpu")
    assert [(what, k) for what, k, _ in fake_compiler] == [("compile", key), ("load", key)]
    assert kernels.compiled == [key]


def test_a_compiler_that_fails_leaves_the_eager_sums_and_says_why_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PRECISE_BN_CACHE", str(tmp_path))
    monkeypatch.setenv("PRECISE_BN_COMPILE", "always")
    if not aoti.available():
        return _without_aoti(monkeypatch, caplog)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(aoti.torch._inductor, "aoti_compile_and_package", broken)
    kernels = compiled.Kernels()
    x = torch.randn(4, 3, 8)
    with caplog.at_level(logging.WARNING, logger="precise_bn"):
        for form in ("channels_first", "channels_last"):
            kernels.run(form, (x, torch.zeros(x.shape[1 if form == "channels_first" else 2])))
        stats, _ = kernels.run("channels_first", (x, torch.zeros(3)))
    assert not kernels.ready and len(kernels.failures) == 2
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["precise-bn: float64 sums run as eager operators (the same numbers, slower): compiling "
                     "them failed: RuntimeError: no C++ compiler found"]
    assert _files(tmp_path) == []  # no partial package left behind
    _assert_exact(stats, x.view(4, 3, 8), "after the failure")


def _without_aoti(monkeypatch, caplog):
    """torch 1.10: short passes stay eager silently; a pass long enough to pay says why, once."""
    monkeypatch.setenv("PRECISE_BN_COMPILE", "auto")
    kernels = compiled.Kernels()
    x = torch.randn(4, 3, 8)
    with caplog.at_level(logging.WARNING, logger="precise_bn"):
        stats, _ = kernels.run("channels_first", (x, torch.zeros(3)))
        assert not caplog.records
        kernels.expect(10 ** 15)
        kernels.expect(10 ** 15)
    assert kernels.failures == ["RuntimeError: this torch ({}) has no AOTInductor (torch 2.6 or later)".format(
        torch.__version__)]
    assert [r.getMessage() for r in caplog.records] == [
        "precise-bn: float64 sums run as eager operators (the same numbers, slower): compiling them failed: "
        + kernels.failures[0]]
    _assert_exact(stats, x, "without AOTInductor")


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.skipif(not aoti.available(), reason="a torch without AOTInductor compiles nothing to interrupt")
def test_an_interrupted_compile_leaves_no_file_and_the_model_as_it_was(monkeypatch, tmp_path):
    monkeypatch.setenv("PRECISE_BN_CACHE", str(tmp_path))
    monkeypatch.setenv("PRECISE_BN_COMPILE", "always")
    monkeypatch.setattr(aoti, "_aoti", lambda: types.SimpleNamespace(aoti_compile_and_package=interrupted))
    monkeypatch.setattr(compiled, "KERNELS", compiled.Kernels())
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(KeyboardInterrupt):
        recompute(model, [torch.randn(2, 3, 6, 6)], progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model[1]) is nn.BatchNorm2d and _files(tmp_path) == []


def interrupted(program, package_path, inductor_configs):
    with open(package_path, "wb") as partial:
        partial.write(b"half a package")
    raise KeyboardInterrupt


needs_aoti = pytest.mark.skipif(not aoti.available(), reason="AOTInductor came with torch 2.6")
#: What the compiled tests compile: every form, for the dtypes a model's activations have and the
#: shift dtypes its buffers have.
COMPILED = [(form, (dtype, shift_dtype), "cpu") for form in moments.FORM_NAMES
            for dtype, shift_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                       (torch.float16, torch.float32), (torch.float64, torch.float64))]


@pytest.fixture(scope="module")
def compiled_kernels():
    """A Kernels object with the forms of COMPILED compiled (a minute or two on a cold cache),
    kept in the run's cache (tests/conftest.py), where the benchmarks' quick runs find them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PRECISE_BN_COMPILE", "auto")
        kernels = compiled.Kernels()
        kernels.cache = os.environ["PRECISE_BN_CACHE"]
        for key in COMPILED:
            kernels.compile_ahead([key], torch.device("cpu"))
        yield kernels


@needs_aoti
def test_the_compiled_sums_agree_with_the_eager_ones_for_any_size(compiled_kernels, monkeypatch):
    assert not compiled_kernels.failures, compiled_kernels.failures
    assert sorted(compiled_kernels.ready, key=str) == sorted([k[:2] + (torch.device("cpu"),) for k in COMPILED], key=str)
    monkeypatch.setattr(compiled, "KERNELS", compiled_kernels)
    tried = 0
    for x in _inputs():
        form, view = moments.view_for_sums(x)
        for name, shift in _shifts(x).items():
            run = compiled_kernels.ready.get((form, (view.dtype, shift.dtype), x.device))
            if run is None:
                continue
            tried += 1
            got, far = run([view, shift])
            want, far_eager = moments._eager(form, view, shift)
            assert bool(far) == bool(far_eager), (form, view.dtype, name)
            if not far:  # around a far shift both cancel, differently, and are measured again
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)
            before = compiled_kernels.eager_elements
            _assert_exact(moments.measure(x, shift), x, "compiled {} {} shift {}".format(tuple(x.shape), x.dtype, name))
            assert compiled_kernels.eager_elements - before in (0, view.numel())  # only a far shift again
    assert tried >= 50


@needs_aoti
def test_the_compiled_sums_do_not_depend_on_the_callers_state(compiled_kernels, monkeypatch):
    """Autocast, grad mode, deterministic mode, a torch function mode and thread count: the
    package runs as compiled."""
    monkeypatch.setattr(compiled, "KERNELS", compiled_kernels)
    x = torch.randn(6, 4, 5, 5) * 3 + 1e3
    want = moments._eager("channels_first", x.view(6, 4, -1), torch.full((4,), 1e3))[0]
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.set_num_threads(2)
        torch.use_deterministic_algorithms(True)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.enable_grad(), torch.device("cpu"):
            before = compiled_kernels.eager_elements
            got = moments.measure(x.requires_grad_(), torch.full((4,), 1e3))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    assert compiled_kernels.eager_elements == before
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


class _Marked(torch.Tensor):
    pass


@needs_aoti
def test_a_tensor_subclass_is_measured_eagerly_and_said_once(compiled_kernels, monkeypatch, caplog):
    monkeypatch.setattr(compiled, "KERNELS", compiled_kernels)
    x = (torch.randn(4, 3, 5, 5) + 7).as_subclass(_Marked)
    before = compiled_kernels.eager_elements
    with caplog.at_level(logging.WARNING, logger="precise_bn"):
        for _ in range(2):
            stats = moments.measure(x, torch.full((3,), 7.0))
    assert compiled_kernels.eager_elements - before == 2 * x.numel()
    assert [r.getMessage() for r in caplog.records] == [
        "precise-bn: inputs of type _Marked, a tensor subclass that compiled code cannot read, are measured by "
        "eager operators (the same numbers, slower)"]
    _assert_exact(stats.as_subclass(torch.Tensor), x.as_subclass(torch.Tensor), "subclass")


@needs_aoti
def test_a_pass_with_compiled_sums_writes_the_float64_statistics(compiled_kernels, monkeypatch):
    monkeypatch.setattr(compiled, "KERNELS", compiled_kernels)
    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.BatchNorm1d(4 * 36))
    data = [(torch.randn(5, 3, 8, 8, generator=gen) * 50 + 1e3).contiguous(memory_format=torch.channels_last)
            for _ in range(6)]
    reference = float64_reference(model, data)
    eager_before = compiled_kernels.eager_elements
    threads_before = set(threading.enumerate())
    recompute(model, data, progress=False)
    assert compiled_kernels.eager_elements == eager_before  # every call went through the compiled loop
    assert set(threading.enumerate()) <= threads_before  # nothing of ours left running
    for name in ("1", "4"):
        layer = model.get_submodule(name)
        assert_close_exact(layer.running_mean, layer.running_var, *reference[name][:2], name)


@needs_aoti
def test_a_fresh_process_loads_the_package_and_leaves_nothing_running(compiled_kernels):
    """A package compiled by one process is loaded by the next, which leaves no thread of its own."""
    script = textwrap.dedent("""
        import threading, torch
        from torch import nn
        from precise_bn import aoti, compiled, moments, package_cache, recompute
        torch.set_num_threads(1)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        before = set(threading.enumerate())
        recompute(model, [torch.randn(2, 3, 8, 8) for _ in range(3)], progress=False)
        print(sorted(str(where[1][0]) for where in compiled.KERNELS.ready), compiled.KERNELS.eager_elements,
              compiled.KERNELS.compiled, len(set(threading.enumerate()) - before))
    """)
    env = dict(os.environ, PRECISE_BN_COMPILE="auto", PRECISE_BN_CACHE=compiled_kernels.cache)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['torch.float32']", "0", "[]", "0"], done.stdout
    assert "Warning" not in done.stderr and "compiled" not in done.stderr, done.stderr


def test_threads_measure_the_same_layer_form_at_once():
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
