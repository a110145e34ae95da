"""``ExactPreciseBNHook``: exact precise BN for OpenMMLab runners (mmengine, mmpretrain, mmaction2).

    custom_hooks = [dict(type="ExactPreciseBNHook", num_samples=8192, interval=1)]

Importing this module registers the hook in mmengine's ``HOOKS`` (add
``custom_imports = dict(imports=["precise_bn.mmengine"])`` to a config). It takes
mmpretrain's ``PreciseBNHook`` arguments, ``num_samples`` and ``interval`` (epochs, or
iterations for an iteration-based loop), and every option of :func:`precise_bn.recompute`,
checked when the hook is built. Where mmpretrain averages per-batch statistics with equal
weights, this hook merges every BN call exactly (see :mod:`precise_bn.estimator`).

When: before each validation during training and before each checkpoint, like the Lightning
callback, keyed by the iteration count: a checkpoint and a validation after the same iteration
get the very same statistics, from one pass. The checkpoint's ``state_dict`` is rewritten too:
mmengine builds it (copies of the buffers on a GPU) before it calls ``before_save_checkpoint``.
A validation outside training (``runner.val()``) leaves the statistics alone.

Batches: by default the runner's training dataloader, a batch going through the model's data
preprocessor and ``model(**data, mode="tensor")`` as in mmpretrain; ``data=`` and
``forward_fn=`` replace either.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, Optional

from torch import nn

from .errors import BackendUnavailableError, ConfigError, warn
from .hooks import PreciseBNHook
from .options import Options, positive_int
from .signals import all_or_nothing

try:
    from mmengine.hooks import Hook
    from mmengine.model import is_model_wrapper
    from mmengine.registry import HOOKS
    from mmengine.runner import BaseLoop, IterBasedTrainLoop
except ImportError as error:
    raise BackendUnavailableError("precise_bn.mmengine needs mmengine: pip install '.[mmengine]' (from a checkout)") from error


def mm_forward(model: nn.Module, batch: Any) -> Any:
    """An OpenMMLab model's forward on a dataloader batch, as mmpretrain's hook runs it."""
    return model(**model.data_preprocessor(batch, False), mode="tensor")


class _TrainingData:
    """The runner's training dataloader, looked up at each new pass over the data."""

    def __init__(self, runner: Any):
        self.runner = runner

    def __iter__(self) -> Iterator[Any]:
        return iter(self.runner.train_dataloader)


@HOOKS.register_module()
class ExactPreciseBNHook(Hook):
    """Recompute exact BN statistics before validation and before checkpoints (module docstring).

    Args:
        num_samples: samples per recomputation (mmpretrain's default, 8192).
        interval: act every this many epochs (iterations with an iteration-based loop).
        data: batches to recompute on; default: the runner's training dataloader.
        **options: every option of :func:`precise_bn.recompute` (``rtol``, ``exact``,
            ``layers``, ``forward_fn``, ``prior``...), checked now.
    """

    priority = "ABOVE_NORMAL"

    def __init__(self, num_samples: Optional[int] = 8192, interval: int = 1, data: Optional[Iterable[Any]] = None,
                 **options: Any):
        options.setdefault("num_batches", None)
        self.options = Options.build("ExactPreciseBNHook", num_samples=num_samples, **options)
        positive_int("interval", interval, allow_none=False)
        if self.options.num_batches is None and self.options.num_samples is None and self.options.rtol is None:
            raise ConfigError("ExactPreciseBNHook: num_samples, num_batches and rtol are all None: "
                              "a recomputation would read the training data forever")
        self.interval = interval
        self.data = data
        self.hook: Optional[PreciseBNHook] = None

    def before_run(self, runner: Any) -> None:
        self.hook = None  # a new run may bring another model or dataloader

    @all_or_nothing
    def before_val(self, runner: Any) -> None:
        hook = self._get_hook(runner)
        if hook is not None and self._due(runner, runner.epoch, runner.iter):
            hook.before_eval(runner.iter)

    @all_or_nothing
    def before_save_checkpoint(self, runner: Any, checkpoint: Dict[str, Any]) -> None:
        hook = self._get_hook(runner)
        meta = checkpoint.get("meta", {})
        epoch, step = meta.get("epoch", runner.epoch), meta.get("iter", runner.iter)
        if hook is None or not self._due(runner, epoch, step) or hook.before_checkpoint(step) is None:
            return
        missing = hook.write_into(checkpoint.get("state_dict", {}))
        if missing:
            warn("ExactPreciseBNHook: the checkpoint's state_dict has no entry {}: the file keeps the "
                 "stats mmengine collected for them".format(", ".join(missing)))

    def _due(self, runner: Any, epoch: int, step: int) -> bool:
        done = step if isinstance(runner.train_loop, IterBasedTrainLoop) else epoch
        return done % self.interval == 0

    def _get_hook(self, runner: Any) -> Optional[PreciseBNHook]:
        if not isinstance(getattr(runner, "_train_loop", None), BaseLoop):
            return None  # not training: validation or testing alone
        if self.hook is None:
            model = runner.model.module if is_model_wrapper(runner.model) else runner.model
            options = self.options
            if options.forward_fn is None:
                options = options.replace(forward_fn=mm_forward)
            data = self.data if self.data is not None else _TrainingData(runner)
            self.hook = PreciseBNHook(model, data, **options.as_kwargs())
        return self.hook
