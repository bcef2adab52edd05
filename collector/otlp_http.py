"""OTLP/HTTP receiver: ``POST /v1/traces`` and ``POST /v1/metrics``, protobuf and JSON.

Behaviour (OTLP/HTTP specification 1.x): protobuf (``application/x-protobuf`` or
``application/protobuf``) or ``application/json``, ``gzip``, ``deflate`` or identity, else
415; the response uses the request's encoding (``Export*ServiceResponse``, or a
``google.rpc.Status`` on failure). Body limits, timeouts and decompression: :mod:`.ingest`;
caps on a request's messages, checked before it is parsed: :mod:`.decoding`; admission,
span checks and duplicates: :mod:`.admission`. Undecodable body, JSON nested too deep or a
bad span id: 400; past a size or message cap: 413; queue over capacity or too many bodies
being decoded: 429 with ``Retry-After``; shutting down: 503 with ``Retry-After``; bad token:
401; a bug: 500 INTERNAL, counted and logged rate-limited. OTLP/JSON ids are hex strings
(not base64 as in protobuf's JSON mapping): ``parse_otlp_json`` converts them.

Cost (protobuf): one compiled walk, one upb parse, one pass over the resource/scope lists;
bodies over ``INLINE_BYTES``, compressed or JSON are decoded on the receiver's decoder threads.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message
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
from .decoding import INLINE_BYTES, Decoded, count_data_points, count_spans, decode_protobuf
from .ingest import (IngestError, IngestLimits, InflightLimit, content_encoding, decompress_bounded, inflate,
                     load_json, read_body, read_raw)
from .request_shape import RequestLimits

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
    ``_check_content_type``, ``_decode`` (bounded by ``self._request_limits`` before it
    parses: it may run on a decoder thread), ``_ok`` and ``_refusal``."""

    receiver: str  # the self-metric label, from semconv

    def __init__(self, intake: Intake, auth: TokenAuth, limits: IngestLimits,
                 errors: RateLimitedLog | None = None) -> None:
        self._intake = intake
        self._pipeline = intake.pipeline
        self._metrics = intake.metrics
        self._auth = auth
        self._limits = limits
        self._request_limits: RequestLimits = intake.limits
        self._inflight = InflightLimit(limits.max_inflight_requests)
        self._errors = errors or RateLimitedLog(log)
        # Decompression and parsing off the event loop; two threads: one bomb does not hold up the rest.
        self._decoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"sightline-{self.receiver}-decode")

    def routes(self) -> list[tuple[str, Handler]]:
        """(path, handler) pairs to serve with POST."""
        raise NotImplementedError

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self._limits.max_request_bytes)
        for path, handler in self.routes():
            app.router.add_post(path, handler)
        return app

    def close(self) -> None:
        self._decoder.shutdown(wait=False, cancel_futures=True)

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
                if encoding == "identity" and not as_json and len(raw) <= INLINE_BYTES:
                    decoded = self._decode(raw, signal, as_json)  # cheaper than a thread hop
                else:
                    decoded = await asyncio.get_running_loop().run_in_executor(
                        self._decoder, self._inflate_and_decode, raw, encoding, signal, as_json)
                self._intake.accept(self.receiver, signal, decoded.message, decoded.items, decoded.parsed_bytes,
                                    decoded.encoded, decoded.variants)
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

    def _inflate_and_decode(self, raw: bytes, encoding: str, signal: str, as_json: bool) -> Decoded:
        return self._decode(inflate(raw, encoding, self._limits), signal, as_json)

    def _decode(self, body: bytes, signal: str, as_json: bool) -> Decoded:
        """The request ``body`` (decompressed) decoded, or IngestError (thread-safe)."""
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

    def _decode(self, body: bytes, signal: str, as_json: bool) -> Decoded:
        limits = self._request_limits
        if not as_json:
            return decode_protobuf(body, signal, limits)
        values = limits.check_json(body)
        if signal == "traces":
            message = parse_otlp_json(body, ExportTraceServiceRequest, self._limits.max_json_depth)
            items = count_spans(message)
        else:
            message = parse_otlp_json(body, ExportMetricsServiceRequest, self._limits.max_json_depth)
            items = count_data_points(message)
        limits.check_items(items, signal)
        return Decoded(message, items, limits.json_parsed_bytes(len(body), values))

    def _ok(self, signal: str, as_json: bool) -> web.Response:
        response: Message = ExportTraceServiceResponse() if signal == "traces" else ExportMetricsServiceResponse()
        if as_json:
            return web.Response(body=json.dumps(to_otlp_json(response)).encode(), content_type=JSON_TYPE)
        return web.Response(body=response.SerializeToString(), content_type="application/x-protobuf")

    def _refusal(self, error: IngestError, as_json: bool) -> web.Response:
        return error_response(error, as_json=as_json, retry_after_s=self._limits.retry_after_s)
