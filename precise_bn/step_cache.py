"""Recompute at a new training step; at the same step, write back what was computed then.

Why a per-step cache: the running stats a model is evaluated with must be the ones its
checkpoint carries, or the saved model scores differently from the validated one. The first
call at a step recomputes; any later call at the same step (evaluation, then checkpoint)
writes the very same values back without running a forward, even if something touched the
buffers in between. :class:`~precise_bn.BatchNormHelper` (either backend) and
:class:`~precise_bn.PreciseBNHook` both keep one.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Generic, Iterable, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import nn

from .api import recalibrate
from .data import CyclingBatches, smart_forward
from .options import ForwardFn, Options
from .report import BNReport
from .pytorch.layers import select_layers, unwrap_model
from .signals import write_last

C = TypeVar("C")
Store = Callable[[C, BNReport], None]
TorchCache = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


class StepCache(Generic[C]):
    """The values and report of the last recomputation, and the step they belong to."""

    def __init__(self) -> None:
        self.step: Any = None
        self.value: Optional[C] = None
        self.report: Optional[BNReport] = None
        self.runs = 0

    def at(self, step: Any, compute: Callable[[Store], BNReport], apply: Callable[[C], None]) -> BNReport:
        """``apply`` the cached values when ``step`` is the cached one (``None`` never is);
        else ``compute(store)``, which must call ``store(values, report)`` once it has written.

        ``apply`` writes last (it returns None, so the report is read in the same expression:
        no statement runs after the write). A ``compute`` that raises after it stored (a
        signal as its write ended: the write is undone) leaves the cache as it was, so the
        next call at this step recomputes rather than writing back stats the model never kept.
        """
        if step is not None and self.value is not None and step == self.step and self.report is not None:
            return apply(self.value) or self.report
        kept = self.step, self.value, self.report, self.runs
        try:
            return compute(lambda value, report: self._store(step, value, report))
        except BaseException:
            self.step, self.value, self.report, self.runs = kept
            raise

    def _store(self, step: Any, value: C, report: BNReport) -> None:
        self.step, self.value, self.report = step, value, report
        self.runs += 1


class TorchJob:
    """One or more models recalibrated together on an endless source of batches.

    With ``extra_models`` (an EMA or SWA copy), each batch runs through ``model`` and then
    every extra model in the same pass, so no batch is stored; the layer names then carry the
    prefix ``"model."`` or ``"extra_<i>."``. Extra models use their BN layers in training
    mode, or all of them when the copy is in eval mode (as EMA copies usually are). The layers
    are chosen at the first recomputation.
    """

    def __init__(self, model: nn.Module, data: Iterable[Any], opts: Options, extra_models: Sequence[nn.Module] = (),
                 default_forward: ForwardFn = smart_forward):
        self.batches = CyclingBatches(data)
        self.opts = opts
        self.default_forward = default_forward
        self.members = [unwrap_model(model), *(unwrap_model(m) for m in extra_models)]
        self.net: nn.Module = self.members[0]
        if extra_models:
            self.net = nn.ModuleDict({"model": self.members[0]})
            self.net.update({"extra_{}".format(i): m for i, m in enumerate(self.members[1:])})
        self._prepared = False

    def layer_names(self) -> List[str]:
        """The qualified names of the layers recomputed (chosen now if not yet)."""
        if not self._prepared:
            self._prepare()
        return list(self.opts.layers or [])

    def _prepare(self) -> None:
        names = []
        for prefix, module in ([("", self.net)] if len(self.members) == 1 else list(self.net.named_children())):
            spec = self.opts.layers if prefix in ("", "model") else None
            names += [(prefix + "." if prefix else "") + name for name, _ in select_layers(module, spec)]
        changes: Dict[str, Any] = {"layers": names}
        if len(self.members) > 1:
            forward, members = self.opts.forward_fn or self.default_forward, self.members
            changes["forward_fn"] = lambda _net, batch: [forward(m, batch) for m in members]
        self.opts = self.opts.replace(**changes)
        self._prepared = True

    def run(self, store: Store[TorchCache]) -> BNReport:
        """Recompute; the written stats are stored (cloned) in the same critical section."""

        def on_write(report: BNReport) -> None:
            modules = dict(self.net.named_modules())
            store({layer.name: (modules[layer.name].running_mean.detach().clone(),
                                modules[layer.name].running_var.detach().clone())
                   for layer in report.layers if layer.ran}, report)

        if not self._prepared:
            self._prepare()
        return recalibrate(self.net, self.batches, self.opts, self.default_forward, on_write=on_write)

    def apply(self, cache: TorchCache) -> None:
        """Write cached stats back as one step that an interrupt cannot split or leave behind
        (:func:`~precise_bn.signals.write_last`, which also installs the signal relays)."""
        modules = dict(self.net.named_modules())
        targets = [(modules[name], mean, var) for name, (mean, var) in cache.items()]
        saved = [(m.running_mean.clone(), m.running_var.clone()) for m, _, _ in targets]

        def copy(values: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
            with torch.no_grad():
                for (module, _, _), (mean, var) in zip(targets, values):
                    module.running_mean.copy_(mean)
                    module.running_var.copy_(var)

        return write_last(lambda: copy([(mean, var) for _, mean, var in targets]), lambda: copy(saved))
