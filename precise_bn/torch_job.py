"""What the training-loop integrations recompute on PyTorch: models recalibrated together on an
endless source of batches, the training run around them unchanged (:mod:`.rng`, :mod:`.reader`)."""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import rng
from .data import CyclingBatches, smart_forward
from .driver import recalibrate
from .options import Options
from .pytorch.bn_pass import BNPass
from .pytorch.layers import by_spec, select_layers, unwrap_model
from .report import BNReport
from .signals import all_or_nothing, write
from .step_cache import Store

TorchCache = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


def recalibrate_untouched(model: nn.Module, data: Iterable[Any], opts: Options,
                          explain_batches: Optional[bool] = None,
                          generators: Sequence[torch.Generator] = ()) -> BNReport:
    """A recalibration with the global random generators and ``generators`` put back as soon as it
    returns or raises: training draws what it would have drawn without it."""
    kept = rng.SavedRNG(generators)
    try:
        return recalibrate(BNPass(model, opts, explain_batches=explain_batches), data, opts)
    finally:
        kept.restore()


class TorchRecalibrator:
    """``model`` and ``extra_models`` (EMA, SWA copies: their layers in training mode, or all of
    them in eval mode) recalibrated in one pass, each batch through each model in turn, names
    prefixed ``model.`` / ``extra_<i>.``; ``forward_context`` wraps each forward."""

    def __init__(self, model: nn.Module, data: Iterable[Any], opts: Options, extra_models: Sequence[nn.Module] = (),
                 forward_context: Optional[Callable[[], ContextManager[Any]]] = None):
        self.batches = CyclingBatches(data)
        self.opts = opts
        self.members = [unwrap_model(model), *(unwrap_model(m) for m in extra_models)]
        if isinstance(opts.layers, (list, tuple)):
            by_spec(self.members[0], opts.layers)
        self.net: nn.Module = self.members[0]
        if extra_models:
            self.net = nn.ModuleDict({"model": self.members[0]})
            self.net.update({"extra_{}".format(i): m for i, m in enumerate(self.members[1:])})
        self.forward_context = forward_context
        self._prepared = False

    def state(self) -> Tuple[Any, ...]:
        """What the stats depend on besides the data: the modules and the weights (identities and
        version counters, which every in-place change bumps but a write through ``.data``, where
        the integrations call ``forget``). Not the buffers: the cache writes those back."""
        return tuple(id(m) for m in self.members), tuple(
            (id(p), p._version) for member in self.members for p in member.parameters())

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
        self.opts = self.opts.replace(layers=names)
        self._prepared = True

    def _forward(self) -> Callable[[nn.Module, Any], Any]:
        forward, context, members = self.opts.forward_fn or smart_forward, self.forward_context, self.members

        def one(module: nn.Module, batch: Any) -> Any:
            if context is None:
                return forward(module, batch)
            with context():
                return forward(module, batch)

        if len(members) == 1:
            return one
        return lambda _net, batch: [one(m, batch) for m in members]

    def run(self, store: Store[TorchCache], opts: Optional[Options] = None) -> BNReport:
        """Recompute (with ``opts``, default those given) and ``store`` clones of the stats written."""
        opts = opts or self.opts
        if not self._prepared:
            self._prepare()
        report = recalibrate_untouched(self.net, self.batches,
                                       opts.replace(forward_fn=self._forward(), layers=self.opts.layers),
                                       opts.forward_fn is None, rng.loader_generators(self.batches.data))
        modules = dict(self.net.named_modules())
        store({layer.name: (modules[layer.name].running_mean.detach().clone(),
                            modules[layer.name].running_var.detach().clone())
               for layer in report.layers if layer.ran}, report)
        return report

    @all_or_nothing
    def apply(self, cache: TorchCache) -> None:
        """Write cached stats back as one :func:`~precise_bn.signals.write`."""
        modules = dict(self.net.named_modules())
        targets = [(modules[name], mean, var) for name, (mean, var) in cache.items()]
        saved = [(m.running_mean.clone(), m.running_var.clone()) for m, _, _ in targets]

        def copy(values: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
            with torch.no_grad():
                for (module, _, _), (mean, var) in zip(targets, values):
                    module.running_mean.copy_(mean)
                    module.running_var.copy_(var)

        write(lambda: copy([(mean, var) for _, mean, var in targets]), lambda: copy(saved))
