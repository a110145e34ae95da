"""An interrupt at any instant of a call leaves the model exactly as it was, or lets the call finish.

The trials and what each checks are described in ``tests/interrupt_trials.py``, the calls they
attack in ``tests/interrupt_cases.py``; the same trials in larger numbers are what
``benchmarks/interrupts.py`` runs (``benchmarks/INTERRUPTS.md``).

Both environments run the line-by-line trials. The random-timed ones run in the main
environment only. Python 3.9 checks for signals at nearly every bytecode, also in the
outermost all-or-nothing call's own last bytecodes (its ``return`` and the freeing of its
frame), after the new statistics are written and the signals deferred since are handed over: a
window that Python code cannot close (see :mod:`precise_bn.signals`). None of 3,500
random-timed trials landed there (``benchmarks/INTERRUPTS.md``), but a failure by chance is
one a test must not have. CPython 3.11 handles signals only on entering a function, on loop
back-edges and after calls to C, and none of those come after that call's last check.
"""
from __future__ import annotations

import warnings
from typing import Iterator

import pytest
import torch
from torch import nn

from interrupt_cases import CASE_NAMES, DEEP_BLOCKS, SMALL_BLOCKS, all_handlers, make_batches, make_case, make_model, \
    model_state
from interrupt_trials import line_trials, timed_trials
from precise_bn import LayerError, PreciseBNHook, PreciseBNWarning, recompute, update_bn_stats

# The trials replace SIGALRM's handler and timer: pytest-timeout must watch from a thread.
thread_timeout = pytest.mark.timeout(900, method="thread")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Small operators on a busy machine: a second intra-op thread only waits for a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.main_env
@thread_timeout
@pytest.mark.parametrize("name", CASE_NAMES)
def test_random_timed_interrupts_leave_the_model_whole_or_the_call_complete(name):
    trials = timed_trials(make_case(name, DEEP_BLOCKS, num_batches=2), count=40, seed=CASE_NAMES.index(name))
    assert any(t.raised for t in trials), "no interrupt landed inside the call"


@pytest.mark.main_env
@thread_timeout
@pytest.mark.parametrize("name", ["recompute", "hook-reapply"])
def test_a_handler_that_does_not_raise_never_costs_the_write(name):
    trials = timed_trials(make_case(name, DEEP_BLOCKS, num_batches=2), count=30, seed=7, raising=False)
    assert not any(t.raised for t in trials) and any(t.landed for t in trials)


@thread_timeout
@pytest.mark.parametrize("name", ["hook-recompute", "hook-reapply", "hook-lend", "recalibrated", "undo"])
def test_an_exception_at_every_line_leaves_the_model_whole(name):
    """A hook's recomputation runs every line a ``recompute`` runs once its options are built,
    and the step cache's; a ``recalibrated`` block every line of a recompute and of the
    restore on exit; the benchmark runs the other cases too."""
    trials = line_trials(make_case(name, SMALL_BLOCKS, num_batches=2))
    assert trials and all(t.landed and t.raised for t in trials), "an injected interrupt was swallowed: {}".format(
        [t.where for t in trials if not t.raised][:5])


@thread_timeout
@pytest.mark.parametrize("send", [False, True], ids=["exception", "signal"])
def test_an_interrupt_at_every_line_puts_a_clamped_weight_back(send):
    """A forward that clamps a weight: the pass keeps the parameters' copy after the first batch
    and puts the weight back on every path, with the buffers, in the same critical sections."""
    case = make_case("recompute-clamping", SMALL_BLOCKS, num_batches=2)
    weight = case.model.observer.weight
    kept = weight.detach().clone()
    report = case.call()
    assert report.changed_parameters == ["observer.weight"] and kept.max() > 1  # the clamp wrote
    assert torch.equal(weight, kept)
    trials = line_trials(case, send=send, stride=1 if not send else 3)
    assert trials and all(t.landed and t.raised for t in trials), [t.where for t in trials if not t.raised][:5]


@thread_timeout
@pytest.mark.parametrize("raising", [True, False], ids=["raising", "counting"])
@pytest.mark.parametrize("name,stride", [("hook-reapply", 1), ("hook-lend", 1), ("recompute", 5), ("recalibrated", 5),
                                         ("undo", 1)])
def test_a_signal_at_every_line_is_deferred_or_raised_never_lost(name, stride, raising):
    """Every fifth of the 1,500-odd lines of a recompute keeps the test short; the benchmark
    runs every line of every case."""
    trials = line_trials(make_case(name, SMALL_BLOCKS, num_batches=2), send=True, raising=raising, stride=stride)
    assert all(t.raised == raising for t in trials), [t.where for t in trials if t.raised != raising][:5]
    assert any(t.deferred for t in trials), "no signal was sent inside a critical section"
    assert not all(t.deferred for t in trials), "no signal was passed straight to its handler"


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.BatchNorm2d(4)
        self.spare = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("what", ["never ran", "short loader", "short loader (update_bn_stats)"])
def test_a_warning_turned_into_an_error_leaves_the_model_unchanged(what):
    model = Unused()
    before = model_state(model)
    handlers = all_handlers()
    read = []

    def data() -> Iterator[torch.Tensor]:
        for batch in make_batches(2):
            read.append(batch)
            yield batch

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(PreciseBNWarning, match="never ran" if what == "never ran" else "ran out"):
            if what == "never ran":
                recompute(model, data(), num_batches=2, progress=False)
            elif what == "short loader":
                recompute(model, data(), num_batches=5, layers=[model.used], progress=False)
            else:
                update_bn_stats(model, data(), num_iters=5, layers=[model.used])
    assert len(read) == 2, "the warning must come from the pass's outcome, after the data was read"
    assert model_state(model) == before
    assert all_handlers() == handlers


def test_a_layer_with_an_instance_forward_is_refused_before_the_pass():
    model = make_model(blocks=2)
    patched = model.blocks[1].bn
    patched.forward = lambda x: nn.functional.batch_norm(x, patched.running_mean, patched.running_var)
    before = model_state(model)
    read = []

    def data() -> Iterator[torch.Tensor]:
        for batch in make_batches(3):
            read.append(batch)
            yield batch

    with pytest.raises(LayerError, match=r"'blocks\.1\.bn'.*forward set on the instance.*del layer\.forward"):
        recompute(model, data(), num_batches=3, progress=False)
    assert read == [] and model_state(model) == before
    hook = PreciseBNHook(model, make_batches(3), num_batches=3, progress=False)
    with pytest.raises(LayerError, match=r"blocks\.1\.bn"):
        hook.before_eval(1)
    assert model_state(model) == before
    others = [model.blocks[0].bn, model.head]
    report = recompute(model, make_batches(3), layers=others, progress=False)
    assert [layer.name for layer in report.layers] == ["blocks.0.bn", "head"] and not report.unused


def test_a_pass_imports_torchs_fsdp_with_signals_deferred(monkeypatch):
    # A Ctrl-C inside torch's first import of FSDP (at a pass's attach) leaves sympy half-imported
    # for the rest of the process; only a deferred signal keeps the import whole.
    import importlib

    from precise_bn.signals import in_critical_section

    seen = []
    real = importlib.import_module

    def recording(name, *args, **kwargs):
        if name == "torch.distributed.fsdp":
            seen.append(in_critical_section())
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", recording)
    recompute(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), [torch.randn(2, 3, 8, 8)], progress=False)
    assert seen and all(seen), seen
