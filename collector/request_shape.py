"""How many messages an encoded export request holds, counted before anything parses it.

``request_shape`` walks an encoded ``ExportTraceServiceRequest`` or
``ExportMetricsServiceRequest`` field by field (compiled; no message is built) and counts
resources, scopes, metrics, spans or data points (*items*), the *values* under them that a
parse would build one by one (attributes, events, links, exemplars, metadata, quantiles) and
histogram bucket counts, empty messages included. :class:`RequestLimits` refuses a request
past any cap with 413 (naming the cap) before it is parsed: 8 MB of empty messages cost one
walk instead of a parse of millions, and a request's parse and aggregation stay in
proportion to what the caps allow. ``parsed_bytes`` estimates the memory the parsed request
holds (upb: ~60 bytes per message, 8 per bucket count), the pipeline queue's unit.

Cost: one pass over the bytes, a few ns per field; the JSON bound (:func:`json_values`) is
three ``bytes.count`` passes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import numba
import numpy as np
from numba import types

from ..instrumentation import check_range
from .config import CollectorConfig
from .compiled import ahead
from .ingest import IngestError
from .protowire import message, skip, varint

__all__ = ["RequestLimits", "RequestShape", "json_values", "request_shape"]

_RESOURCES, _SCOPES, _METRICS, _ITEMS, _VALUES, _BUCKETS = range(6)
_MESSAGE_BYTES = 64  # what upb holds per parsed message, rounded up (measured ~58 for spans)
_BUCKET_BYTES = 8


class RequestShape(NamedTuple):
    resources: int
    scopes: int
    metrics: int
    items: int  # spans or data points
    values: int  # attributes, events, links, exemplars, metadata, quantiles
    buckets: int  # histogram bucket counts and explicit bounds

    def parsed_bytes(self, encoded_bytes: int) -> int:
        """The parsed request's memory, estimated: what the pipeline queue charges for it."""
        messages = self.resources + self.scopes + self.metrics + self.items + 2 * self.values  # KeyValue + AnyValue
        return encoded_bytes + _MESSAGE_BYTES * messages + _BUCKET_BYTES * self.buckets


_CAPS = {f.name: f.default for f in fields(CollectorConfig)}


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one export request's messages (see ``CollectorConfig`` for each field; their
    defaults are declared there once)."""

    max_resources: int = _CAPS["max_resources_per_request"]
    max_scopes: int = _CAPS["max_scopes_per_request"]
    max_items: int = _CAPS["max_spans_per_request"]
    max_values: int = _CAPS["max_values_per_request"]
    max_buckets: int = _CAPS["max_buckets_per_request"]
    max_json_values: int = _CAPS["max_json_values"]
    # data points: each costs the aggregator ~10x a span (its histogram is checked and merged)
    max_points: int = _CAPS["max_points_per_request"]

    def __post_init__(self) -> None:
        for name in ("max_resources", "max_scopes", "max_items", "max_values", "max_buckets", "max_json_values",
                     "max_points"):
            check_range(name, getattr(self, name), 1, 1 << 30, integer=True)

    def check(self, shape: RequestShape, signal: str) -> None:
        """Raises IngestError(413) for the first cap ``shape`` exceeds."""
        for what, count, cap, flag in (
                ("resources", shape.resources, self.max_resources, "max-resources-per-request"),
                ("scopes", shape.scopes + shape.metrics, self.max_scopes, "max-scopes-per-request"),
                *self._items(shape.items, signal),
                ("attributes, events, links and exemplars", shape.values, self.max_values,
                 "max-values-per-request"),
                ("histogram buckets", shape.buckets, self.max_buckets, "max-buckets-per-request")):
            if count > cap:
                raise IngestError(413, "too_large", f"the request holds {count} {what}, more than the {cap} "
                                  f"one request may hold (--{flag})")

    def _items(self, items: int, signal: str) -> tuple[tuple[str, int, int, str]]:
        if signal == "traces":
            return (("spans", items, self.max_items, "max-spans-per-request"),)
        return (("data points", items, self.max_points, "max-points-per-request"),)

    def check_items(self, items: int, signal: str) -> None:
        """Raises IngestError(413) when ``items`` spans or data points are past their cap."""
        for what, count, cap, flag in self._items(items, signal):
            if count > cap:
                raise IngestError(413, "too_large", f"the request holds {count} {what}, more than the "
                                  f"{cap} one request may hold (--{flag})")

    def check_json(self, body: bytes) -> int:
        """The JSON values ``body`` may hold (:func:`json_values`); IngestError(413) past the
        cap, before anything parses it."""
        count = json_values(body)
        if count > self.max_json_values:
            raise IngestError(413, "too_large", f"the JSON body holds up to {count} values, more than the "
                              f"{self.max_json_values} one request may hold (--max-json-values)")
        return count

    @staticmethod
    def json_parsed_bytes(body_bytes: int, values: int) -> int:
        """The parsed size of a request decoded from a JSON body holding ``values`` values."""
        return body_bytes + _MESSAGE_BYTES * values


def json_values(body: bytes) -> int:
    """An upper bound on the objects, arrays and elements a JSON body parses into (every
    ``{``, ``[`` and ``,``, strings included): what ``json.loads`` allocates grows with it."""
    return body.count(b"{") + body.count(b"[") + body.count(b",")


# -- the walk ---------------------------------------------------------------------------
_BYTES = types.Array(types.uint8, 1, "C", readonly=True)
_COUNTS = types.int64[::1]


@numba.njit(cache=True, inline="always")
def _field(buf, at, end):
    """(tag, value start, value end, next position) of the field at ``at``; for a
    length-delimited field the value is its content. Tag -1: unreadable (bad framing, a
    group, field number 0)."""
    tag, at = varint(buf, at, end)
    if tag < 8:
        return -1, 0, 0, end
    if tag & 7 == 2:
        start, stop = message(buf, at, end)
        if stop < 0:
            return -1, 0, 0, end
        return tag, start, stop, stop
    after = skip(buf, at, end, tag & 7)
    if after < 0:
        return -1, 0, 0, end
    return tag, at, after, after


@numba.njit(cache=True, inline="always")
def _add(counts, caps, slot, n):
    """Adds ``n`` to ``counts[slot]``; False once it is past ``caps[slot]`` (the walk stops:
    its cost is bounded by the caps, not by the body)."""
    counts[slot] += n
    return counts[slot] <= caps[slot]


@numba.njit(cache=True)
def _count(buf, at, end, tag, counts, caps, slot):
    """Adds the fields encoded as ``tag`` between ``at`` and ``end`` to ``counts[slot]``;
    False when the bytes are not a message or a count passed its cap."""
    while at < end:
        found, _, _, at = _field(buf, at, end)
        if found < 0:
            return False
        if found == tag and not _add(counts, caps, slot, 1):
            return False
    return True


@numba.njit(cache=True)
def _span(buf, at, end, counts, caps):
    while at < end:
        tag, start, stop, at = _field(buf, at, end)
        if tag < 0:
            return False
        if tag == 0x4A:  # attributes (9)
            if not _add(counts, caps, _VALUES, 1):
                return False
        elif tag == 0x5A:  # events (11), their attributes (3)
            if not _add(counts, caps, _VALUES, 1) or not _count(buf, start, stop, 0x1A, counts, caps, _VALUES):
                return False
        elif tag == 0x6A:  # links (13), their attributes (4)
            if not _add(counts, caps, _VALUES, 1) or not _count(buf, start, stop, 0x22, counts, caps, _VALUES):
                return False
    return True


@numba.njit(cache=True)
def _scope(buf, at, end, counts, caps, signal):
    """A ScopeSpans (signal 0) or ScopeMetrics (1): the scope's attributes, then each span or metric."""
    while at < end:
        tag, start, stop, at = _field(buf, at, end)
        if tag < 0:
            return False
        if tag == 0x0A:  # scope (1), its attributes (3)
            if not _count(buf, start, stop, 0x1A, counts, caps, _VALUES):
                return False
        elif tag == 0x12:  # spans / metrics (2)
            if signal == 0:
                if not _add(counts, caps, _ITEMS, 1) or not _span(buf, start, stop, counts, caps):
                    return False
            elif not _add(counts, caps, _METRICS, 1) or not _metric(buf, start, stop, counts, caps):
                return False
    return True


@numba.njit(cache=True)
def _metric(buf, at, end, counts, caps):
    while at < end:
        tag, start, stop, at = _field(buf, at, end)
        if tag < 0:
            return False
        if tag == 0x62:  # metadata (12)
            if not _add(counts, caps, _VALUES, 1):
                return False
        elif tag == 0x2A or tag == 0x3A or tag == 0x4A or tag == 0x52 or tag == 0x5A:
            # gauge (5), sum (7), histogram (9), exponential_histogram (10), summary (11)
            kind = tag >> 3
            data_at = start
            while data_at < stop:
                found, point_at, point_end, data_at = _field(buf, data_at, stop)
                if found < 0:
                    return False
                if found == 0x0A:  # data_points (1)
                    if not _add(counts, caps, _ITEMS, 1) or not _point(buf, point_at, point_end, counts, caps, kind):
                        return False
    return True


@numba.njit(cache=True)
def _packed(buf, at, end, wire_length):
    """Values in a packed field's content: fixed ``wire_length`` bytes each, or varints (0)."""
    if wire_length:
        return (end - at) // wire_length
    n = 0
    for i in range(at, end):
        n += buf[i] < 0x80
    return n


@numba.njit(cache=True)
def _point(buf, at, end, counts, caps, kind):
    """One data point of a metric of ``kind`` (the Metric field number of its data)."""
    if kind == 10:  # ExponentialHistogramDataPoint
        attributes, exemplars = 0x0A, 0x5A
    elif kind == 9:  # HistogramDataPoint
        attributes, exemplars = 0x4A, 0x42
    elif kind == 11:  # SummaryDataPoint: quantile_values (6) are values too
        attributes, exemplars = 0x3A, 0x32
    else:  # NumberDataPoint
        attributes, exemplars = 0x3A, 0x2A
    while at < end:
        tag, start, stop, at = _field(buf, at, end)
        if tag < 0:
            return False
        if tag == attributes:
            if not _add(counts, caps, _VALUES, 1):
                return False
        elif tag == exemplars:
            if not _add(counts, caps, _VALUES, 1):
                return False
            if kind != 11 and not _count(buf, start, stop, 0x3A, counts, caps, _VALUES):  # filtered_attributes (7)
                return False
        elif kind == 9 and (tag == 0x32 or tag == 0x3A):  # bucket_counts (6), explicit_bounds (7), packed
            if not _add(counts, caps, _BUCKETS, _packed(buf, start, stop, 8)):
                return False
        elif kind == 9 and (tag == 0x31 or tag == 0x39):  # the same, one at a time
            if not _add(counts, caps, _BUCKETS, 1):
                return False
        elif kind == 10 and (tag == 0x42 or tag == 0x4A):  # positive (8), negative (9): Buckets
            bucket_at = start
            while bucket_at < stop:
                found, counts_at, counts_end, bucket_at = _field(buf, bucket_at, stop)
                if found < 0:
                    return False
                if found == 0x12:  # bucket_counts (2), packed varints
                    if not _add(counts, caps, _BUCKETS, _packed(buf, counts_at, counts_end, 0)):
                        return False
                elif found == 0x10 and not _add(counts, caps, _BUCKETS, 1):  # one at a time
                    return False
    return True


# nogil: the walk runs on a decoder thread; the event loop goes on meanwhile
@ahead(types.int64(_BYTES, types.int64, _COUNTS, _COUNTS), nogil=True)
def _walk(buf, signal, counts, caps):
    """Counts into ``counts`` (see the indexes above) until one passes its cap in ``caps``:
    0, or -1 when ``buf`` is not an export request the walk can read (bad framing, groups)
    or a count passed its cap (the caller tells which from ``counts``)."""
    at, end = 0, len(buf)
    while at < end:
        tag, start, stop, at = _field(buf, at, end)
        if tag < 0:
            return -1
        if tag != 0x0A:  # resource_spans / resource_metrics (1)
            continue
        if not _add(counts, caps, _RESOURCES, 1):
            return -1
        while start < stop:
            found, field_at, field_end, start = _field(buf, start, stop)
            if found < 0:
                return -1
            if found == 0x0A:  # resource (1), its attributes (1)
                if not _count(buf, field_at, field_end, 0x0A, counts, caps, _VALUES):
                    return -1
            elif found == 0x12:  # scope_spans / scope_metrics (2)
                if not _add(counts, caps, _SCOPES, 1) or not _scope(buf, field_at, field_end, counts, caps, signal):
                    return -1
    return 0


def request_shape(encoded: bytes, signal: str, limits: RequestLimits | None = None) -> RequestShape:
    """The counts of an encoded export request of ``signal`` (``traces`` or ``metrics``).
    With ``limits``, the walk stops at the first cap passed and raises its IngestError(413);
    IngestError(400) when the bytes are not a message the walk can read."""
    counts = np.zeros(6, dtype=np.int64)
    caps = np.full(6, np.iinfo(np.int64).max, dtype=np.int64)
    if limits is not None:
        caps[:] = (limits.max_resources, limits.max_scopes, limits.max_scopes,
                   limits.max_items if signal == "traces" else limits.max_points, limits.max_values, limits.max_buckets)
    status = _walk(np.frombuffer(encoded, dtype=np.uint8), 0 if signal == "traces" else 1, counts, caps)
    shape = RequestShape(*(int(c) for c in counts))
    if limits is not None:
        limits.check(shape, signal)  # a cap the walk stopped at
    if status < 0:
        raise IngestError(400, "malformed", f"body is not an encoded {signal} export request "
                          "(unreadable protobuf framing)")
    return shape
