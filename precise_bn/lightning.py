"""``PreciseBNCallback``: a :class:`~precise_bn.PreciseBNHook` driven by Lightning, before each
validation and checkpoint, ``WeightAveraging``'s copy included (docs/integrations.md)."""
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
    """The trainer's training DataLoader, or None outside fit; a ConfigError asks for ``data=`` when
    there are several or it is not a DataLoader (reading it might take batches from training)."""
    loader = trainer.train_dataloader
    if loader is None or isinstance(loader, torch.utils.data.DataLoader):
        return loader
    what = "more than one training dataloader" if isinstance(loader, (dict, list, tuple)) else \
        "a training dataloader that is a {}, not a torch DataLoader (reading it could take batches from " \
        "training)".format(type(loader).__name__)
    raise ConfigError("PreciseBNCallback: the trainer has {}; pass data=... (and forward_fn=... if its batches "
                      "need one)".format(what))


class PreciseBNCallback(pl.Callback):
    """``num_batches`` per rank; ``data`` defaults to the trainer's training DataLoader (each rank
    its shard), read through a loader of its own; ``attribute`` names the submodule to recompute
    (default: the LightningModule). Options are checked now, ``attribute`` and ``layers`` at
    ``setup``; ``forward_fn`` runs in the trainer's precision context. The layers default to those
    in training mode during the first training batch (validation runs in eval mode). The sanity
    check's validation is left alone."""

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
        """The target's copies in Lightning's ``WeightAveraging`` callbacks' averaged models."""
        kind = getattr(pl.callbacks, "WeightAveraging", ())
        averaged = [getattr(c, "_average_model", None) for c in trainer.callbacks if isinstance(c, kind)]
        return [self.target(a.module) for a in averaged if a is not None]

    def _get_hook(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional[PreciseBNHook]:
        """The hook for the module validated or saved now (a new one for ``validate(other)``)."""
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
