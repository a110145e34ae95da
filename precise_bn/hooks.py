"""Precise BN inside a training loop: recompute before evaluation and before each checkpoint.

    hook = PreciseBNHook(model, train_loader, num_batches=200, extra_models=[ema_model])
    for step in range(1, max_steps + 1):
        train_one_step()
        if step % eval_every == 0:
            hook.before_eval(step)
            evaluate(model)
        if step % save_every == 0:
            hook.before_checkpoint(step)
            save(model)

An evaluation and a checkpoint at the same step get the very same statistics: the second call
writes back what the first computed, unless the weights changed in between (see
:mod:`precise_bn.step_cache`). A recomputation leaves the training run as it would have been
without it: every random generator it draws from is put back (see :mod:`precise_bn.torch_aux`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence

from torch import nn

from .errors import ConfigError
from .options import Options, positive_int
from .report import BNReport
from .signals import all_or_nothing
from .step_cache import StepCache
from .torch_aux import TorchAuxModel, TorchCache

logger = logging.getLogger("precise_bn")


OWN_ARGUMENTS = ("model", "data", "num_batches", "eval_period", "checkpoint_period", "extra_models", "forward_context")


class PreciseBNHook:
    """Framework-neutral pre-evaluation and checkpoint-time recalibration for a training loop.

    Args:
        model: the model whose BN layers are recomputed (a DDP wrapper is unwrapped).
        data: an iterable of batches: a DataLoader, a list, any re-iterable source. The hook
            keeps one iterator across calls, so successive recomputations see fresh batches,
            and starts a new pass when one runs out, so a call never gets fewer batches than
            asked. (A kept DataLoader iterator keeps its worker processes between calls.) It
            may be the training loop's own DataLoader: with persistent workers the hook reads
            a copy with its own iterator, so the loop's epoch is never cut short. A
            single-pass source (a generator) gets a warning: it cannot start a new pass.
        num_batches: batches per recomputation (None: limited by ``num_samples`` or ``rtol``).
        eval_period / checkpoint_period: :meth:`before_eval` / :meth:`before_checkpoint` act
            only when ``step % period == 0``, so a loop may call them every step.
        extra_models: more models recomputed on the same batches, e.g. an EMA or SWA copy of
            the weights (see :class:`~precise_bn.torch_aux.TorchAuxModel`).
        forward_context: a context entered around every forward of the pass, e.g. a
            framework's mixed-precision context.
        **options: every option of :func:`precise_bn.recompute` (``num_samples``, ``rtol``,
            ``forward_fn``, ``layers``, ``device``, ``exact``...), checked now: a misspelt one
            raises ``TypeError`` here, not at the first recomputation, and named ``layers``
            must be BN layers of ``model``. With an initialised
            process group the stats are merged across ranks: every rank must call the hook at
            the same steps.

    A model without any BN layer to recompute turns the hook off, with one log line.
    """

    def __init__(
        self,
        model: nn.Module,
        data: Iterable[Any],
        num_batches: Optional[int] = 200,
        *,
        eval_period: int = 1,
        checkpoint_period: int = 1,
        extra_models: Sequence[nn.Module] = (),
        forward_context: Optional[Callable[[], ContextManager[Any]]] = None,
        **options: Any,
    ):
        opts = Options.build("PreciseBNHook", num_batches=num_batches, also_known=OWN_ARGUMENTS, **options)
        positive_int("eval_period", eval_period, allow_none=False)
        positive_int("checkpoint_period", checkpoint_period, allow_none=False)
        if opts.num_batches is None and opts.num_samples is None and opts.rtol is None:
            raise ConfigError("num_batches, num_samples and rtol are all None: the hook would read its endless "
                              "batch source forever")
        self.model = model
        self.eval_period = eval_period
        self.checkpoint_period = checkpoint_period
        self.job = TorchAuxModel(model, data, opts, extra_models, forward_context)
        self.cache: StepCache[TorchCache] = StepCache()
        self.enabled = True

    @property
    def last_report(self) -> Optional[BNReport]:
        """The report of the recomputation the current stats come from."""
        return self.cache.report

    @property
    def recomputations(self) -> int:
        """How many times the stats were recomputed (calls that wrote cached stats back excluded)."""
        return self.cache.recomputations

    @property
    def cached_stats(self) -> Optional[TorchCache]:
        """``{layer name: (running_mean, running_var)}`` of the last recomputation, or None.

        Names are those of ``model``; with extra models they carry the prefix ``"model."`` or
        ``"extra_<i>."``.
        """
        return self.cache.value

    @all_or_nothing
    def before_eval(self, step: int, loaded_from: Any = None) -> Optional[BNReport]:
        """Make ``model``'s BN stats precise for an evaluation at ``step``.

        ``loaded_from``: the checkpoint the weights were loaded from, if the loop knows it;
        stats computed for one are never written back for another.

        Returns the report of the recomputation these stats come from, or None when the hook
        did nothing (``step`` not a multiple of ``eval_period``, or the hook is off).
        """
        return self._at(step, self.eval_period, loaded_from)

    @all_or_nothing
    def before_checkpoint(self, step: int, loaded_from: Any = None) -> Optional[BNReport]:
        """Make ``model``'s BN stats precise for a checkpoint written at ``step``.

        Same as :meth:`before_eval`, with ``checkpoint_period``; after an evaluation at the
        same step, with the same weights, it only writes the cached stats back.
        """
        return self._at(step, self.checkpoint_period, loaded_from)

    def write_into(self, state: Dict[str, Any], prefix: str = "") -> List[str]:
        """Write the cached stats into ``state``, a state dict built before the hook ran (a
        checkpoint's, which may hold copies of the buffers), each value converted to its entry's
        dtype and device; returns the keys ``state`` lacks."""
        missing = []
        for name, (mean, var) in (self.cached_stats or {}).items():
            for suffix, value in ((".running_mean", mean), (".running_var", var)):
                key = prefix + name + suffix
                if key in state:
                    state[key] = value.to(state[key])
                else:
                    missing.append(key)
        return missing

    def _at(self, step: int, period: int, loaded_from: Any) -> Optional[BNReport]:
        if not self.enabled or step % period != 0:
            return None
        if self.cache.value is None and not self.job.layer_names():
            logger.warning("precise-bn: %s has no BatchNorm layer to recompute; the hook is off",
                           type(self.model).__name__)
            self.enabled = False
            return None
        return self.cache.at((step, loaded_from, self.job.state()), self.job.run, self.job.apply)
