"""The pass both backends share and :func:`recalibrate`, the whole call: budget, progress, rounds
with the other ranks, the ``rtol`` stop, the report, the backend's write (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from .data import DefaultBudget, batches_for_samples, planned_batches
from .distributed import ACTIVE, DONE, Ranks, fingerprint, resolve_sync
from .buffers import Stats, check_fits
from .errors import EmptyDataError, warn
from .estimator import PopulationStats, pool_with_prior
from .options import Options
from .precision import flags, warn_if_imprecise, warn_if_rtol_unreachable, worst_ratio
from .report import BNReport, LayerReport, counted

logger = logging.getLogger("precise_bn")

#: Batches between two rounds with the other ranks, and between two precision checks.
CHECK_EVERY = 8


class Backend(Protocol):
    """What the driver needs from a backend: the layers, running batches, reading statistics and
    writing results; its name in logs (``label``), its estimator's (``kind``), its budget's."""

    label: str
    kind: str
    budget_name: str
    names: List[str]
    eps: List[float]
    #: The dtype of each layer's running buffers: what the results must fit in.
    dtypes: List[torch.dtype]
    empty_reason: str
    #: Known after the batches, all put back: functional ``batch_norm`` statistics, other buffers and
    #: parameters the forwards changed (by name).
    not_recomputed: Sequence[str]
    changed_buffers: Sequence[str]
    changed_parameters: Sequence[str]

    def choose(self) -> None:
        """Choose the layers (``names``, ``eps``, ``dtypes`` are known afterwards)."""

    def prepare(self, batches: Optional[int]) -> List[Stats]:
        """Ready the model for about ``batches`` batches (None: unknown), undone by
        :meth:`restore`; return each layer's running mean and variance from before the pass,
        float64 on the CPU, in tensors of their own."""

    def restore(self) -> None:
        """Put the model back exactly as before the call (idempotent; rewinds a write too)."""

    def running(self) -> ContextManager[Any]:
        """The context the batches run in (no autograd, autocast, ...)."""

    def step(self, batch: Any) -> int:
        """Run one batch through the model; return how many samples it held."""

    def collect(self) -> List[PopulationStats]:
        """This process's statistics so far, one per layer, pending calls merged."""

    def write(self, results: Sequence[Optional[Stats]], report: BNReport) -> None:
        """Put the model back and write ``results`` (None: keep a layer's) as one
        :func:`~precise_bn.signals.write`; keep in ``report`` what ``report.undo()`` needs."""


@dataclass
class PassResult:
    """What a pass read: ``stats`` merged over ranks, counts summed over ranks."""

    stats: List[PopulationStats]
    batches: int
    samples: int
    stop: str
    local_batches: int
    local_samples: int


class _Progress:
    """A tqdm bar on stderr (default: on a terminal) whose total is what the pass will really read
    (:func:`~precise_bn.data.batches_for_samples`), else ``log_period`` lines."""

    def __init__(self, opts: Options, planned: Optional[int], label: str):
        self.label, self.planned, self.num_samples = label, planned, opts.num_samples
        show = opts.progress if opts.progress is not None else sys.stderr.isatty()
        self.bar: Any = None
        self._redirect: ContextManager[Any] = contextlib.nullcontext()
        if show:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=planned, desc=label, unit="batch", file=sys.stderr, dynamic_ncols=True)
            self._redirect = logging_redirect_tqdm(loggers=[logger, logging.getLogger()])
            self._redirect.__enter__()
        self.log_period = None if show else opts.log_period
        self.tick = time.perf_counter()

    def update(self, batches: int, samples: int) -> None:
        """After ``batches`` batches holding ``samples`` samples in all."""
        if self.bar is not None:
            if self.num_samples is not None:
                self.bar.total = batches_for_samples(batches, samples, self.num_samples, self.planned)
            self.bar.set_postfix_str("{} samples".format(samples), refresh=False)
            self.bar.update(1)
        elif self.log_period and batches % self.log_period == 0:
            now = time.perf_counter()
            logger.info("%s: batch %d, %.4f s/batch", self.label, batches, (now - self.tick) / self.log_period)
            self.tick = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
            self.bar = None


class _Rounds:
    """The rounds of one pass: status with the other ranks, and the precision decision."""

    def __init__(self, backend: Backend, ranks: Ranks, opts: Options):
        self.backend, self.ranks, self.opts = backend, ranks, opts
        self.merged: Optional[List[PopulationStats]] = None
        self.totals = (0, 0)

    @property
    def needed(self) -> bool:
        return self.ranks.world > 1 or self.opts.rtol is not None

    def report_status(self, status: int, batches: int, samples: int) -> Tuple[bool, bool]:
        """One round; returns (every rank is done, the statistics are precise enough)."""
        headers = self.ranks.exchange(status, batches, samples)
        self.totals = (sum(h.batches for h in headers), sum(h.samples for h in headers))
        all_done = all(h.status == DONE for h in headers)
        check = self.opts.rtol is not None and self.totals[0] >= self.opts.min_batches
        if not (check or all_done):
            return all_done, False
        # The decision needs each layer's worst ratio over the slices only; whole statistics travel
        # once the pass stops.
        part = self.ranks.merge_part(self.backend.collect())
        rtol, samples = self.opts.rtol or 0.0, self.totals[1]
        precise = check and max(self.ranks.worst(part, lambda s: worst_ratio(s, rtol, samples)), default=0.0) <= 1.0
        if precise or all_done:
            self.merged = self.ranks.assemble(part)
        return all_done, precise


def run_pass(backend: Backend, batches: Iterator[Any], opts: Options, ranks: Ranks,
             planned: Optional[int]) -> PassResult:
    """Run ``backend`` over ``batches`` within the budget of ``opts``; merge over ``ranks``."""
    rounds = _Rounds(backend, ranks, opts)
    progress = _Progress(opts, planned, backend.label)
    done = samples = 0
    stop = "num_batches"
    try:
        with backend.running():
            while True:
                if opts.num_batches is not None and done >= opts.num_batches:
                    break
                if opts.num_samples is not None and samples >= opts.num_samples:
                    stop = "num_samples"
                    break
                try:
                    batch = next(batches)
                except StopIteration:
                    stop = "data"
                    break
                samples += backend.step(batch)
                done += 1
                progress.update(done, samples)
                if rounds.needed and done % CHECK_EVERY == 0 and rounds.report_status(ACTIVE, done, samples)[1]:
                    stop = "rtol"
                    break
    finally:
        progress.close()
    if ranks.world == 1:
        return PassResult(backend.collect(), done, samples, stop, done, samples)
    while stop != "rtol":
        all_done, precise = rounds.report_status(DONE, done, samples)
        if precise:
            stop = "rtol"
        elif all_done:
            break
    assert rounds.merged is not None
    return PassResult(rounds.merged, rounds.totals[0], rounds.totals[1], stop, done, samples)


def warn_if_short(opts: Options, outcome: PassResult, what: str = "num_batches") -> None:
    """A :class:`PreciseBNWarning` when this rank's data ended before its budget (named ``what``)."""
    if outcome.stop != "data":
        return
    read = counted(outcome.local_batches, "batch", "batches")
    if opts.num_samples is not None:
        warn("the data ran out after {} ({}); num_samples={} was asked for".format(
            counted(outcome.local_samples, "sample"), read, opts.num_samples))
    elif isinstance(opts.num_batches, DefaultBudget):
        warn("the data ran out after {}, before the default {}={} ({} was not given: pass it to set the "
             "budget)".format(read, what, opts.num_batches, what))
    elif opts.num_batches is not None:
        warn("the data ran out after {}; {}={} was asked for".format(read, what, opts.num_batches))


def finalize(stats: Sequence[PopulationStats], unbiased: bool) -> List[Optional[Stats]]:
    """Each layer's float64 ``(mean, var)``, None where it never ran (non-finite: an error naming it)."""
    return [s.finalize(unbiased) if s.count else None for s in stats]


def name_not_recomputed(backend: Backend, report: BNReport) -> None:
    """Put in ``report`` what the forwards changed besides the statistics, and warn of it once."""
    report.not_recomputed = list(backend.not_recomputed)
    report.changed_buffers = list(backend.changed_buffers)
    report.changed_parameters = list(backend.changed_parameters)
    message = report.put_back_warning()
    if message:
        warn(message)


def build_report(
    names: Sequence[str],
    old: Sequence[Stats],
    eps: Sequence[float],
    outcome: PassResult,
    results: Sequence[Optional[Stats]],
    *,
    estimator: str,
    world_size: int,
    opts: Options,
    seconds: float,
    reasons: Sequence[Dict[str, List[int]]],
) -> BNReport:
    """The :class:`BNReport` of a pass, with standard errors and ``reasons`` not to trust some."""
    report = BNReport(batches=outcome.batches, samples=outcome.samples, world_size=world_size,
                      estimator=estimator, seconds=seconds, stop=outcome.stop, rtol=opts.rtol)
    for name, (old_mean, old_var), layer_eps, s, result, why in zip(names, old, eps, outcome.stats, results, reasons):
        mean_se, var_se = s.stderr(opts.unbiased) if result is not None else (None, None)
        report.layers.append(LayerReport(
            name=name, elements=s.count, calls=s.calls, old_mean=old_mean, old_var=old_var,
            new_mean=None if result is None else result[0].cpu(),
            new_var=None if result is None else result[1].cpu(),
            mean_stderr=None if mean_se is None else mean_se.cpu(),
            var_stderr=None if var_se is None else var_se.cpu(), eps=float(layer_eps),
            se_untrusted=sorted(c for channels in why.values() for c in channels), se_reasons=why))
    if report.unused:
        warn("{} BatchNorm layer(s) never ran and kept their previous stats: {}".format(
            len(report.unused), ", ".join(report.unused)))
    return report


def recalibrate(backend: Backend, data: Iterable[Any], opts: Options, *, write: bool = True) -> BNReport:
    """One recalibration on any backend, inside an all-or-nothing call: choose, measure, report,
    write (``write=False``: the model left as it was). An exception on one rank makes every
    other raise :class:`~precise_bn.DistributedError`; no rank writes unless all can."""
    started = time.perf_counter()
    ranks: Optional[Ranks] = None
    grad_enabled = torch.is_grad_enabled()
    # Not a ``with`` block: a signal on entering ``__exit__`` would skip it (docs/interrupts.md).
    try:
        ranks = Ranks(resolve_sync(opts.sync, opts.group), opts.group, opts.timeout)
        backend.choose()
        if ranks.world > 1:
            ranks.start(fingerprint(opts, backend.collect()))
        if not backend.names:  # on every rank: the first round compared the layers
            logger.warning("%s: nothing to recompute: %s", backend.label, backend.empty_reason)
            ranks.finish()
            return BNReport(world_size=ranks.world, estimator=backend.kind)
        results, report = _measure(backend, data, opts, ranks, started)
        if write:
            backend.write(results, report)
        else:
            backend.restore()
        return report
    except BaseException:
        try:
            if ranks is not None:
                ranks.abort()
            backend.restore()
        finally:
            torch.set_grad_enabled(grad_enabled)
        raise


def _measure(backend: Backend, data: Iterable[Any], opts: Options, ranks: Ranks,
             started: float) -> Tuple[List[Optional[Stats]], BNReport]:
    """The pass, the merge, the report and every warning; a last round says every rank got here."""
    label = backend.label
    logger.info("%s: measuring %d BatchNorm layer%s (%s estimator)", label, len(backend.names),
                "" if len(backend.names) == 1 else "s", backend.kind)
    planned = planned_batches(data, opts.num_batches)
    warn_if_rtol_unreachable(opts, planned, getattr(data, "batch_size", None), ranks.world)
    old = backend.prepare(planned)
    outcome = run_pass(backend, iter(data), opts, ranks, planned)
    if outcome.batches == 0:
        raise EmptyDataError("the data gave no batch{}: nothing to measure, model unchanged".format(
            " on any rank" if ranks.world > 1 else ""))
    warn_if_short(opts, outcome, backend.budget_name)
    reasons = [flags(s) for s in outcome.stats]
    warn_if_imprecise(opts, outcome.stats, backend.names, reasons, outcome.batches, outcome.samples, outcome.stop)
    targets = finalize(outcome.stats, opts.unbiased)
    results = [t if t is None or not opts.prior else pool_with_prior(o, t, opts.prior, outcome.samples)
               for o, t in zip(old, targets)]
    check_fits(backend.names, results, backend.dtypes)
    report = build_report(backend.names, old, backend.eps, outcome, results, estimator=backend.kind,
                          world_size=ranks.world, opts=opts, seconds=time.perf_counter() - started,
                          reasons=reasons)
    if opts.prior:
        for layer, target in zip(report.layers, targets):
            layer.target_mean, layer.target_var = (None, None) if target is None else (t.cpu() for t in target)
    name_not_recomputed(backend, report)
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s: %s (%s) read in %.2f s; stopped: %s", label, counted(report.batches, "batch", "batches"),
                    counted(report.samples, "sample"), report.seconds, report.stop)
    ranks.exchange(ACTIVE, round_="end")
    ranks.finish()
    return results, report
