"""Precise BN inside a training loop: recompute before evaluation and before each checkpoint.

    hook = PreciseBNHook(model, train_loader, num_batches=200, extra_models=[ema_model])
    hook.before_eval(step)        # then evaluate(model)
    hook.before_checkpoint(step)  # then save(model)

An evaluation and a checkpoint at the same step get the very same statistics: the second call
writes back what the first computed, unless the weights changed in between
(:mod:`precise_bn.step_cache`). The training run goes on as without it: every random generator
is put back (:mod:`precise_bn.torch_job`). Details: ``docs/integrations.md``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence

from torch import nn

from .distributed import get_world_size, resolve_sync
from .errors import ConfigError
from .options import Options, own_arguments, positive_int
from .pytorch.layers import no_layer_message, unwrap_model
from .report import BNReport
from .signals import all_or_nothing, write
from .step_cache import CachedRecomputations, StepCache
from .torch_job import TorchJob, TorchCache

LOGGER = logging.getLogger("precise_bn")


class PreciseBNHook(CachedRecomputations):
    """Framework-neutral pre-evaluation and checkpoint-time recalibration for a training loop.

    Args:
        model: the model whose BN layers are recomputed (a DDP wrapper is unwrapped).
        data: an iterable of batches: a DataLoader, a list, any re-iterable source. The hook
            keeps one iterator across calls, so successive recomputations see fresh batches,
            and starts a new pass when one runs out, so a call never gets fewer batches than
            asked. (A kept DataLoader iterator keeps its worker processes between calls.) It
            may be the training loop's own DataLoader: the hook reads it through a loader of
            its own (:mod:`precise_bn.reader`), so what the loop reads never changes. A
            single-pass source (a generator) gets a warning: it cannot start a new pass.
        num_batches: batches per recomputation, on each rank (None: limited by ``num_samples``
            or ``rtol``). ``num_samples`` (an option) counts the samples of all ranks together,
            as mmpretrain's does: each of N merging ranks reads ``ceil(num_samples / N)``.
        eval_period / checkpoint_period: :meth:`before_eval` / :meth:`before_checkpoint` act
            only when ``step % period == 0``, so a loop may call them every step.
        extra_models: more models recomputed on the same batches, e.g. an EMA or SWA copy of
            the weights (see :class:`~precise_bn.torch_job.TorchJob`).
        forward_context: a context entered around every forward of the pass, e.g. a
            framework's mixed-precision context.
        logger: where the hook says what it did (a line per call that acts: the report's
            summary, or that cached stats were written back; a warning when it turns itself
            off); None: nowhere.
        **options: every option of :func:`precise_bn.recompute` (``num_samples``, ``rtol``,
            ``forward_fn``, ``layers``, ``device``...), checked now: a misspelt one
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
        logger: Optional[logging.Logger] = LOGGER,
        **options: Any,
    ):
        opts = Options.build("PreciseBNHook", num_batches=num_batches,
                             also_known=own_arguments(PreciseBNHook.__init__), **options)
        positive_int("eval_period", eval_period, allow_none=False)
        positive_int("checkpoint_period", checkpoint_period, allow_none=False)
        if opts.num_batches is None and opts.num_samples is None and opts.rtol is None:
            raise ConfigError("num_batches, num_samples and rtol are all None: the hook would read its endless "
                              "batch source forever")
        self.model = model
        self.eval_period = eval_period
        self.checkpoint_period = checkpoint_period
        self.job = TorchJob(model, data, opts, extra_models, forward_context)
        self.cache: StepCache[TorchCache] = StepCache()
        self.enabled = True
        self.logger = logger
        self.lent: Optional[int] = None  # the extra model whose stats model's layers hold, see lend()

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
        return self._at(step, self.eval_period, loaded_from, "evaluation")

    @all_or_nothing
    def before_checkpoint(self, step: int, loaded_from: Any = None) -> Optional[BNReport]:
        """Make ``model``'s BN stats precise for a checkpoint written at ``step``.

        Same as :meth:`before_eval`, with ``checkpoint_period``; after an evaluation at the
        same step, with the same weights, it only writes the cached stats back.
        """
        return self._at(step, self.checkpoint_period, loaded_from, "checkpoint")

    def cached_for(self, step: int, loaded_from: Any = None) -> bool:
        """Whether a call at ``step`` now would write cached stats back, without a pass."""
        return self.cache.value is not None and self.cache.key == (step, loaded_from, self.job.state())

    @all_or_nothing
    def forget(self) -> None:
        """Recompute at the next call whatever its key: for a framework that changed the
        weights where their version counters do not show it (writes through ``.data``)."""
        self.cache.forget()

    @all_or_nothing
    def lend(self, member: int) -> None:
        """Give ``model``'s layers the cached stats of ``extra_models[member - 1]``, until
        :meth:`take_back`: for a framework that swaps only an EMA copy's weights into ``model``
        for an evaluation (mmengine's ``EMAHook``), which then runs them with their own stats."""
        own = self.stats_of(0)
        self.job.apply({"model." + name: stats for name, stats in self.stats_of(member).items() if name in own})
        kept = self.lent
        write(lambda: setattr(self, "lent", member), lambda: setattr(self, "lent", kept))

    @all_or_nothing
    def take_back(self) -> None:
        """Give every model its own cached stats again, after :meth:`lend` (else nothing)."""
        if self.lent:
            self.job.apply(self.cached_stats or {})
            kept = self.lent
            write(lambda: setattr(self, "lent", None), lambda: setattr(self, "lent", kept))

    def stats_of(self, member: int = 0) -> TorchCache:
        """The cached stats of ``model`` (``member=0``) or of ``extra_models[member - 1]``, by
        the layer names within that model."""
        cache = self.cached_stats or {}
        if len(self.job.members) == 1:
            return dict(cache)
        prefix = "model." if member == 0 else "extra_{}.".format(member - 1)
        return {name[len(prefix):]: stats for name, stats in cache.items() if name.startswith(prefix)}

    def write_into(self, state: Dict[str, Any], prefix: str = "", member: int = 0) -> List[str]:
        """Write the cached stats of ``member`` (see :meth:`stats_of`) into ``state``, a state
        dict built before the hook ran (a checkpoint's, which may hold copies of the buffers),
        each value converted to its entry's dtype and device; returns the keys ``state`` lacks."""
        missing = []
        for name, (mean, var) in self.stats_of(member).items():
            for suffix, value in ((".running_mean", mean), (".running_var", var)):
                key = prefix + name + suffix
                if key in state:
                    state[key] = value.to(state[key])
                else:
                    missing.append(key)
        return missing

    def _at(self, step: int, period: int, loaded_from: Any, what: str) -> Optional[BNReport]:
        if not self.enabled or step % period != 0:
            return None
        if self.cache.value is None and not self.job.layer_names():
            if self.logger is not None:
                self.logger.warning("precise-bn: %s; the hook is off", no_layer_message(unwrap_model(self.model)))
            self.enabled = False
            return None
        done = self.cache.recomputations
        report = self.cache.recompute_or_write_back((step, loaded_from, self.job.state()),
                                                    lambda store: self.job.run(store, self._share()), self.job.apply)
        if self.logger is not None and self.cache.recomputations > done:
            self.logger.info("%s; for the %s at step %s", report.summary(), what, step)
        elif self.logger is not None:
            self.logger.info("precise-bn: the %s at step %s gets the statistics recomputed for that step and those "
                             "weights", what, step)
        return report

    def _share(self) -> Options:
        """The options of a recomputation now: ``num_samples`` split between the ranks that merge."""
        opts = self.job.opts
        if opts.num_samples is None or not resolve_sync(opts.sync, opts.group):
            return opts
        return opts.replace(num_samples=-(-opts.num_samples // get_world_size(opts.group)))
