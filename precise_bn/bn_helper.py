"""``BatchNormHelper``: video-nonlocal-net's helper lifecycle (``create_bn_aux_model`` once, then
``compute_and_update_bn_stats(curr_iter)``) on either backend; only the import changes (docs/caffe2.md)."""
from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn

from .errors import ConfigError
from .options import Options, own_arguments, positive_int
from .report import BNReport
from .signals import all_or_nothing
from .step_cache import CachedRecomputations, StepCache
from .torch_job import TorchRecalibrator

# The original tool's config keys and the settings they map to.
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
BACKENDS = ("torch", "caffe2")
# Options of recompute() that have no meaning for a Caffe2 net.
TORCH_ONLY = ("forward_fn", "device", "layers", "autocast")


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


def _settings(cfg: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    settings = dict(DEFAULTS)
    if cfg is not None:
        for key, dotted in CONFIG_KEYS.items():
            value = config_value(cfg, dotted)
            if value is not None:
                settings[key] = value
    for key in list(kwargs):
        if key in DEFAULTS:
            settings[key] = kwargs.pop(key)
    for key in ("iters", "num_gpus", "log_period"):
        positive_int("{} ({})".format(key, CONFIG_KEYS.get(key, key)), settings[key], allow_none=False)
    return settings


class BatchNormHelper(CachedRecomputations):
    """Settings from ``cfg`` (the original keys, :data:`CONFIG_KEYS`; else the original's global
    config when loaded), overridden by keywords named as :data:`DEFAULTS`; any other keyword is
    an option, checked now. ``backend=None``: torch for an ``nn.Module``, else caffe2."""

    def __init__(self, cfg: Any = None, *, backend: Optional[str] = None, **kwargs: Any):
        if backend is not None and backend not in BACKENDS:
            raise ConfigError("backend must be 'torch', 'caffe2' or None, got {!r}".format(backend))
        self.backend = backend
        if cfg is None:
            from .caffe2.original import original_config

            cfg = original_config()
        self.cfg = cfg
        self.settings = _settings(cfg, kwargs)
        self.options = Options.build("BatchNormHelper", num_batches=self.settings["iters"],
                                     log_period=self.settings["log_period"],
                                     also_known=(*own_arguments(BatchNormHelper.__init__), *DEFAULTS), **kwargs)
        self._given = set(kwargs)
        self.aux: Any = None
        self.cache: StepCache[Any] = StepCache()

    @property
    def iters(self) -> int:
        return int(self.settings["iters"])

    def create_bn_aux_model(self, model: Any = None, data: Any = None, *, node_id: Optional[int] = None,
                            **kwargs: Any) -> Any:
        """Prepare the forward-only aux pass over ``model`` (none: built as the original does) on
        ``data`` (re-iterated when it runs out); ``kwargs`` are more options. Returns the aux object."""
        if model is None and self.backend != "torch":
            from .caffe2.original import build_original_aux_model

            model = build_original_aux_model(self.cfg, 0 if node_id is None else node_id)
        elif node_id is not None:
            raise ConfigError("create_bn_aux_model: node_id only tells the original's model builder which data shard "
                              "to read; with a model given, drop it: bn_aux.create_bn_aux_model(model)")
        backend = self.backend or ("torch" if isinstance(model, nn.Module) else "caffe2")
        options = self.options.replace(**kwargs) if kwargs else self.options
        if backend == "torch":
            if not isinstance(model, nn.Module):
                raise ConfigError("the torch backend needs an nn.Module, got {}".format(type(model).__name__))
            if data is None:
                raise ConfigError("the torch backend needs data: an iterable of batches")
            self.aux = TorchRecalibrator(model, data, options)
            self.aux.layer_names()
        else:
            from .caffe2.backend import Caffe2AuxModel

            used = [name for name in TORCH_ONLY if name in self._given or name in kwargs]
            if used:
                raise ConfigError("option(s) {} apply to PyTorch models only, not to a Caffe2 net".format(
                    ", ".join(used)))
            self.aux = Caffe2AuxModel(model, data, settings=self.settings, opts=options)
        self.cache = StepCache()
        return self.aux

    @all_or_nothing
    def compute_and_update_bn_stats(self, curr_iter: Any = None) -> BNReport:
        """Recompute and write the stats, or re-apply the cached ones if ``curr_iter`` is
        unchanged; ``curr_iter=None`` always recomputes."""
        if self.aux is None:
            raise ConfigError("call create_bn_aux_model(...) before compute_and_update_bn_stats()")
        return self.cache.recompute_or_write_back(curr_iter, self.aux.run, self.aux.apply)
