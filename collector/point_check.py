"""Checks one OTLP exponential-histogram data point before anything merges it.

A point passes only if merging it cannot corrupt a series: scale within the mergeable
range, at most ``MAX_POINT_BUCKETS`` buckets, every count (bucket, zero, total) at most
``MAX_POINT_COUNT`` (so that sums of many points stay far inside int64), the buckets plus
zeros adding up *exactly* to ``count`` (computed with Python integers: no wrap-around),
a finite ``sum`` (NaN or infinite sums would poison every later merge), and exemplar ids
of OTLP's lengths (16/8 bytes, or empty) with finite values. A refused point raises ``PointRefused`` whose
``reason`` is the label it is counted under.

Cost: O(buckets) numpy work per point (the largest count first: below ``MAX_POINT_COUNT``
one uint64 sum is exact), no Python loop over buckets.
"""

from __future__ import annotations

import math

import numpy as np

from ..instrumentation import MAX_SCALE, MIN_SCALE

__all__ = ["MAX_POINT_BUCKETS", "MAX_POINT_COUNT", "POINT_REFUSALS", "PointRefused", "check_exp_point",
           "exact_total"]

MAX_POINT_BUCKETS = 16_384
# 2**40 CTAs (~1.1e12) in one point is far past any real export interval, and leaves 2**23
# such points of headroom before an int64 merged count could wrap.
MAX_POINT_COUNT = 2 ** 40
# every PointRefused reason (out_of_range: raised by otlp_points for durations past any real one)
POINT_REFUSALS = ("bad_scale", "too_many_buckets", "count_overflow", "inconsistent_count", "bad_sum",
                  "bad_exemplar", "out_of_range")
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


class PointRefused(ValueError):
    """A point that cannot be merged; ``reason`` is the refusal's counter label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def exact_total(counts: np.ndarray) -> tuple[int, int]:
    """(exact sum, largest element) of uint64 ``counts`` as Python ints, without wrap-around:
    the high and low 32-bit halves are summed apart (each sum fits for < 2**31 buckets)."""
    if counts.size == 0:
        return 0, 0
    high = int(np.sum(counts >> _SHIFT32, dtype=np.uint64))
    low = int(np.sum(counts & _LOW32, dtype=np.uint64))
    return (high << 32) + low, int(counts.max())


def check_exp_point(point) -> np.ndarray:
    """Raises PointRefused unless ``point`` is safe to merge (see the module docstring);
    returns its positive bucket counts as int64 (each at most ``MAX_POINT_COUNT``)."""
    if not MIN_SCALE <= point.scale <= MAX_SCALE:
        raise PointRefused("bad_scale")
    positive = point.positive.bucket_counts
    negative = point.negative.bucket_counts
    if len(positive) > MAX_POINT_BUCKETS or len(negative) > MAX_POINT_BUCKETS:
        raise PointRefused("too_many_buckets")
    # np.asarray reads the repeated field faster than iterating it in Python would
    counts = np.asarray(positive, dtype=np.uint64)
    positive_max = int(counts.max()) if counts.size else 0
    negative_total, negative_max = exact_total(np.asarray(negative, dtype=np.uint64)) if len(negative) else (0, 0)
    if max(positive_max, negative_max, point.zero_count, point.count) > MAX_POINT_COUNT:
        raise PointRefused("count_overflow")
    # at most MAX_POINT_BUCKETS counts of at most MAX_POINT_COUNT each: the uint64 sum cannot wrap
    positive_total = int(counts.sum())
    if positive_total + negative_total + point.zero_count != point.count:
        raise PointRefused("inconsistent_count")
    if not math.isfinite(point.sum):
        raise PointRefused("bad_sum")
    for exemplar in point.exemplars:
        if (len(exemplar.trace_id) not in (0, 16) or len(exemplar.span_id) not in (0, 8)
                or not math.isfinite(exemplar.as_double)):
            raise PointRefused("bad_exemplar")
    return counts.astype(np.int64)
