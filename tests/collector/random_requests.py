"""Random OTLP export requests with the shape a parse of them would count, for the tests of
the compiled request walks (``collector/request_shape.py``)."""

from __future__ import annotations

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from sightline.collector.request_shape import RequestShape

__all__ = ["random_metrics", "random_traces"]


def _attrs(target, rng, most=3):
    for k in range(rng.integers(0, most + 1)):
        kv = target.add()
        kv.key, kv.value.int_value = f"k{k}", int(rng.integers(0, 100))


def random_traces(rng) -> tuple[ExportTraceServiceRequest, RequestShape]:
    request = ExportTraceServiceRequest()
    values = spans = scopes = 0
    for _ in range(rng.integers(0, 4)):
        rs = request.resource_spans.add()
        _attrs(rs.resource.attributes, rng)
        values += len(rs.resource.attributes)
        for _ in range(rng.integers(0, 4)):
            ss = rs.scope_spans.add()
            scopes += 1
            _attrs(ss.scope.attributes, rng)
            values += len(ss.scope.attributes)
            for _ in range(rng.integers(0, 5)):
                span = ss.spans.add(name="s", trace_id=b"\1" * 16, span_id=b"\2" * 8)
                spans += 1
                _attrs(span.attributes, rng)
                for _ in range(rng.integers(0, 3)):
                    _attrs(span.events.add(name="e").attributes, rng)
                for _ in range(rng.integers(0, 3)):
                    _attrs(span.links.add(trace_id=b"\3" * 16).attributes, rng)
                values += len(span.attributes) + len(span.events) + len(span.links)
                values += sum(len(e.attributes) for e in span.events) + sum(len(x.attributes) for x in span.links)
    return request, RequestShape(len(request.resource_spans), scopes, 0, spans, values, 0)


def random_metrics(rng) -> tuple[ExportMetricsServiceRequest, RequestShape]:
    request = ExportMetricsServiceRequest()
    values = points = scopes = metrics = buckets = 0
    for _ in range(rng.integers(0, 3)):
        rm = request.resource_metrics.add()
        _attrs(rm.resource.attributes, rng)
        values += len(rm.resource.attributes)
        for _ in range(rng.integers(0, 3)):
            sm = rm.scope_metrics.add()
            scopes += 1
            _attrs(sm.scope.attributes, rng)
            values += len(sm.scope.attributes)
            for kind in ("gauge", "sum", "histogram", "exponential_histogram", "summary"):
                metric = sm.metrics.add(name=kind)
                metrics += 1
                _attrs(metric.metadata, rng)
                values += len(metric.metadata)
                data = getattr(metric, kind)
                for _ in range(rng.integers(0, 3)):
                    point = data.data_points.add()
                    points += 1
                    _attrs(point.attributes, rng)
                    values += len(point.attributes)
                    if kind == "summary":
                        point.quantile_values.add(quantile=0.5, value=1.0)
                        values += 1
                        continue
                    exemplar = point.exemplars.add(as_double=1.0)
                    _attrs(exemplar.filtered_attributes, rng)
                    values += 1 + len(exemplar.filtered_attributes)
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
