"""Precise BN inside a training loop: recompute before evaluation and before each checkpoint.

    hook = PreciseBNHook(model, train_loader, num_iters=200, extra_models=[ema_model])
    for step in range(1, max_steps + 1):
        train_one_step()
        if step % eval_every == 0:
            hook.before_eval(step)
            evaluate(model)
        if step % save_every == 0:
            hook.before_checkpoint(step)
            save(model)

Why a per-step cache: the running stats a model is evaluated with must be the ones its
checkpoint carries, or the saved model scores differently from the validated one. The first
call at a step recomputes; any later call at the same step (evaluation, then checkpoint)
writes the very same tensors back without running a forward, even if something touched the
buffers in between.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from torch import nn

from .data import ForwardFn, check_budget, default_forward
from .errors import ConfigError
from .helper import Cache, TorchAuxModel
from .report import BNReport
from .torch_backend import LayerSpec, select_layers, unwrap_model

logger = logging.getLogger("precise_bn")


def _check_period(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError("{} must be a positive integer, got {!r}".format(name, value))


class PreciseBNHook:
    """Framework-neutral pre-evaluation and checkpoint-time recalibration for a training loop.

    Args:
        model: the model whose BN layers are recomputed (a DDP wrapper is unwrapped).
        data: an iterable of batches: a DataLoader, a list, any re-iterable source. The hook
            keeps one iterator across calls, so successive recomputations see fresh batches,
            and starts a new pass when one runs out, so a call never gets fewer batches than
            asked. (A kept DataLoader iterator keeps its worker processes between calls.)
        num_iters: batches per recomputation (None: limited by ``num_samples`` only).
        num_samples: stop each recomputation once this many samples were seen.
        eval_period / checkpoint_period: :meth:`before_eval` / :meth:`before_checkpoint` act
            only when ``step % period == 0``, so a loop may call them every step.
        extra_models: more models recomputed on the same batches, e.g. an EMA or SWA copy of
            the weights. Each batch runs through the model and then through every extra model
            in the same pass, so no batch is stored: memory stays at one batch.
        forward_fn: ``forward_fn(model, batch)`` for each model (see
            :func:`precise_bn.data.default_forward` for the default convention).
        layers: which layers of ``model`` (see :func:`precise_bn.select_layers`). Extra models
            use their BN layers in training mode, or all of them when the copy is in eval mode
            (as EMA copies usually are). The choice is made at the first recomputation.
        log_period: log the time per iteration every this many batches.
        **options: passed to :func:`precise_bn.update_bn_stats` (``device``, ``autocast``,
            ``exact``, ``sync``, ``group``, ``unbiased``, ``progress``). With an initialised
            process group the stats are merged across ranks: every rank must call the hook at
            the same steps.

    A model without any BN layer to recompute turns the hook off, with one log line.
    """

    def __init__(
        self,
        model: nn.Module,
        data: Iterable[Any],
        num_iters: Optional[int] = 200,
        *,
        num_samples: Optional[int] = None,
        eval_period: int = 1,
        checkpoint_period: int = 1,
        extra_models: Sequence[nn.Module] = (),
        forward_fn: Optional[ForwardFn] = None,
        layers: LayerSpec = None,
        log_period: int = 20,
        **options: Any,
    ):
        check_budget(num_iters, num_samples)
        _check_period("eval_period", eval_period)
        _check_period("checkpoint_period", checkpoint_period)
        if num_iters is None and num_samples is None:
            raise ConfigError("num_iters and num_samples are both None: the hook would never stop")
        self.model = model
        self.data = data
        self.num_iters = num_iters
        self.eval_period = eval_period
        self.checkpoint_period = checkpoint_period
        self.extra_models = list(extra_models)
        self.forward_fn = forward_fn or default_forward
        self.layers = layers
        self.options = dict(options, num_samples=num_samples, log_period=log_period)
        self.enabled = True
        self.recomputations = 0
        self.last_report: Optional[BNReport] = None
        self.cached_step: Optional[int] = None
        self._cache: Optional[Cache] = None
        self._aux: Optional[TorchAuxModel] = None

    @property
    def cached_stats(self) -> Optional[Cache]:
        """``{layer name: (running_mean, running_var)}`` of the last recomputation, or None.

        Names are those of ``model``; with extra models they carry the prefix ``"model."`` or
        ``"extra_<i>."``.
        """
        return self._cache

    def before_eval(self, step: int) -> Optional[BNReport]:
        """Make ``model``'s BN stats precise for an evaluation at ``step``.

        Returns the report of the recomputation these stats come from, or None when the hook
        did nothing (``step`` not a multiple of ``eval_period``, or the hook is off).
        """
        return self._at(step, self.eval_period)

    def before_checkpoint(self, step: int) -> Optional[BNReport]:
        """Make ``model``'s BN stats precise for a checkpoint written at ``step``.

        Same as :meth:`before_eval`, with ``checkpoint_period``; after an evaluation at the
        same step it only writes the cached stats back.
        """
        return self._at(step, self.checkpoint_period)

    def _at(self, step: int, period: int) -> Optional[BNReport]:
        if not self.enabled or step % period != 0:
            return None
        if self._cache is not None and step == self.cached_step:
            assert self._aux is not None
            self._aux.apply(self._cache)
            return self.last_report
        aux = self._aux or self._prepare()
        if aux is None:
            return None
        self._cache, self.last_report = aux.compute(self.num_iters)
        self.cached_step = step
        self.recomputations += 1
        return self.last_report

    def _prepare(self) -> Optional[TorchAuxModel]:
        """Choose the layers and build the aux pass; turn the hook off if there is no layer."""
        members: List[Tuple[str, nn.Module, LayerSpec]] = [("", unwrap_model(self.model), self.layers)]
        if self.extra_models:
            members = [("model.", members[0][1], self.layers)] + [
                ("extra_{}.".format(i), unwrap_model(m), None) for i, m in enumerate(self.extra_models)
            ]
        names = [prefix + name for prefix, module, spec in members for name, _ in select_layers(module, spec)]
        if not names:
            logger.warning(
                "precise-bn: %s has no BatchNorm layer to recompute (none tracks running stats in "
                "training mode); the hook is off",
                type(self.model).__name__,
            )
            self.enabled = False
            return None
        modules = [module for _, module, _ in members]
        net: nn.Module = modules[0]
        if self.extra_models:
            net = nn.ModuleDict({prefix[:-1]: module for prefix, module, _ in members})
        forward = self.forward_fn

        def forward_all(_net: nn.Module, batch: Any) -> None:
            for module in modules:
                forward(module, batch)

        self._aux = TorchAuxModel(net, self.data, forward_fn=forward_all, layers=names, **self.options)
        return self._aux

