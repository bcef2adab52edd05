"""The collector's own metrics (``sightline_collector_*``, names from ``semconv``), on its /metrics.

Spans and data points *acknowledged* by each receiver (accepted into the pipeline queue:
the client got 2xx/OK), requests *rejected* by receiver and reason, items acknowledged and
then *dropped* by reason, the queue depth, and the aggregator's time per queued export.
Guarantee: a rejected request adds nothing to the received counts, and the drop reasons
``aggregator_error`` and ``shutdown_timeout`` stay zero in a healthy collector (that is what
a client would call "lost"); every series exists at 0 from the start.

The metrics live in a private ``CollectorRegistry``, so several collectors can run in one
process (tests) without colliding. Cost: label children are bound once, so the hot path is
one dictionary lookup and one locked add per request, not per span.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..instrumentation import semconv as sc

__all__ = ["DROP_REASONS", "REJECT_REASONS", "SelfMetrics"]

RECEIVERS = (sc.RECEIVER_OTLP_GRPC, sc.RECEIVER_OTLP_HTTP, sc.RECEIVER_ZIPKIN)
# Why a request (or a connection) was refused: timeout is headers, a body, a gRPC message or
# handshake too slow; client_disconnected a client gone mid-body; too_many_connections a
# full listener; internal_error a 500 / INTERNAL (a bug, logged rate-limited). gRPC also:
# no_message a call ended without its message, cancelled a call the client reset (or left)
# before its answer, too_many_streams the per-connection or per-peer call cap, rapid_reset a
# connection closed for resetting or opening refused streams too fast, protocol_error an
# HTTP/2 violation or flood of frames that carry no request, deadline_exceeded a call whose
# own deadline (its grpc-timeout) passed before it was answered.
REJECT_REASONS = (
    "malformed",
    "too_large",
    "unsupported_media_type",
    "over_capacity",
    "unauthenticated",
    "shutting_down",
    "timeout",
    "client_disconnected",
    "too_many_connections",
    "internal_error",
    # gRPC transport
    "no_message",
    "cancelled",
    "too_many_streams",
    "rapid_reset",
    "protocol_error",
    "deadline_exceeded",
)
# duplicate: a span acknowledged as a repeat of one already admitted (an exporter's retry)
DROP_REASONS = ("aggregator_error", "shutdown_timeout", "duplicate")
PROCESSING_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                        0.5, 1.0, 2.5)


class SelfMetrics:
    """Counters the receivers and the pipeline bump; all methods are thread-safe."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._spans = Counter(sc.COLLECTOR_SPANS_RECEIVED_TOTAL,
                              "Spans accepted (acknowledged) by a receiver.",
                              [sc.LABEL_RECEIVER], registry=r)
        self._points = Counter(sc.COLLECTOR_DATAPOINTS_RECEIVED_TOTAL,
                               "Metric data points accepted (acknowledged) by a receiver.",
                               [sc.LABEL_RECEIVER], registry=r)
        self._rejected = Counter(sc.COLLECTOR_REJECTED_TOTAL,
                                 "Export requests refused, by receiver and reason.",
                                 [sc.LABEL_RECEIVER, sc.LABEL_REASON], registry=r)
        self._dropped = Counter(sc.COLLECTOR_DROPPED_TOTAL,
                                "Acknowledged spans and data points that were not aggregated.",
                                [sc.LABEL_REASON], registry=r)
        self.queue_depth = Gauge(sc.COLLECTOR_QUEUE_DEPTH,
                                 "Spans and data points waiting for the aggregator.", registry=r)
        self.scrapes_cut = Counter(sc.COLLECTOR_SCRAPES_CUT_TOTAL,
                                   "/metrics responses cut at their write deadline (a reader too slow).", registry=r)
        self._processing = Histogram(sc.COLLECTOR_PROCESSING_SECONDS,
                                     "Aggregator time per queued export request.",
                                     [sc.LABEL_SIGNAL], buckets=PROCESSING_BUCKETS_S, registry=r)
        # Pre-bound children: make every series visible at 0 from the start (a rate()
        # over a series that appears late misses its first increment).
        self._spans_by = {name: self._spans.labels(name) for name in RECEIVERS}
        self._points_by = {name: self._points.labels(name) for name in RECEIVERS}
        self._rejected_by = {(name, reason): self._rejected.labels(name, reason)
                             for name in RECEIVERS for reason in REJECT_REASONS}
        self._processing_by = {s: self._processing.labels(s) for s in ("traces", "metrics")}
        self._dropped_by = {reason: self._dropped.labels(reason) for reason in DROP_REASONS}

    def accepted(self, receiver: str, spans: int, points: int) -> None:
        if spans:
            self._spans_by[receiver].inc(spans)
        if points:
            self._points_by[receiver].inc(points)

    def rejected(self, receiver: str, reason: str) -> None:
        self._rejected_by[(receiver, reason)].inc()

    def dropped(self, reason: str, count: int) -> None:
        if count:
            self._dropped_by[reason].inc(count)

    def snapshot(self) -> dict[tuple[str, ...], float]:
        """The counters as ``{(sample name, *label values): value}``: received, rejected and
        dropped (benchmarks and tests that follow every request)."""
        out: dict[tuple[str, ...], float] = {}
        for counter in (self._spans, self._points, self._rejected, self._dropped):
            for family in counter.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        out[(sample.name, *sample.labels.values())] = sample.value
        return out

    def processed(self, signal: str, seconds: float) -> None:
        self._processing_by[signal].observe(seconds)
