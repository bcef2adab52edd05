"""Zipkin v2 receiver: ``POST /api/v2/spans`` (JSON, optionally gzip) -> OTLP traces.

The aggregator sees one form only, so Zipkin spans are converted to an
``ExportTraceServiceRequest`` here (``zipkin_to_otlp`` gives the field mapping), one
``ResourceSpans`` per ``localEndpoint.serviceName``.

Answers (Zipkin's own): 202 empty on success; 400 with a plain-text reason when the
body is not a JSON list of valid v2 spans (the whole request is refused: Zipkin has no
partial success); 413/415/429/401/503 as the OTLP/HTTP receiver. Valid means: ids of
exactly 16 or 32 (trace) and 16 (span, parent) hex digits; times and durations finite,
non-negative µs before 2262 (int64 ns); ports integers in 0..65535 (0 or absent: unknown);
names, tag and annotation values strings (numbers and booleans are written as JSON), none
holding a lone UTF-16 surrogate; JSON nested at most ``max_json_depth`` deep. A span's
identity (for duplicates) is its ids, kind and ``shared``: both halves of an RPC are kept.
Cost: one Python pass over the spans after ``json.loads``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from ..instrumentation import semconv as sc
from .decoding import Decoded, decoded_traces
from .ingest import IngestError, load_json
from .receiver_base import Handler, HttpIngestReceiver, refusal_headers

__all__ = ["ZipkinReceiver", "zipkin_to_otlp"]

_KINDS = {
    "CLIENT": trace_pb2.Span.SPAN_KIND_CLIENT,
    "SERVER": trace_pb2.Span.SPAN_KIND_SERVER,
    "PRODUCER": trace_pb2.Span.SPAN_KIND_PRODUCER,
    "CONSUMER": trace_pb2.Span.SPAN_KIND_CONSUMER,
}
_UNKNOWN_SERVICE = "unknown_service"
_HEX_DIGITS = re.compile(r"[0-9a-fA-F]+")
# Timestamps and durations (µs) beyond int64 nanoseconds (year 2262) are not times.
_MAX_MICROS = (2**63 - 1) // 1000


def _hex_id(span: dict, key: str, lengths: tuple[int, ...], index: int, required: bool) -> bytes:
    value = span.get(key)
    if value is None or value == "":
        if required:
            raise IngestError(400, "malformed", f"span {index}: {key} is required")
        return b""
    if not isinstance(value, str) or len(value) not in lengths or not _HEX_DIGITS.fullmatch(value):
        raise IngestError(400, "malformed", f"span {index}: {key} {_show(value)} is not "
                          f"{' or '.join(map(str, lengths))} hex digits")
    return bytes.fromhex(value)


def _show(value: Any) -> str:
    """A bounded, always printable rendering of a bad value for an error message."""
    if isinstance(value, (dict, list)):
        return f"<a JSON {'object' if isinstance(value, dict) else 'array'}>"
    return ascii(value)[:80]


def _micros(span: dict, key: str, index: int) -> int:
    value = span.get(key, 0)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value)) or not 0 <= value <= _MAX_MICROS):
        raise IngestError(400, "malformed", f"span {index}: {key} {_show(value)} is not a number of µs "
                          f"in 0..{_MAX_MICROS}")
    return int(value)


def _text(value: Any, what: str, index: int) -> str:
    """A string value as text: strings as they are, numbers and booleans as JSON."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\udc80"): not text
                raise IngestError(400, "malformed", f"span {index}: {what} {_show(value)} is not "
                                  "valid Unicode (lone surrogate)") from None
        return value
    if value is None or isinstance(value, (bool, int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise IngestError(400, "malformed", f"span {index}: {what} {_show(value)} is not a finite number")
        return json.dumps(value)
    raise IngestError(400, "malformed", f"span {index}: {what} {_show(value)} is not a string")


def _add_str(attributes, key: str, value: Any, index: int) -> None:
    kv = attributes.add()
    kv.key = _text(key, "attribute key", index)
    kv.value.string_value = _text(value, key, index)


def _endpoint(attributes, endpoint: Any, *, address_key: str, port_key: str, index: int) -> None:
    if endpoint is None:
        return
    if not isinstance(endpoint, dict):
        raise IngestError(400, "malformed", f"span {index}: endpoint {_show(endpoint)} is not an object")
    address = endpoint.get("ipv4") or endpoint.get("ipv6")
    if address:
        _add_str(attributes, address_key, address, index)
    port = endpoint.get("port")
    if port is None or port == 0:  # 0: Zipkin's "unknown"
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
        raise IngestError(400, "malformed", f"span {index}: port {_show(port)} is not an integer in 1..65535")
    kv = attributes.add()
    kv.key = port_key
    kv.value.int_value = port


def zipkin_to_otlp(document: Any) -> ExportTraceServiceRequest:
    """A parsed Zipkin v2 JSON body (a list of spans) -> ExportTraceServiceRequest.

    ===========================  =====================================================
    Zipkin v2                    OTLP
    ===========================  =====================================================
    traceId (16 or 32 hex)       trace_id (64-bit ids left-padded with zeros to 16 B)
    id / parentId                span_id / parent_span_id
    name, kind                   name, kind (CLIENT/SERVER/PRODUCER/CONSUMER; none ->
                                 UNSPECIFIED)
    timestamp, duration (µs)     start_time_unix_nano, end_time_unix_nano (ns)
    localEndpoint.serviceName    resource attribute ``service.name``
    localEndpoint.ipv4/6, port   ``network.local.address`` / ``network.local.port``
    remoteEndpoint               ``peer.service``, ``network.peer.address``/``.port``
    tags                         string attributes; ``error`` -> status ERROR + message
                                 (``otel.status_code``/``otel.status_description`` too)
    annotations                  events (time µs -> ns, value -> name)
    shared                       attribute ``zipkin.shared`` = true
    ===========================  =====================================================

    Raises IngestError(400) naming the first bad span and field.
    """
    return _convert(document)[0]


def _convert(document: Any) -> tuple[ExportTraceServiceRequest, np.ndarray]:
    """``zipkin_to_otlp``, and per span of the request (in its order) what tells apart spans
    sharing an id: ``kind | shared << 3`` (the two halves of an RPC that Zipkin tracers report
    with one id: the CLIENT span, and the SERVER span marked ``shared``)."""
    if not isinstance(document, list):
        raise IngestError(400, "malformed", "Zipkin v2 body must be a JSON list of spans")
    request = ExportTraceServiceRequest()
    scopes: dict[str, Any] = {}
    variants: dict[str, list[int]] = {}  # per service, in span order
    for index, span in enumerate(document):
        if not isinstance(span, dict):
            raise IngestError(400, "malformed", f"span {index} is not a JSON object")
        trace_id = _hex_id(span, "traceId", (16, 32), index, required=True)
        span_id = _hex_id(span, "id", (16,), index, required=True)
        parent_id = _hex_id(span, "parentId", (16,), index, required=False)
        local = span.get("localEndpoint")
        service = local.get("serviceName") if isinstance(local, dict) else None
        service = _text(service, "localEndpoint.serviceName", index) if service else _UNKNOWN_SERVICE
        scope = scopes.get(service)
        if scope is None:
            rs = request.resource_spans.add()
            kv = rs.resource.attributes.add()
            kv.key = sc.RESOURCE_SERVICE_NAME
            kv.value.string_value = service
            scope = rs.scope_spans.add()
            scope.scope.name = sc.ZIPKIN_SCOPE_NAME
            scopes[service] = scope
            variants[service] = []
        out = scope.spans.add()
        out.trace_id = trace_id.rjust(16, b"\0")
        out.span_id = span_id
        if parent_id:
            out.parent_span_id = parent_id
        name = span.get("name")
        out.name = _text(name, "name", index) if name is not None else ""
        kind = span.get("kind")
        if kind is not None:
            if not isinstance(kind, str) or kind not in _KINDS:
                raise IngestError(400, "malformed", f"span {index}: kind {_show(kind)} is not one of {sorted(_KINDS)}")
            out.kind = _KINDS[kind]
        start_us = _micros(span, "timestamp", index)
        duration_us = _micros(span, "duration", index)
        if start_us + duration_us > _MAX_MICROS:
            raise IngestError(400, "malformed", f"span {index}: timestamp + duration ends after {_MAX_MICROS} µs")
        out.start_time_unix_nano = start_us * 1000
        out.end_time_unix_nano = (start_us + duration_us) * 1000
        attributes = out.attributes
        _endpoint(attributes, local, address_key=sc.NETWORK_LOCAL_ADDRESS,
                  port_key=sc.NETWORK_LOCAL_PORT, index=index)
        remote = span.get("remoteEndpoint")
        if isinstance(remote, dict) and remote.get("serviceName"):
            _add_str(attributes, sc.PEER_SERVICE, remote["serviceName"], index)
        _endpoint(attributes, remote, address_key=sc.NETWORK_PEER_ADDRESS,
                  port_key=sc.NETWORK_PEER_PORT, index=index)
        shared = span.get("shared") is True
        if shared:
            kv = attributes.add()
            kv.key = sc.ZIPKIN_SHARED
            kv.value.bool_value = True
        variants[service].append(out.kind | shared << 3)
        tags = span.get("tags") or {}
        if not isinstance(tags, dict):
            raise IngestError(400, "malformed", f"span {index}: tags must be an object of strings")
        for key, value in tags.items():
            if key == "error":
                out.status.code = trace_pb2.Status.STATUS_CODE_ERROR
                out.status.message = _text(value, "tag error", index)
            elif key == "otel.status_code":
                if value == "ERROR":
                    out.status.code = trace_pb2.Status.STATUS_CODE_ERROR
                elif value == "OK":
                    out.status.code = trace_pb2.Status.STATUS_CODE_OK
            elif key == "otel.status_description":
                out.status.message = _text(value, "tag otel.status_description", index)
            else:
                _add_str(attributes, key, value, index)
        annotations = span.get("annotations") or []
        if not isinstance(annotations, list):
            raise IngestError(400, "malformed", f"span {index}: annotations {_show(annotations)} is not a list")
        for annotation in annotations:
            if not isinstance(annotation, dict) or "value" not in annotation:
                raise IngestError(400, "malformed", f"span {index}: annotation {_show(annotation)} has no value")
            event = out.events.add()
            event.time_unix_nano = _micros(annotation, "timestamp", index) * 1000
            event.name = _text(annotation["value"], "annotation value", index)
    return request, np.fromiter((v for kinds in variants.values() for v in kinds), dtype=np.uint64,
                                count=len(document))


class ZipkinReceiver(HttpIngestReceiver):
    """aiohttp handler for ``POST /api/v2/spans``."""

    receiver = sc.RECEIVER_ZIPKIN

    def routes(self) -> list[tuple[str, Handler]]:
        return [("/api/v2/spans", self.spans)]

    async def spans(self, request: web.Request) -> web.Response:
        return await self._ingest(request, "traces", True)

    def _check_content_type(self, request: web.Request) -> None:
        if request.content_type != "application/json":
            raise IngestError(415, "unsupported_media_type",
                              f"Content-Type {request.content_type!r} is not application/json "
                              "(Zipkin v2 JSON; proto3 is not supported)")

    def _decode(self, body: bytes, signal: str, as_json: bool) -> Decoded:
        limits = self._request_limits
        values = limits.check_json(body)
        document = load_json(body, self._limits.max_json_depth)
        if isinstance(document, list):
            limits.check_items(len(document), signal)
        request, variants = _convert(document)
        return decoded_traces(request, len(document), limits.json_parsed_bytes(len(body), values), variants)

    def _ok(self, signal: str, as_json: bool) -> web.Response:
        return web.Response(status=202)

    def _refusal(self, error: IngestError, as_json: bool) -> web.Response:
        return web.Response(status=error.status, text=error.message + "\n",
                            headers=refusal_headers(error, self._limits.retry_after_s))
