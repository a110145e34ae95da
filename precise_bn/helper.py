"""``BatchNormHelper``: the original Caffe2 tool's lifecycle, on either backend.

    helper = BatchNormHelper(cfg)                 # or BatchNormHelper(iters=200, ...)
    helper.create_bn_aux_model(model, data)       # once
    helper.compute_and_update_bn_stats(curr_iter) # before each test and each checkpoint

Stats are recomputed only when ``curr_iter`` changed since the last call; a second call at the
same iteration re-applies the cached stats without running a forward, so evaluation and the
checkpoint written at the same iteration hold identical numbers.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from .data import CyclingBatches, ForwardFn
from .errors import ConfigError
from .report import BNReport
from .torch_backend import select_layers, update_bn_stats

# The original tool's config keys and the keyword arguments they map to.
CONFIG_KEYS = {
    "iters": "TRAIN.ITER_COMPUTE_PRECISE_BN",
    "bn_epsilon": "MODEL.BN_EPSILON",
    "num_gpus": "NUM_GPUS",
    "root_gpu_id": "ROOT_GPU_ID",
    "log_period": "LOG_PERIOD",
}
DEFAULTS: Dict[str, Any] = {
    "iters": 200,
    "bn_epsilon": 1e-5,
    "num_gpus": 1,
    "root_gpu_id": 0,
    "log_period": 10,
    "device_prefix": "gpu",
}

Cache = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


def config_value(cfg: Any, dotted: str, default: Any = None) -> Any:
    """Read ``A.B.C`` from an attribute-style (yacs, AttrDict) or nested-mapping config."""
    node = cfg
    for part in dotted.split("."):
        if isinstance(node, dict):
            if part not in node:
                return default
            node = node[part]
        elif hasattr(node, part):
            node = getattr(node, part)
        else:
            return default
    return node


class TorchAuxModel:
    """The PyTorch aux "model": the same module (no weight copy) and an endless batch source."""

    def __init__(
        self,
        model: nn.Module,
        data: Iterable[Any],
        forward_fn: Optional[ForwardFn] = None,
        log_period: int = 10,
        **options: Any,
    ):
        self.model = model
        self.batches = CyclingBatches(data)
        self.forward_fn = forward_fn
        self.log_period = log_period
        self.options = options

    def compute(self, iters: int) -> Tuple[Cache, BNReport]:
        report = update_bn_stats(
            self.model,
            self.batches,
            num_iters=iters,
            forward_fn=self.forward_fn,
            log_period=self.log_period,
            **self.options,
        )
        modules = dict(self.model.named_modules())
        cache = {
            layer.name: (
                modules[layer.name].running_mean.detach().clone(),
                modules[layer.name].running_var.detach().clone(),
            )
            for layer in report.layers
            if layer.ran and layer.name in modules
        }
        return cache, report

    def apply(self, cache: Cache) -> None:
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for name, (mean, var) in cache.items():
                modules[name].running_mean.copy_(mean)
                modules[name].running_var.copy_(var)


class BatchNormHelper:
    """Recompute precise BN stats periodically, on the ``"torch"`` or ``"caffe2"`` backend.

    Settings come from ``cfg`` (the original keys, see :data:`CONFIG_KEYS`) and are overridden
    by keyword arguments: ``iters``, ``bn_epsilon``, ``num_gpus``, ``root_gpu_id``,
    ``log_period``, ``device_prefix``. On the torch backend ``bn_epsilon``, ``num_gpus`` and
    ``root_gpu_id`` are carried by the modules themselves and only kept for the Caffe2 backend.
    Other keyword arguments go to :func:`update_bn_stats` (``exact``, ``device``, ``sync``...).
    """

    def __init__(self, cfg: Any = None, *, backend: str = "torch", **kwargs: Any):
        if backend not in ("torch", "caffe2"):
            raise ConfigError("backend must be 'torch' or 'caffe2', got {!r}".format(backend))
        self.backend = backend
        settings = dict(DEFAULTS)
        if cfg is not None:
            for key, dotted in CONFIG_KEYS.items():
                value = config_value(cfg, dotted)
                if value is not None:
                    settings[key] = value
        for key in list(kwargs):
            if key in DEFAULTS:
                settings[key] = kwargs.pop(key)
        if not isinstance(settings["iters"], int) or settings["iters"] <= 0:
            raise ConfigError(
                "iters (TRAIN.ITER_COMPUTE_PRECISE_BN) must be a positive integer, got {!r}".format(
                    settings["iters"]
                )
            )
        self.settings = settings
        self.options = kwargs
        self.aux: Any = None
        self._cache: Optional[Cache] = None
        self._cached_iter: Any = None
        self.last_report: Optional[BNReport] = None
        self.runs = 0

    @property
    def iters(self) -> int:
        return int(self.settings["iters"])

    def create_bn_aux_model(self, model: Any, data: Any = None, **kwargs: Any) -> Any:
        """Prepare the forward-only aux pass over ``model`` and return the aux object.

        torch: ``model`` is the ``nn.Module`` (its BN layers are checked now), ``data`` an
        iterable of batches (re-iterated when it runs out), ``forward_fn`` optional.
        caffe2: see :mod:`precise_bn.caffe2_backend`.
        """
        if self.backend == "torch":
            if data is None:
                raise ConfigError("the torch backend needs data: an iterable of batches")
            select_layers(model, self.options.get("layers"))
            options = dict(self.options)
            options.update(kwargs)
            self.aux = TorchAuxModel(model, data, log_period=self.settings["log_period"], **options)
        else:
            from .caffe2_backend import Caffe2AuxModel

            self.aux = Caffe2AuxModel(model, data, settings=self.settings, **dict(self.options, **kwargs))
        self._cache = None
        self._cached_iter = None
        return self.aux

    def compute_and_update_bn_stats(self, curr_iter: Any = None) -> BNReport:
        """Recompute and write the stats, or re-apply the cached ones if ``curr_iter`` is unchanged.

        ``curr_iter=None`` always recomputes.
        """
        if self.aux is None:
            raise ConfigError("call create_bn_aux_model(...) before compute_and_update_bn_stats()")
        if curr_iter is not None and self._cache is not None and curr_iter == self._cached_iter:
            self.aux.apply(self._cache)
            assert self.last_report is not None
            return self.last_report
        self._cache, self.last_report = self.aux.compute(self.iters)
        self._cached_iter = curr_iter
        self.runs += 1
        return self.last_report
