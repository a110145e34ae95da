"""Precise BN inside a training loop: ``hook.before_eval(step)``, ``hook.before_checkpoint(step)``.

An evaluation and a checkpoint at the same step and weights share one recomputation; training
goes on as without it (docs/integrations.md)."""
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
from .torch_job import TorchRecalibrator, TorchCache

LOGGER = logging.getLogger("precise_bn")


class PreciseBNHook(CachedRecomputations):
    """``data`` (the loop's own DataLoader too: it is read through a loader of its own) is one
    endless stream across calls. ``num_batches`` is per rank; the option ``num_samples`` counts
    all merging ranks, as mmpretrain's. The hooks act when ``step % period == 0``; ``extra_models``
    (EMA, SWA copies) run on the same batches. Options are checked now; a model with no BN
    layer to recompute turns the hook off."""

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
        self.job = TorchRecalibrator(model, data, opts, extra_models, forward_context)
        self.cache: StepCache[TorchCache] = StepCache()
        self.enabled = True
        self.logger = logger
        self.lent: Optional[int] = None  # the extra model whose stats model's layers hold, see lend()

    @property
    def cached_stats(self) -> Optional[TorchCache]:
        """``{layer: (running_mean, running_var)}`` last recomputed (prefixed ``model.``, ``extra_<i>.``)."""
        return self.cache.value

    @all_or_nothing
    def before_eval(self, step: int, loaded_from: Any = None) -> Optional[BNReport]:
        """Precise stats for an evaluation at ``step`` (``loaded_from``: the checkpoint the weights
        came from, if known); the report they come from, or None when the hook did nothing."""
        return self._at(step, self.eval_period, loaded_from, "evaluation")

    @all_or_nothing
    def before_checkpoint(self, step: int, loaded_from: Any = None) -> Optional[BNReport]:
        """:meth:`before_eval` for a checkpoint (after one at the same step: the cached stats)."""
        return self._at(step, self.checkpoint_period, loaded_from, "checkpoint")

    def cached_for(self, step: int, loaded_from: Any = None) -> bool:
        """Whether a call at ``step`` now would write cached stats back, without a pass."""
        return self.cache.value is not None and self.cache.key == (step, loaded_from, self.job.state())

    @all_or_nothing
    def forget(self) -> None:
        """Recompute at the next call: the weights changed where version counters miss it (``.data``)."""
        self.cache.forget()

    @all_or_nothing
    def lend(self, member: int) -> None:
        """Give ``model``'s layers ``extra_models[member - 1]``'s cached stats until :meth:`take_back`."""
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
        """The cached stats of ``model`` (0) or ``extra_models[member - 1]``, named within it."""
        cache = self.cached_stats or {}
        if len(self.job.members) == 1:
            return dict(cache)
        prefix = "model." if member == 0 else "extra_{}.".format(member - 1)
        return {name[len(prefix):]: stats for name, stats in cache.items() if name.startswith(prefix)}

    def write_into(self, state: Dict[str, Any], prefix: str = "", member: int = 0) -> List[str]:
        """Write :meth:`stats_of` ``member`` into ``state`` (a state dict built before the hook ran),
        in each entry's dtype and device; return the keys ``state`` lacks."""
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
        """The options now: ``num_samples`` split between the ranks that merge."""
        opts = self.job.opts
        if opts.num_samples is None or not resolve_sync(opts.sync, opts.group):
            return opts
        return opts.replace(num_samples=-(-opts.num_samples // get_world_size(opts.group)))
