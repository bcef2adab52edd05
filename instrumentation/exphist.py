"""OpenTelemetry base-2 exponential histograms: bucket mapping, merge, re-binning and quantiles.

The one home of this math: the producer (the SM probe reduces CTA durations into these) and
the collector (its per-SM sketches, one :class:`ExpHistogram` or one row of a
``[rows, buckets]`` block each, merged over time windows and replicas) both use it. Buckets are
OpenTelemetry's: at scale ``s`` the base is ``2 ** (2 ** -s)`` and bucket ``i`` holds
``(base**i, base**(i+1)]``; zero and negative values go to ``zero_count``.

Accuracy: a quantile is answered with its bucket's point ``2 * upper / (base + 1)``, within
``(base - 1) / (base + 1)`` relative error of the sample at rank ``ceil(q * count)``
(0.54 % at scale 6, 0.27 % at scale 7), the guarantee DDSketch states.

Memory: one int64 per bucket between the smallest and largest value seen (at scale 6,
1 us .. 1 s is 1,280 buckets, 10 KiB); past ``max_buckets`` the histogram halves its
resolution (scale - 1), as the OTel SDK does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .config_checks import check_range

__all__ = [
    "DEFAULT_MAX_BUCKETS",
    "DEFAULT_SCALE",
    "ExpHistogram",
    "bucket_indices",
    "bucket_point",
    "fit_shift",
    "quantiles",
    "rebin",
    "relative_error",
]

DEFAULT_SCALE = 8  # start fine; downscale only when the range demands it
MIN_SCALE = -10
MAX_SCALE = 20
DEFAULT_MAX_BUCKETS = 2048  # keeps scale >= 6 (<= 0.54 % error) up to a 2**32 value range


def relative_error(scale: int) -> float:
    """The worst-case relative error of a quantile answered at ``scale``."""
    base = 2.0 ** (2.0 ** -scale)
    return (base - 1.0) / (base + 1.0)


def bucket_indices(values: np.ndarray, scale: int) -> np.ndarray:
    """Vectorized OTel mapping of positive ``values`` to bucket indices at ``scale``."""
    values = np.asarray(values, dtype=np.float64)
    if scale > 0:
        # ceil(log2(v) * 2**s) - 1 is exact at powers of the base up to float rounding;
        # frexp keeps exact powers of two exact.
        mantissa, exponent = np.frexp(values)  # v = m * 2**e, m in [0.5, 1)
        exact_pow2 = mantissa == 0.5
        scaled = np.log2(values) * (2.0 ** scale)
        idx = np.ceil(scaled).astype(np.int64) - 1
        pow2_idx = ((exponent.astype(np.int64) - 1) << scale) - 1
        return np.where(exact_pow2, pow2_idx, idx)
    mantissa, exponent = np.frexp(values)
    exponent = exponent.astype(np.int64)
    # (2**(e-1), 2**e] has index e-1 at scale 0; exact powers belong one bucket lower.
    idx0 = np.where(mantissa == 0.5, exponent - 2, exponent - 1)
    return idx0 >> (-scale)


def bucket_point(scale: int, index):
    """The value a quantile answers for bucket ``index`` (an int, or an array of them) at
    ``scale``: ``2 * upper / (base + 1)``, the bucket's midpoint in log space."""
    base = 2.0 ** (2.0 ** -scale)
    return 2.0 * 2.0 ** ((index + 1) * 2.0 ** -scale) / (base + 1.0)


def fit_shift(lo: int, hi: int, max_buckets: int) -> int:
    """The fewest scales down (``index >> shift``) at which buckets ``lo..hi`` fit ``max_buckets``."""
    shift = 0
    while (hi >> shift) - (lo >> shift) + 1 > max_buckets:
        shift += 1
    return shift


def rebin(counts: np.ndarray, offset: int, shift: int) -> tuple[np.ndarray, int]:
    """``counts`` [width] or [rows, width] (bucket ``offset + j``) re-binned ``shift`` scales
    coarser: the new counts (same dtype) and offset. One ``reduceat`` over the last axis."""
    if shift == 0 or counts.shape[-1] == 0:
        return counts, offset >> shift
    first, last = offset >> shift, (offset + counts.shape[-1] - 1) >> shift
    # new bucket k gathers old buckets k << shift .. ((k + 1) << shift) - 1; the first one
    # starts at column 0 (its lower old buckets lie before ``offset``)
    starts = np.arange(first << shift, (last << shift) + 1, 1 << shift, dtype=np.int64) - offset
    starts[0] = 0
    return np.add.reduceat(counts, starts, axis=-1).astype(counts.dtype, copy=False), first


def quantiles(scale: int, offset: int, counts: np.ndarray, zeros: np.ndarray, minimum: np.ndarray,
              maximum: np.ndarray, q: float) -> np.ndarray:
    """Per row of ``counts`` [rows, width] (bucket ``offset + j`` at ``scale``; ``zeros``,
    ``minimum``, ``maximum`` per row): the value at rank ``ceil(q * count)``, as
    :meth:`ExpHistogram.quantile` answers it (NaN for an empty row). Vectorised over rows."""
    total = counts.sum(axis=1, dtype=np.int64) + zeros
    rank = np.maximum(1, np.ceil(q * total)).astype(np.int64)
    out = np.full(total.shape, np.nan)
    if counts.shape[1]:
        cumulative = np.cumsum(counts, axis=1, dtype=np.int64) + zeros[:, None]
        i = np.minimum(np.argmax(cumulative >= rank[:, None], axis=1), counts.shape[1] - 1)
        out = np.minimum(np.maximum(bucket_point(scale, offset + i), minimum), maximum)
    out = np.where(rank <= zeros, 0.0, out)
    return np.where(total > 0, out, np.nan)


@dataclass
class ExpHistogram:
    """A mergeable exponential histogram of non-negative values (e.g. seconds)."""

    scale: int = DEFAULT_SCALE
    max_buckets: int = DEFAULT_MAX_BUCKETS
    offset: int = 0  # index of counts[0]
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    zero_count: int = 0
    count: int = 0
    sum: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    # -- building -----------------------------------------------------------------
    def record(self, values: np.ndarray | list[float] | float) -> None:
        """Adds values (vectorized; no Python loop per value)."""
        values = np.atleast_1d(np.asarray(values, dtype=np.float64))
        if values.size == 0:
            return
        self.count += int(values.size)
        self.sum += float(values.sum())
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))
        positive = values[values > 0]
        self.zero_count += int(values.size - positive.size)
        if positive.size == 0:
            return
        idx = bucket_indices(positive, self.scale)
        lo, hi = int(idx.min()), int(idx.max())
        lo, hi = self._make_room(lo, hi)
        if lo != int(idx.min()) or hi != int(idx.max()):  # scale changed
            idx = bucket_indices(positive, self.scale)
        np.add.at(self.counts, idx - self.offset, 1)

    def add_buckets(self, scale: int, offset: int, counts: np.ndarray, zero_count: int,
                    count: int, total: float, minimum: float, maximum: float) -> None:
        """Merges buckets given in OTLP form (e.g. a received data point)."""
        counts = np.asarray(counts, dtype=np.int64)
        other = ExpHistogram(scale=scale, max_buckets=max(self.max_buckets, counts.size),
                             offset=offset, counts=counts.copy(), zero_count=zero_count,
                             count=count, sum=total, min=minimum, max=maximum)
        self.merge(other)

    def merge(self, other: ExpHistogram) -> None:
        """Adds ``other`` into this histogram, downscaling whichever is finer."""
        self.count += other.count
        self.sum += other.sum
        self.zero_count += other.zero_count
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        nonzero = np.flatnonzero(other.counts)
        if nonzero.size == 0:
            return
        if other.scale < self.scale:
            self._downscale(self.scale - other.scale)
        shift = other.scale - self.scale
        src_idx = (other.offset + nonzero) >> shift
        lo, hi = int(src_idx.min()), int(src_idx.max())
        new_lo, new_hi = self._make_room(lo, hi)
        if (new_lo, new_hi) != (lo, hi):
            src_idx = (other.offset + nonzero) >> (other.scale - self.scale)
        np.add.at(self.counts, src_idx - self.offset, other.counts[nonzero])

    def copy(self) -> ExpHistogram:
        return ExpHistogram(self.scale, self.max_buckets, self.offset, self.counts.copy(),
                            self.zero_count, self.count, self.sum, self.min, self.max)

    # -- reading ------------------------------------------------------------------
    @property
    def base(self) -> float:
        return 2.0 ** (2.0 ** -self.scale)

    def bucket_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Lower and upper bound of every bucket in ``counts``."""
        idx = np.arange(self.offset, self.offset + self.counts.size, dtype=np.float64)
        step = 2.0 ** -self.scale
        return np.exp2(idx * step), np.exp2((idx + 1) * step)

    def quantile(self, q: float) -> float:
        """The value at rank ``ceil(q * count)``, within ``relative_error(scale)``."""
        check_range("quantile q", q, 0.0, 1.0)
        if self.count == 0:
            return math.nan
        rank = max(1, math.ceil(q * self.count))
        if rank <= self.zero_count:
            return 0.0
        cumulative = np.cumsum(self.counts) + self.zero_count
        i = int(np.searchsorted(cumulative, rank))
        i = min(i, self.counts.size - 1)
        estimate = bucket_point(self.scale, self.offset + i)
        # Never answer outside what was seen.
        return float(min(max(estimate, self.min), self.max))

    # -- internals ----------------------------------------------------------------
    def _make_room(self, lo: int, hi: int) -> tuple[int, int]:
        """Grows ``counts`` to cover [lo, hi], downscaling while it would not fit.

        Returns the (possibly rescaled) lo and hi."""
        if self.counts.size:
            lo_all, hi_all = min(lo, self.offset), max(hi, self.offset + self.counts.size - 1)
        else:
            lo_all, hi_all = lo, hi
        shift = fit_shift(lo_all, hi_all, self.max_buckets)
        if shift:
            if self.scale - shift < MIN_SCALE:
                raise ValueError(f"value range too wide for {self.max_buckets} buckets")
            self._downscale(shift)
            lo, hi, lo_all, hi_all = lo >> shift, hi >> shift, lo_all >> shift, hi_all >> shift
        if self.counts.size == 0:
            self.offset = lo_all
            self.counts = np.zeros(hi_all - lo_all + 1, dtype=np.int64)
        elif lo_all < self.offset or hi_all >= self.offset + self.counts.size:
            grown = np.zeros(hi_all - lo_all + 1, dtype=np.int64)
            start = self.offset - lo_all
            grown[start:start + self.counts.size] = self.counts
            self.offset, self.counts = lo_all, grown
        return lo, hi

    def _downscale(self, shift: int) -> None:
        if shift <= 0:
            return
        self.scale -= shift
        if self.counts.size == 0:
            return
        self.counts, self.offset = rebin(np.asarray(self.counts, dtype=np.int64), self.offset, shift)
