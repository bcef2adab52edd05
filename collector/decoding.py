"""Export request bodies decoded into the messages the pipeline carries, bounded before parsing.

:func:`decode_protobuf` walks an encoded OTLP request first (:mod:`.request_shape`): past a
cap it is refused with 413, unreadable with 400, and only then does upb parse it. JSON bodies
are bounded before ``json.loads`` by :meth:`~.request_shape.RequestLimits.check_json`. Each
decoder returns a :class:`Decoded` whose ``parsed_bytes`` (the parsed size, not the wire
size) is what the pipeline queue charges. :func:`off_loop` runs a decoder on a worker thread
unless the body is small, so that no parse holds the event loop (and /healthz) for long: a
thread in upb's parse holds the GIL for one call at most, and the caps bound that call.

Cost: the walk (a few ns per field) on top of the parse; one thread hop per body over
``INLINE_BYTES``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from .ingest import IngestError
from .request_shape import RequestLimits, request_shape

__all__ = ["INLINE_BYTES", "Decoded", "count_data_points", "count_spans", "decode_protobuf", "off_loop"]

INLINE_BYTES = 64 * 1024  # a protobuf body this small parses in well under a millisecond: no hop
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Decoded:
    """One decoded export request: the message, its spans or data points, its estimated
    parsed size, (traces in protobuf) the encoding it was parsed from, and (Zipkin) per span
    what tells apart spans sharing ids (:func:`.span_ids.with_variants`)."""

    message: Any
    items: int
    parsed_bytes: int
    encoded: bytes | None = None
    variants: np.ndarray | None = None


def count_spans(request: ExportTraceServiceRequest) -> int:
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
    message_cls = ExportTraceServiceRequest if traces else ExportMetricsServiceRequest
    try:
        message = message_cls.FromString(body)
    except (DecodeError, ValueError) as exc:
        raise IngestError(400, "malformed", f"body is not a protobuf {message_cls.__name__}: {exc}") from None
    items = count_spans(message) if traces else count_data_points(message)
    return Decoded(message, items, shape.parsed_bytes(len(body)), body if traces else None)


async def off_loop(executor, size: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``: here when ``size`` is at most ``INLINE_BYTES``, else on ``executor``."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
