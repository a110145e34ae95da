"""``PreciseBNCallback``: precise BN stats for Lightning's validation and checkpoints.

    from precise_bn.lightning import PreciseBNCallback
    trainer = Trainer(callbacks=[PreciseBNCallback(num_batches=200), ModelCheckpoint(...)])

The callback recomputes at the start of each validation and before each checkpoint, keyed by
``trainer.global_step`` (see :class:`precise_bn.PreciseBNHook`): a checkpoint written at the
step of a validation gets the very stats that validation used, without another forward.

Why the checkpoint dict is rewritten too: Lightning (checked on 2.6) builds
``checkpoint["state_dict"]`` *before* it calls the callbacks' ``on_save_checkpoint``. Plain
strategies put references to the live buffers in it, which the in-place update reaches, but
strategies that gather copies (and asynchronous checkpoint writers, while training goes on)
would keep the old numbers, so the callback also writes its stats into that dict.

Limits: Lightning skips callbacks' ``on_save_checkpoint`` for weights-only checkpoints
(``ModelCheckpoint(save_weights_only=True)``); those carry precise stats only when they are
written at the step of a validation, as ``ModelCheckpoint`` does by default.

Importing :mod:`precise_bn` never needs Lightning; this module does (``lightning``, or the
older ``pytorch_lightning``).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional

from torch import nn

from .data import smart_forward
from .errors import BackendUnavailableError, ConfigError, PreciseBNWarning
from .hooks import PreciseBNHook
from .options import Options
from .pytorch.layers import select_layers

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as error:
        raise BackendUnavailableError(
            "precise_bn.lightning needs Lightning: pip install 'precise-bn[lightning]' "
            "(or pip install lightning)"
        ) from error


class _TrainingData:
    """The trainer's current training dataloader, looked up at each new pass over the data
    (Lightning may rebuild it between epochs)."""

    def __init__(self, trainer: "pl.Trainer"):
        self.trainer = trainer

    def __iter__(self) -> Iterator[Any]:
        loader = self.trainer.train_dataloader
        if loader is None or isinstance(loader, (Mapping, list, tuple)):
            raise ConfigError(
                "PreciseBNCallback: the trainer has {} training dataloader; pass data=... "
                "(and forward_fn=... if its batches need one)".format(
                    "no" if loader is None else "more than one"
                )
            )
        return iter(loader)


class PreciseBNCallback(pl.Callback):
    """Recompute precise BN stats at the start of validation and before each checkpoint.

    Args:
        num_batches: batches per recomputation (None: limited by ``num_samples`` or ``rtol``).
        data: batches to recompute on; default: the trainer's training dataloader (under DDP
            each rank reads its own shard and the stats are merged across ranks). A kept
            iterator continues across recomputations and starts a new pass when one ends.
        attribute: the submodule of the LightningModule to recompute, e.g. ``"model"`` or
            ``"backbone.encoder"``; default: the LightningModule itself.
        **options: every option of :func:`precise_bn.recompute` (``num_samples``, ``rtol``,
            ``forward_fn``, ``layers``, ``exact``...), checked now. ``forward_fn(target, batch)``
            runs in the trainer's precision context (autocast for mixed precision); by default
            ``(input, target)`` batches give ``target(batch[0])``. The device defaults to the
            LightningModule's, and the layers to those in training mode during the first
            training batch (validation runs in eval mode, so the train flags at recomputation
            time would not tell frozen BN layers apart).

    Validation during the sanity check runs before any training and is left alone. Under DDP
    every rank takes part in each recomputation; only rank 0 writes the checkpoint file, as
    Lightning does. If the training DataLoader has persistent workers, pass your own ``data``:
    iterating it here would reset the training loop's iterator when validation runs mid-epoch.
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
        self.options = Options.build("PreciseBNCallback", num_batches=num_batches, **options)
        self.data = data
        self.attribute = attribute
        self.hook: Optional[PreciseBNHook] = None
        self._train_layers: Optional[List[str]] = None
        self._warned_no_data = False

    def target(self, pl_module: "pl.LightningModule") -> nn.Module:
        """The module whose BN layers are recomputed."""
        if not self.attribute:
            return pl_module
        try:
            return pl_module.get_submodule(self.attribute)
        except AttributeError as error:
            raise ConfigError(
                "PreciseBNCallback(attribute={!r}): {} has no such submodule ({})".format(
                    self.attribute, type(pl_module).__name__, error
                )
            ) from error

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # A new fit may bring another trainer, model or dataloader: start from scratch. A
        # validate() after fit keeps the hook, so it re-applies the last checkpoint's stats.
        self.hook = None
        self._train_layers = None

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.hook is None and self._train_layers is None:
            self._train_layers = [
                name for name, module in select_layers(self.target(pl_module), "all") if module.training
            ]

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.sanity_checking:
            return
        hook = self._get_hook(trainer, pl_module)
        if hook is not None:
            hook.before_eval(trainer.global_step)

    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: Dict[str, Any]
    ) -> None:
        hook = self._get_hook(trainer, pl_module)
        if hook is None or hook.before_checkpoint(trainer.global_step) is None:
            return
        missing = hook.write_into(checkpoint.get("state_dict", {}), self.attribute + "." if self.attribute else "")
        if missing:
            warnings.warn(
                "PreciseBNCallback: the checkpoint's state_dict has no entry {}: the file keeps "
                "whatever the strategy collected for them".format(", ".join(missing)),
                PreciseBNWarning,
                stacklevel=2,
            )

    def _get_hook(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional[PreciseBNHook]:
        if self.hook is not None:
            return self.hook
        data = self.data
        if data is None:
            if trainer.train_dataloader is None:
                if not self._warned_no_data and trainer.is_global_zero:
                    warnings.warn(
                        "PreciseBNCallback: no training dataloader (validate() outside fit()?) and "
                        "no data= given: BN stats are left as they are",
                        PreciseBNWarning,
                        stacklevel=3,
                    )
                self._warned_no_data = True
                return None
            loader = trainer.train_dataloader
            if getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0:
                warnings.warn(
                    "PreciseBNCallback: the training DataLoader has persistent workers; iterating "
                    "it for precise BN resets the training iterator if validation runs "
                    "mid-epoch: pass data= a separate loader",
                    PreciseBNWarning,
                    stacklevel=3,
                )
            data = _TrainingData(trainer)
        forward = self.options.forward_fn or smart_forward
        precision = trainer.precision_plugin

        def forward_in_precision(module: nn.Module, batch: Any) -> Any:
            with precision.forward_context():
                return forward(module, batch)

        changes: Dict[str, Any] = {"forward_fn": forward_in_precision}
        if self.options.device is None:
            changes["device"] = pl_module.device
        if self.options.layers is None:
            changes["layers"] = self._train_layers
        options = self.options.replace(**changes)
        self.hook = PreciseBNHook(self.target(pl_module), data, **options.as_kwargs())
        return self.hook
