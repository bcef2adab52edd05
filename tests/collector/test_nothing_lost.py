"""Nothing acknowledged is lost uncounted, and nothing absurd is added to a series.

Real collectors on free ports, real clients: Zipkin traces recorded by py-zipkin and shaped
as Brave reports them (the SERVER half of an RPC shares its CLIENT half's id, marked
``shared``), posted with aiohttp; the same spans retried; request and kernel spans with
physically impossible values; and a collector process stopped by SIGTERM while its
aggregator is inside a batch. Counts are read from /metrics and the exit summary, which
must agree: acknowledged = processed + duplicate + dropped, exactly.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time

import aiohttp
from py_zipkin.encoding import Encoding
from py_zipkin.transport import BaseTransportHandler
from py_zipkin.zipkin import ZipkinAttrs, zipkin_client_span, zipkin_server_span, zipkin_span

from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import otlp_cta_point, otlp_metrics, otlp_span, otlp_traces
from tests.collector.servers import collector_process, post, running_collector, trace_request

PB = {"Content-Type": "application/x-protobuf"}


# -- Zipkin: both halves of an RPC ----------------------------------------------------------------
class _Collect(BaseTransportHandler):
    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict] = []

    def get_max_payload_bytes(self):
        return None

    def send(self, payload) -> None:
        self.spans.extend(json.loads(payload))


def _brave_shaped_traces(requests: int) -> list[dict]:
    """``requests`` traces of frontend -> backend -> db recorded by py-zipkin, 7 spans each: each
    RPC is a CLIENT span and a SERVER span with the same id, the SERVER one marked ``shared``
    as Brave (and Zipkin's other tracers) report it."""
    transport = _Collect()

    def rpc(client, service: str, name: str):
        a = client.zipkin_attrs
        return zipkin_server_span(service_name=service, span_name=name, transport_handler=transport,
                                  zipkin_attrs=ZipkinAttrs(a.trace_id, a.span_id, a.parent_span_id, a.flags, True),
                                  encoding=Encoding.V2_JSON)

    for _ in range(requests):
        with zipkin_server_span(service_name="frontend", span_name="get /checkout", transport_handler=transport,
                                sample_rate=100.0, encoding=Encoding.V2_JSON, use_128bit_trace_id=True):
            with zipkin_client_span(service_name="frontend", span_name="get /api/cart") as client:
                with rpc(client, "backend", "get /api/cart"):
                    with zipkin_span(service_name="backend", span_name="validate"):
                        pass
                    with zipkin_span(service_name="backend", span_name="price"):
                        pass
                    with zipkin_client_span(service_name="backend", span_name="select cart") as db:
                        with rpc(db, "db", "select cart"):
                            pass
    ids = {(s["traceId"], s["id"]) for s in transport.spans if s.get("kind") == "CLIENT"}
    for span in transport.spans:
        if span.get("kind") == "SERVER" and (span["traceId"], span["id"]) in ids:
            span["shared"] = True
    return transport.spans


async def _post_with_aiohttp(url: str, spans: list[dict]) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=spans) as response:
            return response.status


def _trace_span_count(col, trace_id: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{col.query_url}/api/v1/traces/{trace_id}", timeout=10) as response:
        return len(json.loads(response.read())["spans"])


def test_zipkin_shared_spans_are_kept_as_the_server_half():
    """Before: the SERVER half of every RPC was dropped as a duplicate of its CLIENT half (378 of
    1,041 spans of one public fixture, 45 of 175 of another)."""
    spans = _brave_shaped_traces(25)
    assert len(spans) == 175 and sum(1 for s in spans if s.get("shared")) == 50
    with running_collector() as col:
        status = asyncio.run(_post_with_aiohttp(col.zipkin_url, spans))
        col.idle()
        assert status == 202
        assert col.received(sc.RECEIVER_ZIPKIN) == 175 and col.dropped("duplicate") == 0
        assert col.collector.aggregator.spans_seen == 175
        trace_ids = sorted({s["traceId"] for s in spans})
        assert [_trace_span_count(col, t) for t in trace_ids] == [7] * 25
        # a retry of the same spans is still recognised, halves and all
        assert asyncio.run(_post_with_aiohttp(col.zipkin_url, spans)) == 202
        col.idle()
        assert col.received(sc.RECEIVER_ZIPKIN) == 350 and col.dropped("duplicate") == 175
        assert col.collector.aggregator.spans_seen == 175


def test_a_client_half_named_like_a_request_is_not_a_second_request():
    """Keeping both halves must not count a request twice: the CLIENT half is the caller's view."""
    start_us = int((time.time() - 1) * 1e6)
    half = {"traceId": "5" * 32, "id": "6" * 16, "name": sc.SPAN_HTTP_COMPLETIONS.lower(), "timestamp": start_us,
            "duration": 500_000, "tags": {sc.GEN_AI_REQUEST_MODEL: "m"}}
    halves = [{**half, "kind": "CLIENT", "localEndpoint": {"serviceName": "gateway"}},
              {**half, "kind": "SERVER", "shared": True, "localEndpoint": {"serviceName": "engine"}}]
    with running_collector() as col:
        assert asyncio.run(_post_with_aiohttp(col.zipkin_url, halves)) == 202
        col.idle()
        counts = [v for (name, labels), v in col.metrics().items()
                  if name == sc.COLLECTOR_REQUEST_E2E_SECONDS + "_count"]
        root = col.collector.aggregator.with_store(lambda store: store._traces[b"\x55" * 16].request_root)
        assert root.record().kind == 2  # the SERVER half is the request's root
    assert counts == [1.0]


# -- one meaning of "acknowledged" -----------------------------------------------------------------
def test_acknowledged_means_the_same_on_metrics_and_in_the_exit_summary():
    """Before: the same 3 spans sent twice showed spans_received_total 6 on /metrics and
    spans_acknowledged 3 in the exit summary."""
    body = trace_request(3, seed=17).SerializeToString()
    with running_collector() as col:
        assert [post(col.http_url + "/v1/traces", body, PB)[0] for _ in range(2)] == [200, 200]
        col.idle()
        received = col.received(sc.RECEIVER_OTLP_HTTP)
        summary = col.stop()
    assert received == summary.spans_acknowledged == 6
    assert summary.acknowledged_by_receiver == {sc.RECEIVER_OTLP_HTTP: 6}
    assert (summary.spans_processed, summary.spans_duplicate, summary.dropped) == (3, 3, 0)


# -- SIGTERM while a batch is being aggregated -----------------------------------------------------
def test_sigterm_mid_batch_counts_the_batch_in_flight(tmp_path):
    """Before: a batch inside the aggregator at shutdown was lost uncounted (1,000 acknowledged,
    processed 0, dropped{shutdown_timeout} 0)."""
    process, ports, summary_path = collector_process(tmp_path, "--shutdown-timeout-s", "0.2")
    try:
        now = time.time()
        # 20,000 CTA points: seconds of aggregation, far past the 0.2 s the drain may take
        points = [otlp_cta_point(str(g), str(sm), f"k{k}", [1e-5 * (1 + sm % 7)], now)
                  for g in range(8) for k in range(19) for sm in range(132)][:20_000]
        body = otlp_metrics(points).SerializeToString()
        status, _, _ = post(f"http://127.0.0.1:{ports['http']}/v1/metrics", body, PB, timeout=60)
        assert status == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 1  # not drained cleanly: said so in the exit status
    finally:
        if process.poll() is None:
            process.kill()
    summary = json.loads(summary_path.read_text())
    assert summary["data_points_acknowledged"] == 20_000
    assert summary["data_points_processed"] + summary["dropped"] == 20_000
    assert summary["dropped"] == 20_000 and summary["drained_cleanly"] is False


# -- values past physical bounds ------------------------------------------------------------------
def test_values_past_physical_bounds_are_refused_and_counted():
    """Before: e2e_s=1e308 sent twice made the e2e _sum +Inf for good; a kernel span ending at
    2**64-1 added 1.8e10 s; an end time of 2**63-1 was taken."""
    now = time.time()

    def request_span(i: int, e2e: float):
        return otlp_span(sc.SPAN_HTTP_COMPLETIONS, i.to_bytes(16, "big"), i.to_bytes(8, "big"), now - 1, now - 0.5,
                         {sc.GEN_AI_REQUEST_MODEL: "m", sc.REQUEST_E2E_S: e2e}, kind=2)

    def kernel_span(i: int, start_ns: int, end_ns: int):
        span = otlp_span(sc.SPAN_KERNEL_PREFIX + "fa2", i.to_bytes(16, "big"), i.to_bytes(8, "big"), 0, 0,
                         {sc.HW_GPU_ID: "0", sc.CUDA_KERNEL_NAME: "fa2"})
        span.start_time_unix_nano, span.end_time_unix_nano = start_ns, end_ns
        return span

    now_ns = int(now * 1e9)
    absurd = [request_span(1, 1e308), request_span(2, 1e308), request_span(3, -1.0), request_span(4, math.nan),
              request_span(5, 2 * 86_400.0),
              kernel_span(6, now_ns - 1000, 2**64 - 1), kernel_span(7, 2**63 - 1000, 2**63 - 1),
              kernel_span(8, now_ns - 2 * 86_400 * 10**9, now_ns), kernel_span(9, 0, 10**9)]
    sane = [request_span(10, 0.25), kernel_span(11, now_ns - 150_000, now_ns)]
    with running_collector() as col:
        assert post(col.http_url + "/v1/traces", otlp_traces(absurd + sane).SerializeToString(), PB)[0] == 200
        col.idle()
        metrics = col.metrics()
    refused = metrics[(sc.COLLECTOR_AGGREGATOR_DROPPED_TOTAL + "_total", (("reason", "span_out_of_range"),))]
    assert refused == 9
    e2e = {name: value for (name, labels), value in metrics.items()
           if name.startswith(sc.COLLECTOR_REQUEST_E2E_SECONDS + "_") and name[-4:] in ("_sum", "ount")}
    assert e2e == {sc.COLLECTOR_REQUEST_E2E_SECONDS + "_sum": 0.25, sc.COLLECTOR_REQUEST_E2E_SECONDS + "_count": 1}
    kernel_sum = [value for (name, labels), value in metrics.items()
                  if name == sc.COLLECTOR_KERNEL_DURATION_SECONDS + "_sum"]
    assert kernel_sum == [150e-6]
