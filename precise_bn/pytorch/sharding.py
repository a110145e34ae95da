"""Sharded models (FSDP1, FSDP2 ``fully_shard``): the full parameters gathered once for a pass.

A rank whose data ended would stop issuing FSDP's per-forward all-gathers while the others
still wait for them; so every unit's full parameters are gathered once, before the first batch
(every rank at the same point, in the same module order), and the forwards run with no
collective. :meth:`FullParameters.restore` undoes whatever :meth:`FullParameters.gather` did,
in reverse, and may be called again; the parameters' values are never changed. Why and how, per
FSDP version: ``docs/distributed.md`` ("FSDP").
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, List

from torch import nn

from ..signals import critical


def _fsdp(name: str) -> Any:
    """torch's FSDP class ``name``, or None where this torch lacks it. Imported with signals
    deferred: a Ctrl-C inside torch's first import of FSDP leaves sympy half-imported for good."""
    try:
        with critical():
            return getattr(importlib.import_module("torch.distributed.fsdp"), name)
    except (ImportError, AttributeError):  # a torch without FSDP, or before FSDP2
        return None


class FullParameters:
    """The full parameters of every FSDP unit of ``model`` while gathered (a no-op without FSDP)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._undo: List[Callable[[], None]] = []

    def gather(self) -> None:
        """All-gather every unit's parameters once (a collective: every rank calls it at the
        same point) and make the forwards local."""
        fsdp2 = _fsdp("FSDPModule")
        if fsdp2 is not None:
            for module in self.model.modules():
                if isinstance(module, fsdp2):
                    self._unshard2(module)
        fsdp1 = _fsdp("FullyShardedDataParallel")
        wrappers = [m for m in self.model.modules() if fsdp1 is not None and isinstance(m, fsdp1)]
        if wrappers:
            summon = fsdp1.summon_full_params(self.model, writeback=False, recurse=True)
            summon.__enter__()
            self._undo.append(lambda: summon.__exit__(None, None, None))
            for wrapper in wrappers:
                self._forward_inner(wrapper)

    def _unshard2(self, module: Any) -> None:
        state = module._get_fsdp_state()
        groups = [(group, group.post_forward_mesh_info, group.is_sharded) for group in state._fsdp_param_groups]
        auto = state._auto_reshard_after_forward

        def undo() -> None:
            state._auto_reshard_after_forward = auto
            for group, mesh_info, _ in groups:
                group.post_forward_mesh_info = mesh_info
            if any(sharded for _, _, sharded in groups):
                module.reshard()

        self._undo.append(undo)
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()

    def _forward_inner(self, wrapper: nn.Module) -> None:
        wrapper.__dict__["forward"] = wrapper._fsdp_wrapped_module.forward
        self._undo.append(lambda: wrapper.__dict__.pop("forward", None))

    def restore(self) -> None:
        """Put the sharding back as it was (idempotent); frees the gathered parameters."""
        while self._undo:
            self._undo[-1]()
            self._undo.pop()
