"""The counted export path: what becomes of every span the application ends.

- :class:`CountingBatchSpanProcessor` is the SDK's batch processor with a bounded queue
  (``max_queue_size``); when it is full the span being ended is dropped and counted.
- Exporters are wrapped (:class:`CountingSpanExporter`, :class:`CountingMetricExporter`):
  a failed export (after the SDK exporter's own bounded retries) counts its spans as
  dropped and one export failure; an exporter's exception is logged and turned into
  FAILURE, never raised into the application. While the endpoint is down the worker backs
  off (0.5 s doubling to 5 s) instead of spinning.
- :class:`TelemetryCounters` exposes the counts as Prometheus counters (``semconv.TELEMETRY_*``).

Cost to the application: ``on_end`` is a ``len`` and a deque append; export runs on the
SDK's worker thread, so a dead collector costs queue appends, not CPU.
``otel_setup.build_providers`` assembles these; they are re-exported there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from . import semconv

__all__ = [
    "TelemetryCounters",
    "CountingSpanExporter",
    "CountingMetricExporter",
    "CountingBatchSpanProcessor",
]

# The set-up module's logger: one name to configure for the whole OTel pipeline.
logger = logging.getLogger("sightline.instrumentation.otel_setup")

DROP_QUEUE_FULL = "queue_full"
DROP_EXPORT_FAILED = "export_failed"
DROP_SHUTDOWN = "already_shutdown"
DROP_SHUTDOWN_TIMEOUT = "shutdown_timeout"


class TelemetryCounters(Collector):
    """Thread-safe counts of the span pipeline's fate, readable directly and by Prometheus.

    Series (prometheus_client appends ``_total``):
    ``sightline_telemetry_spans_exported_total``,
    ``sightline_telemetry_spans_dropped_total{reason}``,
    ``sightline_telemetry_export_failures_total{signal}``.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lock = threading.Lock()
        self.spans_exported = 0
        self.spans_dropped: dict[str, int] = {}
        self.export_failures: dict[str, int] = {}
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        try:
            self.registry.register(self)
        except ValueError:
            # Another pipeline already exposes these names in this registry (e.g. a restart
            # in one process): keep counting, but do not fail telemetry set-up over it.
            logger.warning("sightline_telemetry_* counters already registered; this pipeline's "
                           "counts are readable from Telemetry only")

    def add_exported(self, count: int) -> None:
        with self._lock:
            self.spans_exported += count

    def add_dropped(self, count: int, reason: str) -> None:
        with self._lock:
            self.spans_dropped[reason] = self.spans_dropped.get(reason, 0) + count

    def add_failure(self, signal: str) -> None:
        with self._lock:
            self.export_failures[signal] = self.export_failures.get(signal, 0) + 1

    def dropped_total(self) -> int:
        with self._lock:
            return sum(self.spans_dropped.values())

    def failures_total(self) -> int:
        with self._lock:
            return sum(self.export_failures.values())

    def unregister(self) -> None:
        try:
            self.registry.unregister(self)
        except KeyError:
            pass

    def describe(self):
        return self._families({}, {}, 0)

    def collect(self):
        with self._lock:
            dropped = dict(self.spans_dropped)
            failures = dict(self.export_failures)
            exported = self.spans_exported
        return self._families(dropped, failures, exported)

    @staticmethod
    def _families(dropped: dict[str, int], failures: dict[str, int], exported: int):
        fam_exported = CounterMetricFamily(
            semconv.TELEMETRY_SPANS_EXPORTED_TOTAL,
            "Spans the engine's exporter delivered to the OTLP endpoint.",
            value=exported,
        )
        fam_dropped = CounterMetricFamily(
            semconv.TELEMETRY_SPANS_DROPPED_TOTAL,
            "Spans lost inside the engine: queue full, export failed, or after shutdown.",
            labels=[semconv.LABEL_REASON],
        )
        # The known reasons and signals are present at 0 from the start, so that rate() and
        # increase() (alerts, dashboards) see the first loss instead of a new series.
        for reason in (DROP_QUEUE_FULL, DROP_EXPORT_FAILED, DROP_SHUTDOWN, DROP_SHUTDOWN_TIMEOUT):
            dropped.setdefault(reason, 0)
        for signal in ("traces", "metrics"):
            failures.setdefault(signal, 0)
        for reason, count in sorted(dropped.items()):
            fam_dropped.add_metric([reason], count)
        fam_failures = CounterMetricFamily(
            semconv.TELEMETRY_EXPORT_FAILURES_TOTAL,
            "Export calls that failed after the exporter's retries.",
            labels=[semconv.LABEL_SIGNAL],
        )
        for signal, count in sorted(failures.items()):
            fam_failures.add_metric([signal], count)
        return [fam_exported, fam_dropped, fam_failures]


class CountingSpanExporter(SpanExporter):
    """Wraps a span exporter: counts outcomes, turns exceptions into logged FAILUREs, and
    backs off while the endpoint is down.

    The SDK exporter already retries one batch with exponential backoff until its timeout.
    Without more, a down endpoint makes the worker fail batch after batch in a tight loop,
    burning the CPU (and GIL) the application needs. After a failed batch this wrapper waits
    (``backoff_initial_s``, doubling up to ``backoff_max_s``; interrupted by shutdown) before
    trying the next one, so spans wait in the bounded queue — where overflow is counted —
    and flow again when the endpoint returns. A success resets the backoff.
    """

    def __init__(self, inner: SpanExporter, counters: TelemetryCounters, *,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 5.0) -> None:
        self.inner = inner
        self._counters = counters
        self._logged = False
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._stopping = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        wait_s = self._retry_at - time.monotonic()
        if wait_s > 0:
            self._stopping.wait(wait_s)
        if self._stopping.is_set():
            self._counters.add_dropped(len(spans), DROP_SHUTDOWN_TIMEOUT)
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the worker or reach the app
            if not self._logged:
                self._logged = True
                logger.exception("span exporter %s raised; counting its batch as dropped",
                                 type(self.inner).__name__)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._backoff_s = 0.0
            self._retry_at = 0.0
            self._counters.add_exported(len(spans))
        else:
            self._backoff_s = min(max(self._backoff_s * 2, self._backoff_initial_s),
                                  self._backoff_max_s)
            self._retry_at = time.monotonic() + self._backoff_s
            self._counters.add_failure("traces")
            self._counters.add_dropped(len(spans), DROP_EXPORT_FAILED)
        return result

    def shutdown(self) -> None:
        self._stopping.set()
        try:
            self.inner.shutdown()
        except Exception:
            logger.exception("span exporter shutdown failed")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:
            logger.exception("span exporter force_flush failed")
            return False


class CountingMetricExporter(MetricExporter):
    """Wraps a metric exporter: counts failed exports, never raises."""

    def __init__(self, inner: MetricExporter, counters: TelemetryCounters) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self.inner = inner
        self._counters = counters
        self._logged = False

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs):
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            if not self._logged:
                self._logged = True
                logger.exception("metric exporter %s raised", type(self.inner).__name__)
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self._counters.add_failure("metrics")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis=timeout_millis)
        except Exception:
            logger.exception("metric exporter force_flush failed")
            return False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        try:
            self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)
        except Exception:
            logger.exception("metric exporter shutdown failed")


class _DropCountingMetrics:
    """Stands in for the SDK's internal processor metrics hook, to count queue drops."""

    def __init__(self, inner, counters: TelemetryCounters) -> None:
        self._inner = inner
        self._counters = counters

    def register_queue_size(self, get_queue_size) -> None:
        self._inner.register_queue_size(get_queue_size)

    def drop_items(self, count: int, error_type: str = DROP_QUEUE_FULL) -> None:
        self._counters.add_dropped(count, error_type)
        self._inner.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        self._inner.finish_items(count)


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """The SDK's BatchSpanProcessor, with queue-full drops counted and a bounded shutdown.

    The SDK reports drops to an internal metrics hook (``BatchProcessor._metrics``); we put
    our counter in front of it. If a future SDK moves that hook, ``on_end`` falls back to
    checking the queue length itself (same count, one extra ``len`` per span).
    """

    def __init__(
        self,
        exporter: SpanExporter,
        counters: TelemetryCounters,
        *,
        max_queue_size: int,
        max_export_batch_size: int,
        schedule_delay_millis: float,
        export_timeout_millis: float,
        shutdown_timeout_millis: float,
    ) -> None:
        super().__init__(
            exporter,
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_millis,
            max_export_batch_size=max_export_batch_size,
            export_timeout_millis=export_timeout_millis,
        )
        self._counters = counters
        self._max_queue = max_queue_size
        self._shutdown_timeout_millis = shutdown_timeout_millis
        inner = getattr(self, "_batch_processor", None)
        self._queue = getattr(inner, "_queue", None)
        if inner is not None and hasattr(inner, "_metrics"):
            inner._metrics = _DropCountingMetrics(inner._metrics, counters)

    def on_end(self, span: ReadableSpan) -> None:
        # A full queue drops the newest span here (counted), rather than letting the SDK
        # evict the oldest with a log call per span: same loss, a fraction of the cost.
        queue = self._queue
        if queue is not None and len(queue) >= self._max_queue:
            self._counters.add_dropped(1, DROP_QUEUE_FULL)
            return
        super().on_end(span)

    def shutdown(self) -> None:
        try:
            self._batch_processor.shutdown(timeout_millis=self._shutdown_timeout_millis)
        except TypeError:  # pragma: no cover - older SDKs without the argument
            super().shutdown()
        # Spans still queued when the shutdown deadline passed are never exported: count them.
        queue = getattr(self._batch_processor, "_queue", None)
        if queue:
            left = len(queue)
            queue.clear()
            self._counters.add_dropped(left, DROP_SHUTDOWN_TIMEOUT)

    @property
    def queue_length(self) -> int:
        """Spans waiting for export right now."""
        queue = getattr(self._batch_processor, "_queue", None)
        return len(queue) if queue is not None else 0
