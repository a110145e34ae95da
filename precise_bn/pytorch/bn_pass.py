"""One forward-only measurement pass over a PyTorch model: attach, measure, then restore or write.

The guarantee: a pass changes the chosen layers' ``running_mean`` and ``running_var`` and nothing
else, and if the call that owns it raises, whatever the exception and wherever it is raised, the
model is bit-identical to before (every buffer, attribute, class, momentum and train flag, kept by
:mod:`.model_state`, which says why a parameter the forward writes in place is refused rather
than copied). How:

* every change to the model (attaching the captures, restoring, writing) runs inside a
  :func:`~precise_bn.signals.critical` section, so a signal cannot split it;
* a failure anywhere else (a forward, the merge, the report, a warning turned into an error)
  leads to :meth:`BNPass.restore`, which is idempotent;
* :meth:`BNPass.finish` writes with :func:`~precise_bn.signals.write`: if anything is raised
  before the outermost all-or-nothing call returns (a signal deferred from the write on
  included), the old statistics are put back before the exception leaves.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..data import count_samples, describe, move_to_device, recognised
from ..errors import BatchError
from ..estimator import PopulationStats
from ..options import ForwardFn
from ..buffers import round_to
from ..moments import KERNELS
from ..signals import checkpoint, critical, write
from ..snapshot import Snapshot
from .capture import CallCapture, flush
from .layers import NamedLayer, named_modules, no_layer_message
from .model_state import ModelState, module_names
from .sharding import FullParameters

Result = Optional[Tuple[torch.Tensor, torch.Tensor]]


class BNPass:
    """Measures ``layers`` of ``model`` while open (``with BNPass(...) as p:``).

    On enter it keeps the model's state (:class:`~precise_bn.pytorch.model_state.ModelState`)
    and attaches a :class:`~precise_bn.pytorch.capture.CallCapture` to each chosen layer; leaving
    the block restores everything, however it is left. :meth:`finish`, called after the block,
    writes.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[NamedLayer],
        forward: ForwardFn,
        *,
        device: Optional[torch.device] = None,
        autocast: Union[None, bool, torch.dtype] = None,
        explain_batches: bool = False,
    ):
        self.model = model
        self.layers = list(layers)
        self.forward = forward
        self.device = device
        self.autocast = autocast
        self.explain_batches = explain_batches
        self.estimator = "float64"
        self.names = [name for name, _ in self.layers]
        self.eps = [float(m.eps) for _, m in self.layers]
        self.dtypes = [m.running_var.dtype for _, m in self.layers]
        self.captures = [CallCapture(PopulationStats(m.num_features, name=n, device=m.running_mean.device))
                         for n, m in self.layers]
        self.planned: Optional[int] = None
        self._batches = 0
        self._attached: List[Tuple[CallCapture, nn.Module]] = []
        self.sharding = FullParameters(model)
        self.state: Optional[ModelState] = None
        #: Modules whose running statistics a functional ``batch_norm`` changed during the pass
        #: (put back, not recomputed); known once :meth:`running` is left.
        self.not_recomputed: List[str] = []
        self._finished = False

    @property
    def empty_reason(self) -> str:
        return no_layer_message(self.model)

    def attached(self) -> "BNPass":
        """``with bn_pass.attached():`` measures inside the block (the object is its own context)."""
        return self

    def __enter__(self) -> "BNPass":
        # ``return`` inside the ``try``: a signal handled after the section but before
        # ``__enter__`` returns would otherwise leave the captures on, with no ``__exit__`` to
        # come (the ``with`` statement calls it only once ``__enter__`` has returned).
        try:
            with critical(), torch.no_grad():
                self.state = ModelState(self.model, module_names(named_modules(self.model)))
                self.state.freeze_observers()  # the forwards quantize as the model will afterwards
                for capture, (_, module) in zip(self.captures, self.layers):
                    self._attached.append((capture, module))
                    capture.attach(module)
            self.sharding.gather()  # a collective, so outside the section: a signal can still stop a wait
            return self
        except BaseException:
            self.restore()
            raise

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """No autograd, and ``torch.autocast`` on the model's device when asked; left once the
        batches are over, it finds the functional ``batch_norm`` calls (:attr:`not_recomputed`).

        A generator, so that nothing is switched before the caller's ``with`` enters it, and
        a block left without its ``__exit__`` (a signal handled just before it) still switches
        back when the generator is collected, instead of leaving autograd off for the process.
        """
        autocast: ContextManager[Any] = contextlib.nullcontext()
        if self.autocast:
            tensor = next(iter(self.model.parameters()), None)
            if tensor is None:
                tensor = next(iter(self.model.buffers()))
            kwargs = {} if self.autocast is True else {"dtype": self.autocast}
            autocast = torch.autocast(device_type=tensor.device.type, **kwargs)
        with torch.no_grad(), autocast:
            yield
        self.not_recomputed = self._functional_bn()

    def _functional_bn(self) -> List[str]:
        """Modules other than BN layers whose ``running_mean`` or ``running_var`` the forwards
        changed: a functional ``batch_norm`` call on their buffers, which the captures do not see."""
        assert self.state is not None
        bn = [m for m in self.model.modules() if isinstance(m, _BatchNorm)]
        names: List[str] = []
        for name, _ in self.state.changed_buffers(("running_mean", "running_var"), skip=bn):
            if name not in names:
                names.append(name)
        return names

    def step(self, batch: Any) -> int:
        """Run one batch; an unrecognised batch that the model refuses becomes a BatchError.
        First, a signal's exception that a finaliser swallowed is raised (a signals checkpoint)."""
        checkpoint()
        try:
            self.forward(self.model, move_to_device(batch, self.device))
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
        if self._batches == 1 and self.planned is not None:
            KERNELS.expect(sum(c.elements for c in self.captures) * self.planned)
        return count_samples(batch)

    def plan(self, batches: Optional[int]) -> None:
        """The pass expects about ``batches`` batches (None: unknown): with the first batch's
        size, that says whether compiling the float64 sums pays (:meth:`~precise_bn.moments.Kernels.expect`)."""
        self.planned = batches

    def collect(self) -> List[PopulationStats]:
        """Every layer's stats, with the calls still pending in the capture blocks merged."""
        return flush(self.captures)

    def old_stats(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's running stats before the pass, float64 on the CPU."""
        return [(m.running_mean.double().cpu(), m.running_var.double().cpu()) for _, m in self.layers]

    def restore(self) -> None:
        """Put the model back exactly as it was (idempotent)."""
        with critical(), torch.no_grad():
            while self._attached:
                capture, module = self._attached[-1]
                capture.detach(module)
                self._attached.pop()
            self.sharding.restore()
            if self.state is not None:
                self.state.restore()

    def snapshot(self, sync: Optional[bool], group: Any, timeout: float) -> Snapshot:
        """The recomputed layers' buffers as before the call and as they are now: called right
        after the write, it keeps what :meth:`restore` would have put back, so the call can be
        undone later (``report.undo()``)."""
        assert self.state is not None
        return Snapshot([(name, module, key, buf, saved) for name, module in self.layers
                         for key, buf, saved in self.state.saved_buffers(module)], sync, group, timeout)

    def finish(self, results: Sequence[Result]) -> None:
        """Write ``results`` (float64 ``(mean, var)`` per layer, None to keep a layer's old stats)
        in place with ``copy_``, so references held elsewhere see them, each rounded to nearest
        in the buffer's dtype (:func:`~precise_bn.buffers.round_to`).

        A :func:`~precise_bn.signals.write`: if the all-or-nothing call around it raises, a
        signal's handler included, the old statistics are put back before the exception leaves.
        """

        def change() -> None:
            with torch.no_grad():
                self.restore()
                for (_, module), result in zip(self.layers, results):
                    if result is not None:
                        module.running_mean.copy_(round_to(result[0], module.running_mean.dtype))
                        module.running_var.copy_(round_to(result[1], module.running_var.dtype))
            self._finished = True

        def undo() -> None:
            with torch.no_grad():
                if self.state is not None:
                    self.state.restore()

        write(change, undo)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._finished:
            self.restore()
