"""What a call wrote, kept after it returns, so that it can be undone: ``report.undo()`` (only
if nothing changed the statistics since: same tensor objects, ``_version`` counters and bits,
else :class:`~precise_bn.UndoError`, on every rank if any refuses) and the end of a
``with recalibrated(...)`` block (whatever happened since). :class:`Place` puts a value back
into a tensor only where its data lived. Why and how: docs/recalibration.md and docs/interrupts.md.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from .distributed import ACTIVE, Ranks, resolve_sync
from .errors import UndoError
from .options import DEFAULT_TIMEOUT
from .signals import all_or_nothing, critical, write

_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, so that NaN equals NaN and -0.0 differs from 0.0."""
    tensor = tensor.detach()
    return tensor.view(_SAME_WIDTH_INTS[tensor.element_size()]) if tensor.is_floating_point() else tensor


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same dtype, shape and bits (on the same device)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.layout != torch.strided or b.layout != torch.strided:
        return bool(torch.equal(a, b))
    return bool(torch.equal(_bits(a), _bits(b)))


def _storage(tensor: torch.Tensor) -> Any:
    """The tensor's storage, or None for one without a storage of its own (sparse, a subclass
    that wraps others: a ``DTensor``'s storage exists but has no data pointer)."""
    if tensor.layout != torch.strided:
        return None
    try:
        storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage


class Place:
    """Where a tensor's data lived when this was made (storage, offset, sizes, strides, dtype,
    device), so that a value can be put back there safely (:meth:`put`)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.storage = _storage(tensor)
        self.where = self._where()

    def _where(self) -> Tuple[Any, ...]:
        tensor = self.tensor
        where = (tuple(tensor.shape), tensor.dtype, tensor.device)
        if self.storage is None:
            return where
        return where + (tensor.storage_offset(), tensor.stride(), _storage(tensor).data_ptr())

    def moved(self) -> bool:
        """Whether the tensor's data lives elsewhere now (resized, ``set_``, ``.data =``, ...)."""
        try:
            return self._where() != self.where
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # no storage any more
            return True

    def put(self, value: torch.Tensor) -> None:
        """Make the tensor (the same object) hold ``value`` where its data lived. A tensor that
        moved is first pointed back at its own storage, so nothing is written through sizes that
        storage may not hold (torch leaves such sizes when it refuses a resize half-way, as for a
        buffer exported with ``.numpy()``); then only differing bits are written."""
        tensor = self.tensor
        if self.moved():
            shape, dtype, device = self.where[:3]
            if self.storage is None:
                tensor.data = value.clone()
            else:
                offset, stride = self.where[3:5]
                tensor.data = torch.empty(0, dtype=dtype, device=device).set_(self.storage, offset, shape, stride)
        if not same_bits(tensor, value):
            tensor.copy_(value)


@dataclass
class BufferRecord:
    """One buffer of a recomputed layer: before the call, and as the call left it."""

    layer: str
    module: Callable[[], Any]
    key: str
    tensor: torch.Tensor
    before: torch.Tensor
    version: int
    written: torch.Tensor
    place: Place

    def change(self) -> str:
        """What changed since the call wrote, or "" if nothing did."""
        module = self.module()
        if module is None:
            return "the layer no longer exists"
        if module._buffers.get(self.key) is not self.tensor:
            return "{} was replaced by another tensor".format(self.key)
        if self.tensor._version != self.version or not same_bits(self.tensor, self.written):
            return "{} was written since".format(self.key)
        return ""

    def put(self, value: torch.Tensor) -> None:
        module = self.module()
        if module is not None:
            module._buffers[self.key] = self.tensor
            self.place.put(value)


class Snapshot:
    """The recomputed layers' buffers before a call and as it left them (see :meth:`undo`).

    Build it right after the write, in the same all-or-nothing call: ``saved`` lists
    ``(layer name, module, key, tensor, value before)`` for every buffer of every recomputed
    layer. ``sync``, ``group`` and ``timeout`` are the call's, for the round of :meth:`undo`.
    """

    def __init__(self, saved: List[Any], sync: Optional[bool] = None, group: Any = None,
                 timeout: float = DEFAULT_TIMEOUT):
        self.records = [
            BufferRecord(name, weakref.ref(module), key, tensor, before, tensor._version, tensor.detach().clone(),
                         Place(tensor))
            for name, module, key, tensor, before in saved
        ]
        self.sync, self.group, self.timeout = sync, group, timeout
        self.undone = False

    def changes(self) -> List[str]:
        """One line per buffer changed since the call wrote ("layer: what")."""
        return ["layer {!r}: {}".format(r.layer, c) for r in self.records for c in [r.change()] if c]

    def undo(self) -> None:
        """Put back the statistics from before the call, if nothing changed them since; else
        raise :class:`~precise_bn.UndoError` (on every rank, if any rank refuses) and change
        nothing. A :func:`~precise_bn.signals.write`, so called inside an all-or-nothing call
        (``report.undo()``): an interrupt leaves either the call's statistics or the old ones."""
        ranks = Ranks(resolve_sync(self.sync, self.group), self.group, self.timeout)
        try:
            if self.undone:
                raise UndoError("undo(): this recalibration was already undone")
            changes = self.changes()
            if changes:
                raise UndoError(
                    "undo(): the statistics were changed since the recalibration ({}{}); undoing would "
                    "overwrite that change, so nothing was undone. Recompute, or load the statistics you "
                    "want".format("; ".join(changes[:3]), "; ..." if len(changes) > 3 else ""))
            ranks.exchange(ACTIVE)
            ranks.finish()
        except BaseException:
            ranks.abort()
            raise
        write(self._put_back, self._write_again)

    @all_or_nothing
    def restore(self) -> None:
        """Put back the statistics from before the call whatever happened since (unless already
        undone): what leaving a ``with recalibrated(...)`` block does. Idempotent: a caller cut
        short by an interrupt calls it again on the way out."""
        if self.undone:
            return
        with critical():
            self._put_back()

    def _put_back(self) -> None:
        with torch.no_grad():
            for record in self.records:
                record.put(record.before)
        self.undone = True

    def _write_again(self) -> None:
        with torch.no_grad():
            for record in self.records:
                record.put(record.written)
                record.version = record.tensor._version
        self.undone = False
