"""The PyTorch backend: find BN layers, run the forward-only pass, write the population stats.

What one call contributes, and why it is free (the mechanics are in :mod:`precise_bn.capture`):

* Default (``exact=False``): with ``momentum = 1`` a train-mode BN call leaves exactly that
  call's batch mean and *unbiased* batch variance in the running buffers. Each call writes them
  into a fresh row of a per-layer block, so a layer called k times contributes k batches, and
  blocks are merged in float64 with the exact Bessel factor (n - 1) for the call's
  n = numel / C elements per channel. The kernel already computed these numbers; no operator
  runs per call. Their limit is float32: a batch mean is rounded to one float32 ulp, which
  matters only when a channel's mean dwarfs its std.
* ``exact=True``: each call's mean and biased variance are computed from the BN input itself,
  shifted by the call's own float32 batch mean so that nothing cancels even when
  mean/std = 1e4, with float64 sums over a buffer reused across calls: the result matches a
  float64 two-pass reference to ~1e-13, for about the cost of one or two BN kernels.
* SyncBatchNorm layers run as plain BatchNorm during the pass: a call normalises with its own
  rank's batch and issues no collective. A per-call all-gather would pair up with another
  rank's merge or hang as soon as ranks have different numbers of batches; and normalising each
  rank's batch alone is what one process does over the union of the ranks' batches. Their
  stats are then read like any other layer's and merged across ranks once, at the end of the
  pass.

The pass runs inside :class:`BNPass`, which snapshots every buffer of the model, momentum and
train flags and detaches its captures on exit, so a failure or ``KeyboardInterrupt`` anywhere
leaves the model exactly as it was.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import distributed
from .capture import CallCapture, Scratch, flush
from .data import ForwardFn, check_budget, default_forward, move_to_device, peek, take_budget
from .errors import ConfigError, EmptyDataError, LayerError, PreciseBNWarning
from .estimator import PopulationStats
from .report import BNReport, LayerReport

logger = logging.getLogger("precise_bn")

LayerSpec = Union[None, str, Sequence[Union[str, nn.Module]]]
NamedLayer = Tuple[str, _BatchNorm]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module to run the pass on: DDP's inner module, so no per-forward collective is issued.

    ``nn.DataParallel`` is kept: its replicas are what spreads the batch over GPUs, and our
    hooks travel into the replicas with the modules' ``__dict__``.
    """
    ddp = getattr(nn.parallel, "DistributedDataParallel", None)
    if ddp is not None and isinstance(model, ddp):
        return model.module
    return model


def _is_tracking_bn(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and module.track_running_stats


def _check_materialised(name: str, module: _BatchNorm) -> None:
    uninitialized = getattr(nn.parameter, "UninitializedBuffer", ())
    if uninitialized and isinstance(module.running_mean, uninitialized):
        raise LayerError(
            "BatchNorm layer {!r} is lazy and not materialised yet: run one forward pass "
            "before recomputing its statistics".format(name or type(module).__name__)
        )


def get_bn_modules(model: nn.Module) -> List[nn.Module]:
    """BN layers in training mode that track running stats (fvcore's function of the same name)."""
    return [m for m in model.modules() if _is_tracking_bn(m) and m.training]


def select_layers(model: nn.Module, layers: LayerSpec = None) -> List[NamedLayer]:
    """Choose the layers to recalibrate, as ``(qualified name, module)`` pairs.

    ``layers=None``: those in training mode; if the whole model is in eval mode, all of them
    (logged, never a silent no-op). ``"all"``: every tracking BN layer. A sequence of modules or
    qualified names: exactly those. Layers with ``track_running_stats=False`` and frozen BN
    (not a ``_BatchNorm``) are never selected; a layer listed twice is taken once.
    """
    named = [(name, m) for name, m in model.named_modules() if _is_tracking_bn(m)]
    if layers is None:
        chosen = [(n, m) for n, m in named if m.training]
        if not chosen and named and not model.training:
            logger.info(
                "model is in eval mode: recomputing all %d BatchNorm layers", len(named)
            )
            chosen = named
    elif isinstance(layers, str):
        if layers != "all":
            raise ConfigError("layers must be None, 'all' or a list of modules/names, got {!r}".format(layers))
        chosen = named
    else:
        by_name = dict(model.named_modules())
        ids = {id(m): n for n, m in model.named_modules()}
        chosen = []
        for item in layers:
            if isinstance(item, str):
                if item not in by_name:
                    raise ConfigError("layers: no module named {!r} in the model".format(item))
                name, module = item, by_name[item]
            else:
                if id(item) not in ids:
                    raise ConfigError("layers: {!r} is not a submodule of the model".format(item))
                name, module = ids[id(item)], item
            if not _is_tracking_bn(module):
                raise ConfigError(
                    "layers: {!r} ({}) is not a BatchNorm layer that tracks running stats".format(
                        name, type(module).__name__
                    )
                )
            if all(module is not other for _, other in chosen):
                chosen.append((name, module))
    for name, module in chosen:
        _check_materialised(name, module)
    return chosen


class BNPass:
    """Context manager for one forward-only measurement pass over ``layers`` of ``model``.

    On enter it snapshots every buffer of the model, each chosen layer's momentum and train
    flag; puts the chosen layers in train mode with momentum 1 and attaches a
    :class:`~precise_bn.capture.CallCapture` to each. On exit, always, it detaches them and
    restores everything; then, only if the block ended without an exception and :meth:`commit`
    was called, writes the new stats in place with ``copy_`` (references held elsewhere see
    them).
    """

    def __init__(self, model: nn.Module, layers: Sequence[NamedLayer], exact: bool = False):
        self.model = model
        self.layers = list(layers)
        scratch = Scratch()
        self.captures = [
            CallCapture(
                PopulationStats(m.num_features, name=n, device=m.running_mean.device), exact, scratch
            )
            for n, m in self.layers
        ]
        self._attached: List[nn.Module] = []
        self._saved_buffers: List[Tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self._saved_flags: List[Tuple[Optional[float], bool]] = []
        self._results: Optional[List[Optional[Tuple[torch.Tensor, torch.Tensor]]]] = None

    def __enter__(self) -> "BNPass":
        try:
            self._saved_buffers = [
                (module, key, buf, buf.detach().clone())
                for module in self.model.modules()
                for key, buf in module._buffers.items()
                if buf is not None
            ]
            for (_, module), capture in zip(self.layers, self.captures):
                self._saved_flags.append((module.momentum, module.training))
                module.train()
                module.momentum = 1.0  # read by a subclass's own forward (see capture)
                capture.attach(module)
                self._attached.append(module)
        except BaseException:
            self._restore()
            raise
        return self

    def collect(self) -> List[PopulationStats]:
        """Every layer's stats, with the calls still pending in the capture blocks merged."""
        return flush(self.captures)

    def commit(self, results: List[Optional[Tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Stats to write on a clean exit: ``(mean, var)`` per layer, None to keep a layer's old."""
        self._results = results

    def _restore(self) -> None:
        for module in self._attached:
            CallCapture.detach(module)
        self._attached = []
        for (_, module), (momentum, training) in zip(self.layers, self._saved_flags):
            module.momentum = momentum
            module.train(training)
        self._restore_buffers()

    def _restore_buffers(self) -> None:
        # Some torch versions rebind a buffer (``num_batches_tracked = num_batches_tracked + 1``):
        # put the original tensor object back, so references held elsewhere stay valid.
        for module, key, buf, saved in self._saved_buffers:
            module._buffers[key] = buf
            buf.copy_(saved)

    def __exit__(self, exc_type, exc, tb) -> None:
        with torch.no_grad():
            self._restore()
            if exc_type is not None or self._results is None:
                return
            try:
                for (_, module), result in zip(self.layers, self._results):
                    if result is not None:
                        module.running_mean.copy_(result[0])
                        module.running_var.copy_(result[1])
            except BaseException:
                self._restore_buffers()
                raise


def _autocast_context(autocast: Union[bool, torch.dtype, None], model: nn.Module):
    if not autocast:
        return contextlib.nullcontext()
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()))
    device_type = tensor.device.type
    if autocast is True:
        return torch.autocast(device_type=device_type)
    return torch.autocast(device_type=device_type, dtype=autocast)


def _progress_bar(progress: Union[None, bool, str], total: Optional[int]):
    if progress in (None, False):
        return None
    if progress not in (True, "tqdm"):
        raise ConfigError("progress must be None, False, True or 'tqdm', got {!r}".format(progress))
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="precise-bn", unit="batch")


def _warn_if_short(
    batches: int, samples: int, num_iters: Optional[int], num_samples: Optional[int]
) -> None:
    if num_samples is not None and samples < num_samples:
        message = "the data ran out after {} samples ({} batches); num_samples={} was asked for".format(
            samples, batches, num_samples
        )
    elif num_samples is None and num_iters is not None and batches < num_iters:
        message = "the data ran out after {} batches; num_iters={} was asked for".format(
            batches, num_iters
        )
    else:
        return
    warnings.warn(message, PreciseBNWarning, stacklevel=3)


def update_bn_stats(
    model: nn.Module,
    data_loader: Iterable[Any],
    num_iters: Optional[int] = 200,
    progress: Union[None, bool, str] = None,
    *,
    num_samples: Optional[int] = None,
    forward_fn: Optional[ForwardFn] = None,
    device: Union[None, str, torch.device] = None,
    layers: LayerSpec = None,
    autocast: Union[bool, torch.dtype] = False,
    exact: bool = False,
    sync: Optional[bool] = None,
    group=None,
    unbiased: bool = False,
    log_period: int = 20,
) -> BNReport:
    """Recompute the BN layers' running stats as the population stats of their inputs.

    A drop-in for ``fvcore.nn.precise_bn.update_bn_stats(model, data_loader, num_iters,
    progress)``: same positional arguments and meaning, exact numbers, and every failure leaves
    the model as it was.

    Args:
        model: the model; a DDP wrapper is unwrapped so no per-forward collective runs.
        data_loader: any iterable of batches (see :func:`precise_bn.data.default_forward`).
        num_iters: at most this many batches (None: no limit on batches).
        progress: None/False, or True/"tqdm" for a tqdm bar.
        num_samples: stop once this many samples were seen (a batch is never cut).
        forward_fn: ``forward_fn(model, batch)`` for any other calling convention.
        device: move nested tensors of each batch here first.
        layers: which layers (see :func:`select_layers`).
        autocast: run the forward under ``torch.autocast`` (True, or a dtype).
        exact: measure each call from the BN input in float64 instead of the kernel's float32.
        sync: merge across ranks (default: whenever a process group is initialised).
        group: the process group to merge over.
        unbiased: write ``M2 / (n - 1)`` instead of the population variance ``M2 / n``.
        log_period: log the time per iteration every this many batches.

    Returns:
        A :class:`BNReport`: per layer, elements seen, calls, old and new stats and drift.

    Raises:
        EmptyDataError: no batch at all (on any rank), raised before the model is touched.
        NonFiniteStatsError: a layer saw NaN/Inf; names the layer; the model is unchanged.
    """
    check_budget(num_iters, num_samples)
    sync = distributed.resolve_sync(sync, group)
    net = unwrap_model(model)
    chosen = select_layers(net, layers)
    if not chosen:
        logger.warning("no BatchNorm layer to recompute (none tracks running stats in training mode)")
        return BNReport(world_size=distributed.get_world_size(group) if sync else 1)
    with distributed.abort_merge_on_error(sync, group):
        has_batch, batches = peek(iter(data_loader))
    if not has_batch and not sync:
        raise EmptyDataError("the data loader gave no batch: nothing to measure, model unchanged")
    forward = forward_fn or default_forward
    target_device = torch.device(device) if device is not None else None
    started = time.perf_counter()
    logger.info(
        "precise-bn: recomputing %d BatchNorm layers over %s (%s estimator)",
        len(chosen),
        "{} batches".format(num_iters) if num_samples is None else "{} samples".format(num_samples),
        "exact" if exact else "kernel",
    )
    seen_batches = seen_samples = 0
    bar = _progress_bar(progress, num_iters if num_samples is None else None)
    old = [(m.running_mean.double().cpu(), m.running_var.double().cpu()) for _, m in chosen]
    with BNPass(net, chosen, exact=exact) as bn_pass:
        tick = time.perf_counter()
        with distributed.abort_merge_on_error(sync, group), torch.no_grad(), _autocast_context(
            autocast, net
        ):
            for batch, samples in take_budget(batches, num_iters, num_samples):
                forward(net, move_to_device(batch, target_device))
                seen_batches += 1
                seen_samples += samples
                if bar is not None:
                    bar.update(1)
                if log_period and seen_batches % log_period == 0:
                    now = time.perf_counter()
                    logger.info(
                        "precise-bn: iter %d, %.4f s/iter", seen_batches, (now - tick) / log_period
                    )
                    tick = now
        if bar is not None:
            bar.close()
        stats, total_batches, total_samples = bn_pass.collect(), seen_batches, seen_samples
        if sync:
            stats, total_batches, total_samples = distributed.merge_ranks(
                stats, seen_batches, seen_samples, group
            )
        if total_batches == 0:
            raise EmptyDataError(
                "no rank's data loader gave a batch: nothing to measure, model unchanged"
            )
        _warn_if_short(seen_batches, seen_samples, num_iters, num_samples)
        results = [s.finalize(unbiased) if s.count else None for s in stats]
        bn_pass.commit(results)
    report = BNReport(
        batches=total_batches,
        samples=total_samples,
        world_size=distributed.get_world_size(group) if sync else 1,
        estimator="exact" if exact else "kernel",
    )
    for (name, module), (old_mean, old_var), s, result in zip(chosen, old, stats, results):
        report.layers.append(
            LayerReport(
                name=name,
                elements=s.count,
                calls=s.calls,
                old_mean=old_mean,
                old_var=old_var,
                new_mean=None if result is None else result[0].cpu(),
                new_var=None if result is None else result[1].cpu(),
                eps=float(module.eps),
                clamped=s.clamped,
            )
        )
    if report.unused:
        warnings.warn(
            "{} BatchNorm layer(s) never ran and kept their previous stats: {}".format(
                len(report.unused), ", ".join(report.unused)
            ),
            PreciseBNWarning,
            stacklevel=2,
        )
    report.seconds = time.perf_counter() - started
    logger.info(
        "precise-bn: recomputed %d layers from %d batches (%d samples) in %.2f s",
        len(chosen) - len(report.unused), report.batches, report.samples, report.seconds,
    )
    return report


def update_bn(
    loader: Iterable[Any], model: nn.Module, device: Union[None, str, torch.device] = None
) -> BNReport:
    """A drop-in for ``torch.optim.swa_utils.update_bn``: one pass over the whole loader.

    Every BN layer that tracks running stats is recomputed, whatever its train flag, with the
    exact population statistics instead of swa_utils' average of per-batch unbiased variances.
    Unlike swa_utils, other layers (dropout) keep the mode the caller gave them.
    """
    return update_bn_stats(model, loader, num_iters=None, device=device, layers="all")
