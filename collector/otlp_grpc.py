"""OTLP/gRPC receiver: TraceService/Export and MetricsService/Export on grpc.aio.

The methods are registered as generic handlers that receive the raw request bytes, so
that decoding is ours: an undecodable request answers INVALID_ARGUMENT (the stock
generated servicer would answer INTERNAL), and the request is parsed exactly once.

Status codes (OTLP/gRPC specification):
- OK + ``Export*ServiceResponse`` when the whole request was queued.
- INVALID_ARGUMENT: not a valid protobuf message (not retryable).
- RESOURCE_EXHAUSTED: queue over capacity, with ``google.rpc.RetryInfo`` in the
  ``grpc-status-details-bin`` trailer (the OTel SDK exporters honour its delay);
  gRPC core itself answers RESOURCE_EXHAUSTED for a message over
  ``max_decompressed_bytes`` (``grpc.max_receive_message_length`` counts the
  decompressed size), before our handler runs.
- UNAUTHENTICATED: bearer token missing or wrong (``authorization`` metadata).
- UNAVAILABLE: shutting down (retryable; the client's next attempt reaches a peer).
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
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
from sightline.collector.otlp_http import count_data_points, count_spans
from sightline.collector.pipeline import Admission, Batch, Pipeline
from sightline.collector.self_metrics import SelfMetrics
from sightline.instrumentation import semconv as sc

__all__ = ["OtlpGrpcReceiver", "TRACE_SERVICE", "METRICS_SERVICE"]

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
_EMPTY_TRACE_RESPONSE = ExportTraceServiceResponse().SerializeToString()
_EMPTY_METRICS_RESPONSE = ExportMetricsServiceResponse().SerializeToString()


def _retry_trailer(code: int, message: str, retry_after_s: int) -> tuple[tuple[str, bytes], ...]:
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay={"seconds": retry_after_s}))
    return (("grpc-status-details-bin", status.SerializeToString()),)


class OtlpGrpcReceiver:
    """Builds the grpc.aio server with both OTLP services; ``start``/``stop`` it from app.py."""

    receiver = sc.RECEIVER_OTLP_GRPC

    def __init__(self, pipeline: Pipeline, metrics: SelfMetrics, auth: TokenAuth, *,
                 max_message_bytes: int, retry_after_s: int, max_concurrent_rpcs: int = 64) -> None:
        self._pipeline = pipeline
        self._metrics = metrics
        self._auth = auth
        self._retry_after_s = retry_after_s
        self._max_message_bytes = max_message_bytes
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        raw = dict(request_deserializer=None, response_serializer=None)  # bytes in, bytes out
        return [
            grpc.method_handlers_generic_handler(TRACE_SERVICE, {
                "Export": grpc.unary_unary_rpc_method_handler(self._export_traces, **raw)}),
            grpc.method_handlers_generic_handler(METRICS_SERVICE, {
                "Export": grpc.unary_unary_rpc_method_handler(self._export_metrics, **raw)}),
        ]

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
        """Binds and starts; returns the bound port (``port`` 0 picks a free one)."""
        options = [
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

    async def _export_traces(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self._export(body, context, "traces")
        return _EMPTY_TRACE_RESPONSE

    async def _export_metrics(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self._export(body, context, "metrics")
        return _EMPTY_METRICS_RESPONSE

    async def _export(self, body: bytes, context: grpc.aio.ServicerContext, signal: str) -> None:
        """Returns normally only when the batch was queued; otherwise aborts the RPC."""
        metrics, name = self._metrics, self.receiver
        if not self._auth.allows_grpc(context.invocation_metadata()):
            metrics.rejected(name, "unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        if not self._pipeline.has_room(len(body)):  # overloaded: refuse before parsing
            await self._refuse(context, self._pipeline.accepting)
        try:
            if signal == "traces":
                message = ExportTraceServiceRequest.FromString(body)
                items = count_spans(message)
            else:
                message = ExportMetricsServiceRequest.FromString(body)
                items = count_data_points(message)
        except (DecodeError, ValueError) as exc:
            metrics.rejected(name, "malformed")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {signal} export request: {exc}")
        verdict = self._pipeline.offer(Batch(signal, message, items, len(body), name,
                                             body if signal == "traces" else None))
        if verdict is Admission.ACCEPTED:
            if signal == "traces":
                metrics.accepted(name, items, 0)
            else:
                metrics.accepted(name, 0, items)
            return
        await self._refuse(context, verdict is Admission.FULL)

    async def _refuse(self, context: grpc.aio.ServicerContext, full: bool) -> None:
        """Aborts with RESOURCE_EXHAUSTED (queue full) or UNAVAILABLE (shutting down)."""
        if full:
            self._metrics.rejected(self.receiver, "over_capacity")
            text = "collector queue is full; retry later"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, text,
                                _retry_trailer(code_pb2.RESOURCE_EXHAUSTED, text, self._retry_after_s))
        self._metrics.rejected(self.receiver, "shutting_down")
        text = "collector is shutting down"
        await context.abort(grpc.StatusCode.UNAVAILABLE, text,
                            _retry_trailer(code_pb2.UNAVAILABLE, text, self._retry_after_s))
