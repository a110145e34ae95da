"""Capture every call's statistics of a BN layer, at (almost) no cost beyond the call itself.

How a call is seen. For the pass, each chosen layer's class is swapped for a subclass (same
name) whose ``forward`` hands the call to the layer's :class:`CallCapture`. ``nn.Module``'s
call keeps its hook-free fast path, and module replicas (``nn.DataParallel``) inherit the class
and the capture like any attribute. A forward hook would cost more than the reading itself.
Deep-copying or pickling a layer during the pass gives the plain layer it is outside the pass.

How a call's statistics are read without one extra operator. A train-mode BN call with
``momentum = 1`` writes exactly its own batch mean into the running-mean tensor it is given and
its *unbiased* batch variance into the running-variance tensor
(``momentum * new + (1 - momentum) * old``, with ``old`` finite). The capture hands the kernel
the next free slot of a per-layer block as those two tensors: for the stock classes
(``BatchNorm1d/2d/3d`` and ``SyncBatchNorm``, which runs as plain BN for the pass) it calls
``F.batch_norm`` itself; for any other subclass it points the layer's two buffers at the slot
and runs the subclass's own forward. When a block is full, or at the end of the pass, its calls
are merged into the layer's float64 :class:`~precise_bn.estimator.PopulationStats` in one
vectorised step. The layer's own buffers are never written during the pass, and memory is
bounded by the blocks whatever the number of batches.

``exact=True`` measures every call from its input instead: shifted by the float32 batch mean
the kernel just wrote, the input is of the order of its std, so float64 sums of the shifted
values and their squares do not cancel even when mean/std = 1e4, and a constant channel gives
exactly 0. Those float64 statistics go into a float64 block of their own, merged like the
kernel's. Without it, :mod:`.trust` bounds how far the kernel's statistics can be from the
exact ones, layer by layer, after the pass.

A subclass whose forward changes what the capture relies on (its momentum, training mode,
buffers) is seen after the call, and that call is measured from its input instead.

Why SyncBatchNorm runs as plain BN: a per-call all-gather would pair up with another rank's
merge, or hang as soon as ranks have different numbers of batches; normalising each rank's batch
alone is what one process does over the union of the ranks' batches, and the end-of-pass merge
then counts every element once.
"""
from __future__ import annotations

import copyreg
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..estimator import PopulationStats, combine_calls, shift_buffer_size, shifted_moments
from . import trust

MAX_BLOCK_CALLS = 64
_BLOCK_VALUES = 1 << 16


def calls_per_block(channels: int) -> int:
    """Calls a layer keeps before merging them: 64, or fewer (down to 16) for wide layers, so
    that a block stays small next to the layer's activations."""
    return max(16, min(MAX_BLOCK_CALLS, _BLOCK_VALUES // max(channels, 1)))


_CAPTURE_ATTR = "_precise_bn_capture"
_CAPTURING_CLASSES: Dict[type, type] = {}

# Classes whose forward in training mode is exactly ``F.batch_norm`` with batch statistics
# (SyncBatchNorm's too, once it runs as plain BN for the pass): the capture calls the kernel
# itself, with the slot as running buffers, and skips the Python of ``_BatchNorm.forward``.
_PLAIN_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _reduce_as_plain(self: _BatchNorm, protocol: int) -> Any:
    """Pickle and deep-copy a layer in a pass as the plain layer it is outside the pass."""
    capture: CallCapture = self.__dict__[_CAPTURE_ATTR]
    state = {k: v for k, v in self.__dict__.items() if k != _CAPTURE_ATTR}
    state.update(momentum=capture.saved_momentum, training=capture.saved_training)
    # copyreg's reconstructor (what protocol 0 pickles use): the file names only the plain class.
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


class Scratch(threading.local):
    """Work buffers shared by all layers of a pass, one set per thread (replicas of
    ``nn.DataParallel`` run in threads). A fresh large CPU allocation costs a page fault per
    4 KiB on every use, and one buffer per layer would hold a copy of every activation.
    """

    def __init__(self) -> None:
        self.buffers: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def buffer(self, shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A buffer viewed as ``shape``; contents undefined, valid until the next request."""
        numel = 1
        for size in shape:
            numel *= int(size)
        flat = self.buffers.get((device, dtype))
        if flat is None or flat.numel() < numel:
            flat = self.buffers[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)


class _Block:
    """Per-channel means (``store[0, i]``) and variances (``store[1, i]``) of the pending calls
    on one device: the kernel's (float32, unbiased variances) or measured ones (float64,
    ``unbiased=False``). Allocated and zeroed whole, before the first forward, so memory does
    not move with the number of batches; a slot's two views are made on first use and kept."""

    def __init__(self, like: torch.Tensor, calls: int, dtype: Optional[torch.dtype] = None, unbiased: bool = True):
        self.store = torch.zeros(2, calls, like.numel(), dtype=dtype or like.dtype, device=like.device)
        self._rows = self.store.unbind(0)  # indexing these is cheaper than store[0, i] per call
        self.unbiased = unbiased
        self.counts: List[int] = []
        self.slots: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def slot(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if i == len(self.slots):
            means, variances = self._rows
            self.slots.append((means[i], variances[i]))
        return self.slots[i]

    def pending(self) -> torch.Tensor:
        """``(2, calls, C)``: the means and variances of the calls not merged yet."""
        return self.store[:, : len(self.counts)]


class CallCapture:
    """Collects every call of one BN layer into ``stats`` (see the module docstring).

    Thread-safe: ``nn.DataParallel`` runs the replicas of a layer in threads. A lock held for
    the call keeps one writer per block; blocks are kept per device.

    ``float32_elements`` is the most elements per channel of a call whose kernel statistics
    were kept although the kernel may have summed them in float32 (0: none), what
    :func:`.trust.variance_error_bound` needs.
    """

    def __init__(
        self,
        stats: PopulationStats,
        exact: bool = False,
        scratch: Optional[Scratch] = None,
        block_calls: Optional[int] = None,
    ):
        self.stats = stats
        self.exact = exact
        self.float32_elements = 0
        self.block_calls = block_calls or calls_per_block(stats.num_channels)
        self._scratch = scratch if scratch is not None else Scratch()
        self._blocks: Dict[torch.device, _Block] = {}
        self._measured: Dict[torch.device, _Block] = {}
        self._lock = threading.Lock()
        self.saved_class: Optional[type] = None
        self.saved_momentum: Optional[float] = None
        self.saved_training = True

    def _block_for(self, like: torch.Tensor) -> _Block:
        block = self._blocks.get(like.device)
        if block is None:
            block = self._blocks[like.device] = _Block(like, self.block_calls)
        return block

    def attach(self, module: _BatchNorm) -> None:
        """Route ``module``'s calls through this capture until :meth:`detach`: its class is
        swapped, it is put in training mode with ``momentum = 1`` (what makes the kernel write
        exactly the call's statistics), and what it had is saved."""
        self._block_for(module.running_mean)
        self.saved_class = type(module)
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
        with self._lock:
            block = self._blocks.get(x.device) or self._block_for(module.running_mean)
            mean, var = block.slot(len(block.counts))
            direct = direct and not args and not kwargs
            if direct:
                module._check_input_dim(x)
                out = F.batch_norm(x, mean, var, module.weight, module.bias, True, 1.0, module.eps)
            else:
                self._point_at(module, mean, var)
                out = forward(module, x, *args, **kwargs)
            n = x.numel() // x.shape[1]
            if n == 0:
                # Nothing was measured; the kernel may have left 0/0 in the slot.
                mean.zero_()
                var.zero_()
            elif self.exact:
                self._commit(self._measure_input(x.detach(), mean), n)
            elif not (direct or self._kernel_wrote(module, mean, var)):
                # The subclass's forward changed what the capture relies on: the slot holds
                # something else than this call's statistics, so take them from the input.
                self._commit(self._measure_input(x.detach(), None), n)
            else:
                if not (direct and trust.double_accumulated(x)):
                    self.float32_elements = max(self.float32_elements, n)
                self._commit(block, n)
            return out

    @staticmethod
    def _point_at(module: _BatchNorm, mean: torch.Tensor, var: torch.Tensor) -> None:
        """Prepare a subclass's own forward to write its batch statistics into the slot: the
        buffers, training mode and ``momentum = 1``, set again on every call because the model's
        forward may change them (``bn.momentum = None`` before calling it, for one)."""
        buffers = module._buffers
        buffers["running_mean"] = mean
        buffers["running_var"] = var
        module.momentum = 1.0
        module.training = True

    @staticmethod
    def _kernel_wrote(module: _BatchNorm, mean: torch.Tensor, var: torch.Tensor) -> bool:
        """Whether a subclass's forward left everything as :meth:`_point_at` set it, so that
        the kernel wrote exactly the call's statistics into the slot."""
        buffers = module._buffers
        return (module.momentum == 1.0 and module.training and module.track_running_stats
                and buffers.get("running_mean") is mean and buffers.get("running_var") is var)

    def _commit(self, block: _Block, n: int) -> None:
        """Count the call just written into ``block``'s next slot; merge a full block."""
        block.counts.append(n)
        if len(block.counts) == self.block_calls:
            self._merge(block)

    def _measure_input(self, x: torch.Tensor, shift32: Optional[torch.Tensor]) -> _Block:
        """Float64 mean and biased variance of this call's input, per channel, measured around
        ``shift32`` (the kernel's float32 batch mean; None: a float32 mean taken here) by
        :func:`~precise_bn.estimator.shifted_moments`, into the next slot of the layer's float64
        block, which is returned. That costs about one BN kernel; a fresh float64 copy plus
        ``var_mean`` (a scalar Welford loop on CPU) costs four to five. Forming ``y`` and its
        sums in float32 instead would cost less, but then every square is rounded to float32,
        up to ``3 * 2**-24`` relative each, and the bound could not be kept in the worst case.
        """
        if shift32 is None:
            shift32 = x.float().mean([d for d in range(x.dim()) if d != 1])
        # A float32 sum that overflowed leaves no usable centre; 0 still measures in float64.
        shift32 = torch.where(torch.isfinite(shift32), shift32, torch.zeros_like(shift32))
        block = self._measured.get(x.device)
        if block is None:
            block = self._measured[x.device] = _Block(shift32, self.block_calls, torch.float64, unbiased=False)
        by_channel = x.movedim(1, 0)
        buffer = self._scratch.buffer((shift_buffer_size(by_channel),), x.device, torch.float64)
        shifted_moments(by_channel, shift32.double(), buffer, out=block.slot(len(block.counts)))
        return block

    def _merge(self, block: _Block) -> None:
        if block.counts:
            pending = block.pending()
            pairs = self._scratch.buffer(pending.shape, pending.device, torch.float64).copy_(pending)
            center = self.stats.center_for(pairs[0, 0])
            self.stats.add(combine_calls(pairs[0], pairs[1], block.counts, center, unbiased=block.unbiased))
            block.counts = []

    def _all_blocks(self) -> List[_Block]:
        return list(self._blocks.values()) + list(self._measured.values())

    def flush(self) -> PopulationStats:
        """Merge every pending call; returns the layer's stats."""
        with self._lock:
            for block in self._all_blocks():
                self._merge(block)
        return self.stats

    def _uniform_pending(self) -> Optional[_Block]:
        """The one block with pending calls, if they can join a merge of many layers: no other
        block pending, and every pending call with the same element count."""
        pending = [block for block in self._all_blocks() if block.counts]
        if len(pending) != 1:
            return None
        counts = pending[0].counts
        return pending[0] if counts.count(counts[0]) == len(counts) else None


def flush(captures: Sequence[CallCapture]) -> List[PopulationStats]:
    """Merge every capture's pending calls and return their stats, in order.

    At the end of a pass every layer has a partly filled block, and merging each alone is a
    string of small operators per layer, which on a CPU adds up to milliseconds. Layers whose
    k pending calls all count the same n elements per channel (on one device, in one dtype) are
    merged together instead: their blocks concatenated along the channel axis go through one
    :func:`~precise_bn.estimator.combine_calls`, then each layer takes its channels' part.
    """
    groups: Dict[Tuple[torch.device, torch.dtype, bool, int, int], List[Tuple[CallCapture, _Block]]] = {}
    for capture in captures:
        with capture._lock:
            block = capture._uniform_pending()
        if block is None:
            capture.flush()
        else:
            key = (block.store.device, block.store.dtype, block.unbiased, len(block.counts), block.counts[0])
            groups.setdefault(key, []).append((capture, block))
    for (_, _, unbiased, calls, n), members in groups.items():
        pending = torch.cat([block.pending() for _, block in members], dim=2).double()
        center = torch.cat([capture.stats.center_for(block.pending()[0, 0].double()) for capture, block in members])
        combined = combine_calls(pending[0], pending[1], [n] * calls, center, unbiased=unbiased)
        widths = [block.store.shape[2] for _, block in members]
        for (capture, block), part in zip(members, combined.split(widths)):
            capture.stats.add(part)
            block.counts = []
    return [capture.stats for capture in captures]
