"""Classic (Prometheus) histograms of many rows in arrays: a block's per-SM CTA histograms.

:class:`ClassicRows` keeps per row the counts over fixed bounds (plus +Inf), the sum and per
bucket the latest exemplar's cell, in three numpy arrays. No Python object per row:
the cycle collector, which holds the GIL (and so the event loop) for as long as it walks the
heap, has nothing of them to walk (a fleet's 21,000 per-SM histograms were ~90,000 objects),
and a scrape's snapshot is three array copies, not a histogram and two lists per SM.
Accuracy: :func:`~.windows.rebinned`'s, as :class:`~.windows.ClassicHistogram`.
Memory: (bounds + 1) x 48 + 8 bytes per row. Cost: ``add_exp`` one re-bin and one row add.
"""

from __future__ import annotations

import bisect

import numpy as np

from ..instrumentation import ExpHistogram
from .windows import ClassicHistogram, Exemplar, rebinned

__all__ = ["EXEMPLAR_DTYPE", "ClassicRows", "exemplar_at"]

# an exemplar in a structured array; value NaN: none
EXEMPLAR_DTYPE = np.dtype([("value", "f8"), ("trace_id", "S16"), ("span_id", "S8"), ("time", "u8")])


def exemplar_at(cell) -> Exemplar | None:
    """An ``EXEMPLAR_DTYPE`` cell as an Exemplar (None when empty; numpy strips trailing NULs)."""
    if cell["value"] != cell["value"]:
        return None
    return Exemplar(float(cell["value"]), bytes(cell["trace_id"]).ljust(16, b"\0"),
                    bytes(cell["span_id"]).ljust(8, b"\0"), int(cell["time"]))


class ClassicRows:
    """``rows`` classic histograms over ``bounds`` (see the module docstring); rows are added
    by ``resize`` and start empty."""

    __slots__ = ("bounds", "counts", "sums", "exemplars")

    def __init__(self, bounds: tuple[float, ...], rows: int = 0) -> None:
        self.bounds = bounds
        self.counts = np.zeros((rows, len(bounds) + 1), dtype=np.int64)  # not cumulative
        self.sums = np.zeros(rows)
        self.exemplars = np.zeros((rows, len(bounds) + 1), dtype=EXEMPLAR_DTYPE)
        self.exemplars["value"] = np.nan

    def __len__(self) -> int:
        return len(self.sums)

    def resize(self, rows: int) -> None:
        """To ``rows`` rows (more: empty ones added at the end)."""
        extra = rows - len(self)
        if extra <= 0:
            return
        more = ClassicRows(self.bounds, extra)
        self.counts = np.concatenate([self.counts, more.counts])
        self.sums = np.concatenate([self.sums, more.sums])
        self.exemplars = np.concatenate([self.exemplars, more.exemplars])

    def add_exp(self, row: int, hist: ExpHistogram, exemplar: Exemplar | None = None) -> None:
        """Re-bins ``hist`` into ``row``; ``exemplar`` replaces its bucket's."""
        self.counts[row] += rebinned(self.bounds, hist)
        self.sums[row] += hist.sum
        if exemplar is not None:
            self.exemplars[row, bisect.bisect_left(self.bounds, exemplar.value)] = (
                exemplar.value, exemplar.trace_id, exemplar.span_id, exemplar.time_unix_nano)

    def copy(self) -> ClassicRows:
        other = ClassicRows.__new__(ClassicRows)
        other.bounds, other.counts = self.bounds, self.counts.copy()
        other.sums, other.exemplars = self.sums.copy(), self.exemplars.copy()
        return other

    def histogram(self, row: int) -> ClassicHistogram:
        """``row`` as a ClassicHistogram."""
        h = ClassicHistogram(self.bounds)
        h.counts = self.counts[row].tolist()
        h.sum, h.count = float(self.sums[row]), sum(h.counts)
        h.exemplars = [exemplar_at(cell) for cell in self.exemplars[row]]
        return h

    def row_exemplars(self, rows: int) -> list[list[Exemplar | None] | None]:
        """Per row of the first ``rows``: its buckets' exemplars, or None when it has none."""
        has = (self.exemplars["value"][:rows] == self.exemplars["value"][:rows]).any(axis=1)
        return [[exemplar_at(cell) for cell in self.exemplars[r]] if any_ else None
                for r, any_ in enumerate(has.tolist())]
