"""OTLP/HTTP receiver: ``POST /v1/traces`` and ``POST /v1/metrics``, protobuf and JSON.

Behaviour (OTLP/HTTP specification 1.x):
- ``Content-Type: application/x-protobuf`` (or ``application/protobuf``) or
  ``application/json``; anything else -> 415. The response uses the request's encoding:
  ``ExportTraceServiceResponse`` / ``ExportMetricsServiceResponse`` on success, a
  ``google.rpc.Status`` on failure.
- ``Content-Encoding: gzip | deflate | identity``; others -> 415. Decompression is done
  here, in one bounded call: at most ``max_decompressed_bytes`` are ever produced, so a
  gzip bomb costs that much memory and then answers 413.
- Body over ``max_request_bytes`` (by Content-Length, or while reading a chunked body)
  -> 413; a body still incomplete after ``request_timeout_s`` -> 408. Undecodable body
  -> 400. Queue over capacity, or ``max_inflight_requests`` already being read -> 429
  with ``Retry-After``;
  collector shutting down -> 503 with ``Retry-After``; bad token -> 401.
- OTLP/JSON: trace and span ids are hex strings (not base64 as in protobuf's canonical
  JSON mapping); ``parse_otlp_json`` converts them before ``json_format`` sees them.

Cost of the hot path (protobuf): one upb parse plus one pass over the
resource/scope lists to count spans (``len`` of each repeated field; no span is
touched). Nothing else reads the message before the aggregator does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import zlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from sightline.collector.auth import TokenAuth
from sightline.collector.pipeline import Admission, Batch, Pipeline
from sightline.collector.self_metrics import SelfMetrics
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.otlp_json_ids import base64_to_hex, convert_ids

__all__ = [
    "Handler",
    "HttpIngestReceiver",
    "IngestError",
    "IngestLimits",
    "InflightLimit",
    "OtlpHttpReceiver",
    "count_data_points",
    "count_spans",
    "parse_otlp_json",
    "read_body",
    "to_otlp_json",
]

PROTOBUF_TYPES = frozenset({"application/x-protobuf", "application/protobuf"})
JSON_TYPE = "application/json"
# OTLP/JSON carries these as hex; protobuf's JSON mapping expects base64 for bytes.
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class IngestLimits:
    max_request_bytes: int
    max_decompressed_bytes: int
    retry_after_s: int
    max_inflight_requests: int = 64
    request_timeout_s: float = 30.0


class InflightLimit:
    """Counts export requests in progress on one listener (event-loop thread only: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.current = 0

    def try_enter(self) -> bool:
        if self.current >= self.limit:
            return False
        self.current += 1
        return True

    def leave(self) -> None:
        self.current -= 1


class IngestError(Exception):
    """A request refused with ``status``; ``reason`` is the self-metric label."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


# -- body -------------------------------------------------------------------------------
async def read_body(request: web.Request, limits: IngestLimits) -> bytes:
    """The request body, decompressed, within both size limits (see module docstring)."""
    declared = request.content_length
    if declared is not None and declared > limits.max_request_bytes:
        raise IngestError(413, "too_large", f"body of {declared} bytes exceeds the "
                          f"{limits.max_request_bytes}-byte limit")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "", "gzip", "x-gzip", "deflate"):
        raise IngestError(415, "unsupported_media_type",
                          f"Content-Encoding {encoding!r} is not gzip, deflate or identity")
    try:
        # aiohttp stops reading at client_max_size; wait_for keeps Python 3.10 working
        raw = await asyncio.wait_for(request.read(), limits.request_timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise IngestError(413, "too_large", f"body exceeds the {limits.max_request_bytes}-byte limit") from None
    except asyncio.TimeoutError:
        raise IngestError(408, "timeout", f"body did not arrive within {limits.request_timeout_s} s") from None
    if encoding in ("identity", ""):
        return raw
    return decompress_bounded(raw, encoding, limits.max_decompressed_bytes)


def decompress_bounded(raw: bytes, encoding: str, limit: int) -> bytes:
    """gzip/deflate-decodes ``raw`` producing at most ``limit`` bytes, else IngestError 413."""
    # wbits: 16+15 = gzip container; 15 = zlib container ("deflate" as HTTP means it);
    # -15 = the raw deflate some clients send under that name.
    wbits_options = (31,) if encoding in ("gzip", "x-gzip") else (15, -15)
    for wbits in wbits_options:
        try:
            return _inflate(raw, wbits, limit, encoding)
        except zlib.error:
            continue
    raise IngestError(400, "malformed", f"body is not valid {encoding} data")


def _inflate(raw: bytes, wbits: int, limit: int, encoding: str) -> bytes:
    # A gzip body may hold several members back to back (RFC 1952); each one is
    # inflated with what is left of the limit, so the total stays capped.
    parts: list[bytes] = []
    produced = 0
    pending = raw
    while True:
        decoder = zlib.decompressobj(wbits)
        out = decoder.decompress(pending, limit - produced + 1)
        produced += len(out)
        if produced > limit or decoder.unconsumed_tail:
            raise IngestError(413, "too_large", f"decompressed body exceeds the {limit}-byte limit")
        if not decoder.eof:
            raise IngestError(400, "malformed", f"truncated {encoding} body")
        parts.append(out)
        pending = decoder.unused_data
        if not pending or wbits != 31:
            return parts[0] if len(parts) == 1 else b"".join(parts)


# -- counting ---------------------------------------------------------------------------
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


# -- OTLP/JSON --------------------------------------------------------------------------
def _hex_to_base64(key: str, value: str) -> str:
    try:
        return base64.b64encode(bytes.fromhex(value)).decode("ascii")
    except ValueError:
        raise IngestError(400, "malformed", f"{key} {value!r} is not hex") from None


def parse_otlp_json(body: bytes | str | dict, message_cls: type[Message]) -> Message:
    """OTLP/JSON (hex ids, lowerCamelCase or snake_case keys, enums as ints) -> message.

    Raises IngestError(400) for invalid JSON, unknown fields or non-hex ids.
    """
    try:
        document = json.loads(body) if not isinstance(body, dict) else body
    except (ValueError, UnicodeDecodeError) as exc:
        raise IngestError(400, "malformed", f"body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise IngestError(400, "malformed", "OTLP/JSON body must be a JSON object")
    convert_ids(document, _hex_to_base64)
    try:
        return json_format.ParseDict(document, message_cls(), ignore_unknown_fields=False)
    except (json_format.ParseError, ValueError, TypeError) as exc:
        raise IngestError(400, "malformed", f"not an OTLP/JSON {message_cls.__name__}: {exc}") from None


def to_otlp_json(message: Message) -> dict[str, Any]:
    """message -> OTLP/JSON dict (hex ids, lowerCamelCase), the inverse of ``parse_otlp_json``."""
    document = json_format.MessageToDict(message)
    return convert_ids(document, base64_to_hex)


# -- responses --------------------------------------------------------------------------
def _status_body(code: int, message: str, *, as_json: bool, retry_after_s: int | None = None) -> bytes:
    status = status_pb2.Status(code=code, message=message)
    if retry_after_s is not None:
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay={"seconds": retry_after_s}))
    if as_json:
        return json.dumps(json_format.MessageToDict(status)).encode()
    return status.SerializeToString()


_GRPC_CODE_FOR_HTTP = {
    400: code_pb2.INVALID_ARGUMENT,
    401: code_pb2.UNAUTHENTICATED,
    408: code_pb2.DEADLINE_EXCEEDED,
    413: code_pb2.RESOURCE_EXHAUSTED,
    415: code_pb2.INVALID_ARGUMENT,
    429: code_pb2.RESOURCE_EXHAUSTED,
    503: code_pb2.UNAVAILABLE,
}


def error_response(error: IngestError, *, as_json: bool, retry_after_s: int) -> web.Response:
    """An OTLP error response: google.rpc.Status in the request's encoding."""
    retry = retry_after_s if error.status in (429, 503) else None
    headers = {}
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if error.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="sightline-collector"'
    body = _status_body(_GRPC_CODE_FOR_HTTP.get(error.status, code_pb2.UNKNOWN), error.message,
                        as_json=as_json, retry_after_s=retry)
    return web.Response(status=error.status, body=body, headers=headers,
                        content_type=JSON_TYPE if as_json else "application/x-protobuf")


def admit(pipeline: Pipeline, batch: Batch | None) -> None:
    """Offers ``batch``; raises the 429/503 IngestError when the pipeline refuses it.

    ``batch=None`` only raises the refusal (the caller already knows there is no room).
    """
    if batch is None:
        verdict = Admission.CLOSED if not pipeline.accepting else Admission.FULL
    else:
        verdict = pipeline.offer(batch)
    if verdict is Admission.ACCEPTED:
        return
    if verdict is Admission.FULL:
        raise IngestError(429, "over_capacity", "collector queue is full; retry later")
    raise IngestError(503, "shutting_down", "collector is shutting down")


# -- the receivers ----------------------------------------------------------------------
class HttpIngestReceiver:
    """What every HTTP ingest receiver holds (pipeline, self-metrics, auth, limits, its own
    in-flight count) and its aiohttp app: one POST route per ``routes()`` entry, bodies
    capped at ``max_request_bytes`` by aiohttp itself."""

    receiver: str  # the self-metric label, from semconv

    def __init__(self, pipeline: Pipeline, metrics: SelfMetrics, auth: TokenAuth,
                 limits: IngestLimits) -> None:
        self._pipeline = pipeline
        self._metrics = metrics
        self._auth = auth
        self._limits = limits
        self._inflight = InflightLimit(limits.max_inflight_requests)

    def routes(self) -> list[tuple[str, Handler]]:
        """(path, handler) pairs to serve with POST."""
        raise NotImplementedError

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self._limits.max_request_bytes)
        for path, handler in self.routes():
            app.router.add_post(path, handler)
        return app


class OtlpHttpReceiver(HttpIngestReceiver):
    """aiohttp handlers for /v1/traces and /v1/metrics; ``build_app`` makes the app."""

    receiver = sc.RECEIVER_OTLP_HTTP

    def routes(self) -> list[tuple[str, Handler]]:
        return [("/v1/traces", self.traces), ("/v1/metrics", self.metrics)]

    async def traces(self, request: web.Request) -> web.Response:
        return await self._export(request, "traces")

    async def metrics(self, request: web.Request) -> web.Response:
        return await self._export(request, "metrics")

    async def _export(self, request: web.Request, signal: str) -> web.Response:
        as_json = request.content_type == JSON_TYPE
        if not self._inflight.try_enter():
            self._metrics.rejected(self.receiver, "over_capacity")
            return error_response(IngestError(429, "over_capacity", "too many export requests in progress"),
                                  as_json=as_json, retry_after_s=self._limits.retry_after_s)
        try:
            return await self._export_one(request, signal, as_json)
        finally:
            self._inflight.leave()

    async def _export_one(self, request: web.Request, signal: str, as_json: bool) -> web.Response:
        content_type = request.content_type
        try:
            if not self._auth.allows(request.headers.get("Authorization")):
                raise IngestError(401, "unauthenticated", "missing or wrong bearer token")
            if not as_json and content_type not in PROTOBUF_TYPES:
                raise IngestError(415, "unsupported_media_type",
                                  f"Content-Type {content_type!r} is not application/x-protobuf "
                                  "or application/json")
            # Overloaded: answer before reading and parsing the body (the cheap 429).
            if not self._pipeline.has_room(request.content_length or 0):
                admit(self._pipeline, None)
            body = await read_body(request, self._limits)
            if signal == "traces":
                message = self._decode(body, ExportTraceServiceRequest, as_json)
                items = count_spans(message)
            else:
                message = self._decode(body, ExportMetricsServiceRequest, as_json)
                items = count_data_points(message)
            admit(self._pipeline, Batch(signal, message, items, len(body), self.receiver,
                                        body if signal == "traces" and not as_json else None))
        except IngestError as error:
            self._metrics.rejected(self.receiver, error.reason)
            return error_response(error, as_json=as_json, retry_after_s=self._limits.retry_after_s)
        if signal == "traces":
            self._metrics.accepted(self.receiver, items, 0)
            response: Message = ExportTraceServiceResponse()
        else:
            self._metrics.accepted(self.receiver, 0, items)
            response = ExportMetricsServiceResponse()
        if as_json:
            return web.Response(body=json.dumps(to_otlp_json(response)).encode(), content_type=JSON_TYPE)
        return web.Response(body=response.SerializeToString(), content_type="application/x-protobuf")

    @staticmethod
    def _decode(body: bytes, message_cls: type[Message], as_json: bool) -> Message:
        if as_json:
            return parse_otlp_json(body, message_cls)
        try:
            return message_cls.FromString(body)
        except (DecodeError, ValueError) as exc:
            raise IngestError(400, "malformed", f"body is not a protobuf {message_cls.__name__}: {exc}") from None
