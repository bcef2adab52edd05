"""Zipkin v2 receiver: ``POST /api/v2/spans`` (JSON, optionally gzip) -> OTLP traces.

The aggregator sees one form only, so Zipkin spans are converted to an
``ExportTraceServiceRequest`` here, one ``ResourceSpans`` per
``localEndpoint.serviceName``:

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

Answers (Zipkin's own): 202 empty on success; 400 with a plain-text reason when the
body is not a JSON list of valid v2 spans (the whole request is refused: Zipkin has no
partial success); 413/415/429/401/503 as the OTLP/HTTP receiver.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from sightline.collector.otlp_http import Handler, HttpIngestReceiver, IngestError, admit, read_body
from sightline.collector.pipeline import Batch
from sightline.instrumentation import semconv as sc

__all__ = ["ZipkinReceiver", "zipkin_to_otlp"]

_KINDS = {
    "CLIENT": trace_pb2.Span.SPAN_KIND_CLIENT,
    "SERVER": trace_pb2.Span.SPAN_KIND_SERVER,
    "PRODUCER": trace_pb2.Span.SPAN_KIND_PRODUCER,
    "CONSUMER": trace_pb2.Span.SPAN_KIND_CONSUMER,
}
_UNKNOWN_SERVICE = "unknown_service"


def _hex_id(span: dict, key: str, lengths: tuple[int, ...], index: int, required: bool) -> bytes:
    value = span.get(key)
    if value is None or value == "":
        if required:
            raise IngestError(400, "malformed", f"span {index}: {key} is required")
        return b""
    if not isinstance(value, str) or len(value) not in lengths:
        raise IngestError(400, "malformed",
                          f"span {index}: {key} {value!r} is not {' or '.join(map(str, lengths))} hex characters")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise IngestError(400, "malformed", f"span {index}: {key} {value!r} is not hex") from None
    return raw


def _micros(span: dict, key: str, index: int) -> int:
    value = span.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise IngestError(400, "malformed", f"span {index}: {key} {value!r} is not a non-negative number of µs")
    return int(value)


def _add_str(attributes, key: str, value: Any) -> None:
    kv = attributes.add()
    kv.key = key
    kv.value.string_value = value if isinstance(value, str) else json.dumps(value)


def _endpoint(attributes, endpoint: Any, *, address_key: str, port_key: str, index: int) -> None:
    if endpoint is None:
        return
    if not isinstance(endpoint, dict):
        raise IngestError(400, "malformed", f"span {index}: endpoint {endpoint!r} is not an object")
    address = endpoint.get("ipv4") or endpoint.get("ipv6")
    if address:
        _add_str(attributes, address_key, address)
    port = endpoint.get("port")
    if isinstance(port, int) and not isinstance(port, bool) and port > 0:
        kv = attributes.add()
        kv.key = port_key
        kv.value.int_value = port


def zipkin_to_otlp(document: Any) -> ExportTraceServiceRequest:
    """A parsed Zipkin v2 JSON body (a list of spans) -> ExportTraceServiceRequest.

    Raises IngestError(400) naming the first bad span and field.
    """
    if not isinstance(document, list):
        raise IngestError(400, "malformed", "Zipkin v2 body must be a JSON list of spans")
    request = ExportTraceServiceRequest()
    scopes: dict[str, Any] = {}
    for index, span in enumerate(document):
        if not isinstance(span, dict):
            raise IngestError(400, "malformed", f"span {index} is not a JSON object")
        trace_id = _hex_id(span, "traceId", (16, 32), index, required=True)
        span_id = _hex_id(span, "id", (16,), index, required=True)
        parent_id = _hex_id(span, "parentId", (16,), index, required=False)
        local = span.get("localEndpoint")
        service = local.get("serviceName") if isinstance(local, dict) else None
        service = service if isinstance(service, str) and service else _UNKNOWN_SERVICE
        scope = scopes.get(service)
        if scope is None:
            rs = request.resource_spans.add()
            kv = rs.resource.attributes.add()
            kv.key = sc.RESOURCE_SERVICE_NAME
            kv.value.string_value = service
            scope = rs.scope_spans.add()
            scope.scope.name = sc.ZIPKIN_SCOPE_NAME
            scopes[service] = scope
        out = scope.spans.add()
        out.trace_id = trace_id.rjust(16, b"\0")
        out.span_id = span_id
        if parent_id:
            out.parent_span_id = parent_id
        name = span.get("name", "")
        out.name = name if isinstance(name, str) else str(name)
        kind = span.get("kind")
        if kind is not None:
            if kind not in _KINDS:
                raise IngestError(400, "malformed", f"span {index}: kind {kind!r} is not one of {sorted(_KINDS)}")
            out.kind = _KINDS[kind]
        start_us = _micros(span, "timestamp", index)
        duration_us = _micros(span, "duration", index)
        out.start_time_unix_nano = start_us * 1000
        out.end_time_unix_nano = (start_us + duration_us) * 1000
        attributes = out.attributes
        _endpoint(attributes, local, address_key=sc.NETWORK_LOCAL_ADDRESS,
                  port_key=sc.NETWORK_LOCAL_PORT, index=index)
        remote = span.get("remoteEndpoint")
        if isinstance(remote, dict) and remote.get("serviceName"):
            _add_str(attributes, sc.PEER_SERVICE, remote["serviceName"])
        _endpoint(attributes, remote, address_key=sc.NETWORK_PEER_ADDRESS,
                  port_key=sc.NETWORK_PEER_PORT, index=index)
        if span.get("shared") is True:
            kv = attributes.add()
            kv.key = sc.ZIPKIN_SHARED
            kv.value.bool_value = True
        tags = span.get("tags") or {}
        if not isinstance(tags, dict):
            raise IngestError(400, "malformed", f"span {index}: tags must be an object of strings")
        for key, value in tags.items():
            if key == "error":
                out.status.code = trace_pb2.Status.STATUS_CODE_ERROR
                out.status.message = value if isinstance(value, str) else json.dumps(value)
            elif key == "otel.status_code":
                if value == "ERROR":
                    out.status.code = trace_pb2.Status.STATUS_CODE_ERROR
                elif value == "OK":
                    out.status.code = trace_pb2.Status.STATUS_CODE_OK
            elif key == "otel.status_description":
                out.status.message = str(value)
            else:
                _add_str(attributes, key, value)
        for annotation in span.get("annotations") or ():
            if not isinstance(annotation, dict) or "value" not in annotation:
                raise IngestError(400, "malformed", f"span {index}: annotation {annotation!r} has no value")
            event = out.events.add()
            event.time_unix_nano = _micros(annotation, "timestamp", index) * 1000
            event.name = str(annotation["value"])
    return request


class ZipkinReceiver(HttpIngestReceiver):
    """aiohttp handler for ``POST /api/v2/spans``."""

    receiver = sc.RECEIVER_ZIPKIN

    def routes(self) -> list[tuple[str, Handler]]:
        return [("/api/v2/spans", self.spans)]

    async def spans(self, request: web.Request) -> web.Response:
        if not self._inflight.try_enter():
            return self._refusal(IngestError(429, "over_capacity", "too many requests in progress"))
        try:
            return await self._spans(request)
        finally:
            self._inflight.leave()

    def _refusal(self, error: IngestError) -> web.Response:
        self._metrics.rejected(self.receiver, error.reason)
        headers = {}
        if error.status in (429, 503):
            headers["Retry-After"] = str(self._limits.retry_after_s)
        if error.status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="sightline-collector"'
        return web.Response(status=error.status, text=error.message + "\n", headers=headers)

    async def _spans(self, request: web.Request) -> web.Response:
        try:
            if not self._auth.allows(request.headers.get("Authorization")):
                raise IngestError(401, "unauthenticated", "missing or wrong bearer token")
            if request.content_type != "application/json":
                raise IngestError(415, "unsupported_media_type",
                                  f"Content-Type {request.content_type!r} is not application/json "
                                  "(Zipkin v2 JSON; proto3 is not supported)")
            if not self._pipeline.has_room(request.content_length or 0):
                admit(self._pipeline, None)  # overloaded: refuse before reading the body
            body = await read_body(request, self._limits)
            try:
                document = json.loads(body)
            except (ValueError, UnicodeDecodeError) as exc:
                raise IngestError(400, "malformed", f"body is not JSON: {exc}") from None
            message = zipkin_to_otlp(document)
            items = len(document)
            admit(self._pipeline, Batch("traces", message, items, len(body), self.receiver))
        except IngestError as error:
            return self._refusal(error)
        self._metrics.accepted(self.receiver, items, 0)
        return web.Response(status=202)
