"""What a call wrote, kept so that ``report.undo()`` and the end of a ``recalibrated`` block can put
the old statistics back (docs/recalibration.md, docs/interrupts.md)."""
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
    """The tensor's storage, or None without one of its own (sparse, a wrapper such as ``DTensor``)."""
    if tensor.layout != torch.strided:
        return None
    try:
        storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage


class Place:
    """Where a tensor's data lived, so that a value can be put back there safely (:meth:`put`)."""

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
        """Make the tensor hold ``value`` where its data lived (pointed back at its storage first: a
        refused resize can leave sizes it cannot hold); only differing bits are written."""
        self.point_back(value)
        if not same_bits(self.tensor, value):
            self.tensor.copy_(value)

    def point_back(self, value: torch.Tensor) -> None:
        """Point the tensor back at where its data lived, if it moved (without a storage of its
        own: at a copy of ``value``)."""
        if self.moved():
            shape, dtype, device = self.where[:3]
            if self.storage is None:
                self.tensor.data = value.clone()
            else:
                offset, stride = self.where[3:5]
                self.tensor.data = torch.empty(0, dtype=dtype, device=device).set_(self.storage, offset, shape, stride)


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
    """The recomputed layers' buffers before a call and as it left them, built right after the
    write: ``saved`` holds ``(layer, module, key, tensor, value before)``."""

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
        """Put back the statistics from before the call if nothing changed them since (objects,
        versions, bits), else :class:`~precise_bn.UndoError` on every rank and no change."""
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
        """Put back the statistics from before the call whatever happened since (idempotent): the
        end of a ``recalibrated`` block."""
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
