"""The entry points for PyTorch models: :func:`recompute`, the fvcore and swa_utils drop-ins
(docs/dropins.md), :func:`recalibrated` and :func:`check`, each a ``BNPass`` run by the driver."""
from __future__ import annotations

import contextlib
import datetime
from typing import Any, ContextManager, Iterable, Iterator, Optional, Tuple, Union

import torch
from torch import nn

from . import driver
from .data import DEFAULT_ITERS, move_to_device, whole_batch_forward
from .options import (DEFAULT_LOG_PERIOD, DEFAULT_MIN_BATCHES, DEFAULT_TIMEOUT, OPTION_FIELDS, ForwardFn, LayerSpec,
                      Options, as_device, drop_retired, option_help)
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
    """Recompute the BN layers' running stats as the population statistics of their inputs: each
    call of each chosen layer measured in float64, merged exactly, rounded to nearest into the
    buffers. If it raises (Ctrl-C too), the model is as it was. Options (README's table):
    """
    if exact is not None:
        drop_retired("recompute", {"exact": exact})
    given = locals()
    opts = Options(**{name: given[name] for name in OPTION_FIELDS})
    return driver.recalibrate(BNPass(model, opts), data, opts)


recompute.__doc__ = (recompute.__doc__ or "") + "".join(
    "\n    {}: {}".format(name, option_help(name)) for name in OPTION_FIELDS) + "\n"


@all_or_nothing
def update_bn_stats(
    model: nn.Module,
    data_loader: Iterable[Any],
    num_iters: Optional[int] = DEFAULT_ITERS,
    progress: Any = None,
    **options: Any,
) -> BNReport:
    """fvcore's ``update_bn_stats``: ``model(batch)``, ``num_iters`` batches, a bar for ``progress="tqdm"``
    or True, ``**options`` :func:`recompute`'s but ``num_batches`` (differences: docs/dropins.md)."""
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
    """A drop-in for ``torch.optim.swa_utils.update_bn``: one pass over the whole loader, every
    BN layer whatever its train flag, ``batch[0]`` of a list/tuple batch, the input alone moved
    to ``device`` as there. Differences: docs/dropins.md."""
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
    """Do ``model``'s stored BN statistics fit ``data``? Measures as :func:`recompute` does (its
    options but ``prior``) and writes nothing. A layer is stale when a channel differs by more
    than ``tolerance`` (mean in std units, variance relative) and more than sampling explains
    at family-wise level ``alpha`` (docs/check.md). Gate on ``report.fits``: "untested" is no verdict."""
    rule = Rule(tolerance, alpha)
    if "prior" in options:
        raise TypeError("check() takes no prior: it compares the stored statistics with the data's own "
                        "(prior pools them in what recompute writes)")
    opts = Options.build("check", also_known=("tolerance", "alpha"), **options)
    return judge(driver.recalibrate(BNPass(model, opts), data, opts, write=False), rule)


def recalibrated(model: nn.Module, data: Iterable[Any], **options: Any) -> ContextManager[BNReport]:
    """``with recalibrated(model, data, **options) as report:`` recomputed BN statistics inside the
    block only, put back bit for bit however it is left (docs/recalibration.md)."""
    return _recalibrated(model, data, Options.build("recalibrated", **options))


@contextlib.contextmanager
def _recalibrated(model: nn.Module, data: Iterable[Any], opts: Options) -> Iterator[BNReport]:
    # A generator, not a class: a signal on entering a class's ``__exit__`` would skip it, while a
    # suspended generator is closed (its ``finally`` run) when dropped (docs/interrupts.md).
    backend = BNPass(model, opts)
    try:
        yield _recompute_with(backend, data, opts)
        backend.put_back()
    except BaseException:
        backend.put_back()
        raise


#: The entry of a ``recalibrated`` block: a generator cannot be an all-or-nothing call itself.
_recompute_with = all_or_nothing(driver.recalibrate)
