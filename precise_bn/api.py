"""The entry points for PyTorch models: :func:`recompute`, the fvcore and swa_utils drop-ins,
:func:`recalibrated` and :func:`check`.

Each builds a :class:`~precise_bn.pytorch.bn_pass.BNPass` and runs it through
:func:`precise_bn.driver.recalibrate`; they differ only in how a batch reaches the model and in
the defaults their originals have (docs/dropins.md); ``check`` measures without writing and
judges the stored statistics (:mod:`precise_bn.staleness`, docs/check.md).
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Any, ContextManager, Iterable, Iterator, Optional, Tuple, Union

import torch
from torch import nn

from . import driver
from .data import DEFAULT_ITERS, move_to_device, whole_batch_forward
from .options import (DEFAULT_LOG_PERIOD, DEFAULT_MIN_BATCHES, DEFAULT_TIMEOUT, OPTION_FIELDS, ForwardFn, LayerSpec,
                      Options, as_device, drop_retired)
from .pytorch.bn_pass import BNPass
from .report import BNReport
from .signals import all_or_nothing
from .staleness import DEFAULT_ALPHA, DEFAULT_TOLERANCE, CheckReport, Rule, judge


@all_or_nothing
def recompute(
    model: nn.Module,
    data: Iterable[Any],
    *,
    num_batches: Optional[int] = None,
    num_samples: Optional[int] = None,
    forward_fn: Optional[ForwardFn] = None,
    device: Union[None, str, torch.device] = None,
    layers: LayerSpec = None,
    autocast: Union[None, bool, torch.dtype] = None,
    sync: Optional[bool] = None,
    group: Any = None,
    unbiased: bool = False,
    progress: Optional[bool] = None,
    rtol: Optional[float] = None,
    min_batches: int = DEFAULT_MIN_BATCHES,
    timeout: Union[None, float, datetime.timedelta] = DEFAULT_TIMEOUT,
    log_period: Optional[int] = DEFAULT_LOG_PERIOD,
    prior: float = 0.0,
    exact: Optional[bool] = None,
) -> BNReport:
    """Recompute the BN layers' running stats as the population statistics of their inputs.

    The model runs forward only, its BN layers normalising with batch statistics, on batches of
    ``data``; every call of every chosen layer is measured from its input in float64 and merged
    exactly (see :mod:`precise_bn.estimator`), and the population mean and variance are written
    into ``running_mean`` / ``running_var`` in place, rounded to nearest in their dtype, after
    the report and every warning. If the
    call raises, whatever the exception, ``KeyboardInterrupt`` included, the model is exactly
    as it was.

    Args:
        model: the model; DDP and ``torch.compile`` wrappers are looked through.
        data: any iterable of batches.
        num_batches: read at most this many batches (None: no limit).
        num_samples: stop once this many samples were read (a batch is never cut).
            With neither budget, the whole of ``data`` is read (or until ``rtol`` is met).
        forward_fn: ``forward_fn(model, batch)``. By default: a tensor is ``model(batch)``,
            ``(input, target, ...)`` is ``model(batch[0])``, ``{"input": x, ...}`` is
            ``model(x)``, anything else ``model(batch)``; a batch of another shape that the
            model refuses raises :class:`~precise_bn.BatchError` describing it.
        device: move every tensor nested in a batch there first.
        layers: None (BN layers in training mode; all of them if the whole model is in eval
            mode), ``"all"``, or a list of modules or qualified names.
        autocast: run the forward under ``torch.autocast`` (True, or a dtype); BN stays float32.
        sync: merge across ranks (default: whenever a process group spans several processes).
        group: the process group to merge over.
        unbiased: write ``M2 / (n - 1)`` instead of the population variance ``M2 / n``.
        progress: a progress bar on stderr (default: when stderr is a terminal).
        rtol: stop once about 95% of channels are within ``rtol`` of the population value
            (mean in std units, variance relative; :mod:`precise_bn.precision`), checked every
            few batches; the budget still applies, and a pass that ends first warns.
        min_batches: batches read (over all ranks) before ``rtol`` may stop the pass.
        timeout: seconds a rank waits for the others before raising DistributedError (None: no limit).
        log_period: without a bar, log the time per batch every this many batches.
        prior: the running stats count as this many samples, pooled with those read (docs/recalibration.md).

    Returns:
        A :class:`~precise_bn.BNReport`: per layer, elements and calls seen, old and new stats,
        drift and standard errors; why the pass stopped and what it read.
    """
    if exact is not None:
        drop_retired("recompute", {"exact": exact})
    given = locals()
    opts = Options(**{name: given[name] for name in OPTION_FIELDS})
    return driver.recalibrate(BNPass(model, opts), data, opts)


@all_or_nothing
def update_bn_stats(
    model: nn.Module,
    data_loader: Iterable[Any],
    num_iters: Optional[int] = DEFAULT_ITERS,
    progress: Any = None,
    **options: Any,
) -> BNReport:
    """A drop-in for ``fvcore.nn.precise_bn.update_bn_stats(model, data_loader, num_iters, progress)``.

    As in fvcore, every batch goes to ``model(batch)`` whatever its type (unless a
    ``forward_fn`` is given), at most ``num_iters`` batches are read, and ``progress`` may be
    anything: a bar is shown for ``"tqdm"`` (and ``True``). ``**options`` are those of
    :func:`recompute` (``num_batches`` excepted: it is ``num_iters`` here). docs/dropins.md lists
    every difference from fvcore (population variance, restored ``num_batches_tracked``, a
    warning instead of an ``AssertionError`` for a short loader, ...).
    """
    if "num_batches" in options:
        raise TypeError("update_bn_stats() takes the batch budget as num_iters, not num_batches")
    opts = Options.build("update_bn_stats", num_batches=num_iters,
                         progress=progress is True or (isinstance(progress, str) and progress == "tqdm"),
                         **options)
    return driver.recalibrate(BNPass(model, opts, whole_batch_forward, budget_name="num_iters"), data_loader, opts)


def _swa_forward(device: Optional[torch.device]) -> ForwardFn:
    def forward(model: nn.Module, batch: Any) -> Any:
        if isinstance(batch, (list, tuple)):
            batch = batch[0]
        return model(move_to_device(batch, device))

    return forward


@all_or_nothing
def update_bn(loader: Iterable[Any], model: nn.Module, device: Union[None, str, torch.device] = None) -> BNReport:
    """A drop-in for ``torch.optim.swa_utils.update_bn``: one pass over the whole loader.

    As in swa_utils, a list/tuple batch gives ``model(batch[0])`` and anything else
    ``model(batch)``, the input moved to ``device``, and every BN layer that tracks running
    stats is recomputed whatever its train flag. What differs (exact population statistics,
    dropout left as it was, ...) is listed in docs/dropins.md.
    """
    # The input alone goes to ``device``, as in swa_utils: the forward moves it, not the pass.
    opts = Options(layers="all", progress=False)
    return driver.recalibrate(BNPass(model, opts, _swa_forward(as_device(device))), loader, opts)


@all_or_nothing
def check(
    model: nn.Module,
    data: Iterable[Any],
    *,
    tolerance: Tuple[float, float] = DEFAULT_TOLERANCE,
    alpha: float = DEFAULT_ALPHA,
    **options: Any,
) -> CheckReport:
    """Do ``model``'s stored BN statistics fit ``data``? Measures as :func:`recompute` does, with
    the same ``**options`` (all but ``prior``), and writes nothing: the model is left bit for bit
    as it was, its buffers the same tensor objects.

    A layer is stale when some channel's stored mean or variance differs from the measured one
    by more than ``tolerance`` (``(mean in std units, variance relative)``) and by more than
    sampling explains, at a family-wise false-alarm level ``alpha`` over every channel of the
    model (:mod:`precise_bn.staleness`, docs/check.md). ``report.verdict`` is ``"fits"``,
    ``"stale"`` (``report.stale`` names the layers) or ``"untested"``: the data could not test
    some channel (too few of them, as each layer needs :data:`~precise_bn.staleness.MIN_CALLS`
    calls, or standard errors that cannot be trusted), which is no verdict: gate on
    ``report.fits``, not on an empty ``report.stale``. ``print(report)`` shows the drifts and
    their significance.
    """
    rule = Rule(tolerance, alpha)
    if "prior" in options:
        raise TypeError("check() takes no prior: it compares the stored statistics with the data's own "
                        "(prior pools them in what recompute writes)")
    opts = Options.build("check", also_known=("tolerance", "alpha"), **options)
    return judge(driver.recalibrate(BNPass(model, opts), data, opts, write=False), rule)


def recalibrated(model: nn.Module, data: Iterable[Any], **options: Any) -> ContextManager[BNReport]:
    """``with recalibrated(model, data, **options) as report:`` the model runs with recomputed
    BN statistics inside the block only.

    On entry, :func:`recompute` with ``options`` (checked now, when given); on exit, however the
    block is left (an exception, ``KeyboardInterrupt``), every buffer of the recomputed layers is
    put back bit for bit, as the same tensor objects, whatever happened to them inside the
    block, unless ``report.undo()`` already did. For compression and architecture-search loops:
    recalibrate a subnet, evaluate it, go back. See ``docs/recalibration.md``.
    """
    return _recalibrated(model, data, Options.build("recalibrated", **options))


@contextlib.contextmanager
def _recalibrated(model: nn.Module, data: Iterable[Any], opts: Options) -> Iterator[BNReport]:
    # A generator, not a class: a signal handled on entering a class's ``__exit__`` would skip
    # it, while a generator left suspended is closed (running its ``finally``) when its context
    # manager is dropped. The pass keeps what it wrote (``BNPass.written``) in the writing call
    # itself, so no instant after the write escapes the ``except``, which puts the statistics
    # back whatever the block raised, and again if an interrupt cut the first put-back short.
    backend = BNPass(model, opts)
    try:
        yield _recompute_with(backend, data, opts)
        backend.put_back()
    except BaseException:
        backend.put_back()
        raise


#: The entry of a ``recalibrated`` block: a generator cannot be an all-or-nothing call itself.
_recompute_with = all_or_nothing(driver.recalibrate)
