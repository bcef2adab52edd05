"""OTLP requests built by hand for the collector tests: spans, CTA points, exact answers."""

from __future__ import annotations

import math

import numpy as np
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from sightline.collector.aggregator import AggregationConfig, Aggregator
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.exphist import ExpHistogram

T0_S = 1_800_000_000.0  # a fixed "now" (2027) the tests pin the clock to


OPENMETRICS = "application/openmetrics-text; version=1.0.0"  # an Accept header asking for it


def otlp_value(value) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[otlp_value(v) for v in value]))
    return AnyValue(string_value=str(value))


def otlp_attrs(attrs: dict) -> list[KeyValue]:
    return [KeyValue(key=k, value=otlp_value(v)) for k, v in attrs.items()]


def otlp_span(name: str, trace_id: bytes, span_id: bytes, start_s: float, end_s: float,
              attrs: dict | None = None, parent: bytes = b"", links=(), kind: int = 1) -> trace_pb2.Span:
    return trace_pb2.Span(
        name=name, trace_id=trace_id, span_id=span_id, parent_span_id=parent, kind=kind,
        start_time_unix_nano=int(round(start_s * 1e9)), end_time_unix_nano=int(round(end_s * 1e9)),
        attributes=otlp_attrs(attrs or {}),
        links=[trace_pb2.Span.Link(trace_id=t, span_id=s) for t, s in links])


def otlp_traces(spans, service: str = sc.SERVICE_NAME_ENGINE) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.extend(otlp_attrs({"service.name": service}))
    rs.scope_spans.add().spans.extend(spans)
    return req


def otlp_cta_point(gpu, sm, kernel: str, values, t_s: float, scale: int = 8, exemplar=None,
                   start_s: float | None = None) -> metrics_pb2.ExponentialHistogramDataPoint:
    """A point holding exactly ``values`` (via ExpHistogram, as the SM probe reduces them)."""
    h = ExpHistogram(scale=scale)
    h.record(np.asarray(values, dtype=np.float64))
    p = metrics_pb2.ExponentialHistogramDataPoint(
        attributes=otlp_attrs({sc.ATTR_GPU_ID: gpu, sc.ATTR_SM_ID: sm, sc.ATTR_KERNEL_NAME: kernel}),
        start_time_unix_nano=int((start_s if start_s is not None else t_s - 1) * 1e9),
        time_unix_nano=int(t_s * 1e9), count=h.count, sum=h.sum, scale=h.scale,
        zero_count=h.zero_count, min=h.min, max=h.max)
    p.positive.offset = h.offset
    p.positive.bucket_counts.extend(int(c) for c in h.counts)
    if exemplar is not None:
        value, trace_id, span_id = exemplar
        p.exemplars.add(as_double=value, trace_id=trace_id, span_id=span_id, time_unix_nano=int(t_s * 1e9))
    return p


def otlp_metrics(points, cumulative: bool = False) -> ExportMetricsServiceRequest:
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend(otlp_attrs({"service.name": sc.SERVICE_NAME_ENGINE}))
    metric = rm.scope_metrics.add().metrics.add()
    metric.name, metric.unit = sc.METRIC_CTA_DURATION, sc.METRIC_CTA_DURATION_UNIT
    metric.exponential_histogram.aggregation_temporality = 2 if cumulative else 1
    metric.exponential_histogram.data_points.extend(points)
    return req


def exact_quantile(values, q: float) -> float:
    s = np.sort(np.asarray(values))
    return float(s[max(1, math.ceil(q * s.size)) - 1])


def make_aggregator(**kw) -> Aggregator:
    return Aggregator(AggregationConfig(**kw), clock=lambda: T0_S)


def resource_metrics(points, **resource) -> ExportMetricsServiceRequest:
    req = otlp_metrics(points)
    req.resource_metrics[0].resource.attributes.extend(otlp_attrs(resource))
    return req


def request_span(trace_id, span_id, e2e, ttft, model="m", priority=0, reason="stop"):
    return otlp_span(sc.SPAN_HTTP_COMPLETIONS, trace_id, span_id, T0_S - 1 - e2e, T0_S - 1, {
        sc.GEN_AI_REQUEST_MODEL: model, sc.REQUEST_PRIORITY: priority, sc.REQUEST_E2E_S: e2e,
        sc.REQUEST_TTFT_S: ttft, sc.REQUEST_TPOT_S: 0.02, sc.REQUEST_QUEUE_S: 0.001,
        sc.GEN_AI_RESPONSE_FINISH_REASONS: [reason]}, kind=2)


def exp_hist(values, scale: int = 6) -> ExpHistogram:
    """A histogram holding exactly ``values`` (shared with test_sm_blocks)."""
    h = ExpHistogram(scale=scale)
    h.record(np.asarray(values, dtype=np.float64))
    return h
