"""Reading OTLP protobuf values and CTA-duration points into Sightline's own types.

``any_value``, ``num`` and ``label`` read an ``AnyValue`` as a plain value, a number or a
label string cut at ``MAX_LABEL_CHARS``. ``cta_point_histogram`` checks one
``gpu.kernel.cta.duration`` exponential-histogram point (:mod:`.point_check`) and turns it
into an ``ExpHistogram``, or raises :class:`PointRefused` whose ``reason`` is the
``dropped`` label the aggregator counts; ``points_in`` is a metric's data-point count.

Cost: O(buckets) numpy work per point, with no copy of a point's counts when it is at most
``max_buckets`` wide; a value read builds one upb wrapper per message it passes through.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..instrumentation import semconv
from ..instrumentation import MAX_SCALE, ExpHistogram
from .point_check import PointRefused, check_exp_point

__all__ = ["MAX_LABEL_CHARS", "PointRefused", "any_value", "clamped_time_s", "cta_point_histogram", "label",
           "num", "points_in", "resource_instance"]

MAX_LABEL_CHARS = 256  # a label value past this is cut (C++ kernel names run long)
_MIN_LOG2_S, _MAX_LOG2_S = -40.0, 20.0


def clamped_time_s(unix_nano: int, now: float) -> float:
    """A data timestamp in seconds; a missing or future one counts as ``now`` (a sender's
    clock ahead of ours must not open windows that have not started)."""
    t = unix_nano / 1e9
    return now if t > now or t <= 0 else t


def points_in(metric) -> int:
    """Data points of one OTLP ``Metric`` (0 when it carries no data)."""
    kind = metric.WhichOneof("data")
    return len(getattr(metric, kind).data_points) if kind is not None else 0


def any_value(value) -> Any:
    """An OTLP ``AnyValue`` as a plain Python value (arrays as lists)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, which)


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


def resource_instance(resource) -> str:
    """The producer's identity: ``service.instance.id``, else ``host.name``, else "unknown"."""
    host = None
    for kv in resource.attributes:
        if kv.key == semconv.RESOURCE_SERVICE_INSTANCE_ID:
            return label(kv.value) or "unknown"
        if kv.key == semconv.RESOURCE_HOST_NAME:
            host = label(kv.value)
    return host or "unknown"


def cta_point_histogram(point, max_buckets: int) -> ExpHistogram:
    """The point's positive buckets (zeros and negatives counted as zeros) as an
    ExpHistogram; raises PointRefused (:func:`.point_check.check_exp_point`'s reasons, or
    "out_of_range")."""
    counts = check_exp_point(point)
    nonzero = np.flatnonzero(counts)
    if not nonzero.size:
        # No bucket holds a value, so the point's scale says nothing; adopting it would
        # coarsen the series it joins (a block takes its finest point's scale) down to
        # scale -10, whose bucket base 2**1024 is past float range. The finest scale
        # changes nothing.
        return _point_hist(point, counts[:0], max_buckets, scale=MAX_SCALE)
    # Durations outside 2**-40 s (~1 ps) .. 2**20 s (12 days) are not durations; refusing
    # them keeps every merge within ExpHistogram's scale range (it would raise).
    step = 2.0 ** -point.scale
    if ((point.positive.offset + int(nonzero[0])) * step < _MIN_LOG2_S
            or (point.positive.offset + int(nonzero[-1]) + 1) * step > _MAX_LOG2_S):
        raise PointRefused("out_of_range")
    return _point_hist(point, counts, max_buckets, point.scale)


def _point_hist(point, counts: np.ndarray, max_buckets: int, scale: int) -> ExpHistogram:
    """The point as an ExpHistogram at ``scale`` (its own, bounded to ``max_buckets``)."""
    offset = point.positive.offset
    if (point.HasField("min") and point.HasField("max")
            and 0.0 <= point.min <= point.max < math.inf):
        minimum, maximum = point.min, point.max
    else:  # absent or nonsense: the bounds of the outermost non-empty buckets
        nonzero = np.flatnonzero(counts)
        step = 2.0 ** -scale
        minimum = 2.0 ** ((offset + nonzero[0]) * step) if nonzero.size else 0.0
        maximum = 2.0 ** ((offset + nonzero[-1] + 1) * step) if nonzero.size else 0.0
    zeros = int(point.zero_count) + int(sum(point.negative.bucket_counts))
    if counts.size <= max_buckets:
        # Adopt the arrays as they are: no copy, no re-bucketing (the common case).
        return ExpHistogram(scale=scale, max_buckets=max_buckets, offset=offset,
                            counts=counts, zero_count=zeros, count=int(point.count),
                            sum=float(point.sum), min=float(minimum), max=float(maximum))
    hist = ExpHistogram(max_buckets=max_buckets)
    hist.add_buckets(scale, offset, counts, zeros, int(point.count), float(point.sum),
                     float(minimum), float(maximum))
    return hist
