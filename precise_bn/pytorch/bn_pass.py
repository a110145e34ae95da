"""One forward-only measurement pass over a PyTorch model: the ``driver.Backend`` of PyTorch models.
It changes the chosen layers' statistics and nothing else, and if its call raises the model is
bit-identical to before: docs/ARCHITECTURE.md ("One call, start to end"), docs/interrupts.md.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..buffers import Stats, round_to
from ..data import count_samples, describe, move_to_device, recognised, smart_forward
from ..errors import BatchError
from ..estimator import PopulationStats
from .. import compiled, package_cache
from ..options import ForwardFn, Options
from ..report import BNReport
from ..signals import checkpoint, critical, write
from ..snapshot import Snapshot
from .capture import CallCapture, flush, merge_due
from .claims import claim, release
from .layers import RUNNING, NamedLayer, named_modules, no_layer_message, select_layers, unwrap_model, warn_if_split_bn
from .model_state import ModelState, module_names, qualified
from .sharding import FullParameters

_BN_STATISTICS = RUNNING + ("num_batches_tracked",)


class BNPass:
    """One pass over ``model`` with ``opts``: what the driver runs (:class:`precise_bn.driver.Backend`).

    ``forward`` hands a batch to the model when ``opts.forward_fn`` is None; ``budget_name`` is
    what the caller calls the batch budget (in the warning of a short pass); ``explain_batches``
    turns a batch the model refuses into a :class:`~precise_bn.BatchError` (default: when the
    batch goes through :func:`~precise_bn.data.smart_forward`; a caller that wraps the default
    forward in its own says so). The layers are chosen by :meth:`choose`, which the driver calls
    where a failure reaches every rank. ``with bn_pass:`` measures inside the block.
    """

    kind = "float64"
    label = "precise-bn"
    #: What else the forwards changed or wrote in place (put back), known once :meth:`running` is left.
    changed_buffers: Sequence[str] = ()
    changed_parameters: Sequence[str] = ()

    def __init__(self, model: nn.Module, opts: Options, forward: ForwardFn = smart_forward, *,
                 budget_name: str = "num_batches", explain_batches: Optional[bool] = None):
        self.model = model
        self.opts = opts
        self.forward = opts.forward_fn or forward
        self.budget_name = budget_name
        self.explain_batches = (opts.forward_fn is None and forward is smart_forward
                                if explain_batches is None else explain_batches)
        self.layers: List[NamedLayer] = []
        self.names: List[str] = []
        self.eps: List[float] = []
        self.dtypes: List[torch.dtype] = []
        self.captures: List[CallCapture] = []
        self.planned: Optional[int] = None
        self._batches = 0
        self._attached: List[Tuple[CallCapture, nn.Module]] = []
        self.sharding: Optional[FullParameters] = None
        self.state: Optional[ModelState] = None
        #: Modules whose statistics a functional ``batch_norm`` changed (put back, not recomputed).
        self.not_recomputed: List[str] = []
        #: What :meth:`write` wrote, for ``report.undo()`` and the end of a ``recalibrated`` block.
        self.written: Optional[Snapshot] = None

    def choose(self) -> None:
        """Choose the layers (``opts.layers``), looking through DDP and ``torch.compile``."""
        self.model = unwrap_model(self.model)
        self.layers = select_layers(self.model, self.opts.layers)
        self.names = [name for name, _ in self.layers]
        self.eps = [float(m.eps) for _, m in self.layers]
        self.dtypes = [m.running_var.dtype for _, m in self.layers]
        self.captures = [CallCapture(PopulationStats(m.num_features, name=n, device=m.running_mean.device))
                         for n, m in self.layers]
        self.sharding = FullParameters(self.model)

    @property
    def empty_reason(self) -> str:
        return no_layer_message(self.model)

    def attach(self) -> None:
        """Claim the model's modules, keep its state and attach the captures (one critical
        section), then gather FSDP's full parameters; on failure, everything is put back."""
        assert self.sharding is not None
        warn_if_split_bn(self.model, self.layers)
        names = module_names(named_modules(self.model))
        try:
            with critical(), torch.no_grad():
                claim(self, self.model, names)  # before the state: another pass's would be kept
                self.state = ModelState(self.model, names)
                self.state.freeze_observers()  # the forwards quantize as the model will afterwards
                for capture, (_, module) in zip(self.captures, self.layers):
                    self._attached.append((capture, module))
                    capture.attach(module)
            self.sharding.gather()  # a collective, so outside the section: a signal can still stop a wait
        except BaseException:
            self.restore()
            raise

    def __enter__(self) -> "BNPass":
        if self.sharding is None:
            self.choose()
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """No autograd, and ``torch.autocast`` when asked; once left, what else the forwards
        changed is named. A generator: nothing switches before the caller's ``with`` enters it,
        and a block left without its ``__exit__`` switches back when the generator is collected."""
        autocast: ContextManager[Any] = contextlib.nullcontext()
        if self.opts.autocast:
            tensor = next(iter(self.model.parameters()), None)
            if tensor is None:
                tensor = next(iter(self.model.buffers()))
            kwargs = {} if self.opts.autocast is True else {"dtype": self.opts.autocast}
            autocast = torch.autocast(device_type=tensor.device.type, **kwargs)
        with torch.no_grad(), autocast:
            yield
        assert self.state is not None
        changed = self.state.changed_buffers(skip=self._bn_statistics())
        self.not_recomputed = self._functional_bn(changed)
        self.changed_buffers = [qualified(name, key) for name, key in changed if key not in RUNNING]
        self.changed_parameters = self.state.written_parameters()

    def _bn_statistics(self) -> Set[int]:
        """Every BN layer's own statistics, which no report names (measured, or theirs to change)."""
        assert self.state is not None
        return {id(tensor) for module, _, _, _ in self.state.modules if isinstance(module, _BatchNorm)
                for key, tensor, _ in self.state.saved_buffers(module) if key in _BN_STATISTICS}

    @staticmethod
    def _functional_bn(changed: Sequence[Tuple[str, str]]) -> List[str]:
        """The modules among ``changed`` whose running statistics a functional batch_norm wrote."""
        names: List[str] = []
        for name, key in changed:
            if key in RUNNING and name not in names:
                names.append(name)
        return names

    def step(self, batch: Any) -> int:
        """Run one batch; an unrecognised batch the model refuses becomes a BatchError."""
        checkpoint()
        try:
            self.forward(self.model, move_to_device(batch, self.opts.device))
        except Exception as exc:
            if self.explain_batches and not recognised(batch):
                raise BatchError(
                    "the model could not take a batch it was given whole ({}: {}); the batch is {}. "
                    "Batches are handed over as: a tensor -> model(batch); (input, target, ...) -> "
                    "model(batch[0]); {{'input': x, ...}} -> model(x); anything else -> model(batch). "
                    "Say which part is the input with forward_fn=lambda model, batch: model(batch[KEY]) "
                    "(command line: --input-key KEY or --forward-fn package.module:callable)".format(
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", describe(batch))
                ) from exc
            raise
        assert self.state is not None
        self.state.check_parameters()
        self._batches += 1
        merge_due(self.captures)
        if self._batches == 1 and self.planned is not None:
            compiled.KERNELS.expect(sum(c.elements for c in self.captures) * (self.planned - 1))
        return count_samples(batch)

    def plan(self, batches: Optional[int]) -> None:
        """About ``batches`` batches to come (None: unknown): whether compiling the sums pays.
        The compile variables are checked here, before the first batch."""
        package_cache.check_environment()
        self.planned = batches

    def prepare(self, batches: Optional[int]) -> List[Stats]:
        """:meth:`plan`, :meth:`attach`, then :meth:`old_stats`: the driver's one call before the batches."""
        self.plan(batches)
        self.attach()
        return self.old_stats()

    def collect(self) -> List[PopulationStats]:
        """Every layer's stats, with the calls still pending in the capture blocks merged."""
        return flush(self.captures)

    def old_stats(self) -> List[Stats]:
        """Each layer's running stats before the pass, float64 on the CPU, from the kept copies."""
        assert self.state is not None
        kept = [{key: value for key, _, value in self.state.saved_buffers(m)} for _, m in self.layers]
        return [(k["running_mean"].double().cpu(), k["running_var"].double().cpu()) for k in kept]

    def _detach(self) -> None:
        while self._attached:
            capture, module = self._attached[-1]
            capture.detach(module)
            self._attached.pop()
        if self.sharding is not None:
            self.sharding.restore()

    def restore(self) -> None:
        """Put the model back exactly as it was (idempotent), then let other passes claim it."""
        with critical(), torch.no_grad():
            self._detach()
            if self.state is not None:
                self.state.restore()
            release(self)

    def write(self, results: Sequence[Optional[Stats]], report: BNReport) -> None:
        """Put the model back and write ``results`` (float64 ``(mean, var)`` per layer, None to
        keep a layer's) in place, rounded to nearest in the buffers' dtype, as one
        :func:`~precise_bn.signals.write` (undone if the call around it raises); then keep in
        ``report`` what was written, for ``report.undo()``."""
        state = self.state
        assert state is not None

        def change() -> None:
            with torch.no_grad():
                self._detach()
                state.restore()
                for (_, module), result in zip(self.layers, results):
                    if result is not None:
                        module.running_mean.copy_(round_to(result[0], module.running_mean.dtype))
                        module.running_var.copy_(round_to(result[1], module.running_var.dtype))
            release(self)  # once written: a claim taken before would keep the state from before

        write(change, self.restore)
        self.written = report.snapshot = Snapshot(
            [(name, module, key, buf, saved) for name, module in self.layers
             for key, buf, saved in state.saved_buffers(module)], self.opts.sync, self.opts.group, self.opts.timeout)

    def put_back(self) -> None:
        """Leaving a ``recalibrated`` block: the statistics from before the call back (idempotent)."""
        if self.written is not None:
            self.written.restore()
