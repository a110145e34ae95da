"""The cache of compiled packages (precise_bn/package_cache.py, precise_bn/aoti.py,
precise_bn/compiled.py): its environment variables, files any user can read, a read-only cache,
records that keep a damaged package from being loaded, names that say what made a package,
the ledger of eager seconds across processes, one compile among processes at once, and nothing
left behind. One real compile for the module; the rest use a stand-in compiler."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch
from torch import nn

from precise_bn import aoti, compiled, moments, package_cache, recompute
from precise_bn._version import __version__
from precise_bn.errors import ConfigError
from test_moments import KEY, fake_compiler, fake_package  # noqa: F401 (a fixture)

TESTS = os.path.dirname(os.path.abspath(__file__))
CPU = torch.device("cpu")


def _child(script, cache, timeout=300, **env):
    """Run ``script`` in a fresh process on ``cache``; stdout and stderr as text."""
    environ = dict(os.environ, PRECISE_BN_CACHE=str(cache), PRECISE_BN_COMPILE="auto")
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(TESTS), TESTS, environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=environ, capture_output=True,
                          text=True, timeout=timeout)


def test_the_cache_path_expands_home_and_empty_values_mean_the_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("PRECISE_BN_CACHE", "~/pbn")
    assert package_cache.cache_dir() == str(tmp_path / "pbn")
    monkeypatch.setenv("PRECISE_BN_CACHE", "")
    assert package_cache.cache_dir() == str(tmp_path / ".cache" / "precise_bn")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert package_cache.cache_dir() == str(tmp_path / "xdg" / "precise_bn")
    for value, policy in (("", "auto"), (" Always ", "always"), ("never", "never")):
        monkeypatch.setenv("PRECISE_BN_COMPILE", value)
        assert package_cache.policy() == policy


@pytest.mark.parametrize("name, value, message", [
    ("PRECISE_BN_COMPILE", "sometimes", r"PRECISE_BN_COMPILE must be auto, always or never \(or unset: auto\), "
                                        r"got 'sometimes'; fix or unset it"),
    ("PRECISE_BN_CACHE", "FILE", r"PRECISE_BN_CACHE is .*a-file, a file, not a folder: point it at a folder "
                                 r"\(or unset it for ~/.cache/precise_bn\)")])
def test_a_bad_variable_is_refused_before_the_first_batch(monkeypatch, tmp_path, name, value, message):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(name, str(tmp_path / "a-file") if value == "FILE" else value)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    drawn = []

    def data():
        for _ in range(3):
            drawn.append(1)
            yield torch.randn(2, 3, 6, 6)

    with pytest.raises(ConfigError, match=message):
        recompute(model, data(), progress=False)
    assert drawn == [] and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_package_is_named_by_what_made_it(monkeypatch):
    path = os.path.basename(compiled.package_path(KEY, CPU))
    assert path.startswith("channels_first-float32-float32-cpu-pbn{}-".format(__version__))
    monkeypatch.setattr(aoti, "__version__", "9.9.9")
    assert "-pbn9.9.9-" in compiled.package_path(KEY, CPU)
    changed = dataclasses.replace(aoti.PROGRAMS["channels_first"], source=moments.SOURCE + "# edited\n")
    monkeypatch.setitem(aoti.PROGRAMS, "channels_first", changed)
    other = os.path.basename(compiled.package_path(KEY, CPU))
    assert other.split("-")[-2] != path.split("-")[-2] and other.split("-")[-1] == path.split("-")[-1]


def test_ahead_of_time_covers_every_dtype_a_model_gives_the_sums(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(compiled.KERNELS, "compile_ahead", lambda keys, device: asked.extend(keys) or
                        [compiled.package_path(k, device) for k in keys])
    assert moments.main([]) == 0
    pairs = {key[1] for key in asked}
    assert {pair[0] for pair in pairs} == {torch.float32, torch.float16, torch.bfloat16, torch.float64}
    assert {(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64)} <= pairs
    assert sorted(asked, key=str) == sorted({(f, p, "cpu") for f in moments.FORM_NAMES for p in pairs}, key=str)
    with pytest.raises(SystemExit):
        moments.main(["--dtypes", "float16:float17"])
    assert "--dtypes: 'float16:float17' is not INPUT:SHIFT floating dtypes" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_packages_and_records_get_the_mode_of_any_new_file(fake_compiler, monkeypatch, umask):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "always")
    old = os.umask(umask)
    try:
        compiled.Kernels().run("channels_first", (torch.randn(4, 3, 8), torch.zeros(3)))
    finally:
        os.umask(old)
    path = compiled.package_path(KEY, CPU)
    for made in (path, package_cache.record_path(path)):
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o666 & ~umask, made


def test_a_package_that_does_not_match_its_record_is_set_aside_and_rebuilt(fake_compiler, monkeypatch, caplog):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "always")
    path = compiled.package_path(KEY, CPU)
    fake_package(KEY, path)
    with open(path, "r+b") as handle:
        handle.write(b"X")
    with caplog.at_level(logging.WARNING, logger="precise_bn"):
        compiled.Kernels().run("channels_first", (torch.randn(4, 3, 8), torch.zeros(3)))
    assert [what for what, _, _ in fake_compiler] == ["compile", "load"]
    assert os.path.exists(path + ".bad") and package_cache.mismatch(path) is None
    assert caplog.records[0].getMessage() == (
        "precise-bn: the package {} was not loaded: its content is not what its record says ({} bytes, recorded {}); "
        "set aside as {}.bad; a new one is compiled when a pass pays for it (the eager sums run meanwhile)".format(
            path, os.path.getsize(path + ".bad"), os.path.getsize(path + ".bad"), os.path.basename(path)))
    os.unlink(package_cache.record_path(path))  # a package without its record is not loaded either
    assert package_cache.mismatch(path).startswith("it has no record")


def test_a_gpu_pass_of_a_few_hundred_batches_compiles_by_its_second_run(fake_compiler, monkeypatch):
    """Where eager seconds cannot be timed they are estimated per element: a 200-batch pass of
    resnet50 at batch 64 plans about 25 s of eager sums, below one compile; two such runs are not.
    The meta device stands in for a GPU: its calls are not timed either."""
    monkeypatch.setenv("PRECISE_BN_COMPILE", "auto")
    program = aoti.PROGRAMS["channels_first"]  # an eager form every torch runs on meta tensors
    monkeypatch.setitem(aoti.PROGRAMS, "channels_first", dataclasses.replace(program, eager=lambda x, shift: (x, x)))
    x = torch.empty(64, 3, 8, device="meta")
    planned = int(25 / compiled.EAGER_SECONDS_PER_ELEMENT)
    for run in range(2):
        kernels = compiled.Kernels()
        kernels.run("channels_first", (x, torch.zeros(3, device="meta")))
        kernels.expect(planned - x.numel())
        assert [what for what, _, _ in fake_compiler] == ([] if run == 0 else ["compile", "load"])
    assert kernels.compiled == [("channels_first", (torch.float32, torch.float32), "meta")]


def test_a_cache_that_cannot_be_written_keeps_the_ledger_in_the_process(fake_compiler, monkeypatch, caplog):
    monkeypatch.setenv("PRECISE_BN_COMPILE", "auto")
    monkeypatch.setattr(package_cache, "writable", lambda folder: False)
    kernels = compiled.Kernels()
    x = torch.randn(4, 3, 8)
    with caplog.at_level(logging.WARNING, logger="precise_bn"):
        for _ in range(3):
            kernels.run("channels_first", (x, torch.zeros(3)))
            per_element = kernels.eager_seconds / kernels.eager_elements
            kernels.expect(int(compiled.COMPILE_SECONDS * 0.4 / per_element))
    assert fake_compiler == [] and not os.listdir(os.environ["PRECISE_BN_CACHE"])
    assert kernels.failures[0].startswith("RuntimeError: the package cache {} cannot be written by this process: "
                                          "make it writable, or fill it with python -m precise_bn.moments".format(
                                              os.environ["PRECISE_BN_CACHE"]))
    assert len(caplog.records) == 1


def test_a_lock_is_taken_over_only_when_its_process_is_gone_or_it_is_too_old(tmp_path, monkeypatch):
    path = str(tmp_path / "p.pt2")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with package_cache.locked(path) as holder:
        assert holder is None
        with package_cache.locked(path) as other:
            assert other["pid"] == os.getpid()
    for pid, age, taken in ((gone.pid, 0, True), (os.getppid(), 0, False), (os.getppid(), 1e6, True)):
        (tmp_path / "p.lock").write_text('{{"pid": {}, "host": "{}", "at": {}}}'.format(
            pid, __import__("socket").gethostname(), time.time() - age))
        with package_cache.locked(path) as holder:
            assert (holder is None) == taken, (pid, age)
        assert os.path.exists(tmp_path / "p.lock") != taken


LOCK_CHILD = """
    import logging, os, sys, time, torch
    from test_moments import fake_package
    from precise_bn import aoti, compiled, moments, package_cache
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def compile_package(key, device, path):
        with open(package_cache.partial_path(path), "wb"):
            pass
        time.sleep(float(os.environ["COMPILE_FOR"]))
        os.unlink(package_cache.partial_path(path))
        fake_package(key, path)
        print("compiled", flush=True)

    aoti.compile_package = compile_package
    aoti.load_package = lambda key, device, path: (lambda inputs: list(moments._eager(key[0], *inputs)))
    aoti.available = lambda: True
    kernels = compiled.Kernels()
    print("started", flush=True)
    while not os.path.exists(os.environ["START"]):
        time.sleep(0.01)
    x = torch.randn(4, 3, 8)
    kernels.run("channels_first", (x, torch.zeros(3)))
    print("ready" if kernels.ready else "eager", flush=True)
    path = compiled.package_path(("channels_first", (torch.float32, torch.float32), "cpu"), torch.device("cpu"))
    while not os.path.exists(path):
        time.sleep(0.05)
    kernels.expect(0)  # the next pass
    print("ready" if kernels.ready else "eager", flush=True)
"""


def _start(cache, start, compile_for):
    environ = dict(os.environ, PRECISE_BN_CACHE=str(cache), PRECISE_BN_COMPILE="always", START=str(start),
                   COMPILE_FOR=str(compile_for))
    environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(TESTS), TESTS, environ.get("PYTHONPATH", "")])
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOCK_CHILD)], env=environ, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout.readline() == "started\n"
    return child


def test_processes_that_need_a_package_at_once_compile_it_once(tmp_path):
    cache = tmp_path / "cache"
    children = [_start(cache, tmp_path / "go", 3) for _ in range(2)]
    (tmp_path / "go").write_text("")
    outs = [child.communicate(timeout=120) for child in children]
    assert [child.returncode for child in children] == [0, 0], outs
    lines = sorted(out[0].split() for out in outs)
    assert lines == [["compiled", "ready", "ready"], ["eager", "ready"]], outs
    waiter = next(i for i, out in enumerate(outs) if "compiled" not in out[0])
    assert "precise-bn: channels_first(float32, float32) on cpu is being compiled by process {} on ".format(
        children[1 - waiter].pid) in outs[waiter][1]
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".pt2"]


def test_what_a_killed_compile_leaves_is_cleaned_by_the_next_compile(tmp_path):
    cache = tmp_path / "cache"
    killed = _start(cache, tmp_path / "go", 600)
    (tmp_path / "go").write_text("")
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith(package_cache.PARTIAL) and "-lock@" not in p.name
                                             for p in cache.glob(".*")):
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    left = sorted(p.suffix for p in cache.iterdir())
    assert left == [".lock", ".pt2"], left  # the lock, and the partial package
    following = _start(cache, tmp_path / "go", 0)
    out, err = following.communicate(timeout=120)
    assert following.returncode == 0 and out.split() == ["compiled", "ready", "ready"], (out, err)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        os.path.basename(compiled.package_path(KEY, CPU)[: -len(".pt2")]) + s for s in (".json", ".pt2"))


def test_a_partial_package_of_another_host_is_removed_once_old(tmp_path):
    path = str(tmp_path / "p.pt2")
    partial = package_cache.partial_path(path).replace("@{}@".format(__import__("socket").gethostname()), "@far@")
    open(partial, "w").close()
    package_cache.clean_partials(str(tmp_path))
    assert os.path.exists(partial)
    os.utime(partial, (time.time() - 2 * package_cache.PARTIAL_SECONDS,) * 2)
    package_cache.clean_partials(str(tmp_path))
    assert not os.path.exists(partial)


# ---- with a real package ------------------------------------------------------------------

BUILD = """
    import os, threading, torch
    os.umask(0o022)
    from precise_bn import compiled, moments
    compiled.KERNELS.compile_ahead([("channels_first", (torch.float32, torch.float32), "cpu")], torch.device("cpu"))
    children = open("/proc/self/task/{}/children".format(os.getpid())).read().split()
    print(sorted(t.name for t in threading.enumerate()), compiled.KERNELS.failures, children)
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache with KEY's package, compiled by a process of its own with a TMPDIR of its own."""
    if not aoti.available():
        pytest.skip("AOTInductor came with torch 2.6")
    root = tmp_path_factory.mktemp("built")
    (root / "tmp").mkdir()
    environ = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", environ)
        done = _child(BUILD, root / "cache", timeout=600, TMPDIR=str(root / "tmp"))
    assert done.returncode == 0, done.stderr
    return types.SimpleNamespace(cache=root / "cache", tmp=root / "tmp", out=done.stdout, err=done.stderr)


def test_a_compile_leaves_no_thread_child_or_temporary_file(built):
    assert built.out.strip() == "['MainThread'] [] []", built.out
    assert [str(p) for p in built.tmp.rglob("*") if not p.is_dir()] == []
    names = sorted(p.name for p in built.cache.iterdir())
    base = os.path.basename(compiled.package_path(KEY, CPU))[: -len(".pt2")]
    assert names == [base + ".json", base + ".pt2"]
    assert stat.S_IMODE(os.stat(built.cache / (base + ".pt2")).st_mode) == 0o644


MEASURE = """
    import sys, torch
    from torch import nn
    from precise_bn import compiled, recompute
    from reference import assert_close_exact, float64_reference
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for model, shape in ((nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), (5, 3, 8, 8)),
                         (nn.Sequential(nn.Flatten(), nn.BatchNorm1d(12)), (5, 3, 2, 2))):
        data = [torch.randn(shape, generator=gen) * 3 + 50 for _ in range(3)]
        reference = float64_reference(model, data)
        recompute(model, data, progress=False)
        layer = model[1]
        assert_close_exact(layer.running_mean, layer.running_var, *reference["1"][:2], "1")
    print(sorted(where[0] for where in compiled.KERNELS.ready), compiled.KERNELS.eager_elements > 0,
          "torch._inductor" in sys.modules)
"""


def _copy(built, folder):
    shutil.copytree(built.cache, folder)
    return folder


@pytest.fixture
def read_only(built, tmp_path):
    """A copy of the built cache that this process cannot write (``chattr +i`` for root)."""
    folder = _copy(built, tmp_path / "cache")
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("root cannot make a folder read-only here (no chattr +i)")
    else:
        folder.chmod(0o555)
    yield folder
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o755)


@pytest.mark.parametrize("policy", ["auto", "always"])
def test_a_read_only_cache_is_loaded_and_never_written(read_only, policy):
    before = sorted(p.name for p in read_only.iterdir())
    done = _child(MEASURE, read_only, PRECISE_BN_COMPILE=policy)
    assert done.returncode == 0, done.stderr
    # The package there measured the first model; the second's form is not there: eager sums.
    assert done.stdout.split()[:2] == ["['channels_first']", "True"], done.stdout
    assert sorted(p.name for p in read_only.iterdir()) == before
    if policy == "always":
        assert "the package cache {} cannot be written by this process".format(read_only) in done.stderr
    else:
        assert "precise-bn" not in done.stderr, done.stderr


@pytest.mark.parametrize("damage", ["flipped bytes", "truncated", "garbage"])
def test_a_damaged_package_costs_a_line_and_the_eager_sums_never_the_process(built, tmp_path, damage):
    folder = _copy(built, tmp_path / "cache")
    path = compiled.package_path(KEY, CPU).replace(os.environ["PRECISE_BN_CACHE"], str(folder))
    data = bytearray(open(path, "rb").read())
    if damage == "flipped bytes":
        for i in range(len(data) // 3, len(data) * 2 // 3, 997):  # the middle: the kernels' code
            data[i] ^= 0xFF
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray(os.urandom(len(data)))
    open(path, "wb").write(bytes(data))
    done = _child(MEASURE, folder)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "True", "False"], done.stdout
    lines = [line for line in done.stderr.splitlines() if "precise-bn" in line]
    assert len(lines) == 1 and lines[0].startswith("precise-bn: the package {} was not loaded: its content is not "
                                                   "what its record says".format(path)), done.stderr
    assert lines[0].endswith("set aside as {}.bad; a new one is compiled when a pass pays for it (the eager sums "
                             "run meanwhile)".format(os.path.basename(path)))
    assert open(path + ".bad", "rb").read() == bytes(data) and not os.path.exists(path)


def test_a_fresh_node_loads_without_importing_the_compiler_or_building_anything(built, tmp_path):
    """The C++ loader reads the package: torch's compiler modules stay unimported (a second or
    two), and an empty inductor cache stays empty (its CPU probes took about 6 s)."""
    inductor = tmp_path / "inductor"
    done = _child(MEASURE, _copy(built, tmp_path / "cache"), TORCHINDUCTOR_CACHE_DIR=str(inductor))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['channels_first']", "True", "False"], done.stdout
    assert not inductor.exists() or [str(p) for p in inductor.rglob("*") if not p.is_dir()] == []


INTERRUPTED = """
    import os, signal, sys, threading, time, traceback, torch
    from torch import nn
    from precise_bn import aoti, compiled, recompute
    PHASES = ("compile_package", "_aoti", "export", "aoti_compile_and_package", "publish", "load_package")
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(6))
    data = [torch.randn(4, 6) for _ in range(2)]
    os.environ["PRECISE_BN_COMPILE"] = "never"
    recompute(model, data, progress=False)  # what a pass imports, imported: only the compile is interrupted
    os.environ["PRECISE_BN_COMPILE"] = "always"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    timers, now = [], []

    def interrupt(delay):
        timers.append(threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)))
        timers[-1].start()

    def attempt(where):
        now[:] = [where]  # only the phase an attempt is for is armed
        try:
            recompute(model, data, progress=False)
            timers[-1].join()
            time.sleep(1)
        except KeyboardInterrupt:
            timers[-1].join()
            frames = [f.name for f in traceback.extract_tb(sys.exc_info()[2])]
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            print(where, ([n for n in frames if n in PHASES] or ["elsewhere"])[-1], flush=True)
            return
        print(where, "not interrupted", flush=True)

    importing = aoti._aoti

    def armed_import():
        aoti._aoti = importing
        interrupt(0.01)
        return importing()

    aoti._aoti = armed_import
    attempt("_aoti")  # while importing torch's compiler
    inductor = sys.modules["torch._inductor"]
    plan = [("export", 0.05), ("export", 0.5), ("aoti_compile_and_package", 0.5), ("aoti_compile_and_package", 1.5),
            ("load_package", "before"), ("load_package", "after")]
    for owner, name in ((torch.export, "export"), (inductor, "aoti_compile_and_package")):
        def armed(*args, _run=getattr(owner, name), _name=name, **kwargs):
            if plan and plan[0][0] == _name == now[0]:
                interrupt(plan.pop(0)[1])
            return _run(*args, **kwargs)
        setattr(owner, name, armed)
    native = torch._C._aoti.AOTIModelPackageLoader

    def loader(*args):  # the C++ loader takes milliseconds: the signal comes just before or after it
        when = plan.pop(0)[1] if plan and plan[0][0] == "load_package" == now[0] else None
        interrupt(0) if when == "before" else None
        timers[-1].join()
        made = native(*args)
        interrupt(0) if when == "after" else None
        timers[-1].join()
        return made

    torch._C._aoti.AOTIModelPackageLoader = loader
    for where, _ in list(plan):
        attempt(where)
    torch.optim.SGD(model.parameters(), lr=0.1)  # torch still whole
    eager = compiled.KERNELS.eager_elements
    recompute(model, data, progress=False)
    print(compiled.KERNELS.eager_elements == eager, len(compiled.KERNELS.ready), compiled.KERNELS.failures)
    print(sorted(os.listdir(os.environ["PRECISE_BN_CACHE"])))
"""


@pytest.mark.skipif(not aoti.available(), reason="AOTInductor came with torch 2.6")
def test_a_ctrl_c_at_any_phase_of_a_compile_leaves_torch_whole_and_the_program_retried(tmp_path):
    """Interrupts while importing torch's compiler, exporting, compiling and loading, in one
    live process: each leaves the model as it was and nothing in the cache, and the next pass
    tries again; torch still works and the last pass compiles and measures with the package."""
    done = _child(INTERRUPTED, tmp_path / "cache", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    hit = [line.split() for line in lines[:7]]
    assert [line[0] for line in hit] == ["_aoti", "export", "export", "aoti_compile_and_package",
                                         "aoti_compile_and_package", "load_package", "load_package"], lines
    assert all(len(line) == 2 for line in hit), "\n".join(lines)  # every attempt interrupted
    # Each interrupt lands in the phase it was armed in, or (a short phase over first) in the next one.
    later = {"_aoti": ("_aoti",), "export": ("export", "compile_package", "aoti_compile_and_package"),
             "aoti_compile_and_package": ("aoti_compile_and_package", "compile_package", "publish", "load_package"),
             "load_package": ("load_package",)}
    assert all(phase in later[armed] for armed, phase in hit), lines
    assert {"_aoti", "export", "aoti_compile_and_package", "load_package"} <= {phase for _, phase in hit}, lines
    assert lines[7] == "True 1 []", lines
    base = os.path.basename(compiled.package_path(("channels_last", (torch.float32, torch.float32), "cpu"), CPU))
    assert lines[8] == str(sorted([base[: -len(".pt2")] + ".json", base]))


def test_a_default_cache_path_that_is_a_file_names_the_variable_to_set(monkeypatch, tmp_path):
    monkeypatch.delenv("PRECISE_BN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "precise_bn").write_text("")
    with pytest.raises(ConfigError, match="the package cache {} is a file, not a folder: remove it, or set "
                                          "PRECISE_BN_CACHE to a folder".format(tmp_path / "precise_bn")):
        package_cache.check_environment()
