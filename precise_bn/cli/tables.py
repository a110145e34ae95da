"""Aligned tables, as the commands print them (what each reported number means is
:func:`precise_bn.report.legend`)."""
from __future__ import annotations

from typing import List, Sequence


def table(rows: List[Sequence[str]]) -> str:
    """Rows as columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    )
