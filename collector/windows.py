"""Sliding time windows of mergeable exponential histograms.

A :class:`SlidingHistogram` is a ring of ``num_slots`` slots, each ``slot_s`` seconds long
and holding one ``ExpHistogram``; a value (or a received OTLP bucket set) lands in the slot
of its own timestamp, and a query merges the slots of the last ``N`` seconds. Exponential
histograms merge exactly, so the merged window answers like one histogram fed every value.
:class:`ClassicHistogram` keeps cumulative counts over fixed bounds for Prometheus.

Accuracy: the value at rank ``ceil(q * count)`` within ``relative_error(scale)``, at the
coarsest scale among the merged slots (callers report ``relative_error(hist.scale)``).
Memory: at most ``num_slots * (max_buckets * 8 + ~400)`` bytes per series whatever arrives,
plus at most ``flush_every`` pending floats; timestamps older than the ring are refused
and counted by the caller, so a late or replayed point never grows memory.
Cost: ``record`` of one scalar is a list append (folded in ``flush_every`` at a time by one
vectorized ``ExpHistogram.record``); ``add_buckets`` is one numpy merge. Not thread-safe.
"""

from __future__ import annotations

import bisect
import functools
import math
from typing import NamedTuple

import numpy as np

from ..instrumentation import ExpHistogram, bucket_point
from .aggregation_config import WindowConfig

__all__ = ["ClassicHistogram", "Exemplar", "SlidingHistogram", "WindowConfig", "merge_all", "rebinned",
           "subtract_cumulative"]


class Exemplar(NamedTuple):
    """One observed value with the trace and span that produced it (raw OTLP id bytes;
    ``.hex()`` them for output). A tuple: built on every recorded span, so it must be cheap."""

    value: float
    trace_id: bytes
    span_id: bytes
    time_unix_nano: int = 0


def merge_all(hists: list[ExpHistogram], config: WindowConfig) -> ExpHistogram:
    """One histogram holding all of ``hists`` (exact: counts add at the coarsest scale).

    Histograms that share a scale (the usual case: every slot at scale 6) are added as
    array slices in one pass; otherwise it falls back to pairwise ``merge``."""
    if not hists:
        return config.new_histogram()
    scale = hists[0].scale
    if any(h.scale != scale for h in hists):
        merged = config.new_histogram()
        for h in hists:
            merged.merge(h)
        return merged
    with_counts = [h for h in hists if h.counts.size]
    if with_counts:
        lo = min(h.offset for h in with_counts)
        hi = max(h.offset + h.counts.size for h in with_counts)
    else:
        lo = hi = 0
    if hi - lo > config.max_buckets:  # too wide together: let merge downscale
        merged = config.new_histogram()
        for h in hists:
            merged.merge(h)
        return merged
    counts = np.zeros(hi - lo, dtype=np.int64)
    for h in with_counts:
        counts[h.offset - lo:h.offset - lo + h.counts.size] += h.counts
    return ExpHistogram(scale=scale, max_buckets=config.max_buckets, offset=lo, counts=counts,
                        zero_count=sum(h.zero_count for h in hists), count=sum(h.count for h in hists),
                        sum=sum(h.sum for h in hists), min=min(h.min for h in hists),
                        max=max(h.max for h in hists))


def subtract_cumulative(cur: ExpHistogram, prev: ExpHistogram) -> ExpHistogram | None:
    """``cur - prev`` of two cumulative histograms of one stream (exact, at the coarser
    scale), or None when ``cur`` is not a superset of ``prev`` (the stream was reset)."""
    if cur.count < prev.count or cur.zero_count < prev.zero_count:
        return None
    scale = min(cur.scale, prev.scale)
    out = ExpHistogram(scale=scale, max_buckets=cur.max_buckets)
    diffs = {}
    for hist, sign in ((cur, 1), (prev, -1)):
        nz = np.flatnonzero(hist.counts)
        if nz.size:
            idx = (hist.offset + nz) >> (hist.scale - scale)
            diffs[sign] = (idx, hist.counts[nz] * sign)
    if not diffs:
        counts, offset = np.zeros(0, dtype=np.int64), 0
    else:
        all_idx = np.concatenate([d[0] for d in diffs.values()])
        offset = int(all_idx.min())
        counts = np.zeros(int(all_idx.max()) - offset + 1, dtype=np.int64)
        for idx, vals in diffs.values():
            np.add.at(counts, idx - offset, vals)
        if (counts < 0).any():
            return None
    out.add_buckets(scale, offset, counts, cur.zero_count - prev.zero_count,
                    cur.count - prev.count, cur.sum - prev.sum, cur.min, cur.max)
    return out


class _Slot:
    __slots__ = ("epoch", "hist", "exemplar")

    def __init__(self, epoch: int, hist: ExpHistogram) -> None:
        self.epoch = epoch
        self.hist = hist
        self.exemplar: Exemplar | None = None


class SlidingHistogram:
    """A ring of per-slot exponential histograms; see the module docstring.

    Slots start at scale 6 (relative error 0.54 %) and keep it while the values of one slot
    span at most ``max_buckets`` buckets: with the default 1,024 that is 16 octaves (a
    65,536x range, e.g. 1 us .. 65 ms); only a wider slot halves its resolution (scale 5,
    1.08 %). The default 18 slots x 1,024 buckets bound a series at about 155 kB; a slot's
    arrays grow only as wide as its values spread. The aggregator holds one lock around it."""

    __slots__ = ("config", "_slots", "_pending", "_pending_epoch", "_pending_exemplar", "newest_epoch",
                 "_slot_s", "_flush_every")

    def __init__(self, config: WindowConfig) -> None:
        self.config = config
        self._slot_s, self._flush_every = config.slot_s, config.flush_every  # read on every record
        self._slots: list[_Slot | None] = [None] * config.num_slots
        self._pending: list[float] = []
        self._pending_epoch = -1
        self._pending_exemplar: Exemplar | None = None
        self.newest_epoch = -1

    # -- writing --------------------------------------------------------------------
    def _enter_slot(self, epoch: int) -> bool:
        """Makes ``epoch`` the pending slot (flushing the one before); False if it is
        already behind the window. Called only when the slot changes."""
        if epoch <= self.newest_epoch - self.config.num_slots:
            return False
        self._flush()
        self._pending_epoch = epoch
        if epoch > self.newest_epoch:
            self.newest_epoch = epoch
        return True

    def record(self, value: float, t_s: float, exemplar: Exemplar | None = None) -> bool:
        """Adds one value observed at ``t_s``; False (nothing kept) if it is too late."""
        epoch = int(t_s // self._slot_s)
        if epoch != self._pending_epoch and not self._enter_slot(epoch):
            return False
        pending = self._pending
        pending.append(value)
        if exemplar is not None:
            best = self._pending_exemplar
            if best is None or exemplar[0] >= best[0]:  # [0]: the value (tuple index, no property)
                self._pending_exemplar = exemplar
        if len(pending) >= self._flush_every:
            self._flush()
        return True

    def record_many(self, values: list[float], epoch: int, exemplar: Exemplar | None = None) -> bool:
        """Adds ``values`` all observed in slot ``epoch`` (``int(t_s // slot_s)``), with the
        slowest of them as ``exemplar``; False (nothing kept) if that slot is too late.

        The same result as ``record`` called once per value (the same values are folded
        into the histogram at the same ``flush_every`` boundaries), at one call per batch."""
        if epoch != self._pending_epoch and not self._enter_slot(epoch):
            return False
        pending, flush_every = self._pending, self._flush_every
        start, n = 0, len(values)
        while n - start >= flush_every - len(pending):  # fill up to each flush boundary exactly
            take = flush_every - len(pending)
            pending.extend(values[start:start + take])
            start += take
            self._flush()
            pending = self._pending
        if start < n:
            pending.extend(values[start:] if start else values)
        if exemplar is not None:
            best = self._pending_exemplar
            if best is None or exemplar[0] >= best[0]:
                self._pending_exemplar = exemplar
            if not pending:  # everything went out above: the slot takes it now
                self._flush_exemplar(epoch)
        return True

    def add_histogram(self, hist: ExpHistogram, t_s: float,
                      exemplar: Exemplar | None = None) -> bool:
        """Merges a whole histogram observed at ``t_s``; False if it is too late."""
        epoch = self.config.epoch(t_s)
        if epoch <= self.newest_epoch - self.config.num_slots:
            return False
        if epoch > self.newest_epoch:
            self.newest_epoch = epoch
        slot = self._slot_for(epoch)
        slot.hist.merge(hist)
        if exemplar is not None and (slot.exemplar is None or exemplar.value >= slot.exemplar.value):
            slot.exemplar = exemplar
        return True

    # -- reading --------------------------------------------------------------------
    def window(self, now_s: float, last_s: float) -> ExpHistogram:
        """All values of the slots overlapping ``(now_s - last_s, now_s]``, merged."""
        self._flush()
        hists = [slot.hist for _, slot in self._live(now_s, last_s) if slot.hist.count]
        return merge_all(hists, self.config)

    def slots(self, now_s: float, last_s: float) -> list[tuple[int, ExpHistogram, Exemplar | None]]:
        """``(epoch, histogram, slowest exemplar)`` of each non-empty slot, oldest first."""
        self._flush()
        return [(epoch, slot.hist, slot.exemplar) for epoch, slot in self._live(now_s, last_s)
                if slot.hist.count]

    def exemplars(self) -> list[Exemplar]:
        """The slowest exemplar of every slot still in the ring."""
        self._flush()
        return [slot.exemplar for slot in self._slots if slot is not None and slot.exemplar is not None]

    def nbytes(self) -> int:
        """Bytes held by bucket arrays and pending values (the part that scales)."""
        total = 8 * len(self._pending)
        for slot in self._slots:
            if slot is not None:
                total += slot.hist.counts.nbytes
        return total

    # -- internals ------------------------------------------------------------------
    def _live(self, now_s: float, last_s: float):
        newest = self.config.epoch(now_s)
        n = min(self.config.num_slots, max(1, int(math.ceil(last_s / self.config.slot_s))))
        oldest = newest - n + 1
        out = []
        for slot in self._slots:
            if slot is not None and oldest <= slot.epoch <= newest:
                out.append((slot.epoch, slot))
        out.sort(key=lambda item: item[0])
        return out

    def _slot_for(self, epoch: int) -> _Slot:
        i = epoch % self.config.num_slots
        slot = self._slots[i]
        if slot is None or slot.epoch != epoch:
            # Reuse the ring position: the old slot is past the horizon.
            slot = _Slot(epoch, self.config.new_histogram())
            self._slots[i] = slot
        return slot

    def _flush(self) -> None:
        if not self._pending:
            return
        epoch, values, exemplar = self._pending_epoch, self._pending, self._pending_exemplar
        self._pending, self._pending_exemplar = [], None
        if epoch <= self.newest_epoch - self.config.num_slots:
            return  # the ring moved past these while they waited
        slot = self._slot_for(epoch)
        slot.hist.record(np.asarray(values, dtype=np.float64))
        if exemplar is not None and (slot.exemplar is None or exemplar.value >= slot.exemplar.value):
            slot.exemplar = exemplar

    def _flush_exemplar(self, epoch: int) -> None:
        exemplar, self._pending_exemplar = self._pending_exemplar, None
        if exemplar is None or epoch <= self.newest_epoch - self.config.num_slots:
            return
        slot = self._slot_for(epoch)
        if slot.exemplar is None or exemplar.value >= slot.exemplar.value:
            slot.exemplar = exemplar


class ClassicHistogram:
    """Cumulative counts over fixed upper bounds (plus +Inf), with per-bucket exemplars.

    Prometheus's ``histogram_quantile`` reads them. A received exponential histogram is
    re-binned at each bucket's representative point, so a count is misplaced only when its
    value lies within the source's relative error of a classic bound. Memory: one int and
    one exemplar per bound."""

    __slots__ = ("bounds", "counts", "sum", "count", "exemplars")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # not cumulative; the last is (max bound, +Inf)
        self.sum = 0.0
        self.count = 0
        self.exemplars: list[Exemplar | None] = [None] * (len(bounds) + 1)

    def record(self, value: float, exemplar: Exemplar | None = None) -> None:
        i = bisect.bisect_left(self.bounds, value)  # Prometheus buckets are "<= le"
        self.counts[i] += 1
        self.sum += value
        self.count += 1
        if exemplar is not None:
            self.exemplars[i] = exemplar

    def add_exp(self, hist: ExpHistogram, exemplar: Exemplar | None = None) -> None:
        """Re-bins an exponential histogram (see the module docstring for the error)."""
        self.count += hist.count
        self.sum += hist.sum
        counts = self.counts
        for j, n in enumerate(rebinned(self.bounds, hist)):
            counts[j] += n
        if exemplar is not None:
            self.exemplars[bisect.bisect_left(self.bounds, exemplar.value)] = exemplar

    def copy(self) -> ClassicHistogram:
        other = ClassicHistogram(self.bounds)
        other.counts = list(self.counts)
        other.sum, other.count = self.sum, self.count
        other.exemplars = list(self.exemplars)
        return other

def rebinned(bounds: tuple[float, ...], hist: ExpHistogram) -> list[int]:
    """``hist``'s count in each classic bucket over ``bounds`` (plus +Inf; zeros in the first),
    each of its buckets placed at its representative point (see the module docstring)."""
    out = [0] * (len(bounds) + 1)
    out[0] = hist.zero_count
    n = hist.counts.size
    if n:
        # Bucket i goes to classic bucket #{bounds < its point}: with the first bucket index
        # past each bound (cached per scale), one cumsum and a walk over the bounds (plain
        # ints: cheaper than numpy's per-call overhead for ~16 bounds).
        cumulative = np.cumsum(hist.counts).tolist()
        offset, before = hist.offset, 0
        for j, first in enumerate(_first_bucket_above(bounds, hist.scale)):
            k = min(max(first - offset, 0), n)
            upto = cumulative[k - 1] if k else 0
            out[j] += upto - before
            before = upto
        out[-1] += cumulative[-1] - before
    return out


@functools.lru_cache(maxsize=256)
def _first_bucket_above(bounds: tuple[float, ...], scale: int) -> tuple[int, ...]:
    """Per bound ``b``: the smallest bucket index at ``scale`` whose point (the value a
    quantile answers for it, ``2 * upper / (base + 1)``) is above ``b``."""
    base = 2.0 ** (2.0 ** -scale)
    out = []
    for b in bounds:
        i = math.floor(math.log2(b * (base + 1.0) / 2.0) * 2.0 ** scale) - 2
        while bucket_point(scale, i) <= b:  # settle float rounding with the very formula used for points
            i += 1
        while bucket_point(scale, i - 1) > b:
            i -= 1
        out.append(i)
    return tuple(out)
