"""One forward-only measurement pass over a PyTorch model: attach, measure, then restore or write.

The guarantee: if the call that owns the pass raises, whatever the exception and wherever it
is raised, the model is bit-identical to before (every buffer, class, momentum and train flag);
the new statistics are written after everything that can fail, and undone if the call still
raises. How:

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

from ..data import count_samples, describe, move_to_device, recognised
from ..errors import BatchError
from ..estimator import PopulationStats
from ..options import ForwardFn
from ..buffers import round_to
from ..moments import KERNELS
from ..signals import checkpoint, critical, write
from ..snapshot import Snapshot
from .capture import CallCapture, flush
from .layers import NamedLayer, no_layer_message
from .sharding import FullParameters

Result = Optional[Tuple[torch.Tensor, torch.Tensor]]


class BNPass:
    """Measures ``layers`` of ``model`` while open (``with BNPass(...) as p:``).

    On enter it snapshots every buffer of the model and attaches a
    :class:`~precise_bn.pytorch.capture.CallCapture` to each chosen layer; leaving the block
    restores everything, however it is left. :meth:`finish`, called after the block, writes.
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
        self._saved: List[Tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
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
                self._saved = [
                    (module, key, buf, buf.detach().clone())
                    for module in self.model.modules()
                    for key, buf in module._buffers.items()
                    if buf is not None
                ]
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
        """No autograd, and ``torch.autocast`` on the model's device when asked.

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
            self._restore_buffers()

    def snapshot(self, sync: Optional[bool], group: Any, timeout: float) -> Snapshot:
        """The recomputed layers' buffers as before the call and as they are now: called right
        after the write, it keeps what :meth:`restore` would have put back, so the call can be
        undone later (``report.undo()``)."""
        names = {id(module): name for name, module in self.layers}
        return Snapshot([(names[id(module)], module, key, buf, saved) for module, key, buf, saved in self._saved
                         if id(module) in names], sync, group, timeout)

    def _restore_buffers(self) -> None:
        # Some torch versions rebind a buffer (``num_batches_tracked = num_batches_tracked + 1``):
        # put the original tensor object back, so references held elsewhere stay valid.
        for module, key, buf, saved in self._saved:
            module._buffers[key] = buf
            buf.copy_(saved)

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
                self._restore_buffers()

        write(change, undo)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._finished:
            self.restore()
