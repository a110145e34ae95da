"""Recompute the BN statistics of a checkpoint file: the job behind ``precise-bn recompute``."""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from .. import distributed
from ..api import recalibrate
from ..checkpoint.formats import check_output, load_checkpoint, provenance, save_checkpoint, set_provenance, write_file
from ..checkpoint.state import Checkpoint, apply_bn_stats, bn_stats_of, load_into_model, match_model
from ..errors import LayerError
from ..options import Options
from ..pytorch.layers import no_layer_message, select_layers
from ..report import BNReport
from .specs import resolve_data, resolve_model

logger = logging.getLogger("precise_bn")

DEFAULT_ITERS = 200


def default_output(checkpoint: str) -> str:
    """``ckpt.pt`` -> ``ckpt.precise_bn.pt``: next to the input, same extension, same format."""
    root, ext = os.path.splitext(checkpoint)
    return root + ".precise_bn" + ext


def recompute_checkpoint(
    checkpoint: str,
    model: Union[str, nn.Module],
    data: Union[str, Iterable[Any]],
    *,
    model_kwargs: Optional[Mapping[str, Any]] = None,
    data_kwargs: Optional[Mapping[str, Any]] = None,
    batch_size: Optional[int] = None,
    output: Optional[str] = None,
    in_place: bool = False,
    report_path: Optional[str] = None,
    key: Optional[str] = None,
    prefix: Optional[str] = None,
    trust: bool = False,
    caffe2_rules: Any = None,
    **options: Any,
) -> Tuple[BNReport, str]:
    """Recalibrate the BN stats of a checkpoint file; return the report and the file written.

    ``model``/``data`` are specs (see :mod:`precise_bn.cli.specs`) or a module / an iterable.
    ``caffe2_rules`` map a Caffe2 ``.pkl``'s layer names to the model's module names; the new
    stats go back into the very blobs they were read from. ``**options`` are those of
    :func:`precise_bn.recompute`; without a budget (``num_batches``, ``num_samples``, ``rtol``),
    200 batches as in fvcore. ``output`` defaults to :func:`default_output`; ``in_place``
    replaces the input atomically. Only BN ``running_mean``/``running_var`` change in the file
    written (see :mod:`precise_bn.checkpoint.formats`). Under ``torch.distributed`` every rank
    measures and merges, rank 0 writes, all wait for it.
    """
    opts = Options.build("recompute_checkpoint", **options)
    if opts.num_batches is None and opts.num_samples is None and opts.rtol is None:
        opts = opts.replace(num_batches=DEFAULT_ITERS)
    out = checkpoint if in_place else (output or default_output(checkpoint))
    check_output(checkpoint, out, in_place)
    ckpt = load_checkpoint(checkpoint, key=key, trust=trust, rules=caffe2_rules)
    logger.info("%s", ckpt.describe())
    net = model if isinstance(model, nn.Module) else resolve_model(model, model_kwargs)
    prefix = match_model(ckpt, net.state_dict(), prefix)
    if prefix:
        logger.info("the model's keys sit under the prefix %r", prefix)
    load_into_model(net, ckpt, prefix)
    if not select_layers(net):
        raise LayerError("nothing to recompute in {}: {}".format(checkpoint, no_layer_message(net)))
    net.to(opts.device or torch.device("cpu"))
    batches = data if not isinstance(data, str) else resolve_data(data, data_kwargs, batch_size)
    if not distributed.is_main_process():
        opts = opts.replace(progress=False)
    report = recalibrate(net, batches, opts)
    try:
        if distributed.is_main_process():
            apply_bn_stats(ckpt, prefix, bn_stats_of(net, report))
            set_provenance(ckpt, provenance(report))
            save_checkpoint(ckpt, out, in_place=in_place)
            if report_path:
                write_report(report_path, report, ckpt, out, prefix)
    finally:
        distributed.barrier()
    return report, out


def write_report(path: str, report: BNReport, ckpt: Checkpoint, output: str, prefix: str) -> None:
    """The ``--report`` JSON: the files, then :meth:`BNReport.to_dict` (per-layer drift)."""
    body = {"checkpoint": ckpt.path, "output": output, "format": ckpt.format, "prefix": prefix}
    body.update(report.to_dict())
    text = json.dumps(body, indent=2).encode("utf-8")
    write_file(path, lambda handle: handle.write(text))
