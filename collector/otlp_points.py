"""Reading OTLP protobuf values and CTA-duration points into Sightline's own types.

``any_value``, ``num`` and ``label`` read an ``AnyValue`` as a plain value, a number or a
label string cut at ``MAX_LABEL_CHARS``. ``cta_point_histogram`` checks one
``gpu.kernel.cta.duration`` exponential-histogram point (:mod:`.point_check`) and turns it
into an ``ExpHistogram``, or raises :class:`PointRefused` whose ``reason`` is the
``dropped`` label the aggregator counts; ``points_in`` is a metric's data-point count.
``LeanTraceRequest`` parses an encoded ``ExportTraceServiceRequest`` keeping only what the
span distributions read (ids, name, times, status code, each attribute as its raw encoded
``KeyValue``); it is wire-compatible by construction (OTLP trace.proto's field numbers).

Cost: O(buckets) numpy work per point, with no copy of a point's counts when it is at most
``max_buckets`` wide; a lean span is a few bytes objects instead of a tree of upb wrappers.
"""

from __future__ import annotations

import math

import numpy as np

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from ..instrumentation import semconv
from ..instrumentation import MAX_SCALE, ExpHistogram
from .point_check import PointRefused, check_exp_point

__all__ = ["MAX_LABEL_CHARS", "LeanTraceRequest", "PointRefused", "any_value", "clamped_time_s",
           "cta_point_histogram", "decode_attribute", "label", "lean_trace_request_class", "num",
           "points_in", "resource_instance"]

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


def decode_attribute(raw: bytes) -> tuple[str, object]:
    """``(key, AnyValue)`` of one encoded ``KeyValue`` (a lean span's attribute)."""
    kv = KeyValue.FromString(raw)
    return kv.key, kv.value


def lean_trace_request_class(package: str, span_fields: list[tuple]) -> type:
    """A message class that reads an encoded ``ExportTraceServiceRequest`` keeping only
    ``span_fields`` of each span: ``(name, number, FieldDescriptorProto type, repeated,
    message type name or None)``, numbers and wire types as in OTLP's trace.proto; a
    ``Status`` message (its ``code``) may be referred to. Everything else is unknown fields."""
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name=package.replace(".", "_") + ".proto",
                                              package=package, syntax="proto3")

    def message(name, fields):
        m = file.message_type.add(name=name)
        for field_name, number, kind, repeated, type_name in fields:
            field = m.field.add(name=field_name, number=number, type=kind,
                                label=f.LABEL_REPEATED if repeated else f.LABEL_OPTIONAL)
            if type_name:
                field.type_name = f".{package}.{type_name}"

    message("Status", [("code", 3, f.TYPE_INT32, False, None)])
    message("Span", span_fields)
    message("ScopeSpans", [("spans", 2, f.TYPE_MESSAGE, True, "Span")])
    message("ResourceSpans", [("scope_spans", 2, f.TYPE_MESSAGE, True, "ScopeSpans")])
    message("Request", [("resource_spans", 1, f.TYPE_MESSAGE, True, "ResourceSpans")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.Request"))


_FieldType = descriptor_pb2.FieldDescriptorProto  # its TYPE_* constants
# With the upb backend every nested message read from Python builds a wrapper object, so
# reading two attributes of a full span costs several wrappers; here an attribute is one
# bytes object, and a reader decodes (``decode_attribute``) only the ones it wants.
LeanTraceRequest = lean_trace_request_class("sightline.collector.lean", [
    ("trace_id", 1, _FieldType.TYPE_BYTES, False, None),
    ("span_id", 2, _FieldType.TYPE_BYTES, False, None),
    ("name", 5, _FieldType.TYPE_STRING, False, None),
    ("kind", 6, _FieldType.TYPE_INT32, False, None),
    ("start_time_unix_nano", 7, _FieldType.TYPE_FIXED64, False, None),
    ("end_time_unix_nano", 8, _FieldType.TYPE_FIXED64, False, None),
    ("attributes", 9, _FieldType.TYPE_BYTES, True, None),  # each an encoded KeyValue
    ("status", 15, _FieldType.TYPE_MESSAGE, False, "Status")])
