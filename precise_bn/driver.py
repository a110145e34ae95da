"""The pass driver both backends share: budget, progress, rank rounds, the precision stop, the report.

A backend knows how to run one batch and read its layers' statistics (:class:`Backend`); the
driver decides how many batches to run and when to talk to the other ranks:

* the budget: at most ``num_batches`` batches and ``num_samples`` samples (a batch is never
  cut), or until the data ends; ``stop`` names what ended the pass: ``"num_batches"``,
  ``"num_samples"``, ``"data"`` or ``"rtol"``;
* rounds: with several ranks, every :data:`CHECK_EVERY` batches every rank reports its status
  (:class:`~precise_bn.distributed.Ranks`), so a rank that failed is known within a few
  batches; a rank whose data ended keeps answering rounds until every rank is done;
* the precision stop (``rtol``): at those rounds (every :data:`CHECK_EVERY` batches on one
  process), once ``min_batches`` batches were read in all, the statistics merged so far decide
  whether every channel is precise enough (:func:`~precise_bn.precision.worst_ratio`: what
  ``rtol`` promises, and how it is kept); every rank decides on the
  same bits, so all stop after the same batch.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from .data import batches_for_samples, planned_batches
from .distributed import ACTIVE, DONE, Ranks, fingerprint, resolve_sync
from .buffers import check_fits
from .errors import EmptyDataError, warn
from .estimator import PopulationStats, pool_with_prior
from .options import Options
from .precision import flags, warn_if_imprecise, warn_if_rtol_unreachable, worst_ratio
from .report import BNReport, LayerReport, counted
from .signals import all_or_nothing

logger = logging.getLogger("precise_bn")

#: Batches between two rounds with the other ranks, and between two precision checks.
CHECK_EVERY = 8

Stats = Tuple[torch.Tensor, torch.Tensor]


class Backend(Protocol):
    """What the driver needs from a backend: the layers, running batches, reading statistics,
    and writing results (a write that the call undoes if it raises afterwards)."""

    estimator: str
    names: List[str]
    eps: List[float]
    #: The dtype of each layer's running buffers: what the results must fit in.
    dtypes: List[torch.dtype]
    empty_reason: str
    #: Once the batches are run: modules whose running statistics a forward changed outside the
    #: measured layers (a functional ``batch_norm``), put back and not recomputed.
    not_recomputed: Sequence[str]

    def old_stats(self) -> List[Stats]:
        """Each layer's running mean and variance before the pass, float64 on the CPU."""

    def plan(self, batches: Optional[int]) -> None:
        """The number of batches the pass expects to read (None: unknown), before the first."""

    def attached(self) -> ContextManager[Any]:
        """The model prepared for measuring; leaving the block restores it, however it is left."""

    def restore(self) -> None:
        """Put the model back exactly as before the call (idempotent; rewinds a write too)."""

    def running(self) -> ContextManager[Any]:
        """The context the batches run in (no autograd, autocast, ...)."""

    def step(self, batch: Any) -> int:
        """Run one batch through the model; return how many samples it held."""

    def collect(self) -> List[PopulationStats]:
        """This process's statistics so far, one per layer, pending calls merged."""

    def finish(self, results: Sequence[Optional[Stats]]) -> None:
        """Write ``results`` (None: keep that layer's statistics) with
        :func:`~precise_bn.signals.write`, so that a call that raises afterwards undoes it."""


@dataclass
class Outcome:
    """What a pass read: ``stats`` merged over ranks, counts summed over ranks."""

    stats: List[PopulationStats]
    batches: int
    samples: int
    stop: str
    local_batches: int
    local_samples: int


class _Progress:
    """A tqdm bar on stderr (when asked, or by default when stderr is a terminal) counting
    batches, whose total is what the pass will really read (with a sample budget, estimated
    from the batches read so far: a batch is never cut), and ``log_period`` lines when there
    is no bar."""

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

    def play(self, status: int, batches: int, samples: int) -> Tuple[bool, bool]:
        """One round; returns (every rank is done, the statistics are precise enough)."""
        headers = self.ranks.exchange(status, batches, samples)
        self.totals = (sum(h.batches for h in headers), sum(h.samples for h in headers))
        all_done = all(h.status == DONE for h in headers)
        check = self.opts.rtol is not None and self.totals[0] >= self.opts.min_batches
        if not (check or all_done):
            return all_done, False
        # Each rank merges a slice of the channels; the decision needs only each layer's worst
        # ratio over the slices (1 or less: precise enough), and the whole statistics travel
        # once the pass stops.
        part = self.ranks.merge_part(self.backend.collect())
        rtol, samples = self.opts.rtol or 0.0, self.totals[1]
        precise = check and max(self.ranks.worst(part, lambda s: worst_ratio(s, rtol, samples)), default=0.0) <= 1.0
        if precise or all_done:
            self.merged = self.ranks.assemble(part)
        return all_done, precise


def run_pass(backend: Backend, batches: Iterator[Any], opts: Options, ranks: Ranks,
             planned: Optional[int], label: str = "precise-bn") -> Outcome:
    """Run ``backend`` over ``batches`` within the budget of ``opts``; merge over ``ranks``."""
    rounds = _Rounds(backend, ranks, opts)
    progress = _Progress(opts, planned, label)
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
                if rounds.needed and done % CHECK_EVERY == 0 and rounds.play(ACTIVE, done, samples)[1]:
                    stop = "rtol"
                    break
    finally:
        progress.close()
    if ranks.world == 1:
        return Outcome(backend.collect(), done, samples, stop, done, samples)
    while stop != "rtol":
        all_done, precise = rounds.play(DONE, done, samples)
        if precise:
            stop = "rtol"
        elif all_done:
            break
    assert rounds.merged is not None
    return Outcome(rounds.merged, rounds.totals[0], rounds.totals[1], stop, done, samples)


def warn_if_short(opts: Options, outcome: Outcome, what: str = "num_batches") -> None:
    """A :class:`PreciseBNWarning` when this rank's data ended before the budget it was given."""
    if outcome.stop != "data":
        return
    if opts.num_samples is not None:
        message = "the data ran out after {} samples ({} batches); num_samples={} was asked for".format(
            outcome.local_samples, outcome.local_batches, opts.num_samples)
    elif opts.num_batches is not None:
        message = "the data ran out after {} batches; {}={} was asked for".format(
            outcome.local_batches, what, opts.num_batches)
    else:
        return
    warn(message)


def finalize(stats: Sequence[PopulationStats], unbiased: bool) -> List[Optional[Stats]]:
    """Each layer's ``(mean, var)`` in float64, or None for a layer that never ran (a
    non-finite one raises :class:`~precise_bn.NonFiniteStatsError`, naming the layer)."""
    return [s.finalize(unbiased) if s.count else None for s in stats]


def name_not_recomputed(backend: Backend, report: BNReport) -> None:
    """Fill ``BNReport.not_recomputed`` and name those modules in one warning."""
    report.not_recomputed = list(backend.not_recomputed)
    if report.not_recomputed:
        warn("not recomputed: {}: a functional batch_norm call changed their running statistics during the "
             "pass, which precise-bn does not measure, so they were put back as they were. A BatchNorm layer "
             "(torch.nn.BatchNorm1d/2d/3d or a subclass) in its place would be recomputed".format(
                 ", ".join(report.not_recomputed)))


def build_report(
    names: Sequence[str],
    old: Sequence[Stats],
    eps: Sequence[float],
    outcome: Outcome,
    results: Sequence[Optional[Stats]],
    *,
    estimator: str,
    world_size: int,
    opts: Options,
    seconds: float,
    reasons: Sequence[Dict[str, List[int]]],
) -> BNReport:
    """The :class:`BNReport` of a pass, with every layer's standard errors and, in ``reasons``,
    the channels whose standard errors cannot be trusted (:func:`~precise_bn.precision.flags`)."""
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


@all_or_nothing
def recalibrate(
    make_backend: Callable[[], Backend],
    data: Iterable[Any],
    opts: Options,
    *,
    budget_name: str = "num_batches",
    on_write: Optional[Callable[[BNReport], Any]] = None,
    label: str = "precise-bn",
    write: bool = True,
) -> BNReport:
    """One recalibration, on any backend: build it, measure, report, write.

    ``on_write(report)`` runs right after the new statistics are written (the step cache
    stores them there); if it raises, the write is undone. ``write=False`` measures and
    reports only: the model is left as it was (``precise_bn.check``). With several ranks, any exception
    on one rank, from building the backend (layer selection) to the report, makes every other
    rank raise :class:`~precise_bn.DistributedError`; no rank writes unless all can.
    """
    started = time.perf_counter()
    ranks: Optional[Ranks] = None
    backend: Optional[Backend] = None
    grad_enabled = torch.is_grad_enabled()
    # An exception between two statements (a signal's handler) must still tell the other ranks
    # and put the model back. Leaving ``backend.attached()`` puts it back too, but a ``with``
    # block's ``__exit__`` is not guaranteed to run: a signal handled just before it (on
    # entering it, on CPython 3.11) raises with the captures still on, or autograd still off.
    # ``backend.restore()`` is idempotent.
    try:
        ranks = Ranks(resolve_sync(opts.sync, opts.group), opts.group, opts.timeout)
        backend = make_backend()
        ranks.start(fingerprint(opts, backend.collect()))
        if not backend.names:  # on every rank: the first round compared the layers
            logger.warning("%s: nothing to recompute: %s", label, backend.empty_reason)
            ranks.finish()
            return BNReport(world_size=ranks.world, estimator=backend.estimator)
        results, report = _measure(backend, data, opts, ranks, budget_name, label, started)
        if not write:
            return report
        backend.finish(results)
        if on_write is not None:
            on_write(report)
        return report
    except BaseException:
        try:
            if ranks is not None:
                ranks.abort()
            if backend is not None:
                backend.restore()
        finally:
            torch.set_grad_enabled(grad_enabled)
        raise


def _measure(backend: Backend, data: Iterable[Any], opts: Options, ranks: Ranks, budget_name: str, label: str,
             started: float) -> Tuple[List[Optional[Stats]], BNReport]:
    """The pass, the merge, the report and every warning; a last round says every rank got here."""
    logger.info("%s: measuring %d BatchNorm layer%s (%s estimator)", label, len(backend.names),
                "" if len(backend.names) == 1 else "s", backend.estimator)
    old = backend.old_stats()
    planned = planned_batches(data, opts.num_batches)
    backend.plan(planned)
    warn_if_rtol_unreachable(opts, planned, getattr(data, "batch_size", None), ranks.world)
    with backend.attached():
        outcome = run_pass(backend, iter(data), opts, ranks, planned, label)
        if outcome.batches == 0:
            raise EmptyDataError("the data gave no batch{}: nothing to measure, model unchanged".format(
                " on any rank" if ranks.world > 1 else ""))
        warn_if_short(opts, outcome, budget_name)
        reasons = [flags(s) for s in outcome.stats]
        warn_if_imprecise(opts, outcome.stats, backend.names, reasons, outcome.batches, outcome.samples, outcome.stop)
        targets = finalize(outcome.stats, opts.unbiased)
        results = [t if t is None or not opts.prior else pool_with_prior(o, t, opts.prior, outcome.samples)
                   for o, t in zip(old, targets)]
        check_fits(backend.names, results, backend.dtypes)
        report = build_report(backend.names, old, backend.eps, outcome, results, estimator=backend.estimator,
                              world_size=ranks.world, opts=opts, seconds=time.perf_counter() - started,
                              reasons=reasons)
        if opts.prior:
            for layer, target in zip(report.layers, targets):
                layer.target_mean, layer.target_var = (None, None) if target is None else (t.cpu() for t in target)
        name_not_recomputed(backend, report)
        logger.info("%s: %s (%s) read in %.2f s; stopped: %s", label, counted(report.batches, "batch", "batches"),
                    counted(report.samples, "sample"), report.seconds, report.stop)
        ranks.exchange(ACTIVE, round_="end")
        ranks.finish()
    return results, report
