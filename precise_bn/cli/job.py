"""The job behind ``precise-bn recompute`` and ``check``: outputs checked, checkpoint loaded and
matched, data opened (a failure on any rank fails all at the end of this setup), the pass,
then rank 0 writes checkpoint and report atomically."""
from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import distributed
from ..data import DEFAULT_ITERS
from ..driver import recalibrate
from ..checkpoint.formats import load_checkpoint, save_checkpoint
from ..checkpoint.paths import check_paths
from ..checkpoint.provenance import provenance, set_provenance
from ..checkpoint.serializers import write_file
from ..checkpoint.state import Checkpoint, apply_bn_stats, bn_stats_of, load_into_model, match_model
from ..distributed import ACTIVE, Ranks
from ..errors import CheckpointError, ConfigError, Fix, LayerError, PreciseBNError
from ..options import Options
from ..pytorch.bn_pass import BNPass
from ..pytorch.layers import no_layer_message, select_layers
from ..report import BNReport
from ..signals import all_or_nothing
from .data_specs import check_data_spec, data_files, resolve_data
from .failures import BlamedBatches, blame, blamed_on, raised_in_package
from .specs import build_on_meta, check_model_spec, resolve_model, same_family

logger = logging.getLogger("precise_bn")


def default_output(checkpoint: str) -> str:
    """``ckpt.pt`` -> ``ckpt.precise_bn.pt``: next to the input, same extension, same format."""
    root, ext = os.path.splitext(checkpoint)
    return root + ".precise_bn" + ext


@contextlib.contextmanager
def _together(timeout: float) -> Iterator[None]:
    """Setup each rank does on its own: if it raises on one rank, every rank raises at the end."""
    ranks = Ranks(distributed.get_world_size() > 1, None, timeout)
    try:
        yield
    except BaseException:
        ranks.abort()
        raise
    ranks.exchange(ACTIVE)


def _label(spec: Union[str, Any], what: str) -> str:
    return "{} {!r}".format(what, spec) if isinstance(spec, str) else "the {}".format(what.lstrip("-"))


def _load_model(ckpt: Checkpoint, model: Union[str, nn.Module], model_kwargs: Optional[Mapping[str, Any]],
                prefix: Optional[str]) -> Tuple[nn.Module, str]:
    """The model with the checkpoint's tensors in it, and the key prefix they sit under."""
    with blamed_on(_label(model, "--model")):
        net = model if isinstance(model, nn.Module) else resolve_model(model, model_kwargs)
    try:
        prefix = match_model(ckpt, net.state_dict(), prefix)
    except CheckpointError as exc:
        raise CheckpointError(exc.message, *_model_fixes(exc, ckpt, model, model_kwargs or {}, prefix)) from exc
    if prefix:
        logger.info("the model's keys sit under the prefix %r", prefix)
    load_into_model(net, ckpt, prefix)
    if not select_layers(net):
        raise LayerError("nothing to recompute in {}: {}".format(ckpt.path, no_layer_message(net)))
    return net, prefix


def _model_fixes(exc: CheckpointError, ckpt: Checkpoint, model: Union[str, nn.Module],
                 model_kwargs: Mapping[str, Any], prefix: Optional[str]) -> List[Fix]:
    """``exc``'s fixes, else up to three models of ``model``'s family that fit the checkpoint."""
    fixes = [Fix(f.option, dict(model_kwargs, **f.value), f.why) if f.option == "model_kwargs" else f
             for f in exc.fixes]
    search = isinstance(model, str) and not fixes
    for spec in same_family(model) if search else []:
        if sum(f.option == "model" for f in fixes) == 3:
            break
        net = build_on_meta(spec, model_kwargs)
        if net is None:
            continue
        try:
            match_model(ckpt, net.state_dict(), prefix)
        except CheckpointError as other:
            head = [f for f in other.fixes if f.option == "model_kwargs"]
            if head and not any(f.option == "prefix" for f in other.fixes):
                fixes.append(Fix("model", spec, "(with {}, its keys and shapes match the checkpoint)".format(
                    ", ".join("{}={}".format(k, v) for k, v in head[0].value.items()))))
                if not any(f.option == "model_kwargs" for f in fixes):
                    fixes.append(Fix("model_kwargs", dict(model_kwargs, **head[0].value), "(with that model)"))
            continue
        fixes.append(Fix("model", spec, "(its keys and shapes match the checkpoint)"))
    return fixes


@dataclass
class Job:
    """A checkpoint matched to its model, the data to read, the checked ``targets`` (rank 0), and
    the ``label`` naming the model in a failure's message."""

    ckpt: Checkpoint
    net: nn.Module
    prefix: str
    batches: BlamedBatches
    opts: Options
    targets: List[str]
    label: str


def open_job(
    checkpoint: str,
    model: Union[str, nn.Module],
    data: Union[str, Iterable[Any]],
    outputs: Sequence[Tuple[str, str]],
    *,
    where: str,
    in_place: bool = False,
    break_hardlinks: bool = False,
    overwrite: bool = False,
    model_kwargs: Optional[Mapping[str, Any]] = None,
    data_kwargs: Optional[Mapping[str, Any]] = None,
    batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    augment: bool = False,
    key: Optional[str] = None,
    prefix: Optional[str] = None,
    trust: bool = False,
    caffe2_rules: Any = None,
    **options: Any,
) -> Job:
    """Everything before the pass, for :func:`recompute_checkpoint`'s arguments (``where`` names the
    caller in an error)."""
    opts = Options.build(where, **options)
    if opts.num_batches is None and opts.num_samples is None and opts.rtol is None:
        opts = opts.replace(num_batches=DEFAULT_ITERS)
    targets: List[str] = []
    with _together(opts.timeout):
        if isinstance(model, str):
            check_model_spec(model)
        if isinstance(data, str):
            check_data_spec(data, augment)
        if distributed.is_main_process():
            targets = _check_outputs(checkpoint, data, outputs, in_place, break_hardlinks, overwrite)
        ckpt = load_checkpoint(checkpoint, key=key, trust=trust, rules=caffe2_rules)
        logger.info("%s", ckpt.describe())
        net, prefix = _load_model(ckpt, model, model_kwargs, prefix)
        net.to(opts.device or torch.device("cpu"))
        with blamed_on(_label(data, "--data")):
            source = resolve_data(data, data_kwargs, batch_size, seed=seed, augment=augment) \
                if isinstance(data, str) else data
        batches = BlamedBatches(source, _label(data, "--data"))
    if not distributed.is_main_process():
        opts = opts.replace(progress=False)
    calls = "" if opts.forward_fn is None else " through forward_fn {}".format(
        getattr(opts.forward_fn, "__qualname__", opts.forward_fn))
    return Job(ckpt, net, prefix, batches, opts, targets, _label(model, "--model") + calls)


@all_or_nothing
def measure(job: Job, write: bool = True) -> BNReport:
    """The pass (``write=False``: measure only), all or nothing; an exception from the user's
    model becomes one line naming it and the batch."""
    try:
        return recalibrate(BNPass(job.net, job.opts, budget_name="--num-batches"), job.batches, job.opts, write=write)
    except PreciseBNError:
        raise
    except Exception as exc:
        if raised_in_package(exc):
            raise
        raise blame("{} on batch {}".format(job.label, job.batches.read), exc) from exc


def recompute_checkpoint(
    checkpoint: str,
    model: Union[str, nn.Module],
    data: Union[str, Iterable[Any]],
    *,
    model_kwargs: Optional[Mapping[str, Any]] = None,
    data_kwargs: Optional[Mapping[str, Any]] = None,
    batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    augment: bool = False,
    output: Optional[str] = None,
    in_place: bool = False,
    report_path: Optional[str] = None,
    break_hardlinks: bool = False,
    overwrite: bool = False,
    key: Optional[str] = None,
    prefix: Optional[str] = None,
    trust: bool = False,
    caffe2_rules: Any = None,
    **options: Any,
) -> Tuple[BNReport, str]:
    """Recalibrate the BN stats of a checkpoint file; return the report and the file written.
    ``model``/``data``: specs (the command's ``--model``, ``--data``) or a module and an iterable;
    ``**options``: :func:`precise_bn.recompute`'s (no budget: 200 batches, as fvcore). Outputs
    are checked first, as the command's flags of the same names (docs/cli.md)."""
    if in_place and output is not None:
        raise ConfigError("recompute: give output or in_place, not both")
    out = checkpoint if in_place else (output or default_output(checkpoint))
    outputs = [("--in-place" if in_place else "--output", out)] + ([("--report", report_path)] if report_path else [])
    job = open_job(checkpoint, model, data, outputs, where="recompute_checkpoint", in_place=in_place,
                   break_hardlinks=break_hardlinks, overwrite=overwrite, model_kwargs=model_kwargs,
                   data_kwargs=data_kwargs, batch_size=batch_size, seed=seed, augment=augment, key=key, prefix=prefix,
                   trust=trust, caffe2_rules=caffe2_rules, **options)
    report = measure(job)
    _write(job, report, out, report_path)
    return report, out


def _write(job: Job, report: BNReport, out: str, report_path: Optional[str]) -> None:
    """Rank 0 writes the checkpoint (and the report) to the checked targets; all ranks wait."""
    try:
        if distributed.is_main_process():
            apply_bn_stats(job.ckpt, job.prefix, bn_stats_of(job.net, report))
            set_provenance(job.ckpt, provenance(report))
            save_checkpoint(job.ckpt, job.targets[0])
            if report_path:
                write_report(job.targets[1], report, job.ckpt, out, job.prefix)
    finally:
        distributed.barrier()


def _check_outputs(checkpoint: str, data: Union[str, Iterable[Any]], outputs: Sequence[Tuple[str, str]],
                   in_place: bool, break_hardlinks: bool, overwrite: bool) -> List[str]:
    """The files to write, checked against the inputs."""
    read = data_files(data) if isinstance(data, str) else []
    inputs = [("the checkpoint", checkpoint)] + [("--data", f) for f in read]
    return check_paths(inputs, list(outputs), in_place=in_place, break_hardlinks=break_hardlinks, overwrite=overwrite)


def write_report(path: str, report: BNReport, ckpt: Checkpoint, output: str, prefix: str) -> None:
    """The ``--report`` JSON: the files, then :meth:`BNReport.to_dict`."""
    body = {"checkpoint": ckpt.path, "output": output, "format": ckpt.format, "prefix": prefix}
    body.update(report.to_dict())
    text = json.dumps(body, indent=2).encode("utf-8")
    write_file(path, lambda handle: handle.write(text))
    logger.info("wrote %s (the per-layer report)", path)
