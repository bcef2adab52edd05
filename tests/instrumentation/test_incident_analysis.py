"""bench/incident_analysis.py on a capture built by hand, whose answers are known: per-SM
exports inside and outside the planted interval, engine steps, an attention launch span."""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.incident_analysis import analyse
from sightline.deploy.incident import Incident, PlantedInterval
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.capture import CaptureWriter
from sightline.instrumentation.exphist import ExpHistogram

# capture time origin (ns), 1 ms before a 10 s slot boundary: the collector files a delta
# point by its time and a replay keeps the capture's slot phase, so each export (stamped at
# the end of the 10 s it covers) lands in the slot it covers
T = 1_700_000_000 * 10**9 - 1_000_000
S = 10**9
PLANTED = (1,)  # of SMs 0..3, held from T+20 s to T+40 s


def _metrics(start_s: int, end_s: int, per_sm: dict[int, tuple[int, float]]) -> ExportMetricsServiceRequest:
    """One delta export: SM -> (CTAs, each CTA's duration in seconds)."""
    request = ExportMetricsServiceRequest()
    metric = request.resource_metrics.add().scope_metrics.add().metrics.add()
    metric.name = sc.METRIC_CTA_DURATION
    metric.exponential_histogram.aggregation_temporality = 1
    for sm, (n, duration) in per_sm.items():
        h = ExpHistogram()
        h.record(np.full(n, duration))
        point = metric.exponential_histogram.data_points.add()
        for key, value in ((sc.ATTR_GPU_ID, 0), (sc.ATTR_SM_ID, sm)):
            kv = point.attributes.add()
            kv.key, kv.value.int_value = key, value
        kv = point.attributes.add()
        kv.key, kv.value.string_value = sc.ATTR_KERNEL_NAME, "sightline_fa2_prefill"
        point.start_time_unix_nano, point.time_unix_nano = T + start_s * S, T + end_s * S
        point.count, point.sum, point.min, point.max, point.scale = h.count, h.sum, h.min, h.max, h.scale
        point.positive.offset = h.offset
        point.positive.bucket_counts.extend(int(c) for c in h.counts)
    return request


def _spans(steps: list[tuple[float, float]], launches: list[tuple[float, int, int]],
           first_id: int) -> ExportTraceServiceRequest:
    """Step spans (start, end in seconds) and FA2 launch spans (at, sms_used, parent step's index);
    span ids from ``first_id`` on."""
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    for i, (a, b) in enumerate(steps):
        spans.add(name=sc.SPAN_ENGINE_STEP, trace_id=bytes([1] * 16), span_id=(first_id + i).to_bytes(8, "big"),
                  start_time_unix_nano=T + int(a * S), end_time_unix_nano=T + int(b * S))
    for j, (at, sms_used, parent) in enumerate(launches):
        span = spans.add(name=sc.SPAN_KERNEL_PREFIX + "sightline_fa2_prefill", trace_id=bytes([1] * 16),
                         span_id=(first_id + 50 + j).to_bytes(8, "big"),
                         parent_span_id=(first_id + parent).to_bytes(8, "big"),
                         start_time_unix_nano=T + int(at * S), end_time_unix_nano=T + int(at * S) + 1000)
        kv = span.attributes.add()
        kv.key, kv.value.int_value = sc.KERNEL_SMS_USED, sms_used
    return request


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("capture") / "incident.jsonl.gz"
    incident = Incident(False, "test", "test", "cpu", 4, (PlantedInterval(T + 20 * S, T + 40 * S, PLANTED),))
    normal = {sm: (100, 10e-6) for sm in range(4)}
    slowed = {**normal, 1: (10, 30e-6)}  # during the interval SM 1 runs few, slow CTAs
    with CaptureWriter(path) as writer:
        writer.write_meta(incident.to_meta())
        writer.write_traces(_spans([(1, 1.5), (2, 2.5)], [(1.2, 4, 0)], 1), T)
        # six slots: the four quiet ones besides each interval slot give each SM's usual share
        for k in range(6):
            writer.write_metrics(_metrics(10 * k, 10 * (k + 1), slowed if k in (2, 3) else normal),
                                 T + (10 * (k + 1)) * S + 1000)
        # steps in the interval: a 10 s one from T+25 s (its launches at 25.5, 26 and 34 s), then one at T+36 s
        writer.write_traces(_spans([(25, 35), (36, 36.5), (45, 45.2)], [(25.5, 3, 0), (26, 3, 0), (34, 3, 0)], 100),
                            T + 50 * S + 2000)
    return analyse(path)


def test_exports_split_by_the_interval_with_planted_against_other_sms(report):
    assert report["exports"]["count"] == 6 and report["exports"]["gaps_s"] == [10.0] * 5
    [interval] = report["intervals"]
    assert (interval["start_s"], interval["end_s"], interval["planted_sms"]) == (20.0, 40.0, 1)
    inside = interval["by_export_window"]["inside"]
    outside = interval["by_export_window"]["outside"]
    assert inside["windows_s"] == [[20.0, 30.0], [30.0, 40.0]]
    assert interval["by_export_window"]["straddling"]["windows_s"] == []
    k = inside["kernels"]["sightline_fa2_prefill"]
    assert (k["planted"]["ctas"], k["others"]["ctas"]) == (20, 600)
    assert k["planted_cta_share"] == pytest.approx(20 / 620) and k["even_share"] == 0.25
    # every CTA of an SM has one duration: its P99 is that duration (the histogram clamps to min/max)
    assert k["planted"]["median_sm_p99_us"] == pytest.approx(30.0)
    assert k["others"]["median_sm_p99_us"] == pytest.approx(10.0)
    assert k["p99_ratio"] == pytest.approx(3.0)
    o = outside["kernels"]["sightline_fa2_prefill"]
    assert (o["planted"]["ctas"], o["others"]["ctas"], o["p99_ratio"]) == (400, 1200, 1.0)


def test_steps_and_launches_inside_and_outside(report):
    [during] = report["steps"]["intervals"]
    assert during["steps"] == 2 and during["busy_s"] == 10.5
    assert during["longest_step"] == {"start_s": 25.0, "end_s": 35.0, "duration_s": 10.0, "attention_launches": 3,
                                      "widest_gap_between_attention_launches_s": [26.0, 34.0]}
    # step starts at 25 and 36 between 20 and 40: the longest stretch without one is 25 -> 36
    assert during["longest_time_without_a_step_start_s"] == 11.0 and during["steps_over_s"] == {"0.5": 1}
    assert during["attention_launch_spans_sms_used"] == {"sightline_fa2_prefill": {"launches": 3, "min": 3,
                                                                                  "median": 3, "max": 3}}
    outside = report["steps"]["outside"]
    assert outside["steps"] == 3 and outside["attention_launch_spans_sms_used"]["sightline_fa2_prefill"]["max"] == 4


def test_the_finding_flags_the_planted_sm_slow_and_starved(report):
    [f] = report["finding"]["findings"]
    assert f["slots"] == 2 and f["planted"] == [1]
    # SM 1 in each interval slot: 10 CTAs at 3x the others' duration, where 310 / 4 = 77.5 were
    # its share: its score is the larger factor, 77.5 / 10
    assert f["flagged"] == {"1": pytest.approx(7.75)} and (f["precision"], f["recall"]) == (1.0, 1.0)
    assert f["reasons"] == {"1": "slow+starved"} and f["slots_flagged"] == {"1": 2}
