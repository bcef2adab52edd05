"""The aggregator against exact answers: per-SM quantiles, span-derived series, limits."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from sightline.collector.aggregator import AggregationConfig, Aggregator
from sightline.collector.exposition import metrics_page
from sightline.collector.sm_store import GpuKey, Refusal
from sightline.collector.windows import WindowConfig
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.exphist import ExpHistogram, relative_error
from tests.collector.otlp_builders import (OPENMETRICS, T0_S, exact_quantile, make_aggregator, otlp_attrs,
                                           otlp_cta_point, otlp_metrics, otlp_span, otlp_traces, request_span,
                                           resource_metrics)

def test_per_sm_p99_within_stated_error_of_exact():
    rng = np.random.default_rng(1)
    agg = make_aggregator()
    exact = {}
    points = []
    for sm in range(16):
        sigma = 0.3 + 0.05 * sm
        values = rng.lognormal(math.log(20e-6 * (1 + (sm == 7))), sigma, size=3000)
        exact[str(sm)] = values
        # three exports per SM in different slots of the window
        for part, t in zip(np.array_split(values, 3), (T0_S - 25, T0_S - 12, T0_S - 1)):
            points.append(otlp_cta_point(0, sm, "fa2_fwd", part, t))
    assert agg.consume_metrics(otlp_metrics(points)) == len(points)
    windows = agg.sm_windows("0", "fa2_fwd", last_s=60)
    assert sorted(windows, key=int) == [str(i) for i in range(16)]
    for sm, values in exact.items():
        h = windows[sm]
        assert h.count == values.size
        for q in (0.5, 0.9, 0.99):
            want = exact_quantile(values, q)
            got = h.quantile(q)
            assert abs(got - want) / want <= relative_error(h.scale) + 1e-12, (sm, q, got, want)


def test_cumulative_points_become_deltas():
    agg = make_aggregator()
    first = np.full(100, 10e-6)
    second = np.full(50, 40e-6)
    p1 = otlp_cta_point(0, 3, "k", first, T0_S - 20, start_s=T0_S - 100)
    p2 = otlp_cta_point(0, 3, "k", np.concatenate([first, second]), T0_S - 5, start_s=T0_S - 100)
    agg.consume_metrics(otlp_metrics([p1], cumulative=True))
    agg.consume_metrics(otlp_metrics([p2], cumulative=True))
    assert agg.sm_slots("1", "k", last_s=60) == {}  # another GPU: nothing
    slots = agg.sm_slots("0", "k", last_s=60)["3"]
    assert [h.count for _, h, _ in slots] == [100, 50]
    delta = slots[1][1]
    assert delta.quantile(0.5) == pytest.approx(40e-6, rel=relative_error(delta.scale))
    assert delta.sum == pytest.approx(50 * 40e-6)


def test_explicit_histograms_and_bad_points_are_refused_and_counted():
    agg = make_aggregator()
    req = ExportMetricsServiceRequest()
    metric = req.resource_metrics.add().scope_metrics.add().metrics.add()
    metric.name = sc.METRIC_CTA_DURATION
    metric.histogram.data_points.add(count=3, bucket_counts=[1, 2], explicit_bounds=[1e-5])
    metric.histogram.data_points.add(count=1, bucket_counts=[1, 0], explicit_bounds=[1e-5])
    assert agg.consume_metrics(req) == 0
    bad = otlp_cta_point(0, 1, "k", [1e-5, 2e-5], T0_S)
    bad.count = 7
    no_sm = otlp_cta_point(0, 1, "k", [1e-5], T0_S)
    del no_sm.attributes[1]
    late = otlp_cta_point(0, 1, "k", [1e-5], T0_S - 10_000)
    assert agg.consume_metrics(otlp_metrics([bad, no_sm])) == 0
    assert agg.consume_metrics(otlp_metrics([otlp_cta_point(0, 1, "k", [1e-5], T0_S)])) == 1
    assert agg.consume_metrics(otlp_metrics([late])) == 0
    assert agg.dropped == {"explicit_bucket_histogram": 2, "inconsistent_count": 1,
                           "missing_attributes": 1, "late": 1}


def test_sm_series_limit_refuses_counts_series_and_bounds_memory():
    wc = WindowConfig(slot_s=1.0, num_slots=4, max_buckets=64)
    agg = make_aggregator(window=wc, gauge_window_s=3.0, max_sm_series=10)
    rng = np.random.default_rng(2)
    for round_ in range(2):  # the same 40 series twice: every refused point counts, like the drops
        for i in range(40):
            # wide ranges (1 ns .. 1 s) to push each histogram to its bucket limit
            values = np.exp(rng.uniform(math.log(1e-9), 0.0, size=200))
            agg.consume_metrics(otlp_metrics([otlp_cta_point(0, i, "k", values, T0_S - (i % 4))]))
    assert agg.series_counts()["sm"] == 10
    assert agg.overflow == {"sm_cta": 60} and agg.dropped == {"sm_series_limit": 60}
    assert sorted(agg.sm_windows("0", "k", last_s=4.0), key=int) == [str(i) for i in range(10)]
    assert agg.sm.refusal(GpuKey("unknown", "0")) == Refusal("max_sm_series", 10, 30)
    # bucket memory: per SM row (capacity 16), full-resolution slots x max_buckets x 4 bytes plus
    # 4 per-row arrays, and per slot an 80-byte summary (P99, count, exemplar, contention
    # evidence) and the slot's wide-launch CTAs
    rows, detail = 16, agg.sm.detail_slots  # 10 rows, in steps of 16
    assert agg.memory_bytes() <= (rows * detail * (64 * 4 + 32) + rows * wc.num_slots * 80 + rows * 8
                                  + wc.num_slots * 8)


def test_two_engines_sending_gpu_0_are_two_series():
    """Every engine's first GPU is gpu.id=0: the resource (and gpu.uuid) keep them apart."""
    rng = np.random.default_rng(3)
    a, b = rng.lognormal(math.log(25e-6), 0.1, 2000), rng.lognormal(math.log(50e-6), 0.1, 2000)
    agg = make_aggregator()
    agg.consume_metrics(resource_metrics([otlp_cta_point(0, 5, "fa2", a, T0_S - 1)],
                                          **{sc.RESOURCE_SERVICE_INSTANCE_ID: "node-a"}))
    agg.consume_metrics(resource_metrics([otlp_cta_point(0, 5, "fa2", b, T0_S - 1)], **{sc.RESOURCE_HOST_NAME: "node-b"}))
    with_uuid = otlp_cta_point(0, 5, "fa2", b, T0_S - 1)
    with_uuid.attributes.extend(otlp_attrs({sc.ATTR_GPU_UUID: "GPU-c0ffee"}))
    agg.consume_metrics(resource_metrics([with_uuid], **{sc.RESOURCE_SERVICE_INSTANCE_ID: "node-a"}))
    entries = {(e["instance"], e["gpu"], e["gpu_index"]): e["ctas"] for e in agg.kernels() if e["source"] == "sm_probe"}
    assert entries == {("node-a", "0", "0"): 2000, ("node-a", "GPU-c0ffee", "0"): 2000, ("node-b", "0", "0"): 2000}
    for instance, gpu, values in (("node-a", "0", a), ("node-b", "0", b), ("node-a", "GPU-c0ffee", b)):
        h = agg.sm_windows(gpu, "fa2", instance=instance)["5"]
        want = exact_quantile(values, 0.99)
        assert h.count == 2000 and abs(h.quantile(0.99) - want) / want <= relative_error(h.scale)
    with pytest.raises(ValueError, match="2 instances"):
        agg.sm_windows("0", "fa2")
    registry = CollectorRegistry()
    registry.register(agg.prometheus_collector())
    text = metrics_page(registry, agg)[0].decode()
    for gpu in ("node-a:0", "node-b:0", "GPU-c0ffee"):  # the label: the UUID, else instance:index
        assert f'{sc.COLLECTOR_SM_CTA_P99_SECONDS}{{gpu="{gpu}",kernel="fa2",sm="5"}}' in text
    assert f'{sc.COLLECTOR_GPU_INFO}{{gpu="GPU-c0ffee",gpu_index="0",instance_id="node-a"}} 1.0' in text


def test_eight_gpus_share_the_sm_series_limit_fairly():
    """Each GPU's share is max_sm_series / GPUs present, whatever order they arrive in; a GPU
    over its share when another arrives gives back whole kernels."""
    agg = make_aggregator(max_sm_series=8 * 132 * 2)  # room for 2 of each GPU's 4 kernels
    for gpu in range(8):  # GPU 0 first, alone: it takes all 4 kernels, then gives 2 back
        points = [otlp_cta_point(gpu, sm, f"k{k}", [10e-6 * (k + 1)] * 3, T0_S - 1) for k in range(4) for sm in range(132)]
        agg.consume_metrics(otlp_metrics(points))
    for gpu in range(8):
        kernels = {e["kernel"]: e["sms"] for e in agg.kernels() if e.get("gpu") == str(gpu) and e["source"] == "sm_probe"}
        assert kernels == {"k0": 132, "k1": 132}, gpu
    assert agg.series_counts()["sm"] == 8 * 132 * 2
    # every refused point (a kernel given back had its points taken while it was admitted)
    assert agg.overflow["sm_cta"] == agg.dropped["sm_series_limit"] > 0
    assert {key.gpu: r.refused_series for key, r in agg.sm.refusals().items()} == {str(g): 264 for g in range(8)}


def test_cumulative_streams_past_capacity_are_never_counted_twice():
    """Before: streams past 2 x max_sm_series were evicted and re-taken whole (600, not 300)."""
    agg = make_aggregator(max_sm_series=4)
    points = lambda n, t: [otlp_cta_point(0, sm, "k", [10e-6] * n, t, start_s=T0_S - 100) for sm in range(10)]  # noqa: E731
    agg.consume_metrics(otlp_metrics(points(300, T0_S - 30), cumulative=True))
    agg.consume_metrics(otlp_metrics(points(600, T0_S - 20), cumulative=True))
    windows = agg.sm_windows("0", "k", last_s=60)
    assert {sm: h.count for sm, h in windows.items()} == {str(sm): 600 for sm in range(4)}  # 300 + 300
    assert agg.dropped == {"sm_series_limit": 12}
    # Streams idle past the horizon are let go when room is needed; a stream that started
    # before that may have been seen already, so its first point is only a baseline.
    clock = [T0_S]
    agg = Aggregator(AggregationConfig(max_sm_series=4), clock=lambda: clock[0])
    agg.consume_metrics(otlp_metrics(points(300, T0_S - 30)[:4], cumulative=True))
    clock[0] = T0_S + 400
    later = [otlp_cta_point(0, 9, "k", [10e-6] * n, t, start_s=T0_S - 100) for n, t in ((900, T0_S + 390), (950, T0_S + 399))]
    assert agg.consume_metrics(otlp_metrics(later[:1], cumulative=True)) == 0
    assert agg.consume_metrics(otlp_metrics(later[1:], cumulative=True)) == 1
    assert agg.dropped == {"cumulative_baseline": 1}
    assert agg.sm_windows("0", "k", last_s=60)["9"].count == 50


def test_span_series_and_prometheus_exposition():
    agg = make_aggregator()
    spans = [request_span(bytes([i + 1]) * 16, bytes([i + 1]) * 8, e2e=0.1 * (i + 1), ttft=0.03,
                           priority=i % 2) for i in range(6)]
    step = otlp_span(sc.SPAN_ENGINE_STEP, b"\xaa" * 16, b"\xab" * 8, T0_S - 2, T0_S - 1.996,
                     {sc.STEP_PREFILL_TOKENS: 0, sc.STEP_DECODE_TOKENS: 8})
    kernel = otlp_span(sc.SPAN_KERNEL_PREFIX + "fa2_fwd", b"\xaa" * 16, b"\xac" * 8, T0_S - 2,
                       T0_S - 2 + 150e-6, {sc.HW_GPU_ID: 0, sc.CUDA_KERNEL_NAME: "fa2_fwd"},
                       parent=b"\xab" * 8)
    phase = otlp_span(sc.SPAN_QUEUE, b"\x01" * 16, b"\x77" * 8, T0_S - 2, T0_S - 1.9)
    assert agg.consume_traces(otlp_traces(spans + [step, kernel, phase])) == 9
    agg.consume_metrics(otlp_metrics([otlp_cta_point(0, 5, "fa2_fwd", [10e-6] * 98 + [90e-6] * 2, T0_S - 3,
                                                     exemplar=(90e-6, b"\xaa" * 16, b"\xab" * 8))]))
    registry = CollectorRegistry()
    registry.register(agg.prometheus_collector())
    text = metrics_page(registry, agg, OPENMETRICS)[0].decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    e2e = {(s.labels.get("priority"), s.labels.get("le")): s.value for s in fams[sc.COLLECTOR_REQUEST_E2E_SECONDS].samples
           if s.name.endswith("_bucket")}
    # priority 0: e2e 0.1, 0.3, 0.5; priority 1: 0.2, 0.4, 0.6 (le is inclusive)
    assert e2e[("0", "0.1")] == 1 and e2e[("0", "0.25")] == 1 and e2e[("0", "0.5")] == 3
    assert e2e[("1", "0.25")] == 1 and e2e[("1", "0.5")] == 2 and e2e[("1", "0.75")] == 3
    total = {tuple(sorted(s.labels.items())): s.value for s in fams[sc.COLLECTOR_REQUESTS_TOTAL].samples
             if s.name.endswith("_total")}
    assert total[(("finish_reason", "stop"), ("model", "m"), ("priority", "0"))] == 3
    p99 = {s.labels["sm"]: s.value for s in fams[sc.COLLECTOR_SM_CTA_P99_SECONDS].samples}
    assert p99["5"] == pytest.approx(90e-6, rel=relative_error(6))  # windows answer at scale 6
    assert sc.COLLECTOR_SM_HOTSPOT_RATIO in fams
    step_count = [s.value for s in fams[sc.COLLECTOR_STEP_DURATION_SECONDS].samples
                  if s.name.endswith("_count") and s.labels["phase"] == "decode"]
    assert step_count == [1]
    kernel_sum = [s.value for s in fams[sc.COLLECTOR_KERNEL_DURATION_SECONDS].samples if s.name.endswith("_sum")]
    assert kernel_sum == [(kernel.end_time_unix_nano - kernel.start_time_unix_nano) / 1e9]
    # the slowest CTA's exemplar (the step span) is exposed in OpenMetrics
    assert 'span_id="' + (b"\xab" * 8).hex() + '"' in text
    assert 'trace_id="' + (b"\x06" * 16).hex() + '"' in text  # the slowest request's exemplar


def test_concurrent_ingest_counts_everything():
    agg = make_aggregator()
    def work(k):
        for i in range(50):
            agg.consume_metrics(otlp_metrics([otlp_cta_point(0, k, "k", [1e-5] * 10, T0_S - 1)]))
            agg.consume_traces(otlp_traces([request_span(bytes([k + 1, i + 1]) * 8, b"\x01" * 8, 0.1, 0.01)]))
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(h.count for h in agg.sm_windows("0", "k", last_s=60).values()) == 4 * 50 * 10
    assert agg.spans_seen == 200 and agg.latency_window("e2e", ("m", "0")).count == 200


def test_points_built_by_the_gpu_telemetry_exporter_are_taken_exactly():
    """The producer's own code path (``build_cta_metrics`` of instrumentation/gpu_telemetry.py, SDK
    data points encoded by the OTLP exporter's encoder) into the aggregator."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.resources import Resource

    from sightline.instrumentation.cta_metrics import build_cta_metrics
    from sightline.instrumentation.sm_probe import SmExemplar

    rng = np.random.default_rng(5)
    values = {(0, sm, "attn_fwd"): rng.lognormal(math.log(30e-6), 0.3, 500) for sm in range(4)}
    hists = {}
    for key, v in values.items():
        hists[key] = ExpHistogram()
        hists[key].record(v)
    exemplars = {(0, 2, "attn_fwd"): SmExemplar(float(values[(0, 2, "attn_fwd")].max()), int((T0_S - 2) * 1e9),
                                                 0x1234, 0x99)}
    data = build_cta_metrics(hists, exemplars, int((T0_S - 10) * 1e9), int((T0_S - 2) * 1e9),
                             Resource.create({"service.name": sc.SERVICE_NAME_ENGINE}))
    agg = make_aggregator()
    assert agg.consume_metrics(encode_metrics(data)) == 4
    windows = agg.sm_windows("0", "attn_fwd", last_s=60)
    for (gpu, sm, kernel), v in values.items():
        h = windows[str(sm)]
        assert h.count == v.size
        want = exact_quantile(v, 0.99)
        assert abs(h.quantile(0.99) - want) / want <= relative_error(h.scale)
    key, sm, ex = agg.sm.exemplar_for_spans({(0x99).to_bytes(8, "big")})
    assert (key.gpu, sm, key.kernel, ex.trace_id) == ("0", "2", "attn_fwd", (0x1234).to_bytes(16, "big"))


def test_span_series_cardinality_limits():
    agg = make_aggregator(max_kernel_series=2, max_request_series=1, expose_sm_histograms=False)
    spans = [otlp_span(sc.SPAN_KERNEL_PREFIX + f"k{i}", b"\x01" * 16, bytes([i + 1]) * 8, T0_S - 2, T0_S - 1.5,
                       {sc.HW_GPU_ID: 0}) for i in range(5)]
    spans += [request_span(bytes([i + 1]) * 16, b"\x02" * 8, 0.1, 0.01, model=f"m{i}") for i in range(3)]
    agg.consume_traces(otlp_traces(spans))
    assert agg.series_counts()["kernel"] == 3 and agg.series_counts()["request"] == 2
    assert agg.overflow == {"kernel": 3, "request": 2}
    over = (sc.OVERFLOW_LABEL_VALUE, sc.OVERFLOW_LABEL_VALUE)
    assert agg.latency_window("kernel", over).count == 3 and agg.latency_window("e2e", over).count == 2
    assert [k["kernel"] for k in agg.kernels()] == ["k0", "k1", sc.OVERFLOW_LABEL_VALUE]
    assert agg.sm.snapshot(T0_S) == []
    assert agg.exposition_snapshot().requests_total[over + (sc.OVERFLOW_LABEL_VALUE,)] == 2


def test_cumulative_stream_downscaled_between_exports_and_reset():
    agg = make_aggregator()
    a = np.full(10, 10e-6)
    b = np.full(5, 30e-6)
    p1 = otlp_cta_point(0, 1, "k", a, T0_S - 30, scale=8, start_s=T0_S - 100)
    p2 = otlp_cta_point(0, 1, "k", np.concatenate([a, b]), T0_S - 20, scale=5, start_s=T0_S - 100)  # SDK downscaled
    p3 = otlp_cta_point(0, 1, "k", np.full(7, 50e-6), T0_S - 10, scale=8, start_s=T0_S - 15)  # restarted
    for p in (p1, p2, p3):
        assert agg.consume_metrics(otlp_metrics([p], cumulative=True)) == 1
    slots = agg.sm_slots("0", "k", last_s=60)["1"]
    assert [h.count for _, h, _ in slots] == [10, 5, 7]
    assert slots[1][1].sum == pytest.approx(5 * 30e-6)
    assert slots[1][1].quantile(1.0) == 30e-6  # a delta keeps the stream's max as its clamp


def test_points_outside_any_duration_range_are_refused_and_the_batch_kept():
    agg = make_aggregator()
    far = []
    for offset in (-(2 ** 31) + 1, 2 ** 31 - 2):  # 2**32 buckets apart at scale 0: no scale >= -10 fits
        p = otlp_cta_point(0, 1, "k", [1e-5], T0_S - 1)
        p.scale, p.positive.offset, p.min, p.max = 0, offset, 1e-5, 1e-5
        del p.positive.bucket_counts[:]
        p.positive.bucket_counts.append(1)
        far.append(p)
    good = otlp_cta_point(0, 2, "k", [1e-5] * 3, T0_S - 1)
    assert agg.consume_metrics(otlp_metrics([far[0], far[1], good])) == 1
    assert agg.dropped == {"out_of_range": 2}
    assert agg.sm_windows("0", "k", last_s=60)["2"].count == 3


def test_sliding_window_ring_selection_and_late_values():
    from sightline.collector.windows import Exemplar, SlidingHistogram, merge_all

    wc = WindowConfig(slot_s=1.0, num_slots=3, flush_every=2)
    w = SlidingHistogram(wc)
    for t in range(6):  # value t+1 at time t + 0.5, three times each
        for _ in range(3):
            assert w.record(float(t + 1), t + 0.5, Exemplar(float(t + 1), b"t" * 16, bytes([t]) * 8))
    assert not w.record(9.0, 2.5)  # older than the ring (slots 3, 4, 5 remain)
    assert [(e, h.count, h.min) for e, h, _ in w.slots(now_s=5.9, last_s=3)] == [(3, 3, 4.0), (4, 3, 5.0), (5, 3, 6.0)]
    assert [e for e, _, _ in w.slots(now_s=5.9, last_s=2)] == [4, 5]
    merged = w.window(now_s=5.9, last_s=10)  # capped at the ring
    assert (merged.count, merged.min, merged.max, merged.sum) == (9, 4.0, 6.0, 45.0)
    assert merged.quantile(0.5) == pytest.approx(5.0, rel=relative_error(merged.scale))
    assert max(w.exemplars(), key=lambda e: e.value).span_id == bytes([5]) * 8
    assert w.window(now_s=100.0, last_s=30).count == 0  # all slots too old for that query
    # merge_all agrees with pairwise merges, also across scales
    a, b = ExpHistogram(scale=6), ExpHistogram(scale=4)
    a.record([1.0, 2.0, 3.0])
    b.record([2.5, 100.0])
    fast = merge_all([a], wc)
    slow = ExpHistogram(scale=6)
    slow.merge(a)
    assert (fast.scale, fast.offset, fast.counts.tolist()) == (slow.scale, slow.offset, slow.counts.tolist())
    both = merge_all([a, b], wc)
    assert both.count == 5 and both.scale == 4 and both.quantile(1.0) == 100.0


def test_label_values_are_bounded():
    agg = make_aggregator()
    long_kernel = "void flash_fwd<" + "x" * 1000 + ">"
    spans = [request_span(b"\x01" * 16, b"\x01" * 8, 0.1, 0.01, reason="made-up-reason"),
             request_span(b"\x02" * 16, b"\x02" * 8, 0.1, 0.01, reason="length"),
             otlp_span(sc.SPAN_KERNEL_PREFIX + long_kernel, b"\x03" * 16, b"\x03" * 8, T0_S - 2, T0_S - 1.9,
                       {sc.HW_GPU_ID: 1, sc.CUDA_KERNEL_NAME: long_kernel})]
    agg.consume_traces(otlp_traces(spans))
    assert agg.exposition_snapshot().requests_total == {("m", "0", "other"): 1, ("m", "0", "length"): 1}
    [kernel] = agg.kernels()
    assert (kernel["gpu"], kernel["kernel"]) == ("1", long_kernel[:256])


def test_classic_rebinning_matches_binning_each_bucket_point():
    from sightline.collector.exposition import ClassicHistogram

    rng = np.random.default_rng(9)
    bounds = sc.CTA_BUCKETS_S
    for scale in (-2, 0, 3, 6, 8, 12):
        for _ in range(5):
            h = ExpHistogram(scale=scale, max_buckets=100_000)
            h.record(np.exp(rng.uniform(math.log(2e-7), math.log(0.5), 3000)))
            h.zero_count += 7
            h.count += 7
            got = ClassicHistogram(bounds)
            got.add_exp(h)
            want = [0] * (len(bounds) + 1)
            want[0] += h.zero_count
            for i, c in enumerate(h.counts):
                point = 2.0 * 2.0 ** ((h.offset + i + 1) * 2.0 ** -h.scale) / (h.base + 1.0)
                want[int(np.searchsorted(np.asarray(bounds), point, side="left"))] += int(c)
            assert got.counts == want, scale
            assert sum(got.counts) == h.count


def test_a_point_without_buckets_keeps_the_series_resolution_whatever_its_scale():
    # A point of zeros only (no bucket holds a value) says nothing of scale. Taking its scale
    # would coarsen every SM of the kernel to it (a block takes its finest point's); at -10,
    # OTLP's lowest, the bucket base 2**1024 overflowed and the batch was lost.
    agg = make_aggregator()
    values = np.full(50, 20e-6)
    assert agg.consume_metrics(otlp_metrics([otlp_cta_point(0, 1, "k", values, T0_S - 2)])) == 1
    before = agg.sm_windows("0", "k", last_s=60)["1"]
    for scale in (-10, -9, 0):
        empty = otlp_cta_point(0, 2, "k", [], T0_S - 1)
        empty.scale, empty.zero_count, empty.count = scale, 3, 3
        assert agg.consume_metrics(otlp_metrics([empty, otlp_cta_point(0, 1, "k", values, T0_S - 1)])) == 2
    assert agg.dropped == {}
    windows = agg.sm_windows("0", "k", last_s=60)
    assert windows["1"].scale == before.scale and windows["1"].count == 200
    assert windows["1"].quantile(0.99) == before.quantile(0.99)
    assert windows["2"].count == 9 and windows["2"].zero_count == 9
