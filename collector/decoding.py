"""Export request bodies decoded, once, into the form admission, series and trace store read.

:func:`decode_protobuf` walks an encoded OTLP request first (:mod:`.request_shape`): past a
cap it is refused with 413, unreadable with 400, and only then does upb parse it, the one
parse of the request (traces: into :data:`~.decoded_traces.DecodedTraceRequest`). The
:class:`Decoded` it returns goes on to admission, then to the series and the trace store,
which read that message, never the bytes. JSON bodies are bounded before ``json.loads`` by
:meth:`~.request_shape.RequestLimits.check_json`. ``parsed_bytes`` is what the queue
charges. :func:`off_loop` runs a decoder on a worker thread unless the body is small, so no
parse holds the event loop (and /healthz) for long: the caps bound one upb call's GIL hold.

Cost: the walk (a few ns per field) on top of the parse; one thread hop per body over
``INLINE_BYTES``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from .decoded_traces import DecodedTraceRequest
from .ingest import IngestError
from .request_shape import RequestLimits, request_shape
from .span_ids import span_fingerprints, with_variants

__all__ = ["INLINE_BYTES", "Decoded", "count_data_points", "count_spans", "decode_protobuf", "decoded_traces",
           "off_loop", "with_fingerprints"]

INLINE_BYTES = 64 * 1024  # a protobuf body this small parses in well under a millisecond: no hop
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Decoded:
    """One decoded export request: the message, its spans or data points, its estimated
    parsed size, (protobuf) the size of the encoding it was parsed from (the trace store's
    unit), (Zipkin) per span what tells apart spans sharing ids, and (traces) the spans'
    fingerprints (:mod:`.span_ids`; IngestError 400 for a bad id), so the event loop only
    looks them up."""

    message: Any
    items: int
    parsed_bytes: int
    encoded_bytes: int | None = None
    variants: np.ndarray | None = None
    fingerprints: np.ndarray | None = None  # traces: each span's identity, computed off the loop


def count_spans(request) -> int:
    """Spans in an export request: lengths of the repeated fields, no span is decoded."""
    return sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)


def count_data_points(request: ExportMetricsServiceRequest) -> int:
    """Data points in an export request (all five metric kinds)."""
    total = 0
    for rm in request.resource_metrics:
        for scope in rm.scope_metrics:
            for metric in scope.metrics:
                kind = metric.WhichOneof("data")
                if kind is not None:
                    total += len(getattr(metric, kind).data_points)
    return total


def decode_protobuf(body: bytes, signal: str, limits: RequestLimits) -> Decoded:
    """An encoded ``traces`` or ``metrics`` export request, walked and checked against
    ``limits`` before it is parsed; IngestError 413 past a cap, 400 when undecodable."""
    shape = request_shape(body, signal, limits)
    traces = signal == "traces"
    message_cls = DecodedTraceRequest if traces else ExportMetricsServiceRequest
    try:
        message = message_cls.FromString(body)
    except (DecodeError, ValueError) as exc:
        raise IngestError(400, "malformed", f"body is not a protobuf {message_cls.__name__}: {exc}") from None
    if not traces:
        return Decoded(message, count_data_points(message), shape.parsed_bytes(len(body)))
    return Decoded(message, count_spans(message), shape.parsed_bytes(len(body)), len(body),
                   fingerprints=span_fingerprints(message, body))


def decoded_traces(message, items: int, parsed_bytes: int, variants: np.ndarray | None = None) -> Decoded:
    """A stock ``ExportTraceServiceRequest`` (from JSON or Zipkin) in the decoded form the
    pipeline carries: one encode, one parse (:mod:`.decoded_traces`)."""
    encoded = message.SerializeToString()
    return Decoded(DecodedTraceRequest.FromString(encoded), items, parsed_bytes, len(encoded), variants)


def with_fingerprints(decoded: Decoded) -> Decoded:
    """``decoded`` (traces decoded from JSON) with its spans' fingerprints, variants mixed in."""
    fp = with_variants(span_fingerprints(decoded.message), decoded.variants)
    return dataclasses.replace(decoded, fingerprints=fp)


async def off_loop(executor, size: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``: here when ``size`` is at most ``INLINE_BYTES``, else on ``executor``."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
