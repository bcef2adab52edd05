"""OpenTelemetry SDK set-up: per-instance tracer and meter providers with OTLP exporters.

Nothing here touches the SDK's global providers, so a process (or a test) may hold several
independent pipelines. Guarantees:

- Spans leave through a :class:`CountingBatchSpanProcessor` into wrapped exporters
  (``counting_export.py``): bounded queue, drops and failed exports
  counted in :class:`TelemetryCounters`, exporter exceptions logged and never raised into
  the application, a backoff while the endpoint is down.
- ``shutdown`` is bounded by ``shutdown_timeout_s`` even when the endpoint is down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace import sampling
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client.registry import CollectorRegistry

from . import semconv
from .config import TelemetryConfig
from .counting_export import (
    CountingBatchSpanProcessor,
    CountingMetricExporter,
    CountingSpanExporter,
    TelemetryCounters,
)

__all__ = [
    "Providers",
    "build_providers",
    "build_sampler",
    "build_resource",
    "build_otlp_span_exporter",
    "build_otlp_metric_exporter",
]

logger = logging.getLogger(__name__)


def build_sampler(name: str, arg: float) -> sampling.Sampler:
    """The sampler named as in ``OTEL_TRACES_SAMPLER`` (names validated by the config)."""
    if name == "always_on":
        return sampling.ALWAYS_ON
    if name == "always_off":
        return sampling.ALWAYS_OFF
    if name == "traceidratio":
        return sampling.TraceIdRatioBased(arg)
    if name == "parentbased_always_on":
        return sampling.ParentBased(sampling.ALWAYS_ON)
    if name == "parentbased_always_off":
        return sampling.ParentBased(sampling.ALWAYS_OFF)
    if name == "parentbased_traceidratio":
        return sampling.ParentBased(sampling.TraceIdRatioBased(arg))
    raise ValueError(f"sampler {name!r} is not known")


class _HashedOnceResource(Resource):
    """A Resource whose hash is computed once. The OTLP span encoder groups spans by
    resource and so hashes it for every span it encodes, and ``Resource.__hash__`` is a
    sorted JSON dump of the attributes. The attributes are immutable, so is the hash."""

    def __init__(self, attributes, schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


def build_resource(config: TelemetryConfig) -> Resource:
    """Service name + configured attributes + SDK identity; the process env is not re-read."""
    from opentelemetry.sdk.version import __version__ as sdk_version

    attrs: dict[str, str] = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.version": sdk_version,
    }
    attrs.update(config.resource_attributes)
    attrs["service.name"] = config.service_name
    return _HashedOnceResource(attrs)


def _otlp_span_exporter(config: TelemetryConfig) -> SpanExporter:
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(
            endpoint=config.traces_endpoint,
            insecure=config.otlp_insecure,
            headers=dict(config.otlp_headers) or None,
            timeout=config.export_timeout_s,
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(
        endpoint=config.traces_endpoint,
        headers=dict(config.otlp_headers) or None,
        timeout=config.export_timeout_s,
    )


def _temporality(config: TelemetryConfig) -> dict:
    if config.metrics_temporality == "cumulative":
        return {
            kind: AggregationTemporality.CUMULATIVE
            for kind in (Counter, UpDownCounter, Histogram, ObservableCounter,
                         ObservableUpDownCounter, ObservableGauge)
        }
    # The spec's "delta" preference: monotonic sums and histograms as deltas, the rest cumulative.
    return {
        Counter: AggregationTemporality.DELTA,
        UpDownCounter: AggregationTemporality.CUMULATIVE,
        Histogram: AggregationTemporality.DELTA,
        ObservableCounter: AggregationTemporality.DELTA,
        ObservableUpDownCounter: AggregationTemporality.CUMULATIVE,
        ObservableGauge: AggregationTemporality.CUMULATIVE,
    }


# Data points per metric export request: a TP engine's per-SM histograms are GPUs x SMs x
# kernels points (21,120 for 8 x 132 x 20), more than one request may carry to Sightline's
# collector (--max-points-per-request, 4,096 by default); with room for a sidecar to merge two.
MAX_POINTS_PER_EXPORT = 2_048


def _otlp_metric_exporter(config: TelemetryConfig) -> MetricExporter:
    temporality = _temporality(config)
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(
            endpoint=config.metrics_endpoint,
            insecure=config.otlp_insecure,
            headers=dict(config.otlp_headers) or None,
            timeout=config.export_timeout_s,
            preferred_temporality=temporality,
            max_export_batch_size=MAX_POINTS_PER_EXPORT,
        )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(
        endpoint=config.metrics_endpoint,
        headers=dict(config.otlp_headers) or None,
        timeout=config.export_timeout_s,
        preferred_temporality=temporality,
        max_export_batch_size=MAX_POINTS_PER_EXPORT,
    )


def build_otlp_span_exporter(config: TelemetryConfig) -> SpanExporter:
    """The SDK OTLP span exporter for ``config`` (gRPC or HTTP/protobuf, timeout set)."""
    return _otlp_span_exporter(config)


def build_otlp_metric_exporter(config: TelemetryConfig) -> MetricExporter:
    """The SDK OTLP metric exporter for ``config`` (temporality per ``metrics_temporality``)."""
    return _otlp_metric_exporter(config)


@dataclass
class Providers:
    """What :func:`build_providers` made; ``shutdown`` flushes and closes all of it."""

    tracer_provider: TracerProvider
    meter_provider: MeterProvider | None
    span_processors: list[CountingBatchSpanProcessor]
    counters: TelemetryCounters
    capture_writer: object | None = None

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        ok = True
        try:
            ok = self.tracer_provider.force_flush(int(timeout_s * 1000))
        except Exception:
            logger.exception("tracer provider force_flush failed")
            ok = False
        if self.meter_provider is not None:
            try:
                ok = self.meter_provider.force_flush(int(timeout_s * 1000)) and ok
            except Exception:
                logger.exception("meter provider force_flush failed")
                ok = False
        return ok

    def shutdown(self, timeout_s: float = 5.0) -> None:
        try:
            self.tracer_provider.shutdown()
        except Exception:
            logger.exception("tracer provider shutdown failed")
        if self.meter_provider is not None:
            try:
                self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
            except Exception:
                logger.exception("meter provider shutdown failed")
        if self.capture_writer is not None:
            try:
                self.capture_writer.close()
            except Exception:
                logger.exception("capture writer close failed")
        self.counters.unregister()


def build_providers(
    config: TelemetryConfig,
    *,
    registry: CollectorRegistry | None = None,
    span_exporters: Iterable[SpanExporter] = (),
    metric_readers: Iterable[MetricReader] = (),
) -> Providers:
    """Builds tracer + meter providers for ``config``; adds ``span_exporters`` / ``metric_readers``.

    The OTLP exporter is added when ``config.exporter == "otlp"``; a capture file
    (``config.capture_path``) gets its own processor and reader. Exporter construction
    does not connect: a down endpoint shows up as counted export failures later.
    """
    counters = TelemetryCounters(registry)
    processor_args = dict(
        max_queue_size=config.max_queue_size,
        max_export_batch_size=config.max_export_batch_size,
        schedule_delay_millis=config.schedule_delay_s * 1000,
        export_timeout_millis=config.export_timeout_s * 1000,
        shutdown_timeout_millis=config.shutdown_timeout_s * 1000,
    )
    exporters: list[SpanExporter] = list(span_exporters)
    readers: list[MetricReader] = list(metric_readers)
    metric_exporters: list[MetricExporter] = []
    capture_writer = None
    if config.exporter == "otlp":
        exporters.append(_otlp_span_exporter(config))
        if config.metrics_enabled:
            metric_exporters.append(_otlp_metric_exporter(config))
    if config.capture_path:
        from .capture import (
            CaptureMetricExporter,
            CaptureSpanExporter,
            CaptureWriter,
        )

        capture_writer = CaptureWriter(config.capture_path)
        exporters.append(CaptureSpanExporter(capture_writer))
        if config.metrics_enabled:
            metric_exporters.append(
                CaptureMetricExporter(capture_writer, preferred_temporality=_temporality(config))
            )
    for metric_exporter in metric_exporters:
        readers.append(
            PeriodicExportingMetricReader(
                CountingMetricExporter(metric_exporter, counters),
                export_interval_millis=config.metric_export_interval_s * 1000,
                export_timeout_millis=config.export_timeout_s * 1000,
            )
        )

    resource = build_resource(config)
    limits = SpanLimits(max_links=max(config.max_links_per_span, 1))
    tracer_provider = TracerProvider(
        sampler=build_sampler(config.sampler, config.sampler_arg),
        resource=resource,
        span_limits=limits,
        shutdown_on_exit=False,
    )
    processors: list[CountingBatchSpanProcessor] = []
    for exporter in exporters:
        processor = CountingBatchSpanProcessor(
            CountingSpanExporter(exporter, counters), counters, **processor_args
        )
        tracer_provider.add_span_processor(processor)
        processors.append(processor)

    meter_provider = None
    if config.metrics_enabled:
        views = [
            # Per-SM CTA durations are exponential histograms (mergeable in the collector).
            View(
                instrument_name=semconv.METRIC_CTA_DURATION,
                aggregation=ExponentialBucketHistogramAggregation(max_size=160, max_scale=20),
            )
        ]
        meter_provider = MeterProvider(
            metric_readers=readers, resource=resource, views=views, shutdown_on_exit=False
        )
    return Providers(tracer_provider, meter_provider, processors, counters, capture_writer)
