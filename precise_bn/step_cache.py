"""Recompute for a new key; for the same key, write back what was computed then.

Why a cache: the running stats a model is evaluated with must be the ones its checkpoint
carries, or the saved model scores differently from the validated one. The first call for a
key recomputes; any later call with the same key (evaluation, then checkpoint) writes the very
same values back without running a forward, even if something touched the buffers in between.
The key is the training step and, for PyTorch models, what the stats are a function of besides
the data (:meth:`precise_bn.torch_job.TorchJob.state`: which modules, which weights), so
a checkpoint loaded or another module validated at the same step is recomputed, never given
stats that belong to other weights. :class:`~precise_bn.BatchNormHelper` (either backend) and
:class:`~precise_bn.PreciseBNHook` both keep one.
"""
from __future__ import annotations

from typing import Any, Callable, Generic, Optional, TypeVar

from .report import BNReport
from .signals import all_or_nothing, write

C = TypeVar("C")
Store = Callable[[C, BNReport], None]


class StepCache(Generic[C]):
    """The values and report of the last recomputation, the key they belong to, and how many
    recomputations there were."""

    def __init__(self) -> None:
        self.key: Any = None
        self.value: Optional[C] = None
        self.report: Optional[BNReport] = None
        self.recomputations = 0

    @all_or_nothing
    def recompute_or_write_back(self, key: Any, compute: Callable[[Store], BNReport],
                                apply: Callable[[C], None]) -> BNReport:
        """``apply`` the cached values when ``key`` is the cached one (``None`` never is);
        else ``compute(store)``, which must call ``store(values, report)`` once it has written.

        Storing is a :func:`~precise_bn.signals.write` of its own: if the call raises after it
        (a signal as the model's write ended: that write is undone too), the cache is as it
        was, so the next call with this key recomputes rather than writing back stats the
        model never kept.
        """
        if key is not None and self.value is not None and key == self.key and self.report is not None:
            apply(self.value)
            return self.report
        return compute(lambda value, report: self._store(key, value, report))

    @all_or_nothing
    def forget(self) -> None:
        """No key is the cached one any more: the next call recomputes."""
        kept = self.key
        write(lambda: setattr(self, "key", None), lambda: setattr(self, "key", kept))

    def _store(self, key: Any, value: C, report: BNReport) -> None:
        kept = self.key, self.value, self.report, self.recomputations

        def change() -> None:
            self.key, self.value, self.report = key, value, report
            self.recomputations = kept[3] + 1

        def undo() -> None:
            self.key, self.value, self.report, self.recomputations = kept

        write(change, undo)


class CachedRecomputations:
    """What an object keeping a :class:`StepCache` as ``cache`` tells its users about it."""

    cache: StepCache[Any]

    @property
    def last_report(self) -> Optional[BNReport]:
        """The report of the recomputation the current stats come from."""
        return self.cache.report

    @property
    def recomputations(self) -> int:
        """How many times the stats were recomputed (calls that wrote cached stats back excluded)."""
        return self.cache.recomputations
