"""OTLP/gRPC receiver: TraceService/Export and MetricsService/Export on :mod:`.grpc_server`.

Status codes follow the OTLP/gRPC specification: OK when the whole request was queued;
INVALID_ARGUMENT for an undecodable message, a bad span id or a call without exactly one
message; RESOURCE_EXHAUSTED over capacity or size, with ``google.rpc.RetryInfo`` (which the
OTel SDK exporters honour) when the queue is full; UNAUTHENTICATED for a missing or wrong
bearer token (answered from the headers, before the message); UNAVAILABLE while shutting
down (retryable); INTERNAL for a bug, logged rate-limited. Transport refusals (connections,
streams, deadlines, resets) are the server's. Every refusal is counted in
``sightline_collector_rejected_total`` with its reason; admission, span checks and
duplicates as for every receiver (:mod:`.admission`).

Cost: the request is parsed exactly once, after a compiled walk that counts its messages
against the caps (:mod:`.decoding`), plus one pass over the resource/scope lists to count
its items; a compressed message is inflated on a decoder thread.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ..instrumentation import semconv as sc
from .admission import Intake
from .auth import TokenAuth
from .connection_guard import RateLimitedLog
from .connection_table import ConnectionTable
from .grpc_server import GrpcAbort, GrpcCall, GrpcLimits, GrpcServer
from .ingest import IngestError, IngestLimits, InflightLimit, decode_body

__all__ = ["OtlpGrpcReceiver", "TRACE_SERVICE", "METRICS_SERVICE"]

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
_EMPTY_TRACE_RESPONSE = ExportTraceServiceResponse().SerializeToString()
_EMPTY_METRICS_RESPONSE = ExportMetricsServiceResponse().SerializeToString()
_CODES = {400: code_pb2.INVALID_ARGUMENT, 401: code_pb2.UNAUTHENTICATED, 408: code_pb2.DEADLINE_EXCEEDED,
          413: code_pb2.RESOURCE_EXHAUSTED, 415: code_pb2.INVALID_ARGUMENT, 429: code_pb2.RESOURCE_EXHAUSTED,
          499: code_pb2.CANCELLED, 500: code_pb2.INTERNAL, 503: code_pb2.UNAVAILABLE}
log = logging.getLogger(__name__)


def _retry_details(code: int, message: str, retry_after_s: int) -> bytes:
    """A google.rpc.Status with RetryInfo, for ``grpc-status-details-bin``."""
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay={"seconds": retry_after_s}))
    return status.SerializeToString()


class OtlpGrpcReceiver:
    """The OTLP services on a :class:`~.grpc_server.GrpcServer`; ``start``/``stop`` it from app.py."""

    receiver = sc.RECEIVER_OTLP_GRPC

    def __init__(self, intake: Intake, auth: TokenAuth, limits: IngestLimits, grpc_limits: GrpcLimits,
                 table: ConnectionTable, errors: RateLimitedLog | None = None) -> None:
        self._intake = intake
        self._pipeline = intake.pipeline
        self._metrics = intake.metrics
        self._auth = auth
        self._limits = limits
        self._inflight = InflightLimit(limits.max_inflight_requests)
        self._errors = errors or RateLimitedLog(log)
        # decompression off the event loop; two threads: one bomb does not hold up the rest
        self._inflater = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sightline-otlp_grpc-inflate")
        methods = {f"/{TRACE_SERVICE}/Export": self._export_traces,
                   f"/{METRICS_SERVICE}/Export": self._export_metrics}
        self.server = GrpcServer(methods, grpc_limits, table, screen=self._screen, on_refused=self._refused)
        self.port: int | None = None

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Binds and starts; returns the bound port (``port`` 0 picks a free one)."""
        self.port = await self.server.start(host, port, ssl_context)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stops accepting calls; open ones get ``grace_s`` to be answered."""
        await self.server.stop(grace_s)
        self._inflater.shutdown(wait=False, cancel_futures=True)

    def _refused(self, reason: str) -> None:
        self._metrics.rejected(self.receiver, reason)

    def _screen(self, call: GrpcCall) -> None:
        """Before the message: a call without the bearer token is refused at once."""
        if not self._auth.allows_grpc(call.metadata):
            raise GrpcAbort(code_pb2.UNAUTHENTICATED, "missing or wrong bearer token", "unauthenticated")

    async def _export_traces(self, call: GrpcCall) -> bytes:
        await self._export(call, "traces")
        return _EMPTY_TRACE_RESPONSE

    async def _export_metrics(self, call: GrpcCall) -> bytes:
        await self._export(call, "metrics")
        return _EMPTY_METRICS_RESPONSE

    async def _export(self, call: GrpcCall, signal: str) -> None:
        """Returns normally only when the request was admitted; otherwise raises GrpcAbort."""
        try:
            # a call takes a decoding slot only once its message has arrived (like HTTP bodies)
            if not self._inflight.try_enter():
                raise IngestError(429, "over_capacity", "too many export requests being decoded")
            try:
                self._intake.check_room(len(call.message))  # overloaded: refuse before parsing
                body = call.message
                if call.compressed:
                    body = await decode_body(body, call.encoding, self._limits, self._inflater)
                decoded = await self._intake.decode(body, signal)  # capped before it is parsed, off the loop
                self._intake.accept(self.receiver, signal, decoded)
            finally:
                self._inflight.leave()
            return
        except IngestError as error:
            refusal = error
        except Exception as exc:  # a bug: answered INTERNAL and counted
            self._errors.error(f"{self.receiver}:{type(exc).__name__}", "%s receiver failed on a request",
                               self.receiver, exc_info=exc)
            refusal = IngestError(500, "internal_error", f"internal error: {type(exc).__name__}")
        details = None
        if refusal.status in (429, 503):
            code = code_pb2.RESOURCE_EXHAUSTED if refusal.status == 429 else code_pb2.UNAVAILABLE
            details = _retry_details(code, refusal.message, self._limits.retry_after_s)
        raise GrpcAbort(_CODES[refusal.status], refusal.message, refusal.reason, details)
