"""Horizontal scale: three collector replicas behind resource routing answer like one.

Three real ``sightline collector run`` processes (the replicas) and a fourth that receives
everything (the single replica) are scraped by one real Prometheus. Per-SM CTA
histograms of several GPUs, one engine process (one OTLP resource) per GPU, are sent to
the single collector whole, and to the replicas split by resource the way the
OpenTelemetry Collector's load-balancing exporter does with ``routing_key: resource``:
each ``ResourceMetrics`` goes to the replica its resource's hash falls on in a
consistent-hash ring. otelcol-contrib is not available on this machine, so the test
does that routing itself (:func:`route_by_resource`). Every engine's GPU is ``gpu.id=0``:
the resource's ``service.instance.id`` keeps them apart. Since a GPU's streams always land
on one replica, PromQL must see, exactly, ``sum by (gpu, kernel, le)`` of the
replicas' per-GPU bucket series equal to the single replica's, and each per-SM P99 gauge
equal to the single replica's within the sketch's stated error (``relative_error(6)``).
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import zlib

import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from sightline.instrumentation import semconv as sc
from sightline.instrumentation.exphist import relative_error
from tests.collector.otlp_builders import exact_quantile, otlp_attrs, otlp_cta_point
from tests.support import free_port, wait_for_collector, wait_for_http

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus (scripts/setup.sh)")

GPUS, SMS, KERNELS, ROUNDS = 6, 8, ("fa2_prefill", "fa2_decode"), 3
BUCKET = sc.COLLECTOR_GPU_CTA_DURATION_SECONDS + "_bucket"
P99 = sc.COLLECTOR_SM_CTA_P99_SECONDS
BY = "gpu, sm, kernel"
BY_GPU = "gpu, kernel"


# -- resource routing (what the load-balancing exporter does with routing_key: resource) --
def _resource_key(resource) -> bytes:
    """A resource's identity: its attributes, sorted, as text."""
    return "\x1f".join(sorted(f"{kv.key}={kv.value}" for kv in resource.attributes)).encode()


def _ring(endpoints: list[str], points_per_endpoint: int = 100) -> list[tuple[int, str]]:
    return sorted((zlib.crc32(f"{endpoint}#{i}".encode()), endpoint)
                  for endpoint in endpoints for i in range(points_per_endpoint))


def route_by_resource(request: ExportMetricsServiceRequest, endpoints: list[str]) -> dict[str, ExportMetricsServiceRequest]:
    """Splits ``request`` by ``ResourceMetrics``; each goes to the endpoint owning the first
    ring point at or after its resource's hash (wrapping around)."""
    ring = _ring(endpoints)
    positions = [p for p, _ in ring]
    out: dict[str, ExportMetricsServiceRequest] = {}
    for rm in request.resource_metrics:
        i = bisect.bisect_left(positions, zlib.crc32(_resource_key(rm.resource))) % len(ring)
        out.setdefault(ring[i][1], ExportMetricsServiceRequest()).resource_metrics.append(rm)
    return out


# -- the parts ---------------------------------------------------------------------------
def _start_collector() -> tuple[subprocess.Popen, int, int]:
    http, query = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "SIGHTLINE_COLLECTOR_TOKEN"}
    process = subprocess.Popen(
        [sys.executable, "-m", "sightline.deploy.cli", "collector", "run",
         "--otlp-grpc", f"127.0.0.1:{free_port()}", "--otlp-http", f"127.0.0.1:{http}",
         "--zipkin", f"127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{query}", "--log-level", "WARNING"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return process, http, query


def _post(port: int, request: ExportMetricsServiceRequest) -> None:
    post = urllib.request.Request(f"http://127.0.0.1:{port}/v1/metrics", data=request.SerializeToString(),
                                  headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(post, timeout=10) as response:
        assert response.status == 200


def _query(port: int, query: str, at: float) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query, "time": f"{at:.3f}"})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _scalar(port: int, query: str, at: float) -> float | None:
    result = _query(port, query, at)
    return float(result[0]["value"][1]) if result else None


def _export_round(rng: np.random.Generator, now: float, raw: dict) -> ExportMetricsServiceRequest:
    """One export of every GPU's per-SM points; one ResourceMetrics (engine process) per GPU."""
    request = ExportMetricsServiceRequest()
    for gpu in range(GPUS):
        rm = request.resource_metrics.add()
        rm.resource.attributes.extend(otlp_attrs({sc.RESOURCE_SERVICE_NAME: sc.SERVICE_NAME_ENGINE,
                                                  "host.name": f"node-{gpu // 2}",
                                                  "service.instance.id": f"engine-gpu{gpu}"}))
        metric = rm.scope_metrics.add().metrics.add()
        metric.name, metric.unit = sc.METRIC_CTA_DURATION, sc.METRIC_CTA_DURATION_UNIT
        metric.exponential_histogram.aggregation_temporality = 1  # DELTA
        for sm in range(SMS):
            for k, kernel in enumerate(KERNELS):
                scale = 3.0 if sm == 3 else 1.0  # one slow SM per GPU
                values = (20e-6 * (k + 1) * scale * rng.lognormal(0.0, 0.3, 40)).tolist()
                raw.setdefault((f"engine-gpu{gpu}:0", str(sm), kernel), []).extend(values)
                metric.exponential_histogram.data_points.append(otlp_cta_point(0, sm, kernel, values, now))
    return request


def test_three_replicas_routed_by_resource_equal_one(tmp_path):
    collectors = [_start_collector() for _ in range(4)]  # 3 replicas + the single one
    replicas, single = collectors[:3], collectors[3]
    prom_port = free_port()
    targets = lambda group: ", ".join(f"'127.0.0.1:{query}'" for _, _, query in group)  # noqa: E731
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n"
        f"  - {{job_name: replicas, static_configs: [{{targets: [{targets(replicas)}]}}]}}\n"
        f"  - {{job_name: single, static_configs: [{{targets: [{targets([single])}]}}]}}\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for process, _, query in collectors:
            wait_for_collector(f"http://127.0.0.1:{query}", process)
        wait_for_http(f"http://127.0.0.1:{prom_port}/-/ready", 60, prom)

        rng = np.random.default_rng(7)
        raw: dict[tuple[str, str, str], list[float]] = {}
        # Ring points from stable replica names (the exporter hashes its backends' hostnames),
        # not from the free ports: the split is the same on every run (2 GPUs per replica).
        port_of = {f"replica-{i}": http for i, (_, http, _) in enumerate(replicas)}
        endpoints = list(port_of)
        routed_gpus: dict[str, set[str]] = {}
        for _ in range(ROUNDS):
            request = _export_round(rng, time.time(), raw)
            _post(single[1], request)
            for endpoint, part in route_by_resource(request, endpoints).items():
                _post(port_of[endpoint], part)
                routed_gpus.setdefault(endpoint, set()).update(
                    kv.value.string_value for rm in part.resource_metrics for kv in rm.resource.attributes
                    if kv.key == "service.instance.id")
        assert len(routed_gpus) == 3, f"the ring left a replica without data: {routed_gpus}"
        assert sum(map(len, routed_gpus.values())) == GPUS  # each GPU on exactly one replica

        # Wait until Prometheus has scraped everything from all four.
        total = sum(map(len, raw.values()))
        deadline = time.monotonic() + 30
        while True:
            at = time.time()
            got = [_scalar(prom_port, f'sum({sc.COLLECTOR_GPU_CTA_DURATION_SECONDS}_count{{job="{job}"}})', at)
                   for job in ("replicas", "single")]
            gauges = [_scalar(prom_port, f'count({P99}{{job="{job}"}})', at) for job in ("replicas", "single")]
            if got == [total, total] and gauges == [len(raw), len(raw)]:
                break
            assert time.monotonic() < deadline, f"Prometheus saw counts {got} and gauges {gauges}, want {total}"
            time.sleep(0.25)

        # Buckets: equal, every one of them (no series missing on either side).
        replicas_sum = f'sum by ({BY_GPU}, le) ({BUCKET}{{job="replicas"}})'
        single_sum = f'sum by ({BY_GPU}, le) ({BUCKET}{{job="single"}})'
        assert _query(prom_port, f"{replicas_sum} != {single_sum}", at) == []
        n_buckets = GPUS * len(KERNELS) * (len(sc.CTA_BUCKETS_S) + 1)
        assert _scalar(prom_port, f"count({replicas_sum} == {single_sum})", at) == n_buckets
        assert _scalar(prom_port, f"count({replicas_sum})", at) == _scalar(prom_port, f"count({single_sum})", at) == n_buckets
        assert _scalar(prom_port, f'count(count by (instance) ({BUCKET}{{job="replicas"}}))', at) == 3

        # P99 gauges: each (gpu, sm, kernel) on one replica only, equal to the single's within the error.
        error = relative_error(6)
        assert _query(prom_port, f'count by ({BY}) ({P99}{{job="replicas"}}) > 1', at) == []
        replicas_p99 = f'max by ({BY}) ({P99}{{job="replicas"}})'
        single_p99 = f'max by ({BY}) ({P99}{{job="single"}})'
        assert _query(prom_port, f"abs({replicas_p99} - {single_p99}) > {error} * {single_p99}", at) == []
        assert _scalar(prom_port, f"count({replicas_p99} - {single_p99})", at) == len(raw)
        # ... and both within the error of the exact P99 of the values sent.
        for row in _query(prom_port, replicas_p99, at):
            m = row["metric"]
            exact = exact_quantile(raw[(m["gpu"], m["sm"], m["kernel"])], 0.99)
            assert abs(float(row["value"][1]) - exact) <= error * exact, (m, row["value"][1], exact)
    finally:
        prom.terminate()
        for process, _, _ in collectors:
            process.send_signal(signal.SIGTERM)
        for process, _, _ in collectors:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        prom.wait(30)
