"""Replay of OTLP captures recorded through the OpenTelemetry SDK, in-process and into a
real collector process over OTLP/HTTP; then the heatmap and explain CLIs against it."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, set_span_in_context

from sightline.collector.aggregator import Aggregator
from sightline.collector.replay import AggregatorSink, ReplayConfig, replay
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.capture import (CaptureMetricExporter, CaptureSpanExporter, CaptureWriter,
                                               read_capture_meta)
from sightline.instrumentation.exphist import relative_error
from tests.collector.otlp_builders import exact_quantile, otlp_cta_point, otlp_metrics
from tests.support import free_port, wait_for_collector

KERNEL = "_fwd_kernel_sm_probe"
N_SMS = 6
N_REQUESTS = 8


def make_capture(path):
    """A capture written by the OTel SDK through the capture exporters: request spans,
    step spans linked to them, kernel spans, and per-SM CTA durations as SDK exponential
    histograms exported twice (cumulative temporality, the SDK default).
    Returns {sm: all values} and the e2e of each request trace id."""
    rng = np.random.default_rng(7)
    resource = Resource.create({"service.name": sc.SERVICE_NAME_ENGINE})
    writer = CaptureWriter(path)
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(CaptureSpanExporter(writer)))
    reader = PeriodicExportingMetricReader(CaptureMetricExporter(writer), export_interval_millis=3_600_000)
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader], views=[
        View(instrument_name=sc.METRIC_CTA_DURATION, aggregation=ExponentialBucketHistogramAggregation())])
    tracer = tracer_provider.get_tracer(sc.INSTRUMENTATION_SCOPE)
    cta = meter_provider.get_meter(sc.INSTRUMENTATION_SCOPE).create_histogram(sc.METRIC_CTA_DURATION, unit="s")
    values = {sm: [] for sm in range(N_SMS)}
    e2e = {}
    for batch in range(2):
        for i in range(N_REQUESTS // 2):
            n = batch * N_REQUESTS // 2 + i
            start = time.time_ns()
            root = tracer.start_span(sc.SPAN_HTTP_COMPLETIONS, kind=SpanKind.SERVER, start_time=start,
                                     attributes={sc.GEN_AI_REQUEST_MODEL: "tiny", sc.REQUEST_PRIORITY: n % 2,
                                                 sc.REQUEST_E2E_S: 0.05 * (n + 1)})
            step = tracer.start_span(sc.SPAN_ENGINE_STEP, start_time=start, links=[Link(root.get_span_context())],
                                     attributes={sc.STEP_ID: n, sc.STEP_DECODE_TOKENS: 1})
            kernel = tracer.start_span(sc.SPAN_KERNEL_PREFIX + KERNEL, start_time=start,
                                       context=set_span_in_context(step),
                                       attributes={sc.HW_GPU_ID: 0, sc.CUDA_KERNEL_NAME: KERNEL,
                                                   sc.KERNEL_SLOWEST_SM: n % N_SMS})
            kernel.end(start + 200_000 + 10_000 * n)
            step.end(start + 1_000_000)
            root.end(start + int(0.05 * (n + 1) * 1e9))
            e2e[format(root.get_span_context().trace_id, "032x")] = 0.05 * (n + 1)
        for sm in range(N_SMS):
            v = rng.lognormal(math.log(30e-6 * (1.5 if sm == 4 else 1.0)), 0.25, size=400)
            values[sm].extend(v.tolist())
            for x in v:
                cta.record(float(x), {sc.ATTR_GPU_ID: 0, sc.ATTR_SM_ID: sm, sc.ATTR_KERNEL_NAME: KERNEL})
        reader.force_flush()
    meter_provider.shutdown()
    tracer_provider.shutdown()
    writer.close()
    return values, e2e


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    path = tmp_path_factory.mktemp("capture") / "engine.jsonl.gz"
    values, e2e = make_capture(path)
    return path, values, e2e


def test_in_process_replay_is_exact(capture):
    path, values, e2e = capture
    agg = Aggregator()
    result = replay(path, AggregatorSink(agg), ReplayConfig())
    assert result.spans == 3 * N_REQUESTS and result.data_points >= 2 * N_SMS
    windows = agg.sm_windows("0", KERNEL, last_s=agg.config.window.horizon_s)
    assert sorted(windows, key=int) == [str(sm) for sm in range(N_SMS)]
    for sm, v in values.items():
        h = windows[str(sm)]
        assert h.count == len(v) == 800  # two cumulative exports turned into deltas, not 400 + 800
        want = exact_quantile(v, 0.99)
        assert abs(h.quantile(0.99) - want) / want <= relative_error(h.scale) + 1e-12
    assert agg.latency_window("e2e", ("tiny", "1")).count == N_REQUESTS // 2
    slowest = max(e2e, key=e2e.get)
    from sightline.collector.explain import explain_slowest
    answer = explain_slowest(agg, quantile=1.0, limit=1)
    assert answer.requests[0].trace_id == slowest and answer.requests[0].steps_total == 1


def test_paced_replay_keeps_relative_timing(tmp_path, capture):
    path = tmp_path / "paced.jsonl"
    with CaptureWriter(path) as w:
        for i in range(3):
            w.write_metrics(otlp_metrics([otlp_cta_point(0, 1, "k", [1e-5], 1_700_000_000 + i)]),
                            time_unix_nano=1_700_000_000_000_000_000 + i * 300_000_000)
    agg = Aggregator()
    result = replay(path, AggregatorSink(agg), ReplayConfig(speed=1.0))
    assert result.duration_s >= 0.6 and result.exports == 3
    fast = replay(path, AggregatorSink(Aggregator()), ReplayConfig(speed=0))
    assert fast.duration_s < 0.5
    # rebased: the old data landed in the live window
    assert agg.sm_windows("0", "k", last_s=agg.config.window.horizon_s)["1"].count == 3
    not_rebased = Aggregator()
    replay(path, AggregatorSink(not_rebased), ReplayConfig(rebase=False))
    assert not_rebased.dropped == {"late": 3} and not not_rebased.kernels()


class _ListSink:
    """Keeps every request it is sent (copies), with the signal."""

    def __init__(self) -> None:
        self.sent, self.retries = [], 0

    def send(self, signal, request, max_retries) -> None:
        copy = type(request)()
        copy.CopyFrom(request)
        self.sent.append((signal, copy))


def _timed_capture(path):
    """A metadata line, then spans at capture seconds 0, 10, 20 (each 2 s long, an event at
    +0.5 s) exported 1 s after each, and a per-SM point at 21 s."""
    base = 1_700_000_000_000_000_000
    with CaptureWriter(path) as w:
        w.write_meta({"note": "kept out of the replay"})
        for i in range(3):
            start = base + i * 10 * 10**9
            req = ExportTraceServiceRequest()
            span = req.resource_spans.add().scope_spans.add().spans.add()
            span.trace_id, span.span_id, span.name = bytes([i + 1]) * 16, bytes([i + 1]) * 8, "s"
            span.start_time_unix_nano, span.end_time_unix_nano = start, start + 2 * 10**9
            span.events.add(time_unix_nano=start + 5 * 10**8, name="e")
            w.write_traces(req, time_unix_nano=start + 3 * 10**9)
        w.write_metrics(otlp_metrics([otlp_cta_point(0, 1, "k", [1e-5], 1_700_000_021)]),
                        time_unix_nano=base + 23 * 10**9)
    return base


def test_a_slot_aligned_replay_keeps_each_point_in_the_slot_it_had_live(tmp_path):
    """With ``align_slot_s`` the capture moves by whole slots: its last export (23 s after
    the base, 3 s into a 10 s slot) lands at the latest instant 3 s into a slot that is not
    after now, and every point keeps its phase in its slot."""
    path = tmp_path / "timed.jsonl.gz"
    base = _timed_capture(path)
    now = 1_800_000_007_500_000_000   # 7.5 s into a slot: the last export's phase, 3 s, is behind it
    sink = _ListSink()
    result = replay(path, sink, ReplayConfig(align_slot_s=10.0), clock_ns=lambda: now)
    shift = result.time_map(base) - base
    assert shift % (10 * 10**9) == 0 and result.time_map(base + 23 * 10**9) == now - 45 * 10**8
    spans = [req.resource_spans[0].scope_spans[0].spans[0] for signal, req in sink.sent if signal == "traces"]
    assert [(sp.start_time_unix_nano - shift - base) // 10**9 for sp in spans] == [0, 10, 20]
    early = 1_800_000_001_000_000_000   # 1 s into a slot: the slot before, 3 s in
    late = replay(path, _ListSink(), ReplayConfig(align_slot_s=10.0), clock_ns=lambda: early)
    assert late.time_map(base + 23 * 10**9) == early - 8 * 10**9


def test_speed_compresses_time_and_spans_keep_their_durations(tmp_path):
    path = tmp_path / "timed.jsonl.gz"
    base = _timed_capture(path)
    now = 1_800_000_000_000_000_000
    sink = _ListSink()
    result = replay(path, sink, ReplayConfig(speed=100.0), clock_ns=lambda: now)
    assert [s for s, _ in sink.sent] == ["traces"] * 3 + ["metrics"]  # no metadata line
    first = base + 3 * 10**9  # the first export's time lands at now
    for i, (_, req) in enumerate(sink.sent[:3]):
        span = req.resource_spans[0].scope_spans[0].spans[0]
        start = now + (base + i * 10 * 10**9 - first) // 100
        assert span.start_time_unix_nano == start
        assert span.end_time_unix_nano == start + 2 * 10**9
        assert span.events[0].time_unix_nano == start + 5 * 10**8
    point = sink.sent[3][1].resource_metrics[0].scope_metrics[0].metrics[0].exponential_histogram.data_points[0]
    assert point.time_unix_nano == now + (base + 21 * 10**9 - first) // 100
    assert result.time_map(first + 100) == now + 1

    fast = _ListSink()
    result = replay(path, fast, ReplayConfig(speed=0.0), clock_ns=lambda: now)
    last = base + 23 * 10**9  # the last export lands at now; spacing kept
    spans = [req.resource_spans[0].scope_spans[0].spans[0] for _, req in fast.sent[:3]]
    assert [s.start_time_unix_nano for s in spans] == [now - last + base + i * 10 * 10**9 for i in range(3)]
    assert result.shift_ns == now - last


def test_metrics_then_spans_on_one_clock(tmp_path):
    path = tmp_path / "timed.jsonl"
    base = _timed_capture(path)
    metrics, traces = _ListSink(), _ListSink()
    first = replay(path, metrics, ReplayConfig(signals=("metrics",)), clock_ns=lambda: 5 * 10**18)
    second = replay(path, traces, ReplayConfig(signals=("traces",)), clock_ns=lambda: 6 * 10**18,
                    time_map=first.time_map)
    assert [s for s, _ in metrics.sent] == ["metrics"] and [s for s, _ in traces.sent] == ["traces"] * 3
    assert second.time_map == first.time_map
    span = traces.sent[0][1].resource_spans[0].scope_spans[0].spans[0]
    assert span.start_time_unix_nano == 5 * 10**18 - (base + 23 * 10**9) + base
    with pytest.raises(ValueError, match="signals=()"):
        ReplayConfig(signals=())
    assert read_capture_meta(path) == {"note": "kept out of the replay"}


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-c", "import sys; from sightline.deploy.cli import main; "
                           "sys.exit(main())", *args], capture_output=True, text=True, timeout=timeout)


def test_replay_into_collector_process_then_heatmap_and_explain(tmp_path, capture):
    path, values, e2e = capture
    ports = {name: free_port() for name in ("grpc", "http", "zipkin", "query")}
    env = {k: v for k, v in os.environ.items() if k != "SIGHTLINE_COLLECTOR_TOKEN"}
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from sightline.deploy.cli import main; sys.exit(main())",
         "collector", "run", "--otlp-grpc", f"127.0.0.1:{ports['grpc']}", "--otlp-http",
         f"127.0.0.1:{ports['http']}", "--zipkin", f"127.0.0.1:{ports['zipkin']}", "--http",
         f"127.0.0.1:{ports['query']}", "--log-level", "WARNING"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    query = f"http://127.0.0.1:{ports['query']}"
    try:
        wait_for_collector(query, process)
        done = _cli("replay", str(path), "--collector", f"http://127.0.0.1:{ports['http']}")
        assert done.returncode == 0, done.stderr
        assert f"({3 * N_REQUESTS} spans" in done.stdout
        deadline = time.monotonic() + 20
        ctas = 0
        while time.monotonic() < deadline:
            with urllib.request.urlopen(query + "/api/v1/kernels", timeout=5) as r:
                kernels = [k for k in json.loads(r.read())["kernels"] if k["source"] == "sm_probe"]
            ctas = sum(k["ctas"] for k in kernels)
            if ctas == N_SMS * 800:
                break
            time.sleep(0.1)
        assert ctas == N_SMS * 800
        out = tmp_path / "heatmaps"
        done = _cli("heatmap", "--url", query, "--out", str(out))
        assert done.returncode == 0, done.stderr
        heat = json.loads((out / f"gpu0_{KERNEL}_time_sm.json").read_text())
        assert heat["sms"] == [str(sm) for sm in range(N_SMS)]
        assert sum(map(sum, heat["counts"])) == N_SMS * 800
        assert heat["hotspot"]["hottest_sm"] == "4"  # its durations were 1.5x the others'
        assert (out / f"gpu0_{KERNEL}_sm_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "<svg" in (out / "index.html").read_text()
        done = _cli("explain", "--url", query, "--quantile", "0.9", "--limit", "1")
        assert done.returncode == 0, done.stderr
        assert max(e2e, key=e2e.get) in done.stdout and "steps ridden: 1" in done.stdout
        fastest = min(e2e, key=e2e.get)
        done = _cli("explain", "--url", query, "--trace-id", fastest)
        assert done.returncode == 0, done.stderr
        assert f"trace {fastest}" in done.stdout and "steps ridden: 1" in done.stdout
        with urllib.request.urlopen(query + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        # the OTel SDK's resource carries a service.instance.id: the series' instance
        assert re.search(rf'{sc.COLLECTOR_SM_CTA_P99_SECONDS}{{gpu="[0-9a-f-]{{36}}:0",kernel="{KERNEL}",sm="4"}}', metrics)
    finally:
        process.terminate()
        process.wait(30)


def test_instants_in_span_attributes_move_with_their_span():
    """A kernel span's launch end and a step's wait start are instants (Unix ns): rebased
    with their span, they keep their offset from its start (else the collector, which needs
    them inside the step, would leave the GPU/host split of every replayed step unread)."""
    from sightline.collector.replay import TimeMap, rebase_request
    from tests.collector.otlp_builders import otlp_span, otlp_traces

    start_s = 1_700_000_000.0
    kernel = otlp_span("cuda.kernel.gemm", b"t" * 16, b"k" * 8, start_s + 0.004, start_s + 0.009,
                       {sc.KERNEL_LAUNCH_END_NS: int((start_s + 0.001) * 1e9), sc.STEP_ID: 7})
    step = otlp_span(sc.SPAN_ENGINE_STEP, b"t" * 16, b"s" * 8, start_s, start_s + 0.010,
                     {sc.STEP_WAIT_START_NS: int((start_s + 0.002) * 1e9), sc.STEP_WAIT_START_NS + "x": 5})
    request = otlp_traces([kernel, step])
    rebase_request("traces", request, TimeMap(int(start_s * 1e9), 10**18))
    moved_kernel, moved_step = request.resource_spans[0].scope_spans[0].spans
    attrs = {kv.key: kv.value.int_value for span in (moved_kernel, moved_step) for kv in span.attributes}
    assert moved_step.start_time_unix_nano == 10**18
    # (to a microsecond: the spans' times were built from float seconds)
    assert attrs[sc.KERNEL_LAUNCH_END_NS] - moved_kernel.start_time_unix_nano == pytest.approx(-3_000_000, abs=1000)
    assert attrs[sc.STEP_WAIT_START_NS] - moved_step.start_time_unix_nano == pytest.approx(2_000_000, abs=1000)
    assert attrs[sc.STEP_ID] == 7 and attrs[sc.STEP_WAIT_START_NS + "x"] == 5   # not instants: untouched
