"""Every call of a BN layer measured in float64, through a class swap: the layer computes with
``momentum = 1`` and a slot as running buffers (its own are never written), then its input is
measured around the batch mean the slot received; calls wait in per-layer blocks, merged between
batches many layers at once. SyncBatchNorm runs as plain BN. Why: ``docs/numerics.md`` ("One
call"), ``docs/distributed.md``.
"""
from __future__ import annotations

import copyreg
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..estimator import PopulationStats, add_side_by_side, combine_calls
from ..moments import measure

MAX_BLOCK_CALLS = 64
_BLOCK_VALUES = 1 << 16


def calls_per_block(channels: int) -> int:
    """Calls a layer keeps before merging them: fewer for wide layers (down to 16), so that a
    block stays small next to its activations."""
    return max(16, min(MAX_BLOCK_CALLS, _BLOCK_VALUES // max(channels, 1)))


_CAPTURE_ATTR = "_precise_bn_capture"
_CAPTURING_CLASSES: Dict[type, type] = {}

# Forwards that are exactly F.batch_norm in training mode: the capture calls the kernel itself.
_PLAIN_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _reduce_as_plain(self: _BatchNorm, protocol: int) -> Any:
    """Pickle and deep-copy a layer in a pass as the plain layer it is outside the pass."""
    capture: CallCapture = self.__dict__[_CAPTURE_ATTR]
    state = {k: v for k, v in self.__dict__.items() if k != _CAPTURE_ATTR}
    state.update(momentum=capture.saved_momentum, training=capture.saved_training)
    return copyreg._reconstructor, (capture.saved_class, object, None), state


def _capturing_class(cls: type) -> type:
    """A subclass of ``cls`` (same name) whose forward goes through the layer's capture."""
    sub = _CAPTURING_CLASSES.get(cls)
    if sub is None:
        base_forward = _BatchNorm.forward if issubclass(cls, nn.SyncBatchNorm) else cls.forward
        direct = cls in _PLAIN_BN

        def forward(self: _BatchNorm, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return self.__dict__[_CAPTURE_ATTR](self, base_forward, direct, input, args, kwargs)

        namespace = {"forward": forward, "__reduce_ex__": _reduce_as_plain, "__module__": cls.__module__}
        sub = type(cls.__name__, (cls,), namespace)
        sub.__qualname__ = cls.__qualname__
        _CAPTURING_CLASSES[cls] = sub
    return sub


class _Block:
    """The pending calls of a layer on one device: ``((2, C) float64 mean and variance, count)``
    pairs in one list, which DataParallel's threads append to whole."""

    def __init__(self) -> None:
        self.calls: List[Tuple[torch.Tensor, int]] = []

    @property
    def counts(self) -> List[int]:
        return [n for _, n in self.calls]

    def take(self) -> Tuple[List[torch.Tensor], List[int]]:
        """The pending calls' statistics and counts, leaving the block empty."""
        calls, self.calls = self.calls, []
        return [stats for stats, _ in calls], [n for _, n in calls]


_BATCH_NORMS = {F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum"),
                torch.batch_norm: ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum")}


class _Slot(torch.Tensor):
    """The running mean handed to a subclass's own forward: it records the input of every
    training-mode batch_norm call that updates it (a subclass may scale its input first). Only
    calls involving the slot pass through here, and torch turns subclass dispatch off and back on
    in C, in one step no exception can split."""

    #: Each training-mode call's input, and whether its momentum was 1.
    seen: List[Tuple[torch.Tensor, bool]]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _BATCH_NORMS:
            named = dict(zip(_BATCH_NORMS[func], args), **kwargs)
            slot = named.get("running_mean")
            if isinstance(slot, _Slot) and named.get("training"):
                slot.seen.append((named["input"], named.get("momentum", 0.1) == 1.0))
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


class CallCapture:
    """Collects every call of one BN layer into ``stats``. DataParallel's threads (one device
    each) share it: slots and blocks are per device, so a plain layer's call takes no lock; a
    subclass's call (recorded on its slot) and merges hold it."""

    def __init__(self, stats: PopulationStats, block_calls: Optional[int] = None):
        self.stats = stats
        self.block_calls = block_calls or calls_per_block(stats.num_channels)
        self.elements = 0
        self._blocks: Dict[torch.device, _Block] = {}
        #: Per device: the running mean and variance handed to the kernel, and the mean as a
        #: plain tensor.
        self._slots: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.saved_class: Optional[type] = None
        self.saved_momentum: Optional[float] = None
        self.saved_training = True

    def _slot_for(self, device: torch.device, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slot = self._slots.get(device)
        if slot is None:
            plain = mean = torch.zeros(like.shape, dtype=like.dtype, device=device)
            if self.saved_class not in _PLAIN_BN:
                mean = plain.as_subclass(_Slot)
                mean.seen = []
            slot = self._slots[device] = (mean, torch.ones(like.shape, dtype=like.dtype, device=device), plain)
        return slot

    def attach(self, module: _BatchNorm) -> None:
        """Route ``module``'s calls through this capture until :meth:`detach`."""
        self.saved_class = type(module)
        self._slot_for(module.running_mean.device, module.running_mean)
        self.saved_momentum = module.momentum
        self.saved_training = module.training
        module.__dict__[_CAPTURE_ATTR] = self
        module.__class__ = _capturing_class(self.saved_class)
        module.momentum = 1.0
        module.training = True

    def detach(self, module: _BatchNorm) -> None:
        """Undo :meth:`attach` (idempotent). Restoring the buffers is the caller's (``BNPass``)."""
        if module.__dict__.get(_CAPTURE_ATTR) is self:
            module.__class__ = self.saved_class
            module.momentum = self.saved_momentum
            module.training = self.saved_training
            del module.__dict__[_CAPTURE_ATTR]

    def __call__(
        self,
        module: _BatchNorm,
        forward: Callable[..., Any],
        direct: bool,
        x: torch.Tensor,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
    ) -> Any:
        if direct and not args and not kwargs:
            mean, var, _ = self._slots.get(x.device) or self._slot_for(x.device, module.running_mean)
            module._check_input_dim(x)
            out = F.batch_norm(x, mean, var, module.weight, module.bias, True, 1.0, module.eps)
            self._add(x, mean)
            return out
        with self._lock:  # a subclass's calls are recorded on the slot, one per device
            mean, var, plain = self._slot_for(x.device, module.running_mean)
            assert isinstance(mean, _Slot)
            self._point_at(module, mean, var)
            mean.seen = []
            out = forward(module, x, *args, **kwargs)
            seen, mean.seen = mean.seen, []
            for i, (normalised, whole) in enumerate(seen):
                # The last call's batch mean is still in the slot: the shift, for free.
                self._add(normalised, plain if whole and i == len(seen) - 1 else None)
            if not seen:
                self._add(x, None)
            return out

    def _add(self, x: torch.Tensor, shift: Optional[torch.Tensor]) -> None:
        """Measure ``x`` around ``shift`` (None: its own mean) into its device's block."""
        channels = x.shape[1] if x.dim() > 1 else 0
        n = x.numel() // channels if channels else 0
        if not n:
            return
        if x.requires_grad:
            x = x.detach()
        if shift is None:
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            shift = x.mean([d for d in range(x.dim()) if d != 1], dtype=dtype)
        block = self._blocks.get(x.device) or self._blocks.setdefault(x.device, _Block())
        block.calls.append((measure(x, shift), n))
        self.elements += n * channels

    @staticmethod
    def _point_at(module: _BatchNorm, mean: torch.Tensor, var: torch.Tensor) -> None:
        """Point a subclass's running statistics at the slot, in training mode, on every call:
        the model's forward may change them (``bn.momentum = None``, for one)."""
        buffers = module._buffers
        buffers["running_mean"] = mean
        buffers["running_var"] = var
        object.__setattr__(module, "momentum", 1.0)  # plain attributes: nn.Module's checks are slow
        object.__setattr__(module, "training", True)

    def _merge(self, block: _Block) -> None:
        if block.calls:
            calls, counts = block.take()
            pending = torch.stack(calls, dim=1)
            center = self.stats.center_for(pending[0, 0])
            self.stats.add(combine_calls(pending[0], pending[1], counts, center), owned=True)

    def due(self) -> bool:
        """Whether a block holds :attr:`block_calls` calls or more."""
        return any(len(block.calls) >= self.block_calls for block in self._blocks.values())

    def flush(self) -> PopulationStats:
        """Merge every pending call; returns the layer's stats."""
        with self._lock:
            for block in self._blocks.values():
                self._merge(block)
        return self.stats

    def _uniform_pending(self) -> Optional[_Block]:
        """The one block with pending calls, if all of them count the same elements."""
        pending = [block for block in self._blocks.values() if block.calls]
        if len(pending) != 1:
            return None
        counts = pending[0].counts
        return pending[0] if counts.count(counts[0]) == len(counts) else None


def merge_due(captures: Sequence[CallCapture]) -> None:
    """Between batches: merge the layers whose blocks are full, together (:func:`flush`)."""
    due = [capture for capture in captures if capture.due()]
    if due:
        flush(due)


def flush(captures: Sequence[CallCapture]) -> List[PopulationStats]:
    """Merge every capture's pending calls and return their stats, in order. Layers whose k
    pending calls all count the same n elements (on one device) go through one
    :func:`~precise_bn.estimator.combine_calls` together, their channels side by side: merged
    alone, each would be a string of small operators."""
    groups: Dict[Tuple[torch.device, int, int], List[Tuple[CallCapture, _Block]]] = {}
    for capture in captures:
        with capture._lock:
            block = capture._uniform_pending()
        if block is None:
            capture.flush()
        else:
            key = (block.calls[0][0].device, len(block.calls), block.calls[0][1])
            groups.setdefault(key, []).append((capture, block))
    for members in groups.values():
        taken = [block.take() for _, block in members]
        # One copy into (2, k, channels of every layer): call j of each layer, then call j + 1.
        pending = torch.cat([calls[j] for j in range(len(taken[0][0])) for calls, _ in taken], dim=1)
        pending = pending.view(2, len(taken[0][0]), -1)
        centers = [capture.stats.center_for(calls[0][0]) for (capture, _), (calls, _) in zip(members, taken)]
        combined = combine_calls(pending[0], pending[1], taken[0][1], torch.cat(centers) if len(centers) > 1 else centers[0])
        if len(members) == 1:
            members[0][0].stats.add(combined, owned=True)
            continue
        add_side_by_side([capture.stats for capture, _ in members], combined, [calls[0].shape[1] for calls, _ in taken])
    return [capture.stats for capture in captures]
