"""OTLP/gRPC receiver: TraceService/Export and MetricsService/Export on grpc.aio.

Status codes follow the OTLP/gRPC specification: OK when the whole request was queued;
INVALID_ARGUMENT for an undecodable message or a bad span id; RESOURCE_EXHAUSTED over
capacity or size, with ``google.rpc.RetryInfo`` (which the OTel SDK exporters honour) when
the queue is full; UNAUTHENTICATED for a missing or wrong bearer token; UNAVAILABLE while
shutting down (retryable); INTERNAL for a bug, logged rate-limited. Every refusal is
counted in ``sightline_collector_rejected_total`` with its reason; admission, span checks
and duplicates as for every receiver (:mod:`.admission`).

Cost: the request is parsed exactly once, by us (the methods receive raw bytes), after a
compiled walk that counts its messages against the caps (:mod:`.decoding`), plus one pass
over the resource/scope lists to count its items.
"""

from __future__ import annotations

import logging

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ..instrumentation import semconv as sc
from .admission import Intake
from .auth import TokenAuth
from .connection_guard import RateLimitedLog
from .ingest import IngestError

__all__ = ["OtlpGrpcReceiver", "TRACE_SERVICE", "METRICS_SERVICE"]

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
_EMPTY_TRACE_RESPONSE = ExportTraceServiceResponse().SerializeToString()
_EMPTY_METRICS_RESPONSE = ExportMetricsServiceResponse().SerializeToString()
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
          499: grpc.StatusCode.CANCELLED, 500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE}
log = logging.getLogger(__name__)


def _retry_trailer(code: int, message: str, retry_after_s: int) -> tuple[tuple[str, bytes], ...]:
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay={"seconds": retry_after_s}))
    return (("grpc-status-details-bin", status.SerializeToString()),)


class OtlpGrpcReceiver:
    """Builds the grpc.aio server with both OTLP services; ``start``/``stop`` it from app.py."""

    receiver = sc.RECEIVER_OTLP_GRPC

    def __init__(self, intake: Intake, auth: TokenAuth, *, max_message_bytes: int, retry_after_s: int,
                 max_concurrent_rpcs: int = 64, errors: RateLimitedLog | None = None) -> None:
        self._intake = intake
        self._pipeline = intake.pipeline
        self._metrics = intake.metrics
        self._auth = auth
        self._retry_after_s = retry_after_s
        self._max_message_bytes = max_message_bytes
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._errors = errors or RateLimitedLog(log)
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        # Generic handlers that receive the raw request bytes, so that decoding is ours: an
        # undecodable request answers INVALID_ARGUMENT (the stock generated servicer would
        # answer INTERNAL). Request-streaming (a unary call is the same on the wire), so that
        # a message gRPC core refused for its size still reaches _export as "no message" and
        # is counted; a call with more than one message is refused.
        raw = dict(request_deserializer=None, response_serializer=None)  # bytes in, bytes out
        return [
            grpc.method_handlers_generic_handler(TRACE_SERVICE, {
                "Export": grpc.stream_unary_rpc_method_handler(self._export_traces, **raw)}),
            grpc.method_handlers_generic_handler(METRICS_SERVICE, {
                "Export": grpc.stream_unary_rpc_method_handler(self._export_metrics, **raw)}),
        ]

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
        """Binds and starts; returns the bound port (``port`` 0 picks a free one)."""
        options = [
            # counts the decompressed size: gRPC core answers RESOURCE_EXHAUSTED over it,
            # before our handler runs
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.max_send_message_length", 1024 * 1024),
            ("grpc.so_reuseport", 0),
        ]
        # Beyond maximum_concurrent_rpcs gRPC answers RESOURCE_EXHAUSTED itself.
        self.server = grpc.aio.server(options=options, maximum_concurrent_rpcs=self._max_concurrent_rpcs)
        self.server.add_generic_rpc_handlers(self.handlers())
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if credentials is None:
            self.port = self.server.add_insecure_port(target)
        else:
            self.port = self.server.add_secure_port(target, credentials)
        if not self.port:
            raise OSError(f"OTLP gRPC receiver could not bind {target}")
        await self.server.start()
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stops accepting RPCs; in-flight ones get ``grace_s`` to finish."""
        if self.server is not None:
            await self.server.stop(grace_s)

    async def _export_traces(self, messages, context: grpc.aio.ServicerContext) -> bytes:
        await self._export(messages, context, "traces")
        return _EMPTY_TRACE_RESPONSE

    async def _export_metrics(self, messages, context: grpc.aio.ServicerContext) -> bytes:
        await self._export(messages, context, "metrics")
        return _EMPTY_METRICS_RESPONSE

    async def _export(self, messages, context: grpc.aio.ServicerContext, signal: str) -> None:
        """Returns normally only when the request was admitted; otherwise aborts the RPC."""
        try:
            if not self._auth.allows_grpc(context.invocation_metadata()):
                raise IngestError(401, "unauthenticated", "missing or wrong bearer token")
            body = await self._one_message(messages, context)
            self._intake.check_room(len(body))  # overloaded: refuse before parsing
            decoded = await self._intake.decode(body, signal)  # capped before it is parsed, off the loop
            self._intake.accept(self.receiver, signal, decoded.message, decoded.items, decoded.parsed_bytes,
                                decoded.encoded)
            return
        except IngestError as error:
            refusal = error
        except Exception as exc:  # a bug: answered INTERNAL and counted
            self._errors.error(f"{self.receiver}:{type(exc).__name__}", "%s receiver failed on a request",
                               self.receiver, exc_info=exc)
            refusal = IngestError(500, "internal_error", f"internal error: {type(exc).__name__}")
        self._metrics.rejected(self.receiver, refusal.reason)
        trailer = ()
        if refusal.status in (429, 503):
            code = code_pb2.RESOURCE_EXHAUSTED if refusal.status == 429 else code_pb2.UNAVAILABLE
            trailer = _retry_trailer(code, refusal.message, self._retry_after_s)
        await context.abort(_CODES[refusal.status], refusal.message, trailer)

    async def _one_message(self, messages, context: grpc.aio.ServicerContext) -> bytes:
        body = None
        async for message in messages:
            if body is not None:
                raise IngestError(400, "malformed", "an export call carries one request message")
            body = message
        if body is None:
            if context.cancelled():
                raise IngestError(499, "client_disconnected", "the client cancelled the call")
            # gRPC core refused the message for its size (RESOURCE_EXHAUSTED is already set)
            raise IngestError(413, "too_large", f"request message over {self._max_message_bytes} bytes")
        return body
