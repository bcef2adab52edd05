"""OTLP/HTTP receiver: ``POST /v1/traces`` and ``POST /v1/metrics``, protobuf and JSON.

Behaviour (OTLP/HTTP specification 1.x): protobuf (``application/x-protobuf`` or
``application/protobuf``) or ``application/json``, ``gzip``, ``deflate`` or identity, else
415; the response uses the request's encoding (``Export*ServiceResponse``, or a
``google.rpc.Status`` on failure). The request flow, limits and refusals every HTTP receiver
shares: :mod:`.receiver_base`; caps checked before a body is parsed: :mod:`.decoding`.
Undecodable body, JSON nested too deep or a bad span id: 400; past a size or message cap:
413; queue over capacity or too many bodies being decoded: 429 with ``Retry-After``;
shutting down: 503 with ``Retry-After``; bad token: 401; a bug: 500 INTERNAL. OTLP/JSON ids
are hex strings (not base64 as in protobuf's JSON mapping): ``parse_otlp_json`` converts them.

Cost (protobuf): one compiled walk, one upb parse, one pass over the resource/scope lists;
bodies over ``INLINE_BYTES``, compressed or JSON are decoded on the receiver's decoder threads.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message
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
from .decoding import Decoded, count_data_points, count_spans, decode_protobuf, decoded_traces
from .ingest import IngestError, load_json
from .receiver_base import JSON_TYPE, Handler, HttpIngestReceiver, error_response

__all__ = ["OtlpHttpReceiver", "parse_otlp_json", "to_otlp_json"]

PROTOBUF_TYPES = frozenset({"application/x-protobuf", "application/protobuf"})


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
            limits.check_items(items, signal)
            return decoded_traces(message, items, limits.json_parsed_bytes(len(body), values))
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
