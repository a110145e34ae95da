"""``ExactPreciseBNHook`` for OpenMMLab runners, registered on import
(``custom_hooks = [dict(type="ExactPreciseBNHook", ...)]``): mmpretrain's arguments, exact."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from torch import nn

from .distributed import get_world_size, resolve_sync
from .errors import BackendUnavailableError, ConfigError, warn
from .hooks import PreciseBNHook
from .options import Options, positive_int
from .reader import PrivateReader
from .signals import all_or_nothing

try:
    from mmengine.hooks import CheckpointHook, EMAHook, Hook
    from mmengine.model import is_model_wrapper
    from mmengine.registry import HOOKS
    from mmengine.runner import BaseLoop, IterBasedTrainLoop
except ImportError as error:
    raise BackendUnavailableError("precise_bn.mmengine needs mmengine: pip install '.[mmengine]' (from a checkout)") from error


def _saves_now(checkpoints: CheckpointHook, runner: Any, by_epoch: bool) -> bool:
    """Whether ``checkpoints`` saves at this point, by its own conditions."""
    if checkpoints.by_epoch != by_epoch:
        return False
    start = getattr(checkpoints, "save_begin", 0)
    if by_epoch:
        return checkpoints.every_n_epochs(runner, checkpoints.interval, start) or bool(
            checkpoints.save_last and checkpoints.is_last_train_epoch(runner))
    return checkpoints.every_n_train_iters(runner, checkpoints.interval, start) or bool(
        checkpoints.save_last and checkpoints.is_last_train_iter(runner))


def mm_forward(model: nn.Module, batch: Any) -> Any:
    """An OpenMMLab model's forward on a batch, through its data preprocessor as ``val_step`` does."""
    data = model.data_preprocessor(batch, False)
    return model(**data, mode="tensor") if isinstance(data, dict) else model(*data, mode="tensor")


@HOOKS.register_module()
class ExactPreciseBNHook(Hook):
    """Recompute before validations and checkpoints every ``interval`` epochs (or iterations) on
    ``num_samples`` of all ranks together (mmpretrain's count), from ``data`` (default: the
    runner's training dataloader); options are checked now."""

    # After EMAHook (NORMAL), which updates the EMA weights after each iteration and swaps them
    # in and out around validation and checkpoints; before CheckpointHook (VERY_LOW).
    priority = "LOW"

    def __init__(self, num_samples: Optional[int] = 8192, interval: int = 1, data: Optional[Iterable[Any]] = None,
                 **options: Any):
        options.setdefault("num_batches", None)
        self.options = Options.build("ExactPreciseBNHook", num_samples=num_samples, **options)
        positive_int("interval", interval, allow_none=False)
        if self.options.num_batches is None and self.options.num_samples is None and self.options.rtol is None:
            raise ConfigError("ExactPreciseBNHook: num_samples, num_batches and rtol are all None: "
                              "a recomputation would read the training data forever")
        self.num_samples = self.options.num_samples
        self.interval = interval
        self.data = data
        self.hook: Optional[PreciseBNHook] = None
        self.ema: Optional[EMAHook] = None

    def before_run(self, runner: Any) -> None:
        self.hook = None  # a new run may bring another model, dataloader or EMA copy

    def before_train(self, runner: Any) -> None:
        hooks = list(runner.hooks)
        mine = hooks.index(self)
        late = [h for h in hooks[mine:] if isinstance(h, EMAHook)]
        early = [h for h in hooks[:mine] if isinstance(h, CheckpointHook)]
        if late or early:
            raise ConfigError("ExactPreciseBNHook(priority={!r}) runs {} {} (priority {!r}): it must run after "
                              "EMAHook and before CheckpointHook, as its default priority 'LOW' does".format(
                                  self.priority, "before" if late else "after", type((late or early)[0]).__name__,
                                  (late or early)[0].priority))

    @all_or_nothing
    def before_val(self, runner: Any) -> None:
        hook = self._get_hook(runner)
        if hook is None or not self._due(runner, runner.iter) or hook.before_eval(runner.iter) is None:
            return
        if self.ema is not None and not self.ema.ema_model.update_buffers:
            hook.lend(1)  # EMAHook swaps only the weights in (at before_val_epoch): they run with their stats

    @all_or_nothing
    def after_val_epoch(self, runner: Any, metrics: Optional[Dict[str, float]] = None) -> None:
        if self.hook is not None:
            self.hook.take_back()  # after EMAHook swapped the weights back, before save_best's checkpoint

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._before_checkpoints(runner, by_epoch=False)

    def after_train_epoch(self, runner: Any) -> None:
        self._before_checkpoints(runner, by_epoch=True)

    def _before_checkpoints(self, runner: Any, by_epoch: bool) -> None:
        """The pass, on every rank, for what a CheckpointHook saves next (it runs after this hook)."""
        hook = self._get_hook(runner)
        done = runner.iter if by_epoch else runner.iter + 1  # mmengine counts the iteration after these hooks
        if hook is not None and self._due(runner, done) and any(
                _saves_now(h, runner, by_epoch) for h in runner.hooks if isinstance(h, CheckpointHook)):
            hook.before_checkpoint(done)

    @all_or_nothing
    def before_save_checkpoint(self, runner: Any, checkpoint: Dict[str, Any]) -> None:
        hook = self._get_hook(runner)
        step = checkpoint.get("meta", {}).get("iter", runner.iter)
        if hook is None or not hook.enabled or not self._due(runner, step):
            return
        opts = hook.job.opts
        if not hook.cached_for(step) and resolve_sync(opts.sync, opts.group) and get_world_size(opts.group) > 1:
            warn("ExactPreciseBNHook: a checkpoint at iteration {} that no CheckpointHook announced is written by "
                 "rank 0 alone, where no pass over the ranks can run: it keeps the statistics mmengine "
                 "collected".format(step))
            return
        hook.before_checkpoint(step)
        state = checkpoint.get("state_dict", {})
        if self.ema is not None and "ema_state_dict" in checkpoint:
            # EMAHook, just before, put the EMA weights in state_dict and the trained ones in ema_state_dict.
            missing = hook.write_into(state, member=1) + hook.write_into(checkpoint["ema_state_dict"], "module.")
        else:
            missing = hook.write_into(state)
        if missing:
            warn("ExactPreciseBNHook: the checkpoint has no entry {}: the file keeps the stats mmengine "
                 "collected for them".format(", ".join(missing)))

    def _due(self, runner: Any, done: int) -> bool:
        """Whether the point after ``done`` iterations is due (an epoch's end, or an iteration)."""
        loop = runner.train_loop
        if not isinstance(loop, IterBasedTrainLoop):
            per_epoch = len(loop.dataloader)
            if done % per_epoch:
                return False  # inside an epoch
            done //= per_epoch
        return done % self.interval == 0

    def _get_hook(self, runner: Any) -> Optional[PreciseBNHook]:
        if not isinstance(getattr(runner, "_train_loop", None), BaseLoop):
            return None  # not training: validation or testing alone
        if self.hook is None:
            model = runner.model.module if is_model_wrapper(runner.model) else runner.model
            emas: List[EMAHook] = [h for h in runner.hooks if isinstance(h, EMAHook)]
            if len(emas) > 1:
                raise ConfigError("ExactPreciseBNHook: the runner has {} EMAHooks; it recomputes for one EMA "
                                  "copy of the weights".format(len(emas)))
            self.ema = emas[0] if emas else None
            options = self.options
            if options.forward_fn is None:
                options = options.replace(forward_fn=mm_forward)
            data = self.data if self.data is not None else PrivateReader(lambda: runner.train_dataloader)
            extra = [self.ema.ema_model.module] if self.ema is not None else []
            self.hook = PreciseBNHook(model, data, extra_models=extra, logger=runner.logger, **options.as_kwargs())
        return self.hook
