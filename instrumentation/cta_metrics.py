"""The per-SM CTA-duration metric on its way out: its OTLP form and its destinations.

``build_cta_metrics`` turns the worker's per-(gpu, SM, kernel) histograms into SDK
``MetricsData`` (one delta exponential-histogram point per key, with the slowest-CTA
exemplar and the GPU's NVML UUID beside its index; per (gpu, kernel) the CTAs of wide
launches, ``semconv.METRIC_CTA_WIDE``, and per (gpu, SM, kernel) the CTAs the dispatch order
deals, ``METRIC_CTA_DEALT``, when the producer counted them); ``metric_exporters_from`` finds where the telemetry sends metrics (OTLP per its
config, and its capture file). Used by :mod:`.gpu_telemetry`'s worker thread, never on
the request path; the OTel SDK is imported only when called.
"""

from __future__ import annotations

import logging

from . import semconv
from .nvml import gpu_uuid

__all__ = ["build_cta_metrics", "metric_exporters_from", "resource_of"]

# The GPU telemetry's logger: its export trouble is reported under one name.
logger = logging.getLogger("sightline.instrumentation.gpu_telemetry")


def _gpu_attributes(gpu, gpu_ranks: dict | None) -> dict:
    attributes = {semconv.ATTR_GPU_ID: gpu}
    rank, uuid = (gpu_ranks or {}).get(gpu, (None, None))
    if uuid is None:
        uuid = gpu_uuid(gpu) if isinstance(gpu, int) or str(gpu).isdigit() else None
    if uuid:  # the GPU's identity across hosts (gpu.id is only its index on this one)
        attributes[semconv.ATTR_GPU_UUID] = uuid
    if rank is not None:
        attributes[semconv.TP_RANK] = rank
    return attributes


def build_cta_metrics(hists, exemplars, start_ns: int, now_ns: int, resource, launch_mix=None,
                      num_sms: int | None = None, gpu_ranks: dict | None = None, dealt=None):
    """OTel SDK ``MetricsData`` with one delta exponential-histogram point per
    (gpu, SM, kernel), each with its slowest-CTA exemplar (trace/span of the step); with
    ``launch_mix`` ((gpu, kernel) -> (wide CTAs, all CTAs)) and ``num_sms``, one delta sum
    point of wide-launch CTAs per (gpu, kernel) too; with ``dealt`` ((gpu, SM, kernel) ->
    CTAs), one delta sum point per SM the dispatch order dealt CTAs. ``gpu_ranks``: gpu id
    -> (tensor-parallel rank, UUID) as the ranks reported them."""
    from opentelemetry.sdk.metrics.export import (AggregationTemporality, Buckets,
                                                  ExponentialHistogram,
                                                  ExponentialHistogramDataPoint, Metric,
                                                  MetricsData, NumberDataPoint, ResourceMetrics,
                                                  ScopeMetrics, Sum)
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    try:
        from opentelemetry.sdk.metrics import Exemplar
    except ImportError:
        from opentelemetry.sdk.metrics._internal.exemplar import Exemplar
    points = []
    for (gpu, sm, kernel), h in sorted(hists.items()):
        ex = exemplars.get((gpu, sm, kernel))
        ex_list = []
        if ex is not None and ex.trace_id and ex.span_id:
            ex_list.append(Exemplar({}, ex.value_s, ex.time_unix_nano or now_ns, ex.span_id,
                                    ex.trace_id))
        attributes = {**_gpu_attributes(gpu, gpu_ranks), semconv.ATTR_SM_ID: sm, semconv.ATTR_KERNEL_NAME: kernel}
        points.append(ExponentialHistogramDataPoint(
            attributes=attributes,
            start_time_unix_nano=start_ns, time_unix_nano=now_ns, count=h.count, sum=h.sum,
            scale=h.scale, zero_count=h.zero_count,
            positive=Buckets(offset=h.offset, bucket_counts=[int(c) for c in h.counts]),
            negative=Buckets(offset=0, bucket_counts=[]), flags=0,
            min=h.min if h.count else 0.0, max=h.max if h.count else 0.0, exemplars=ex_list))
    metric = Metric(name=semconv.METRIC_CTA_DURATION,
                    description="Duration of each CTA of probed kernels, per SM",
                    unit=semconv.METRIC_CTA_DURATION_UNIT,
                    data=ExponentialHistogram(data_points=points,
                                              aggregation_temporality=AggregationTemporality.DELTA))
    metrics = [metric]
    if launch_mix and num_sms:
        wide = [NumberDataPoint(attributes={**_gpu_attributes(gpu, gpu_ranks), semconv.ATTR_KERNEL_NAME: kernel,
                                            semconv.ATTR_GPU_SM_COUNT: int(num_sms)},
                                start_time_unix_nano=start_ns, time_unix_nano=now_ns, value=int(w))
                for (gpu, kernel), (w, _) in sorted(launch_mix.items())]
        metrics.append(Metric(name=semconv.METRIC_CTA_WIDE,
                              description=f"CTAs of launches with at least {semconv.WIDE_LAUNCH_WAVES}x as many "
                                          "CTAs as the GPU has SMs",
                              unit=semconv.METRIC_CTA_COUNT_UNIT,
                              data=Sum(data_points=wide, aggregation_temporality=AggregationTemporality.DELTA,
                                       is_monotonic=True)))
    if dealt:
        points = [NumberDataPoint(attributes={**_gpu_attributes(gpu, gpu_ranks), semconv.ATTR_SM_ID: sm,
                                              semconv.ATTR_KERNEL_NAME: kernel},
                                  start_time_unix_nano=start_ns, time_unix_nano=now_ns, value=int(ctas))
                  for (gpu, sm, kernel), ctas in sorted(dealt.items())]
        metrics.append(Metric(name=semconv.METRIC_CTA_DEALT,
                              description="Probed CTAs the GPU's dispatch order deals this SM",
                              unit=semconv.METRIC_CTA_COUNT_UNIT,
                              data=Sum(data_points=points, aggregation_temporality=AggregationTemporality.DELTA,
                                       is_monotonic=True)))
    scope = ScopeMetrics(scope=InstrumentationScope(semconv.INSTRUMENTATION_SCOPE),
                         metrics=metrics, schema_url="")
    return MetricsData(resource_metrics=[ResourceMetrics(resource=resource,
                                                         scope_metrics=[scope], schema_url="")])


def resource_of(telemetry):
    """The resource of the telemetry's tracer provider (an empty one without)."""
    from opentelemetry.sdk.resources import Resource
    provider = getattr(telemetry, "tracer_provider", None)
    return getattr(provider, "resource", None) or Resource.create({})


def metric_exporters_from(telemetry) -> list:
    """The telemetry's own metric destinations: OTLP (per its config) and its capture file."""
    out = []
    config = getattr(telemetry, "config", None)
    providers = getattr(telemetry, "providers", None)
    if config is None or not getattr(config, "metrics_enabled", True):
        return out
    try:
        if config.exporter == "otlp":
            from .otel_setup import _otlp_metric_exporter
            out.append(_otlp_metric_exporter(config))
        writer = getattr(providers, "capture_writer", None)
        if writer is not None:
            from .capture import CaptureMetricExporter
            out.append(CaptureMetricExporter(writer))
    except Exception:
        logger.exception("could not build the per-SM metric exporters")
    return out
