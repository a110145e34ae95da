"""``PreciseBNCallback``: precise BN stats for Lightning's validation and checkpoints.

    from precise_bn.lightning import PreciseBNCallback
    trainer = Trainer(callbacks=[PreciseBNCallback(num_batches=200), ModelCheckpoint(...)])

A :class:`~precise_bn.PreciseBNHook` driven by Lightning's callbacks: it recomputes at the start
of each validation and before each checkpoint (keyed by the step, the checkpoint loaded from and
the weights), writes into ``checkpoint["state_dict"]`` too, recomputes ``WeightAveraging``'s
averaged copy with the module, and leaves training bit for bit as it was. Which files hold which
statistics, and why: ``docs/integrations.md``. Importing :mod:`precise_bn` never needs
Lightning; this module does (``lightning``, or the older ``pytorch_lightning``).
"""
from __future__ import annotations

import difflib
import logging
import warnings
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import nn

from .errors import BackendUnavailableError, ConfigError, PreciseBNWarning
from .hooks import PreciseBNHook
from .options import Options, own_arguments
from .pytorch.layers import by_spec, select_layers
from .reader import PrivateReader
from .signals import all_or_nothing

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as error:
        raise BackendUnavailableError(
            "precise_bn.lightning needs Lightning: pip install '.[lightning]' (from a checkout) "
            "(or pip install lightning)"
        ) from error

#: The callback's lines, under Lightning's own logger (shown on rank 0 as Lightning's are).
LOGGER = logging.getLogger(pl.__name__ + ".callbacks.precise_bn")


def _training_loader(trainer: "pl.Trainer") -> Optional[torch.utils.data.DataLoader]:
    """The trainer's training DataLoader, or None outside fit; a ConfigError asks for ``data=``
    when there are several, or when it is not a DataLoader: the callback cannot tell whether
    iterating such an object takes batches from the training loop."""
    loader = trainer.train_dataloader
    if loader is None or isinstance(loader, torch.utils.data.DataLoader):
        return loader
    what = "more than one training dataloader" if isinstance(loader, (dict, list, tuple)) else \
        "a training dataloader that is a {}, not a torch DataLoader (reading it could take batches from " \
        "training)".format(type(loader).__name__)
    raise ConfigError("PreciseBNCallback: the trainer has {}; pass data=... (and forward_fn=... if its batches "
                      "need one)".format(what))


class PreciseBNCallback(pl.Callback):
    """Recompute precise BN stats at the start of validation and before each checkpoint.

    Args:
        num_batches: batches per recomputation, on each rank (None: limited by ``num_samples``,
            which counts all ranks together, or ``rtol``).
        data: batches to recompute on; default: the trainer's training DataLoader (under DDP
            each rank reads its own shard and the stats are merged across ranks), read through
            a loader of its own (:mod:`precise_bn.reader`). A training dataloader that is not a torch DataLoader is
            refused (reading it might take batches from training): pass ``data`` then. A kept
            iterator continues across recomputations and starts a new pass when one ends.
        attribute: the submodule of the LightningModule to recompute, e.g. ``"model"`` or
            ``"backbone.encoder"``; default: the LightningModule itself.
        **options: every option of :func:`precise_bn.recompute` (``num_samples``, ``rtol``,
            ``forward_fn``, ``layers``...), checked now; ``attribute`` and named
            ``layers`` are checked against the module at ``setup``, before training starts.
            ``forward_fn(target, batch)`` runs in the trainer's precision context (autocast
            for mixed precision); by default ``(input, target)`` batches give
            ``target(batch[0])``, and a batch the target refuses raises
            :class:`~precise_bn.BatchError` saying which ``forward_fn`` to pass. The device
            defaults to the LightningModule's, and the layers to those in training mode
            during the first training batch (validation runs in eval mode, so the train flags
            at recomputation time would not tell frozen BN layers apart).

    Validation during the sanity check runs before any training and is left alone. Under DDP
    every rank takes part in each recomputation; only rank 0 writes the checkpoint file, as
    Lightning does.
    """

    def __init__(
        self,
        num_batches: Optional[int] = 200,
        data: Optional[Iterable[Any]] = None,
        *,
        attribute: Optional[str] = None,
        **options: Any,
    ):
        super().__init__()
        self.options = Options.build("PreciseBNCallback", num_batches=num_batches,
                                     also_known=own_arguments(PreciseBNCallback.__init__), **options)
        self.data = data
        self.attribute = attribute
        self.hook: Optional[PreciseBNHook] = None
        self._training: Optional[PrivateReader] = None
        self._train_layers: Optional[List[str]] = None
        self._warned_no_data = False

    def target(self, pl_module: "pl.LightningModule") -> nn.Module:
        """The module whose BN layers are recomputed."""
        if not self.attribute:
            return pl_module
        try:
            return pl_module.get_submodule(self.attribute)
        except AttributeError as error:
            close = difflib.get_close_matches(self.attribute, [n for n, _ in pl_module.named_modules() if n], n=1)
            raise ConfigError(
                "PreciseBNCallback(attribute={!r}): {} has no such submodule ({}){}".format(
                    self.attribute, type(pl_module).__name__, error,
                    "; did you mean {!r}?".format(close[0]) if close else "")
            ) from error

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        target = self.target(pl_module)
        if isinstance(self.options.layers, (list, tuple)):
            by_spec(target, self.options.layers)
        for checkpoint in trainer.checkpoint_callbacks:
            timed = getattr(checkpoint, "_every_n_train_steps", 0) or getattr(checkpoint, "_train_time_interval", None)
            if stage == "fit" and getattr(checkpoint, "save_weights_only", False) and timed and trainer.is_global_zero:
                warnings.warn(
                    "PreciseBNCallback: Lightning calls no callback for weights-only checkpoints, and those "
                    "that {} saves on a step count or a timer are written before any validation at their "
                    "step: they hold Lightning's running averages, not precise stats".format(
                        type(checkpoint).__name__), PreciseBNWarning, stacklevel=2)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # A new fit may bring another trainer, model or dataloader: start from scratch.
        self.hook = self._training = self._train_layers = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.data is None:
            _training_loader(trainer)

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.hook is None and self._train_layers is None:
            self._train_layers = [
                name for name, module in select_layers(self.target(pl_module), "all") if module.training
            ]

    @all_or_nothing
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.hook is not None and self._averaged(trainer):
            self.hook.forget()  # WeightAveraging copies the average into the module, through .data

    @all_or_nothing
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.sanity_checking:
            return
        hook = self._get_hook(trainer, pl_module)
        if hook is not None:
            hook.before_eval(trainer.global_step, trainer.ckpt_path)

    @all_or_nothing
    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: Dict[str, Any]
    ) -> None:
        hook = self._get_hook(trainer, pl_module)
        if hook is None or hook.before_checkpoint(trainer.global_step, trainer.ckpt_path) is None:
            return
        prefix = self.attribute + "." if self.attribute else ""
        if len(hook.job.members) > 1 and "current_model_state" in checkpoint:
            # WeightAveraging came first: the averaged weights are in state_dict, the trained ones moved.
            missing = hook.write_into(checkpoint["state_dict"], prefix, member=1) + hook.write_into(
                checkpoint["current_model_state"], prefix)
        else:
            # WeightAveraging, if any, saves its model's own buffers, where the pass wrote its statistics.
            missing = hook.write_into(checkpoint.get("state_dict", {}), prefix)
        if missing:
            warnings.warn(
                "PreciseBNCallback: the checkpoint's state_dict has no entry {}: the file keeps "
                "whatever the strategy collected for them".format(", ".join(missing)),
                PreciseBNWarning,
                stacklevel=2,
            )

    def _averaged(self, trainer: "pl.Trainer") -> List[nn.Module]:
        """The target's copies in the averaged models of Lightning's ``WeightAveraging`` callbacks
        (versions that have them)."""
        kind = getattr(pl.callbacks, "WeightAveraging", ())
        averaged = [getattr(c, "_average_model", None) for c in trainer.callbacks if isinstance(c, kind)]
        return [self.target(a.module) for a in averaged if a is not None]

    def _get_hook(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional[PreciseBNHook]:
        """The hook for the module being validated or saved now, and its averaged copies: a new
        one for a new module (``validate(other_module)`` after ``fit``)."""
        target, averaged = self.target(pl_module), self._averaged(trainer)
        if self.hook is not None and self.hook.model is target and self.hook.job.members[1:] == averaged:
            return self.hook
        data = self.data
        if data is None and self._training is None and _training_loader(trainer) is not None:
            self._training = PrivateReader(lambda: _training_loader(trainer))
        if data is None:
            if self._training is None:
                if not self._warned_no_data and trainer.is_global_zero:
                    warnings.warn(
                        "PreciseBNCallback: no training dataloader (validate() outside fit()?) and "
                        "no data= given: BN stats are left as they are",
                        PreciseBNWarning,
                        stacklevel=3,
                    )
                self._warned_no_data = True
                return None
            data = self._training
        changes: Dict[str, Any] = {}
        if self.options.device is None:
            changes["device"] = pl_module.device
        if self.options.layers is None:
            changes["layers"] = self._train_layers
        options = self.options.replace(**changes)
        self.hook = PreciseBNHook(target, data, forward_context=trainer.precision_plugin.forward_context,
                                  extra_models=averaged, logger=LOGGER if trainer.is_global_zero else None,
                                  **options.as_kwargs())
        return self.hook
