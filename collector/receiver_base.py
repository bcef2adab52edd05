"""What every HTTP ingest receiver shares: the request flow, the OTLP error response, counting.

:class:`HttpIngestReceiver` runs one request flow for the OTLP/HTTP and Zipkin receivers:
bearer token (401), content type (415), the cheap refusal before the body is read (429/503),
the body within :mod:`.ingest`'s limits, a decoding slot (429 past ``max_inflight_requests``),
one decode (:mod:`.decoding`; on a decoder thread when compressed, JSON or large), then
admission (:mod:`.admission`). A bug is answered 500 and logged rate-limited, never raised
into aiohttp. :func:`error_response` is OTLP's refusal: a ``google.rpc.Status`` in the
request's encoding, with ``Retry-After`` and ``RetryInfo`` on 429 and 503.

Cost: identity bodies up to ``INLINE_BYTES`` decode on the event loop (no thread hop); every
other body pays one hand-off to the receiver's two decoder threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from aiohttp import web
from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2

from .admission import Intake
from .auth import TokenAuth
from .connection_guard import RateLimitedLog
from .decoding import INLINE_BYTES, Decoded, with_fingerprints
from .ingest import IngestError, IngestLimits, InflightLimit, content_encoding, inflate, read_raw
from .request_shape import RequestLimits

__all__ = ["JSON_TYPE", "Handler", "HttpIngestReceiver", "error_response", "refusal_headers"]

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


def refusal_headers(error: IngestError, retry_after_s: int) -> dict[str, str]:
    """The headers every HTTP refusal carries: ``Retry-After`` on 429 and 503 (retry later),
    the bearer challenge on 401."""
    headers = {}
    if error.status in (429, 503):
        headers["Retry-After"] = str(retry_after_s)
    if error.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="sightline-collector"'
    return headers


def error_response(error: IngestError, *, as_json: bool, retry_after_s: int) -> web.Response:
    """An OTLP error response: google.rpc.Status in the request's encoding."""
    retry = retry_after_s if error.status in (429, 503) else None
    headers = refusal_headers(error, retry_after_s)
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
                self._intake.accept(self.receiver, signal, decoded)
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
        decoded = self._decode(inflate(raw, encoding, self._limits), signal, as_json)
        if signal == "traces" and decoded.fingerprints is None:  # JSON: ids read here, not on the loop
            decoded = with_fingerprints(decoded)
        return decoded

    def _decode(self, body: bytes, signal: str, as_json: bool) -> Decoded:
        """The request ``body`` (decompressed) decoded, or IngestError (thread-safe)."""
        raise NotImplementedError

    def _ok(self, signal: str, as_json: bool) -> web.Response:
        raise NotImplementedError

    def _refusal(self, error: IngestError, as_json: bool) -> web.Response:
        raise NotImplementedError
