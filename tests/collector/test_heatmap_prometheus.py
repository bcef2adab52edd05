"""The aggregator's exposition scraped by a real Prometheus (OpenMetrics, exemplar
storage on): series, histogram_quantile and exemplars come back as computed here."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry

from sightline.collector.exposition import metrics_page
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.exphist import relative_error
from tests.collector.otlp_builders import OPENMETRICS, otlp_cta_point, otlp_metrics, otlp_traces, request_span
from tests.support import free_port, wait_for_http

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus (scripts/setup.sh)")


def _serve(registry, agg) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body, content_type = metrics_page(registry, agg, OPENMETRICS)
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _query(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def test_real_prometheus_scrapes_quantiles_and_exemplars(tmp_path):
    from sightline.collector.aggregator import AggregationConfig, Aggregator

    now = time.time()  # Prometheus stores samples at scrape time; data must be "now"
    agg = Aggregator(AggregationConfig())
    e2e = [0.05, 0.15, 0.3, 0.3, 0.7, 1.5, 3.0, 6.0]
    agg.consume_traces(otlp_traces([
        request_span(bytes([i + 1]) * 16, bytes([i + 1]) * 8, v, v / 4) for i, v in enumerate(e2e)]))
    slow_trace = bytes([0xEE]) * 16
    agg.consume_metrics(otlp_metrics([
        otlp_cta_point(0, 3, "fa2", [20e-6] * 90 + [80e-6] * 10, now - 1, exemplar=(80e-6, slow_trace, b"\x0e" * 8)),
        otlp_cta_point(0, 4, "fa2", [20e-6] * 100, now - 1)]))
    registry = CollectorRegistry()
    registry.register(agg.prometheus_collector())
    server, target = _serve(registry, agg)
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: collector, static_configs: [{{targets: ['127.0.0.1:{target}']}}]}}]\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--enable-feature=exemplar-storage"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/-/ready", 60, prom)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            result = _query(port, "/api/v1/query", query=f"{sc.COLLECTOR_SM_CTA_P99_SECONDS}")["result"]
            if len(result) == 2:
                break
            time.sleep(0.5)
        p99 = {r["metric"]["sm"]: float(r["value"][1]) for r in result}
        assert p99["4"] == 20e-6  # all equal: exact
        assert abs(p99["3"] - 80e-6) / 80e-6 <= relative_error(6)
        ratio = _query(port, "/api/v1/query", query=sc.COLLECTOR_SM_HOTSPOT_RATIO)["result"]
        assert float(ratio[0]["value"][1]) == pytest.approx(p99["3"] / ((p99["3"] + p99["4"]) / 2))
        # Prometheus's own histogram_quantile over our classic buckets: rank 0.5 * 8 = 4 falls in
        # (0.25, 0.5] holding 2 of 4 -> 0.25 + 0.25 * (4 - 2) / 2 = 0.5
        q = _query(port, "/api/v1/query", query=f"histogram_quantile(0.5, sum by (le) "
                                                f"({sc.COLLECTOR_REQUEST_E2E_SECONDS}_bucket))")["result"]
        assert float(q[0]["value"][1]) == pytest.approx(0.5)
        hottest = _query(port, "/api/v1/query", query=sc.COLLECTOR_SM_HOTTEST)["result"]
        assert float(hottest[0]["value"][1]) == 3
        # the per-GPU histogram over all SMs (per-SM buckets are opt-in)
        total = _query(port, "/api/v1/query", query=f"{sc.COLLECTOR_GPU_CTA_DURATION_SECONDS}_count")["result"]
        assert float(total[0]["value"][1]) == 200
        exemplars = _query(port, "/api/v1/query_exemplars", query=f"{sc.COLLECTOR_GPU_CTA_DURATION_SECONDS}_bucket",
                           start=str(now - 600), end=str(time.time() + 60))
        labels = [e["labels"] for series in exemplars for e in series["exemplars"]]
        assert {sc.EXEMPLAR_TRACE_ID_LABEL: slow_trace.hex(), "span_id": "0e" * 8} in labels
    finally:
        prom.terminate()
        prom.wait(30)
        server.shutdown()
