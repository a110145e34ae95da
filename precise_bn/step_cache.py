"""Recompute for a new key (step, weights); for the same key, write back what was computed then,
so that a checkpoint carries the very stats its model was evaluated with."""
from __future__ import annotations

from typing import Any, Callable, Generic, Optional, TypeVar

from .report import BNReport
from .signals import all_or_nothing, write

C = TypeVar("C")
Store = Callable[[C, BNReport], None]


class StepCache(Generic[C]):
    def __init__(self) -> None:
        self.key: Any = None
        self.value: Optional[C] = None
        self.report: Optional[BNReport] = None
        self.recomputations = 0

    @all_or_nothing
    def recompute_or_write_back(self, key: Any, compute: Callable[[Store], BNReport],
                                apply: Callable[[C], None]) -> BNReport:
        """``apply`` the cached values when ``key`` is the cached one (``None`` never is); else
        ``compute(store)``, which calls ``store(values, report)`` once it has written: a write
        of its own, undone with the model's if the call raises after it."""
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
    """What an object keeping a :class:`StepCache` as ``cache`` tells about it."""

    cache: StepCache[Any]

    @property
    def last_report(self) -> Optional[BNReport]:
        """The report the current stats come from."""
        return self.cache.report

    @property
    def recomputations(self) -> int:
        """How many times the stats were recomputed (not written back)."""
        return self.cache.recomputations
