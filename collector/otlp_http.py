"""OTLP/HTTP receiver: ``POST /v1/traces`` and ``POST /v1/metrics``, protobuf and JSON.

Behaviour (OTLP/HTTP specification 1.x): protobuf (``application/x-protobuf`` or
``application/protobuf``) or ``application/json``, ``gzip``, ``deflate`` or identity, else
415; the response uses the request's encoding (``Export*ServiceResponse``, or a
``google.rpc.Status`` on failure). Body limits, timeouts and decompression: :mod:`.ingest`;
admission, span checks and duplicates: :mod:`.admission`. Undecodable body, JSON nested
too deep or a bad span id: 400; queue over capacity or too many bodies being decoded: 429
with ``Retry-After``; shutting down: 503 with ``Retry-After``; bad token: 401; a bug: 500
INTERNAL, counted ``internal_error`` and logged rate-limited. OTLP/JSON ids are hex strings
(not base64 as in protobuf's canonical JSON mapping): ``parse_otlp_json`` converts them.

Cost of the hot path (protobuf): one upb parse plus one pass over the resource/scope lists
to count spans (no span is touched); nothing else reads the message before the aggregator.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
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

from ..instrumentation import base64_to_hex, convert_ids
from ..instrumentation import semconv as sc
from .admission import Intake, admit
from .auth import TokenAuth
from .connection_guard import RateLimitedLog
from .ingest import (IngestError, IngestLimits, InflightLimit, content_encoding, decode_body,
                     decompress_bounded, load_json, read_body, read_raw)

__all__ = [
    "Handler",
    "HttpIngestReceiver",
    "IngestError",
    "IngestLimits",
    "InflightLimit",
    "OtlpHttpReceiver",
    "admit",
    "count_data_points",
    "count_spans",
    "decompress_bounded",
    "parse_otlp_json",
    "read_body",
    "to_otlp_json",
]

log = logging.getLogger(__name__)

PROTOBUF_TYPES = frozenset({"application/x-protobuf", "application/protobuf"})
JSON_TYPE = "application/json"
# OTLP/JSON carries these as hex; protobuf's JSON mapping expects base64 for bytes.
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")
MAX_JSON_DEPTH = 64  # OTLP/JSON needs ~12 levels, plus nested AnyValue lists and maps


def _hex_to_base64(key: str, value: str) -> str:
    if not _HEX.fullmatch(value):  # bytes.fromhex would take spaces: "01 23" is not an id
        raise IngestError(400, "malformed", f"{key} {value[:80]!r} is not an even number of hex digits")
    return base64.b64encode(bytes.fromhex(value)).decode("ascii")


def parse_otlp_json(body: bytes | str | dict, message_cls: type[Message],
                    max_depth: int = MAX_JSON_DEPTH) -> Message:
    """OTLP/JSON (hex ids, lowerCamelCase or snake_case keys, enums as ints) -> message.

    Raises IngestError(400) for invalid JSON, JSON nested deeper than ``max_depth``,
    unknown fields or non-hex ids.
    """
    document = load_json(body, max_depth) if not isinstance(body, dict) else body
    if not isinstance(document, dict):
        raise IngestError(400, "malformed", "OTLP/JSON body must be a JSON object")
    convert_ids(document, _hex_to_base64)
    try:
        return json_format.ParseDict(document, message_cls(), ignore_unknown_fields=False)
    # SystemError: upb's field-name lookup fails that way on a key holding a lone surrogate.
    except (json_format.ParseError, ValueError, TypeError, OverflowError, RecursionError, SystemError) as exc:
        raise IngestError(400, "malformed", f"not an OTLP/JSON {message_cls.__name__}: {exc}"[:1000]) from None


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
    499: code_pb2.CANCELLED,
    500: code_pb2.INTERNAL,
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


# -- the receivers ----------------------------------------------------------------------
class HttpIngestReceiver:
    """What every HTTP ingest receiver holds (intake, auth, limits, its own in-flight count,
    a decoder thread for compressed bodies) and its aiohttp app: one POST route per
    ``routes()`` entry, bodies capped at ``max_request_bytes`` by aiohttp itself.

    ``_ingest`` is the one request flow both receivers run; a subclass supplies
    ``_check_content_type``, ``_decode``, ``_ok`` and ``_refusal``."""

    receiver: str  # the self-metric label, from semconv

    def __init__(self, intake: Intake, auth: TokenAuth, limits: IngestLimits,
                 errors: RateLimitedLog | None = None) -> None:
        self._intake = intake
        self._pipeline = intake.pipeline
        self._metrics = intake.metrics
        self._auth = auth
        self._limits = limits
        self._inflight = InflightLimit(limits.max_inflight_requests)
        self._errors = errors or RateLimitedLog(log)
        # Decompression off the event loop; two threads: one bomb does not hold up the rest.
        self._inflater = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"sightline-{self.receiver}-inflate")

    def routes(self) -> list[tuple[str, Handler]]:
        """(path, handler) pairs to serve with POST."""
        raise NotImplementedError

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self._limits.max_request_bytes)
        for path, handler in self.routes():
            app.router.add_post(path, handler)
        return app

    def close(self) -> None:
        self._inflater.shutdown(wait=False, cancel_futures=True)

    async def _ingest(self, request: web.Request, signal: str, as_json: bool) -> web.Response:
        try:
            if not self._auth.allows(request.headers.get("Authorization")):
                raise IngestError(401, "unauthenticated", "missing or wrong bearer token")
            self._check_content_type(request)
            encoding = content_encoding(request)
            # Overloaded: answer before reading and parsing the body (the cheap 429).
            self._intake.check_room(request.content_length or 0)
            raw = await read_raw(request, self._limits)
            # a request takes a decoding slot only once its body has arrived, so slow senders
            # cannot lock fast ones out
            if not self._inflight.try_enter():
                raise IngestError(429, "over_capacity", "too many export requests being decoded")
            try:
                body = await decode_body(raw, encoding, self._limits, self._inflater)
                message, items, encoded = self._decode(body, signal, as_json)
                self._intake.accept(self.receiver, signal, message, items, len(body), encoded)
            finally:
                self._inflight.leave()
        except IngestError as error:
            self._metrics.rejected(self.receiver, error.reason)
            return self._refusal(error, as_json)
        except Exception as exc:  # a bug: answered and counted, never a silent 500 from aiohttp
            self._errors.error(f"{self.receiver}:{type(exc).__name__}", "%s receiver failed on a request",
                               self.receiver, exc_info=exc)
            self._metrics.rejected(self.receiver, "internal_error")
            return self._refusal(IngestError(500, "internal_error", f"internal error: {type(exc).__name__}"),
                                 as_json)
        return self._ok(signal, as_json)

    def _check_content_type(self, request: web.Request) -> None:
        raise NotImplementedError

    def _decode(self, body: bytes, signal: str, as_json: bool) -> tuple[Any, int, bytes | None]:
        """(request message, spans or data points in it, its protobuf encoding or None)."""
        raise NotImplementedError

    def _ok(self, signal: str, as_json: bool) -> web.Response:
        raise NotImplementedError

    def _refusal(self, error: IngestError, as_json: bool) -> web.Response:
        raise NotImplementedError


class OtlpHttpReceiver(HttpIngestReceiver):
    """aiohttp handlers for /v1/traces and /v1/metrics; ``build_app`` makes the app."""

    receiver = sc.RECEIVER_OTLP_HTTP

    def routes(self) -> list[tuple[str, Handler]]:
        return [("/v1/traces", self.traces), ("/v1/metrics", self.metrics)]

    async def traces(self, request: web.Request) -> web.Response:
        return await self._ingest(request, "traces", request.content_type == JSON_TYPE)

    async def metrics(self, request: web.Request) -> web.Response:
        return await self._ingest(request, "metrics", request.content_type == JSON_TYPE)

    def _check_content_type(self, request: web.Request) -> None:
        content_type = request.content_type
        if content_type != JSON_TYPE and content_type not in PROTOBUF_TYPES:
            raise IngestError(415, "unsupported_media_type",
                              f"Content-Type {content_type!r} is not application/x-protobuf "
                              "or application/json")

    def _decode(self, body: bytes, signal: str, as_json: bool) -> tuple[Any, int, bytes | None]:
        if signal == "traces":
            message = self._parse(body, ExportTraceServiceRequest, as_json)
            return message, count_spans(message), None if as_json else body
        message = self._parse(body, ExportMetricsServiceRequest, as_json)
        return message, count_data_points(message), None

    def _parse(self, body: bytes, message_cls: type[Message], as_json: bool) -> Message:
        if as_json:
            return parse_otlp_json(body, message_cls, self._limits.max_json_depth)
        try:
            return message_cls.FromString(body)
        except (DecodeError, ValueError) as exc:
            raise IngestError(400, "malformed", f"body is not a protobuf {message_cls.__name__}: {exc}") from None

    def _ok(self, signal: str, as_json: bool) -> web.Response:
        response: Message = ExportTraceServiceResponse() if signal == "traces" else ExportMetricsServiceResponse()
        if as_json:
            return web.Response(body=json.dumps(to_otlp_json(response)).encode(), content_type=JSON_TYPE)
        return web.Response(body=response.SerializeToString(), content_type="application/x-protobuf")

    def _refusal(self, error: IngestError, as_json: bool) -> web.Response:
        return error_response(error, as_json=as_json, retry_after_s=self._limits.retry_after_s)
