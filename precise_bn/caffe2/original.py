"""The original video-nonlocal-net tool's config and model builder, found in ``sys.modules`` where
its training script put them (so ``BatchNormHelper()`` and ``create_bn_aux_model(node_id=...)``
keep working), never imported by name: a package merely called ``core`` is never loaded."""
from __future__ import annotations

import sys
from typing import Any, Optional

from ..errors import ConfigError

CONFIG_MODULE = "core.config"
BUILDER_MODULE = "models.model_builder_video"

#: What replaces ``create_bn_aux_model(node_id=...)`` where the original's modules are absent.
REPLACEMENT = "bn_aux.create_bn_aux_model(train_model)"


def original_config() -> Optional[Any]:
    """``core.config.config`` when the original's config module is loaded and looks like it."""
    cfg = getattr(sys.modules.get(CONFIG_MODULE), "config", None)
    train = getattr(cfg, "TRAIN", None)
    return cfg if getattr(train, "ITER_COMPUTE_PRECISE_BN", None) is not None else None


def build_original_aux_model(cfg: Any, node_id: int) -> Any:
    """The aux model as the original helper builds it (a forward-only ``ModelBuilder``); a
    ConfigError with the replacing line when the builder or the config is not loaded."""
    builder = getattr(sys.modules.get(BUILDER_MODULE), "ModelBuilder", None)
    if builder is None or cfg is None:
        missing = BUILDER_MODULE if builder is None else CONFIG_MODULE
        raise ConfigError(
            "create_bn_aux_model(node_id={}) builds the aux net as video-nonlocal-net does, with {}.ModelBuilder "
            "and the {}.config settings, but {} is not imported in this process. Give the model instead:\n"
            "    {}\n"
            "where train_model is the Caffe2 training model whose parameters are in the workspace (for a "
            "PyTorch model: bn_aux.create_bn_aux_model(model, data_loader))".format(
                node_id, BUILDER_MODULE, CONFIG_MODULE, missing, REPLACEMENT))
    model = builder(
        name="{}_bn_aux".format(cfg.MODEL.MODEL_NAME),
        train=True,
        use_cudnn=True,
        cudnn_exhaustive_search=True,
        ws_nbytes_limit=(cfg.CUDNN_WORKSPACE_LIMIT * 1024 * 1024),
        split=cfg.TRAIN.DATA_TYPE,
        use_mem_cache=False,
        force_fw_only=True,
    )
    model.build_model(node_id=node_id)
    return model
