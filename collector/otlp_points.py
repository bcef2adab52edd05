"""Reading OTLP protobuf values and CTA-duration points into Sightline's own types.

``num`` and ``label`` read an ``AnyValue`` as a number or as a bounded label string (the
common string and int cases without building Python values). ``cta_point_histogram``
checks one ``gpu.kernel.cta.duration`` exponential-histogram point and turns it into an
:class:`~sightline.instrumentation.exphist.ExpHistogram`, or raises :class:`PointRefused`
whose ``reason`` is the ``dropped`` label the aggregator counts. Cost: O(buckets) numpy
work per point; a point at most ``max_buckets`` wide adopts its counts array without a copy.
"""

from __future__ import annotations

import math

import numpy as np

from sightline.collector.trace_store import any_value
from sightline.instrumentation.exphist import MAX_SCALE, MIN_SCALE, ExpHistogram

__all__ = ["MAX_LABEL_CHARS", "PointRefused", "cta_point_histogram", "label", "num"]

MAX_LABEL_CHARS = 256  # a label value past this is cut (C++ kernel names run long)
_MAX_POINT_BUCKETS = 16_384
_MIN_LOG2_S, _MAX_LOG2_S = -40.0, 20.0


class PointRefused(ValueError):
    """A point that cannot be merged; ``reason`` is the refusal's counter label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def num(value) -> float | None:
    which = value.WhichOneof("value")
    if which == "double_value":
        return value.double_value
    if which == "int_value":
        return float(value.int_value)
    if which == "string_value":
        try:
            return float(value.string_value)
        except ValueError:
            return None
    return None


def label(value) -> str:
    which = value.WhichOneof("value")
    if which == "string_value":  # the usual cases first, without any_value's generality
        return value.string_value[:MAX_LABEL_CHARS]
    if which == "int_value":
        return str(value.int_value)
    v = any_value(value)
    if isinstance(v, list):
        v = v[0] if v else ""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)[:MAX_LABEL_CHARS]


def cta_point_histogram(point, max_buckets: int) -> ExpHistogram:
    """The point's positive buckets (zeros and negatives counted as zeros) as an
    ExpHistogram; raises PointRefused("bad_scale" | "too_many_buckets" |
    "inconsistent_count" | "out_of_range")."""
    if not MIN_SCALE <= point.scale <= MAX_SCALE:
        raise PointRefused("bad_scale")
    counts = np.asarray(point.positive.bucket_counts, dtype=np.int64)
    if counts.size > _MAX_POINT_BUCKETS:
        raise PointRefused("too_many_buckets")
    if int(counts.sum()) + int(point.zero_count) + int(sum(point.negative.bucket_counts)) != point.count:
        raise PointRefused("inconsistent_count")
    nonzero = np.flatnonzero(counts)
    if nonzero.size:
        # Durations outside 2**-40 s (~1 ps) .. 2**20 s (12 days) are not durations; refusing
        # them keeps every merge within ExpHistogram's scale range (it would raise).
        step = 2.0 ** -point.scale
        if ((point.positive.offset + int(nonzero[0])) * step < _MIN_LOG2_S
                or (point.positive.offset + int(nonzero[-1]) + 1) * step > _MAX_LOG2_S):
            raise PointRefused("out_of_range")
    return _point_hist(point, counts, max_buckets)


def _point_hist(point, counts: np.ndarray, max_buckets: int) -> ExpHistogram:
    """The point as an ExpHistogram at its own scale (bounded to ``max_buckets``)."""
    offset = point.positive.offset
    if (point.HasField("min") and point.HasField("max")
            and 0.0 <= point.min <= point.max < math.inf):
        minimum, maximum = point.min, point.max
    else:  # absent or nonsense: the bounds of the outermost non-empty buckets
        nonzero = np.flatnonzero(counts)
        step = 2.0 ** -point.scale
        minimum = 2.0 ** ((offset + nonzero[0]) * step) if nonzero.size else 0.0
        maximum = 2.0 ** ((offset + nonzero[-1] + 1) * step) if nonzero.size else 0.0
    zeros = int(point.zero_count) + int(sum(point.negative.bucket_counts))
    if counts.size <= max_buckets:
        # Adopt the arrays as they are: no copy, no re-bucketing (the common case).
        return ExpHistogram(scale=point.scale, max_buckets=max_buckets, offset=offset,
                            counts=counts, zero_count=zeros, count=int(point.count),
                            sum=float(point.sum), min=float(minimum), max=float(maximum))
    hist = ExpHistogram(max_buckets=max_buckets)
    hist.add_buckets(point.scale, offset, counts, zeros, int(point.count), float(point.sum),
                     float(minimum), float(maximum))
    return hist
