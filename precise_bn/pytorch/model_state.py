"""Everything the forwards of a pass may change in a PyTorch model, kept before it and put back:
per module its class, attributes and tables; per buffer where its data lives and its value; per
parameter its ``_version`` counter, where its data lives and, while the first batch runs, its
value in host memory (kept for the whole pass if that batch wrote one; a parameter first written
later is refused). What is put back, and why: ``docs/interrupts.md``.
"""
from __future__ import annotations

from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import ParameterChangedError
from ..snapshot import Place, same_bits

_TABLES = ("_parameters", "_buffers", "_modules")
_MISSING = object()
_HOST = torch.device("cpu")
_CHUNK_BYTES = 1 << 23

#: Buffers that switch a fake-quantize module's range learning on.
OBSERVER_SWITCHES = ("observer_enabled", "static_enabled")


class _Buffer:
    """One tensor: where its data lives, its value, and the value the pass holds it at
    (``expected``), which the forwards changed if they made it differ."""

    def __init__(self, tensor: torch.Tensor):
        self.place = Place(tensor)
        self.value = tensor.detach().clone()
        self.expected = self.value

    def changed(self) -> bool:
        return self.place.moved() or not same_bits(self.place.tensor, self.expected)

    def restore(self) -> None:
        self.place.put(self.value)


class _Parameter:
    """One parameter: its name, ``_version`` counter, place, and host copy while one is kept
    (never for a parameter without a storage, such as FSDP2's sharded ``DTensor``)."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name = name
        self.tensor = tensor
        self.version = tensor._version
        self.place = Place(tensor)
        self.copy: Optional[torch.Tensor] = None

    def written(self) -> bool:
        """Whether the forwards wrote it: its counter moved or, while a copy is kept, its bits
        differ (a write through ``.data`` moves no counter). Data that moved (FSDP) is no write."""
        return self.tensor._version != self.version or (
            self.copy is not None and not self.place.moved() and not _same_bits(self.tensor, self.copy))

    def restore(self) -> None:
        copy = self.copy
        if copy is None:
            return
        self.place.point_back(copy)
        if not _same_bits(self.tensor, copy):
            self.tensor.copy_(copy)


def _host_copies(parameters: Collection[_Parameter]) -> None:
    """Copy each parameter with a storage into host memory, with its own strides."""
    for parameter in parameters:
        if parameter.place.storage is not None:
            tensor = parameter.tensor.detach()
            if _dense(tensor):
                copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_HOST)
                parameter.copy = copy.copy_(tensor)
            else:
                parameter.copy = tensor.to(_HOST, copy=True)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill ``numel()`` consecutive places of its storage."""
    if not tensor.numel():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_bits(tensor: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether ``tensor`` holds its host ``copy``'s bits, compared a chunk at a time where its
    data lies."""
    if tensor.dtype != copy.dtype or tensor.shape != copy.shape:
        return False
    tensor = tensor.detach()
    small = tensor.numel() * tensor.element_size() <= _CHUNK_BYTES
    if small or tensor.stride() != copy.stride() or not _dense(tensor):
        return same_bits(tensor, copy.to(tensor.device))
    ours, kept = _span(tensor), _span(copy)
    step = max(1, _CHUNK_BYTES // tensor.element_size())
    return all(same_bits(ours[i:i + step], kept[i:i + step].to(tensor.device)) for i in range(0, ours.numel(), step))


def _span(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


class ModelState:
    """The state of ``model`` when built; ``names`` maps each module to its name in messages."""

    def __init__(self, model: nn.Module, names: Dict[int, str]):
        self.names = names
        self.modules = [(m, type(m), dict(m.__dict__), [dict(m.__dict__[t]) for t in _TABLES])
                        for m in model.modules()]
        self._buffer_tables = {id(m): tables[1] for m, _, _, tables in self.modules}
        self.buffers: Dict[int, _Buffer] = {}
        self.parameters: Dict[int, _Parameter] = {}
        for module in model.modules():
            for key, tensor in module._buffers.items():
                if tensor is not None and id(tensor) not in self.buffers:
                    self.buffers[id(tensor)] = _Buffer(tensor)
            for key, tensor in module._parameters.items():
                if tensor is not None and id(tensor) not in self.parameters:
                    self.parameters[id(tensor)] = _Parameter(qualified(self.names.get(id(module), ""), key), tensor)
        _host_copies(self.parameters.values())
        self.checked = 0
        self.keep_copies = False

    def saved_buffers(self, module: nn.Module) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(key, tensor, value before)`` for each buffer ``module`` held when the state was kept."""
        table = self._buffer_tables[id(module)]
        return [(key, t, self.buffers[id(t)].value) for key, t in table.items() if t is not None]

    def freeze_observers(self) -> None:
        """Stop every fake-quantize module from learning ranges: the forwards quantize with the
        ranges the model has, as it will after the pass."""
        for module, _, _, tables in self.modules:
            for key in OBSERVER_SWITCHES:
                switch = tables[1].get(key)
                if switch is not None:
                    switch.zero_()
                    self.buffers[id(switch)].expected = switch.detach().clone()

    def written_parameters(self) -> List[str]:
        """The names of the parameters the forwards wrote in place."""
        return [p.name for p in self.parameters.values() if p.written()]

    def check_parameters(self) -> None:
        """After each batch: after the first, release the copy if it wrote no parameter, else
        keep all of it; once released, a counter that moved raises
        :class:`~precise_bn.ParameterChangedError` (nothing can put that parameter back)."""
        self.checked += 1
        parameters = self.parameters.values()
        if self.keep_copies or self.checked > 1 and all(p.tensor._version == p.version for p in parameters):
            return
        written = self.written_parameters()
        if self.checked == 1:
            if written:
                self.keep_copies = True
            else:
                for parameter in self.parameters.values():
                    parameter.copy = None
        elif written:
            raise ParameterChangedError(
                "the model's forward wrote parameter(s) in place during batch {} of the pass: {}. The first "
                "batch wrote none, so the pass had released its copy of the parameters (it keeps one only "
                "while the first batch runs, unless that batch writes one); it stops here, before writing "
                "any statistics. Every buffer and attribute was put back and no other parameter's version "
                "counter moved, but these parameters hold what the forward wrote (even if it wrote the same "
                "values). {}".format(self.checked, ", ".join(written), ParameterChangedError.advice))

    def changed_buffers(self, skip: Collection[int] = ()) -> List[Tuple[str, str]]:
        """``(module name, key)`` of each kept buffer the forwards replaced, removed or changed,
        each tensor once, under its first module; those whose ``id`` is in ``skip`` left out."""
        named = set(skip)
        changed: List[Tuple[str, str]] = []
        for module, _, _, tables in self.modules:
            for key, tensor in tables[1].items():
                if tensor is None or id(tensor) in named:
                    continue
                if module._buffers.get(key) is not tensor or self.buffers[id(tensor)].changed():
                    named.add(id(tensor))
                    changed.append((self.names.get(id(module), ""), key))
        return changed

    def restore(self) -> None:
        """Put the model back as it was kept: classes, attributes, tables, buffers' values.
        Idempotent; a caller makes it a critical section."""
        for module, cls, attributes, tables in self.modules:
            if type(module) is not cls:
                module.__class__ = cls
            _put_back(module.__dict__, attributes)
            for name, saved in zip(_TABLES, tables):
                _put_back(module.__dict__[name], saved)
        for buffer in self.buffers.values():
            buffer.restore()
        for parameter in self.parameters.values():
            parameter.restore()


def _put_back(table: Dict[str, Any], saved: Dict[str, Any]) -> None:
    """Make ``table`` hold exactly ``saved``'s keys, bound to the same objects."""
    for key in [k for k in table if k not in saved]:
        del table[key]
    for key, value in saved.items():
        if table.get(key, _MISSING) is not value:
            table[key] = value


def qualified(module: str, key: str) -> str:
    """The name of ``module``'s tensor ``key``, as ``state_dict()`` spells it."""
    return module + "." + key if module else key


def module_names(named: Sequence[Tuple[str, nn.Module]]) -> Dict[int, str]:
    """``id(module) -> name`` from ``(name, module)`` pairs, the first name of a module kept."""
    names: Dict[int, str] = {}
    for name, module in named:
        names.setdefault(id(module), name)
    return names
