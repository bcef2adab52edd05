"""Memory has a ceiling whatever clients send: identities, names, label values, scrapers.

Real collectors on free ports take what made memory grow without bound before: instance ids
by the ten thousand past the GPU limit, megabyte span names and kernel-name attributes,
priority values by the hundred, and slow /metrics readers. Each table keyed by a client's
value is bounded in count and key length, full tables let idle series go (counted), and a
scrape streams one shared page. The full-size figures (a million instance ids, 1,000
one-megabyte names, 100 slow scrapers) are in bench/collector_limits.py.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from sightline.collector import sm_refusals
from sightline.collector.aggregation_config import AggregationConfig
from sightline.instrumentation import semconv as sc
from tests.collector.test_aggregator import otlp_attrs, otlp_cta_point, otlp_span, otlp_traces
from tests.collector.test_receivers import post, running_collector

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


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


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
        status, body = _get(col.query_url + "/api/v1/heatmap?gpu=0&instance_id=node-5999&kernel=k")
        assert status == 404 and "max_gpus=4 reached" in body["error"]["message"], body
        status, body = _get(col.query_url + "/api/v1/heatmap?gpu=nope")
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
    with running_collector(aggregation=AggregationConfig(store_traces=False)) as col:
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
