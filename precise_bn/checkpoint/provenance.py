"""The ``precise_bn`` entry a recompute leaves in its checkpoint: how, by what and when."""
from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Dict, Mapping

import torch

from .._version import __version__
from ..errors import ConfigError
from ..report import BNReport
from .formats import format_named
from .state import Checkpoint

logger = logging.getLogger("precise_bn")

def _now() -> datetime.datetime:
    """``SOURCE_DATE_EPOCH`` when set (identical runs, identical bytes), else now, in UTC."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        return datetime.datetime.now(datetime.timezone.utc)
    try:
        return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
    except (ValueError, OverflowError, OSError) as exc:
        raise ConfigError("SOURCE_DATE_EPOCH={!r} is not a number of seconds since 1970".format(epoch)) from exc


def provenance(report: BNReport) -> Dict[str, Any]:
    """What the ``precise_bn`` entry records: how the stats were measured, by what, when."""
    return {
        "version": __version__,
        "torch": str(torch.__version__),
        "date": _now().isoformat(timespec="seconds"),
        "samples": report.samples,
        "iterations": report.batches,
        "world_size": report.world_size,
        "estimator": report.estimator,
        "layers": len(report.layers) - len(report.unused),
    }


def provenance_of(ckpt: Checkpoint) -> Any:
    """The ``precise_bn`` entry a previous recompute left in ``ckpt``, as stored, or None."""
    return format_named(ckpt.format).provenance(ckpt)


def set_provenance(ckpt: Checkpoint, info: Mapping[str, Any]) -> None:
    """Record ``info`` as the ``precise_bn`` entry where the layout has room (logged if not)."""
    if not format_named(ckpt.format).set_provenance(ckpt, info):
        logger.info("%s: a %s layout has no room for a precise_bn provenance entry; none recorded", ckpt.path,
                    "bare state dict" if ckpt.format == "torch" else ckpt.format)

