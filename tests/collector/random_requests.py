"""Random OTLP export requests with the shape a parse of them would count, for the tests of
the compiled request walks (``collector/request_shape.py``)."""

from __future__ import annotations

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from sightline.collector.request_shape import RequestShape

__all__ = ["random_metrics", "random_traces"]


def _attrs(target, rng, most=3) -> int:
    """Adds 0..``most`` attributes to ``target``; returns how many (values a parse counts)."""
    n = int(rng.integers(0, most + 1))
    for k in range(n):
        kv = target.add()
        kv.key, kv.value.int_value = f"k{k}", int(rng.integers(0, 100))
    return n


def random_traces(rng) -> tuple[ExportTraceServiceRequest, RequestShape]:
    request = ExportTraceServiceRequest()
    values = spans = scopes = 0
    for _ in range(rng.integers(0, 4)):
        rs = request.resource_spans.add()
        values += _attrs(rs.resource.attributes, rng)
        for _ in range(rng.integers(0, 4)):
            ss = rs.scope_spans.add()
            scopes += 1
            values += _attrs(ss.scope.attributes, rng)
            for _ in range(rng.integers(0, 5)):
                span = ss.spans.add(name="s", trace_id=b"\1" * 16, span_id=b"\2" * 8)
                spans += 1
                values += _attrs(span.attributes, rng)
                for _ in range(rng.integers(0, 3)):
                    values += 1 + _attrs(span.events.add(name="e").attributes, rng)
                for _ in range(rng.integers(0, 3)):
                    values += 1 + _attrs(span.links.add(trace_id=b"\3" * 16).attributes, rng)
    return request, RequestShape(len(request.resource_spans), scopes, 0, spans, values, 0)


def random_metrics(rng) -> tuple[ExportMetricsServiceRequest, RequestShape]:
    request = ExportMetricsServiceRequest()
    values = points = scopes = metrics = buckets = 0
    for _ in range(rng.integers(0, 3)):
        rm = request.resource_metrics.add()
        values += _attrs(rm.resource.attributes, rng)
        for _ in range(rng.integers(0, 3)):
            sm = rm.scope_metrics.add()
            scopes += 1
            values += _attrs(sm.scope.attributes, rng)
            for kind in ("gauge", "sum", "histogram", "exponential_histogram", "summary"):
                metric = sm.metrics.add(name=kind)
                metrics += 1
                values += _attrs(metric.metadata, rng)
                data = getattr(metric, kind)
                for _ in range(rng.integers(0, 3)):
                    point = data.data_points.add()
                    points += 1
                    values += _attrs(point.attributes, rng)
                    if kind == "summary":
                        point.quantile_values.add(quantile=0.5, value=1.0)
                        values += 1
                        continue
                    exemplar = point.exemplars.add(as_double=1.0)
                    values += 1 + _attrs(exemplar.filtered_attributes, rng)
                    n = int(rng.integers(0, 300))  # counts past 127 take two varint bytes
                    if kind == "histogram":
                        point.bucket_counts.extend(range(n + 1))
                        point.explicit_bounds.extend(float(i) for i in range(n))
                        buckets += 2 * n + 1
                    elif kind == "exponential_histogram":
                        point.positive.bucket_counts.extend(range(n))
                        point.negative.bucket_counts.extend(range(n // 2))
                        buckets += n + n // 2
    return request, RequestShape(len(request.resource_metrics), scopes, metrics, points, values, buckets)
