"""Everything the forwards of a pass may change in a PyTorch model, kept before it and put back.

Training-mode forwards can change more than the BN statistics (observers, spectral norm,
counters, new buffers or attributes, a clamped weight). :class:`ModelState` keeps, per module,
its class, attributes and tables of parameters, buffers and submodules; per buffer, where its
data lives and a copy of its value; per parameter, its ``_version`` counter, where its data
lives, and a copy of its value in host memory (whatever the model's device) while the first
batch runs. A copy of the parameters held for the
whole pass would add the size of the model to every pass, for something forwards rarely do: so
:meth:`ModelState.check_parameters` releases it after a first batch that wrote no parameter, and
keeps all of it for the whole pass after one that did (any parameter may then be written on any
batch). A parameter written only after the copy was released cannot be put back, and is refused
(:class:`~precise_bn.ParameterChangedError`). :meth:`ModelState.restore` puts every object back,
points a tensor whose data moved back at its own storage before anything is written, then
writes only the buffers and kept parameters whose bits differ. What is put back, and why:
``docs/interrupts.md``.
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

#: Buffers that switch a fake-quantize module's range learning on (``observer_enabled`` of
#: ``torch.ao.quantization`` fake-quantize modules, ``static_enabled`` of the learnable one).
OBSERVER_SWITCHES = ("observer_enabled", "static_enabled")


class _Buffer:
    """One tensor (however many modules hold it): where its data lives, a copy of its value, and
    the value the pass holds it at (``expected``: its own, or what :meth:`ModelState.freeze_observers`
    set), which the forwards changed if they made it differ."""

    def __init__(self, tensor: torch.Tensor):
        self.place = Place(tensor)
        self.value = tensor.detach().clone()
        self.expected = self.value

    def changed(self) -> bool:
        return self.place.moved() or not same_bits(self.place.tensor, self.expected)

    def restore(self) -> None:
        self.place.put(self.value)


class _Parameter:
    """One parameter (however many modules hold it): its name, its ``_version`` counter, where its
    data lives, and its copy in host memory while the pass keeps one (None once released, and for
    a parameter without a storage of its own, such as FSDP2's sharded ``DTensor``: the pass runs
    on the full parameters, and reads its counter alone)."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name = name
        self.tensor = tensor
        self.version = tensor._version
        self.place = Place(tensor)
        self.copy: Optional[torch.Tensor] = None

    def written(self) -> bool:
        """Whether the forwards wrote it: its counter moved or, while its copy is kept, its bits
        differ (a write through ``.data``, ``.numpy()`` or the storage moves no counter). Data
        that moved is no write: FSDP points parameters at the gathered full ones while the pass
        runs, and back afterwards; :meth:`restore` points one still elsewhere back at its storage."""
        return self.tensor._version != self.version or (
            self.copy is not None and not self.place.moved() and not _same_bits(self.tensor, self.copy))

    def restore(self) -> None:
        copy = self.copy
        if copy is None:
            return
        if self.place.moved():
            self.place.put(self.tensor)  # points it back at its own storage; its value is its own
        if not _same_bits(self.tensor, copy):
            self.tensor.copy_(copy)


def _host_copies(parameters: Collection[_Parameter]) -> None:
    """Copy every parameter with a storage into host memory, one block per dtype: a dense one
    (the usual) with its own strides, so that its bits compare span by span with a device's."""
    groups: Dict[torch.dtype, List[_Parameter]] = {}
    for parameter in parameters:
        if parameter.place.storage is not None:
            groups.setdefault(parameter.tensor.dtype, []).append(parameter)
    for dtype, group in groups.items():
        block = _host_empty(sum(p.tensor.numel() for p in group if _dense(p.tensor)), dtype)
        start = 0
        for parameter in group:
            tensor = parameter.tensor.detach()
            if _dense(tensor):
                parameter.copy = block.as_strided(tensor.shape, tensor.stride(), start).copy_(tensor)
                start += tensor.numel()
            else:
                parameter.copy = tensor.to(_HOST, copy=True)


def _host_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of host memory. Through numpy where it can: numpy asks Linux for huge
    pages for a large block, which a copy fills several times faster than fresh small pages."""
    try:
        import numpy

        size = torch.empty(0, dtype=dtype).element_size()
        return torch.from_numpy(numpy.empty(n, "int{}".format(8 * size))).view(dtype)
    except (ImportError, TypeError, RuntimeError):
        return torch.empty(n, dtype=dtype)


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
    """Whether ``tensor`` holds the bits of its host ``copy``, compared a chunk at a time where
    its data lies, so that no copy of a parameter ever fills an accelerator's memory."""
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
    """A dense tensor's elements as they lie in its storage, one dimension."""
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


class ModelState:
    """The state of ``model`` when built (see the module docstring); ``names`` maps each module
    to the name that error messages and reports use."""

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
        #: Batches checked by :meth:`check_parameters`; whether the parameters' copy is kept for
        #: the whole pass (the first batch wrote a parameter).
        self.checked = 0
        self.keep_copies = False

    def saved_buffers(self, module: nn.Module) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(key, tensor, value before)`` for each buffer ``module`` held when the state was kept."""
        table = self._buffer_tables[id(module)]
        return [(key, t, self.buffers[id(t)].value) for key, t in table.items() if t is not None]

    def freeze_observers(self) -> None:
        """Stop every fake-quantize module from learning ranges (see :data:`OBSERVER_SWITCHES`):
        the forwards quantize with the ranges the model has, as it will after the pass."""
        for module, _, _, tables in self.modules:
            for key in OBSERVER_SWITCHES:
                switch = tables[1].get(key)
                if switch is not None:
                    switch.zero_()
                    self.buffers[id(switch)].expected = switch.detach().clone()

    def written_parameters(self) -> List[str]:
        """The names of the parameters the forwards wrote in place (see :meth:`_Parameter.written`)."""
        return [p.name for p in self.parameters.values() if p.written()]

    def check_parameters(self) -> None:
        """After each batch. After the first: release the parameters' copy if it wrote none, else
        keep all of it for the whole pass, so that :meth:`restore` puts back every parameter
        written on any batch. Once the copy is released, raise
        :class:`~precise_bn.ParameterChangedError` naming every parameter written in place since
        (its ``_version`` counter moved): nothing can put it back."""
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
        """``(module name, key)`` of each buffer kept that the forwards replaced, removed or changed
        (its data moved, or its bits differ from what the pass holds it at), each tensor once,
        under the first module holding it; the tensors whose ``id`` is in ``skip`` left out."""
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
