"""``PreciseBatchNormHook``: a drop-in for ClassyVision's hook of the same name (task config
``{"name": "exact_precise_bn", ...}``), with exact population statistics (docs/dropins.md)."""
from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Dict, Iterable, Iterator, List

import torch
from torch import nn

from .data import count_samples, move_to_device
from .errors import BackendUnavailableError, ConfigError
from .options import Options, check_names, own_arguments
from .reader import read_privately
from .signals import all_or_nothing
from .torch_job import recalibrate_untouched

try:
    from classy_vision.hooks import ClassyHook, register_hook
except ImportError as error:
    raise BackendUnavailableError(
        "precise_bn.classy needs ClassyVision: pip install '.[classy]' (from a checkout) "
        "(or pip install classy_vision==0.7.0)"
    ) from error

logger = logging.getLogger("precise_bn")

#: The name this hook is registered under in ClassyVision's hook registry.
REGISTRY_NAME = "exact_precise_bn"


def _forward_input(model: nn.Module, model_input: Any) -> Any:
    return model(model_input)


def _inputs(samples: Iterable[Dict[str, Any]]) -> Iterator[Any]:
    for sample in samples:
        yield sample["input"]


# ClassyVision's own hook has the same class name; its registry then needs bypass_checks.
@register_hook(REGISTRY_NAME, bypass_checks=True)
class PreciseBatchNormHook(ClassyHook):
    """Recompute the base model's BN stats at the end of each training phase on ``num_samples``
    per replica (the last batch whole); ``cache_samples`` keeps the phase's first inputs on the
    CPU instead of a second pass over the dataset. Options are checked now."""

    on_end = ClassyHook._noop

    def __init__(self, num_samples: float, cache_samples: bool = False, **options: Any) -> None:
        super().__init__()
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Real) or not num_samples > 0:
            raise ConfigError("num_samples must be a positive number, got {!r}".format(num_samples))
        self.num_samples = num_samples
        self.cache_samples = bool(cache_samples)
        self.options = Options.build("PreciseBatchNormHook", num_samples=math.ceil(num_samples),
                                     forward_fn=_forward_input,
                                     also_known=own_arguments(PreciseBatchNormHook.__init__), **options)
        self._cached: List[Any] = []
        self._cached_samples = 0

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "PreciseBatchNormHook":
        """Build from a task config entry (``num_samples`` required); an unknown key raises ``TypeError``."""
        config = dict(config)
        config.pop("name", None)
        check_names("PreciseBatchNormHook.from_config", config,
                    ["num_samples", "cache_samples"] + [f for f in Options.__dataclass_fields__
                                                         if f not in ("num_samples", "forward_fn")])
        if "num_samples" not in config:
            raise ConfigError("PreciseBatchNormHook.from_config: num_samples is required")
        return cls(**config)

    def on_start(self, task: Any) -> None:
        logger.info(
            "precise-bn: recomputing BN stats at the end of each training phase on %s samples per replica (%s)",
            self.num_samples, "cached from the phase" if self.cache_samples else "read from the phase's dataloader",
        )

    def on_phase_start(self, task: Any) -> None:
        self._cached = []
        self._cached_samples = 0

    def on_step(self, task: Any) -> None:
        if not (task.train and self.cache_samples) or self._cached_samples >= self.num_samples:
            return
        model_input = move_to_device(task.last_batch.sample["input"], torch.device("cpu"))
        self._cached.append(model_input)
        self._cached_samples += count_samples(model_input)

    @all_or_nothing
    def on_phase_end(self, task: Any) -> None:
        if not task.train:
            return
        if self.cache_samples:
            inputs: Iterable[Any] = self._cached
            self._cached = []
        else:
            inputs = _inputs(read_privately(task.dataloader))
        options = self.options
        if options.device is None and task.use_gpu:
            options = options.replace(device="cuda")
        report = recalibrate_untouched(task.base_model, inputs, options)
        logger.info("%s; at the end of training phase %d", report.summary(), task.train_phase_idx)
