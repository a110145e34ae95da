"""Everything the forwards of a pass may change in a PyTorch model, kept before it and put back.

Training-mode forwards can change more than the BN statistics (observers, spectral norm,
counters, new buffers or attributes). :class:`ModelState` keeps, per module, its class,
attributes and tables of parameters, buffers and submodules; per buffer, where its data lives
and a copy of its value; per parameter, only its ``_version`` counter: a parameter written in
place is refused (:meth:`ModelState.check_parameters`) rather than copied, which would double a
pass's memory. :meth:`ModelState.restore` puts every object back, points a buffer whose data
moved back at its own storage before anything is written, then writes only the buffers whose
bits differ. What is put back, and why: ``docs/interrupts.md``.
"""
from __future__ import annotations

from typing import Any, Collection, Dict, Iterable, List, Sequence, Tuple

import torch
from torch import nn

from ..errors import ParameterChangedError
from ..snapshot import Place, same_bits

_TABLES = ("_parameters", "_buffers", "_modules")
_MISSING = object()

#: Buffers that switch a fake-quantize module's range learning on (``observer_enabled`` of
#: ``torch.ao.quantization`` fake-quantize modules, ``static_enabled`` of the learnable one).
OBSERVER_SWITCHES = ("observer_enabled", "static_enabled")


class _Buffer:
    """One buffer tensor (however many modules hold it): where its data lives, a copy of its value."""

    def __init__(self, tensor: torch.Tensor):
        self.place = Place(tensor)
        self.value = tensor.detach().clone()

    def changed(self) -> bool:
        return self.place.moved() or not same_bits(self.place.tensor, self.value)

    def restore(self) -> None:
        self.place.put(self.value)


class ModelState:
    """The state of ``model`` when built (see the module docstring); ``names`` maps each module
    to the name that error messages and reports use."""

    def __init__(self, model: nn.Module, names: Dict[int, str]):
        self.names = names
        self.modules = [(m, type(m), dict(m.__dict__), [dict(m.__dict__[t]) for t in _TABLES])
                        for m in model.modules()]
        self._buffer_tables = {id(m): tables[1] for m, _, _, tables in self.modules}
        self.buffers: Dict[int, _Buffer] = {}
        self.parameters: Dict[int, Tuple[str, torch.Tensor, int]] = {}
        for module in model.modules():
            for key, tensor in module._buffers.items():
                if tensor is not None and id(tensor) not in self.buffers:
                    self.buffers[id(tensor)] = _Buffer(tensor)
            for key, tensor in module._parameters.items():
                if tensor is not None and id(tensor) not in self.parameters:
                    self.parameters[id(tensor)] = (self._name(module, key), tensor, tensor._version)

    def _name(self, module: nn.Module, key: str) -> str:
        prefix = self.names.get(id(module), "")
        return prefix + "." + key if prefix else key

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

    def check_parameters(self) -> None:
        """Raise :class:`~precise_bn.ParameterChangedError` naming every parameter written in
        place since the state was kept (its ``_version`` counter moved)."""
        changed = [name for name, tensor, version in self.parameters.values() if tensor._version != version]
        if changed:
            raise ParameterChangedError(
                "the model's forward changed parameter(s) in place during the pass: {}. precise-bn keeps no "
                "copy of the parameters, so it stops here, before writing any statistics; every buffer and "
                "attribute was put back, but these parameters hold what the forward wrote (even if it wrote "
                "the same values). A statistics pass should not change weights: move that change out of "
                "forward (into the training step), or skip it when torch.is_grad_enabled() is False".format(
                    ", ".join(changed)))

    def changed_buffers(self, keys: Collection[str], skip: Iterable[nn.Module] = ()) -> List[Tuple[str, str]]:
        """``(module name, key)`` of each buffer named one of ``keys`` that was replaced, removed or
        changed since the state was kept, in the modules not in ``skip``."""
        skipped = {id(m) for m in skip}
        return [(self.names.get(id(module), ""), key)
                for module, _, _, tables in self.modules if id(module) not in skipped
                for key, tensor in tables[1].items() if tensor is not None and key in keys
                if module._buffers.get(key) is not tensor or self.buffers[id(tensor)].changed()]

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


def _put_back(table: Dict[str, Any], saved: Dict[str, Any]) -> None:
    """Make ``table`` hold exactly ``saved``'s keys, bound to the same objects."""
    for key in [k for k in table if k not in saved]:
        del table[key]
    for key, value in saved.items():
        if table.get(key, _MISSING) is not value:
            table[key] = value


def module_names(named: Sequence[Tuple[str, nn.Module]]) -> Dict[int, str]:
    """``id(module) -> name`` from ``(name, module)`` pairs, the first name of a module kept."""
    names: Dict[int, str] = {}
    for name, module in named:
        names.setdefault(id(module), name)
    return names
