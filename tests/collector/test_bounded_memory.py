"""Memory has a ceiling whatever clients send: identities, names, label values, scrapers.

Real collectors on free ports take what made memory grow without bound before: instance ids
by the ten thousand past the GPU limit, megabyte span names and kernel-name attributes,
priority values by the hundred, and slow /metrics readers. Each table keyed by a client's
value is bounded in count and key length, full tables let idle series go (counted), and a
scrape streams one shared page. The full-size figures (a million instance ids, 1,000
one-megabyte names, 100 slow scrapers) are in bench/collector_limits.py.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from sightline.collector import sm_refusals
from sightline.collector.aggregation_config import AggregationConfig, TraceStoreConfig, WindowConfig
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import otlp_attrs, otlp_cta_point, otlp_metrics, otlp_span, otlp_traces
from tests.collector.servers import post, running_collector
from tests.support import get_json

PB = {"Content-Type": "application/x-protobuf"}


def _per_instance_points(instances: range, now: float) -> bytes:
    """One CTA point of GPU 0 from each instance id in ``instances`` (a resource each)."""
    request = ExportMetricsServiceRequest()
    for i in instances:
        rm = request.resource_metrics.add()
        rm.resource.attributes.extend(otlp_attrs({sc.RESOURCE_SERVICE_INSTANCE_ID: f"node-{i}"}))
        metric = rm.scope_metrics.add().metrics.add(name=sc.METRIC_CTA_DURATION)
        metric.exponential_histogram.aggregation_temporality = 1
        metric.exponential_histogram.data_points.append(otlp_cta_point("0", "1", "k", [1e-5], now))
    return request.SerializeToString()


def test_refused_identities_are_a_bounded_table_answered_by_index(monkeypatch):
    """Before: every refused (instance, gpu) stayed for good (1,000,000 ids: +490 MB) and each
    heatmap query copied the whole table on the event loop (2-10 s)."""
    monkeypatch.setattr(sm_refusals.RefusedGpus.__init__, "__defaults__", (1_000, 100_000))
    now = time.time()
    with running_collector(aggregation=AggregationConfig(max_gpus=4)) as col:
        for start in range(0, 6_000, 2_000):
            status, _, _ = post(col.http_url + "/v1/metrics", _per_instance_points(range(start, start + 2_000), now), PB)
            assert status == 200
        col.idle()
        store = col.collector.aggregator.sm
        assert len(store.refusals()) == 1_000 and store._refused.evicted == 6_000 - 4 - 1_000
        copies = []
        monkeypatch.setattr(sm_refusals.RefusedGpus, "all", lambda self: copies.append(1) or {})
        # the latest refused identity still names its limit; an unknown GPU is a plain 404
        status, body = get_json(col.query_url + "/api/v1/heatmap?gpu=0&instance_id=node-5999&kernel=k")
        assert status == 404 and "max_gpus=4 reached" in body["error"]["message"], body
        status, body = get_json(col.query_url + "/api/v1/heatmap?gpu=nope")
        assert status == 404 and "no per-SM data matches" in body["error"]["message"]
        assert copies == []


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_megabyte_span_names_and_kernel_names_are_not_remembered():
    """Before: 1,000 span names of 1 MB kept +1.1 GB (the name dispatch remembered 4,096 names
    of any length), and 1 MB kernel-name attributes +0.7 GB (the attribute cache)."""
    now = time.time()
    megabyte = "x" * (1024 * 1024)
    with running_collector(aggregation=AggregationConfig(trace_store=TraceStoreConfig(mode="off"))) as col:
        series = col.collector.aggregator._spans
        before = None
        for batch in range(16):  # 48 span names of 1 MB and 48 kernel-name attributes of 1 MB
            if batch == 4:  # past the allocators' first high-water mark (client and server)
                col.idle()
                before = _rss_mib()
            spans = []
            for i in range(6):
                n = batch * 6 + i
                ids = (n + 1).to_bytes(16, "big"), (n + 1).to_bytes(8, "big")
                name = f"{n}{megabyte}" if i % 2 else f"{sc.SPAN_KERNEL_PREFIX}k"
                attrs = {sc.CUDA_KERNEL_NAME: f"{n}{megabyte}", sc.HW_GPU_ID: "0"} if i % 2 == 0 else {}
                spans.append(otlp_span(name, ids[0], ids[1], now - 1, now - 0.5, attrs))
            assert post(col.http_url + "/v1/traces", otlp_traces(spans).SerializeToString(), PB)[0] == 200
        col.idle()
        held = (sum(len(name) for name in series._dispatch) + sum(len(raw) for raw in series._attr_cache)
                + sum(len(raw) for raw in series._label_cache))
        grown = _rss_mib() - before
        kernels = {kernel for _, kernel in series.kernels}
    assert held < 4096 * 512, f"{held / 2**20:.0f} MiB of keys held"
    assert grown < 24, f"RSS +{grown:.0f} MiB"  # before: +72 MiB (36 names + 36 attributes of 1 MB)
    assert {len(kernel) for kernel in kernels} == {256}  # the series label: the name, cut


def _request_spans(labels: list[tuple[str, object]], end_s: float, seed: int):
    """One request span per (model, priority), ending at ``end_s``."""
    return otlp_traces([otlp_span(sc.SPAN_HTTP_COMPLETIONS, (seed * 10_000 + i + 1).to_bytes(16, "big"),
                                  (seed * 10_000 + i + 1).to_bytes(8, "big"), end_s - 0.2, end_s, {
                                      sc.GEN_AI_REQUEST_MODEL: model, sc.REQUEST_PRIORITY: priority,
                                      sc.REQUEST_E2E_S: 0.2}, kind=2)
                        for i, (model, priority) in enumerate(labels)]).SerializeToString()


def _request_series(col) -> dict[tuple[str, str], float]:
    return {(dict(labels)["model"], dict(labels)["priority"]): value for (name, labels), value in col.metrics().items()
            if name == sc.COLLECTOR_REQUEST_E2E_SECONDS + "_count"}


def test_priorities_are_clamped_and_a_full_series_table_lets_idle_series_go():
    """Before: 520 distinct API priorities filled the request-series table for good and legitimate
    traffic folded into __overflow__ from then on."""
    window = WindowConfig(slot_s=0.5, num_slots=4)  # a 2 s horizon
    aggregation = AggregationConfig(window=window, gauge_window_s=2.0, max_request_series=16)
    with running_collector(aggregation=aggregation) as col:
        odd = [("m", -1000), ("m", 10**12), ("m", 100), ("m", 2.5), ("m", "urgent"), ("m", "7")]
        assert post(col.http_url + "/v1/traces", _request_spans(odd, time.time(), seed=1), PB)[0] == 200
        col.idle()
        assert _request_series(col) == {("m", "-100"): 1, ("m", "100"): 2, ("m", "other"): 2, ("m", "7"): 1}
        flood = [("m", p) for p in range(520)]  # priorities 0..519: 101 labels after the clamp
        assert post(col.http_url + "/v1/traces", _request_spans(flood, time.time(), seed=2), PB)[0] == 200
        col.idle()
        assert ("__overflow__", "__overflow__") in _request_series(col)
        time.sleep(window.horizon_s + 2 * window.slot_s)  # the flood idles past the horizon
        assert post(col.http_url + "/v1/traces", _request_spans([("llama", 0)], time.time(), seed=3), PB)[0] == 200
        col.idle()
        series = _request_series(col)
        metrics = col.metrics()
    assert series[("llama", "0")] == 1  # its own series again, not the overflow
    assert metrics[(sc.COLLECTOR_SERIES_EVICTED_TOTAL + "_total", (("family", "request"),))] == 16  # all but the overflow series
    assert metrics[(sc.COLLECTOR_SERIES_EVICTED_TOTAL + "_total", (("family", "kernel"),))] == 0


def _slow_scraper(port: int) -> socket.socket:
    """A /metrics request from a reader that never reads: a small receive buffer, nothing read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n")
    return sock


def _fleet_points(gpus: int, kernels: int, now: float) -> list[bytes]:
    return [otlp_metrics([otlp_cta_point(str(g), str(sm), f"kernel_{k}", [1e-5, 2e-5, 4e-5], now)
                          for k in range(kernels) for sm in range(132)]).SerializeToString() for g in range(gpus)]


def test_slow_scrapers_share_one_page_and_are_cut_at_the_deadline(monkeypatch):
    """Before: 100 readers at 4 KB/s each held a full copy of the page (345 MB -> 7.8 GB RSS),
    with no write deadline."""
    from sightline.collector import app as app_module
    renders = []
    real_page = app_module.metrics_page
    monkeypatch.setattr(app_module, "metrics_page", lambda *a, **k: renders.append(1) or real_page(*a, **k))
    now = time.time()
    with running_collector(aggregation=AggregationConfig(expose_sm_histograms=True), scrape_deadline_s=4.0) as col:
        for body in _fleet_points(4, 10, now):
            assert post(col.http_url + "/v1/metrics", body, PB)[0] == 200
        col.idle()
        with urllib.request.urlopen(col.query_url + "/metrics", timeout=30) as response:
            page_bytes = len(response.read())
        assert page_bytes > 8 * 2**20  # 4 GPUs x 132 SMs x 10 kernels, 19 lines each
        renders.clear()
        before = _rss_mib()
        scrapers = [_slow_scraper(col.ports.http) for _ in range(20)]
        time.sleep(1.5)
        grown = _rss_mib() - before
        assert grown < 2 * page_bytes / 2**20 + 16, f"RSS +{grown:.0f} MiB for a {page_bytes / 2**20:.0f} MiB page"
        assert len(renders) <= 2, len(renders)
        def cut() -> float:   # read in process: a scrape would render the 8 MB page
            return col.collector.metrics.registry.get_sample_value(sc.COLLECTOR_SCRAPES_CUT_TOTAL + "_total")

        deadline = time.monotonic() + 30
        while cut() < 20:  # past the 4 s deadline: each is cut, what it had buffered let go
            assert time.monotonic() < deadline, cut()
            time.sleep(0.2)
        for sock in scrapers:
            received = 0
            sock.settimeout(10)
            try:
                while chunk := sock.recv(1 << 20):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            sock.close()
            assert received < page_bytes
        with urllib.request.urlopen(col.query_url + "/metrics", timeout=30) as response:
            assert response.status == 200 and len(response.read()) > 8 * 2**20
        assert col.metrics()[(sc.COLLECTOR_SCRAPES_CUT_TOTAL + "_total", ())] == 20
