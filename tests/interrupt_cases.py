"""The calls that ``tests/interrupt_trials.py`` attacks, the model they run on, and what "the
model is as it was" means, bit for bit.

The model has every kind of BN layer the capture treats differently (the kernel called
directly, a subclass's own forward, no affine parameters, momentum None), a layer in eval mode
that must not be touched, hooks on two layers, and a module with state of its own that a pass
holds still and puts back (an observer's switch, the range it learns, a call counter, and in one
case a weight its forward clamps); each case knows the state it starts from and the state an
undisturbed call leaves.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

from precise_bn import BNReport, PreciseBNHook, recalibrated, recompute, update_bn_stats

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_state_dict_hooks", "_load_state_dict_pre_hooks")
#: 100 blocks and the head: 101 BN layers, 88 recomputed and 13 in eval mode left alone.
DEEP_BLOCKS = 100
#: 3 blocks (one direct, one subclass, one eval-mode layer) and the head.
SMALL_BLOCKS = 3


# --------------------------------------------------------------------------------------------
# The model: every kind of layer the capture handles differently


class SubclassBN(nn.BatchNorm2d):
    """A BN subclass: the capture runs its forward with the layer's buffers pointed at a slot."""


#: Block kinds, in turn: the kernel called directly, a subclass's own forward, a layer in eval
#: mode (not chosen: must stay exactly as it is), no affine parameters, momentum None.
KINDS = ("plain", "subclass", "eval", "no-affine", "plain", "subclass", "no-affine", "cumulative")


class Block(nn.Module):
    def __init__(self, channels: int, kind: str):
        super().__init__()
        cls = SubclassBN if kind == "subclass" else nn.BatchNorm2d
        self.bn = cls(channels, affine=kind != "no-affine", momentum=None if kind == "cumulative" else 0.1)
        if kind == "eval":
            self.bn.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(x)


class Observer(nn.Module):
    """Learns the largest magnitude of each channel while its switch is on (as a fake-quantize
    module's observer does) and counts its calls; with ``clamps``, also clamps its weight in place
    (as weight clipping does): a pass turns the switch off and puts all back, the weight included."""

    def __init__(self, channels: int, clamps: bool = False):
        super().__init__()
        self.register_buffer("observer_enabled", torch.ones(1, dtype=torch.uint8))
        self.register_buffer("max_val", torch.zeros(channels))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.clamps = clamps
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.observer_enabled[0] == 1:
            torch.maximum(self.max_val, x.detach().abs().amax(0), out=self.max_val)
        if self.clamps:
            with torch.no_grad():
                self.weight.clamp_(max=1.0)
        return x * self.weight


class Deep(nn.Module):
    """``blocks`` residual BN blocks, an observer, then a BatchNorm1d head; hooks on two layers."""

    def __init__(self, blocks: int, channels: int = 4, clamps: bool = False):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(channels, KINDS[i % len(KINDS)]) for i in range(blocks)))
        self.observer = Observer(channels, clamps)
        self.head = nn.BatchNorm1d(channels)
        self.blocks[0].bn.register_forward_hook(lambda m, i, o: None)
        self.head.register_forward_pre_hook(lambda m, i: None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.observer(self.blocks(x).mean((2, 3))))


def make_model(blocks: int, seed: int = 0, clamps: bool = False) -> Deep:
    torch.manual_seed(seed)
    model = Deep(blocks, clamps=clamps)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.num_batches_tracked.fill_(7)
    return model


def make_batches(count: int, seed: int = 1) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 4, 2, 2, generator=gen) * 2 + 1 for _ in range(count)]


# --------------------------------------------------------------------------------------------
# What "the model is as it was" means


def model_state(model: nn.Module) -> List[Tuple[Any, ...]]:
    """Everything a call may touch, per module, in a form that compares bit for bit."""
    state = []
    for name, m in model.named_modules():
        tensors = [(kind, key, id(t), t.dtype, tuple(t.shape), t.detach().cpu().numpy().tobytes())
                   for kind, table in (("buffer", m._buffers), ("param", m._parameters))
                   for key, t in table.items() if t is not None]
        hooks = [(key, list(getattr(m, key).items())) for key in HOOK_DICTS if key in m.__dict__]
        state.append((name, type(m), m.training, getattr(m, "momentum", None), sorted(m.__dict__),
                      tensors, hooks))
    return state


def first_difference(before: Sequence[Any], after: Sequence[Any]) -> str:
    for old, new in zip(before, after):
        if old != new:
            for index, (a, b) in enumerate(zip(old, new)):
                if a != b:
                    return "module {!r}, field {}: {!r} -> {!r}".format(old[0], index, a, b)[:600]
    return "module lists differ in length" if len(before) != len(after) else ""


def all_handlers() -> Dict[int, Any]:
    handlers = {}
    for signum in signal.valid_signals():
        try:
            handlers[signum] = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
    return handlers


# --------------------------------------------------------------------------------------------
# The calls under attack


@dataclass
class Case:
    """One call and the state it starts from; ``expected`` is the state after an undisturbed call."""

    name: str
    model: nn.Module
    call: Callable[[], Any]
    reset: Callable[[], None]
    extra: Callable[[], Any] = lambda: None
    expected: Any = None

    def state(self) -> Any:
        return model_state(self.model), self.extra()

    def prepare(self) -> "Case":
        self.reset()
        self.call()
        self.expected = self.state()
        self.reset()
        return self


def _restorer(model: nn.Module) -> Callable[[], None]:
    """Puts every buffer back, object and value, and every parameter whose value changed: a
    trial's plain forward in train mode moves the running stats (and clamps a clamping
    observer's weight), and on torch 1.x rebinds ``num_batches_tracked`` to a new tensor. A
    parameter left alone keeps its version counter, which the hooks' cache reads."""
    pristine = [(m, key, t, t.detach().clone()) for m in model.modules() for key, t in m._buffers.items()
                if t is not None]
    weights = [(p, p.detach().clone()) for p in model.parameters()]

    def reset() -> None:
        with torch.no_grad():
            for module, key, t, value in pristine:
                module._buffers[key] = t
                t.copy_(value)
            for p, value in weights:
                if not torch.equal(p, value):
                    p.copy_(value)

    return reset


def _cache_state(hook: PreciseBNHook) -> Any:
    cache = hook.cache
    value = None if cache.value is None else {
        k: (m.numpy().tobytes(), v.numpy().tobytes()) for k, (m, v) in cache.value.items()}
    return cache.key, value, cache.report is not None, cache.recomputations


def _function_case(name: str, blocks: int, call: Callable[[nn.Module], Any], clamps: bool = False) -> Case:
    model = make_model(blocks, clamps=clamps)
    return Case(name, model, lambda: call(model), _restorer(model))


def _hook_recompute_case(blocks: int, batches: List[torch.Tensor]) -> Case:
    """A hook's first call at a step: a recomputation (a fresh hook for every trial)."""
    model = make_model(blocks)
    hooks: List[PreciseBNHook] = []
    reset = _restorer(model)

    def fresh_hook() -> None:
        reset()
        hooks[:] = [PreciseBNHook(model, batches, num_batches=len(batches), progress=False)]

    return Case("hook-recompute", model, lambda: hooks[0].before_eval(1), fresh_hook,
                lambda: _cache_state(hooks[0]))


def _hook_reapply_case(blocks: int, batches: List[torch.Tensor]) -> Case:
    """A hook's second call at the same step: the cached stats written back, no forward."""
    model = make_model(blocks)
    hook = PreciseBNHook(model, batches, num_batches=len(batches), progress=False)
    reset = _restorer(model)
    hook.before_checkpoint(1)
    reset()  # what training does to the buffers between a checkpoint and an evaluation
    return Case("hook-reapply", model, lambda: hook.before_eval(1), reset, lambda: _cache_state(hook))


def _hook_lend_case(blocks: int, batches: List[torch.Tensor]) -> Case:
    """A hook lending an extra model's cached stats to the model (mmengine's EMAHook swaps only
    the weights in for validation): written back, no forward."""
    model = make_model(blocks)
    hook = PreciseBNHook(model, batches, num_batches=len(batches), extra_models=[make_model(blocks, seed=1)],
                         progress=False)
    hook.before_checkpoint(1)
    restore = _restorer(model)  # the model's own recomputed stats

    def reset() -> None:
        restore()
        hook.lent = None

    return Case("hook-lend", model, lambda: hook.lend(1), reset, lambda: (hook.lent, _cache_state(hook)))


def _recalibrated_case(blocks: int, batches: List[torch.Tensor]) -> Case:
    """A ``with recalibrated(...)`` block, entered and left: the model ends as it started."""

    def call(model: nn.Module) -> None:
        with recalibrated(model, batches, progress=False):
            pass

    return _function_case("recalibrated", blocks, call)


def _undo_case(blocks: int, batches: List[torch.Tensor]) -> Case:
    """``report.undo()`` after a recompute (a fresh recompute before every trial)."""
    model = make_model(blocks)
    reports: List[BNReport] = []
    reset = _restorer(model)

    def recomputed() -> None:
        reset()
        reports[:] = [recompute(model, batches, progress=False)]

    return Case("undo", model, lambda: reports[0].undo(), recomputed)


CASE_NAMES = ("recompute", "update_bn_stats", "hook-recompute", "hook-reapply", "hook-lend", "recalibrated",
              "undo")


def make_case(name: str, blocks: int, num_batches: int) -> Case:
    """One of :data:`CASE_NAMES`, with its expected state: ``recompute``, ``update_bn_stats``,
    a hook's recomputation at a new step, its re-apply of the cached stats at the same step and
    its lending of an extra model's, a ``recalibrated`` block, ``undo`` after a recompute; or
    ``recompute-clamping``, a recompute whose forwards clamp a weight, which the pass puts back."""
    batches = make_batches(num_batches)
    if name in ("recompute", "recompute-clamping"):
        case = _function_case(name, blocks, lambda m: recompute(m, batches, num_batches=num_batches, progress=False),
                              clamps=name == "recompute-clamping")
    elif name == "update_bn_stats":
        case = _function_case(name, blocks, lambda m: update_bn_stats(m, batches, num_iters=num_batches))
    elif name == "hook-recompute":
        case = _hook_recompute_case(blocks, batches)
    elif name == "hook-lend":
        case = _hook_lend_case(blocks, batches)
    elif name == "recalibrated":
        case = _recalibrated_case(blocks, batches)
    elif name == "undo":
        case = _undo_case(blocks, batches)
    else:
        case = _hook_reapply_case(blocks, batches)
    return case.prepare()
