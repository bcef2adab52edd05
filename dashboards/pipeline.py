"""Pipeline health: is the telemetry itself arriving?

The collector's self-metrics (received, rejected, dropped, queue depth, processing
time, series overflow), the engine's exporter self-metrics (spans exported, dropped,
export failures) and the share of steps its kernel tracing may have slowed, plus
Prometheus' own ``up`` for every scrape target. A
quiet GPU dashboard means nothing until this one says data is flowing.
"""

from __future__ import annotations

from ..instrumentation import semconv as sc
from . import promql as q
from .panels import DashboardSpec, PanelSpec, Query, Row

__all__ = ["UID", "spec", "UP_METRIC"]

UID = "sightline-pipeline"
# Prometheus' own per-target health series (not a Sightline name).
UP_METRIC = "up"


def _rate(name: str, by: tuple[str, ...]) -> str:
    return q.sum_by(by, q.rate(q.counter(name)))


def spec() -> DashboardSpec:
    collector = Row(
        "Collector",
        (
            PanelSpec(
                title="Spans received",
                unit="short",
                queries=(Query(_rate(sc.COLLECTOR_SPANS_RECEIVED_TOTAL, (sc.LABEL_RECEIVER,)), "{{receiver}}"),),
            ),
            PanelSpec(
                title="Data points received",
                unit="short",
                queries=(Query(_rate(sc.COLLECTOR_DATAPOINTS_RECEIVED_TOTAL, (sc.LABEL_RECEIVER,)), "{{receiver}}"),),
            ),
            PanelSpec(
                title="Rejected",
                unit="short",
                description="Refused at the door (bad payload, too large, unauthenticated, overloaded).",
                queries=(Query(_rate(sc.COLLECTOR_REJECTED_TOTAL, (sc.LABEL_RECEIVER, sc.LABEL_REASON)),
                               "{{receiver}} {{reason}}"),),
            ),
            PanelSpec(
                title="Dropped after acceptance",
                unit="short",
                description="Accepted data that was lost (queue full, aggregation limits): should be zero.",
                queries=(
                    Query(_rate(sc.COLLECTOR_DROPPED_TOTAL, (sc.LABEL_REASON,)), "pipeline {{reason}}"),
                    Query(_rate(sc.COLLECTOR_AGGREGATOR_DROPPED_TOTAL, (sc.LABEL_REASON,)), "aggregator {{reason}}"),
                ),
            ),
            PanelSpec(
                title="Queue depth",
                unit="short",
                width=8,
                queries=(Query(q.selector(sc.COLLECTOR_QUEUE_DEPTH), "{{instance}}"),),
            ),
            PanelSpec(
                title="Processing time P50 / P99",
                unit="s",
                width=8,
                queries=tuple(
                    Query(q.histogram_quantile(quantile, sc.COLLECTOR_PROCESSING_SECONDS),
                          f"P{round(quantile * 100)}")
                    for quantile in (0.5, 0.99)
                ),
            ),
            PanelSpec(
                title="Series overflow",
                unit="short",
                width=8,
                description="New label sets folded into the overflow series because a cardinality limit was hit.",
                queries=(Query(q.sum_by((sc.LABEL_FAMILY,), q.rate(q.counter(sc.COLLECTOR_SERIES_OVERFLOW_TOTAL))),
                               "{{family}}"),),
            ),
        ),
    )
    exporters = Row(
        "Engine exporters",
        (
            PanelSpec(
                title="Spans exported",
                unit="short",
                width=6,
                queries=(Query(_rate(sc.TELEMETRY_SPANS_EXPORTED_TOTAL, ("instance",)), "{{instance}}"),),
            ),
            PanelSpec(
                title="Spans dropped in the engine",
                unit="short",
                width=6,
                queries=(Query(_rate(sc.TELEMETRY_SPANS_DROPPED_TOTAL, ("instance",)), "{{instance}}"),),
            ),
            PanelSpec(
                title="Export failures",
                unit="short",
                width=6,
                queries=(Query(_rate(sc.TELEMETRY_EXPORT_FAILURES_TOTAL, ("instance", sc.LABEL_SIGNAL)),
                               "{{instance}} {{signal}}"),),
            ),
            PanelSpec(
                title="Telemetry records dropped by the engine",
                unit="short",
                width=6,
                description=("Lifecycle events and GPU records the engine could not hand to its "
                             "telemetry process, per second, by reason: buffer_full, queue_full, "
                             "process_down (the process died and is being restarted). Requests are "
                             "unaffected; their traces are incomplete."),
                queries=(Query(_rate(sc.TELEMETRY_EVENTS_DROPPED_TOTAL, ("instance", sc.LABEL_REASON)),
                               "{{instance}} {{reason}}"),),
            ),
        ),
    )
    targets = Row(
        "Scrape targets",
        (
            PanelSpec(
                title="Targets up",
                unit="short",
                width=24,
                height=6,
                queries=(Query(q.selector(UP_METRIC), "{{job}} {{instance}}"),),
            ),
        ),
    )
    return DashboardSpec(
        uid=UID,
        title="Sightline / Pipeline health",
        description="Collector and exporter self-metrics: is the telemetry arriving, and is any of it lost?",
        variables=(),
        rows=(collector, exporters, targets),
    )
