"""Work in proportion to the bytes: every export request's cost is bounded before it is done.

Real collectors on free ports take hostile bodies through their real receivers (HTTP via
urllib and aiohttp clients, gRPC through grpcio): millions of empty messages, compression
bombs of every ratio, JSON of empty containers, SM ids by the hundred thousand. Each is
refused with its protocol's error before it is parsed (or costs in proportion to its
size), is counted by reason on /metrics, and /healthz keeps answering meanwhile.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from google.protobuf.internal.encoder import _VarintBytes
from google.rpc import status_pb2

from sightline.collector.otlp_http import to_otlp_json
from sightline.collector.request_shape import json_values
from sightline.collector.sm_blocks import SmBlock
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import otlp_cta_point, otlp_metrics
from tests.collector.servers import (GatedAggregator, collector_process, fresh_copies, post, running_collector,
                                     scrape, trace_request)

PB = {"Content-Type": "application/x-protobuf"}
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def test_many_sm_ids_grow_a_block_geometrically(monkeypatch):
    """100,000 SM ids on one GPU made each batch 14x slower than the first: the rows grew 16
    at a time, each growth copying the whole block, and every merge touched every row."""
    grows = []
    real_grow = SmBlock._grow
    monkeypatch.setattr(SmBlock, "_grow", lambda self, cap: (grows.append(cap), real_grow(self, cap)))
    bincount_sizes = []
    real_bincount = np.bincount

    def bincount(*args, **kwargs):
        out = real_bincount(*args, **kwargs)
        bincount_sizes.append(out.size)
        return out

    monkeypatch.setattr(np, "bincount", bincount)
    now = time.time()
    with running_collector() as col:
        for batch in range(20):
            points = [otlp_cta_point("0", str(batch * 500 + sm), "k", [1e-5, 2e-5], now) for sm in range(500)]
            status, _, _ = post(col.http_url + "/v1/metrics", otlp_metrics(points).SerializeToString(), PB)
            assert status == 200
        col.idle()
        block = col.collector.aggregator.sm._gpus[next(iter(col.collector.aggregator.sm._gpus))].blocks["k"]
        assert len(block.sms) == 10_000
    # before: 625 growths (16 rows each); geometric: ~17
    assert len(grows) <= 25, len(grows)
    # each merge adds the buckets of the 500 rows it touches, not of all rows so far
    assert max(bincount_sizes) <= 500 * 128, max(bincount_sizes)


# -- empty messages by the million: refused before they are parsed ------------------------------
def _length_delimited(tag: int, content: bytes) -> bytes:
    return bytes([tag]) + _VarintBytes(len(content)) + content


def _empty_resources(n: int) -> bytes:
    return b"\x0a\x00" * n  # ExportTraceServiceRequest.resource_spans: n empty ResourceSpans


def _empty_metrics(n: int) -> bytes:
    scope = _length_delimited(0x12, b"\x12\x00" * n)  # ScopeMetrics.metrics: n empty Metrics
    return _length_delimited(0x0A, scope)


def _empty_spans(n: int) -> bytes:
    scope = _length_delimited(0x12, b"\x12\x00" * n)  # ScopeSpans.spans: n empty Spans
    return _length_delimited(0x0A, scope)


def _bare_attributes(n: int) -> bytes:
    span = _length_delimited(0x12, b"\x4a\x00" * n)  # one Span with n empty attributes
    return _length_delimited(0x0A, _length_delimited(0x12, span))


class _Prober:
    """/healthz every 20 ms from a thread while a hostile request is served: the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self._done = url + "/healthz", 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            started = time.monotonic()
            with urllib.request.urlopen(self.url, timeout=30) as response:
                assert response.status == 200
            self.slowest = max(self.slowest, time.monotonic() - started)
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(30)


class _CollectorProcess:
    """``sightline collector run`` as a process: what one request costs it is measured alone."""

    def __init__(self, tmp_path) -> None:
        self.process, self.ports, _ = collector_process(tmp_path)
        self.http_url = f"http://127.0.0.1:{self.ports['http']}"
        self.zipkin_url = f"http://127.0.0.1:{self.ports['zipkin']}"
        self.query_url = f"http://127.0.0.1:{self.ports['query']}"
        self.grpc_target = f"127.0.0.1:{self.ports['grpc']}"

    def rejected(self, receiver: str, reason: str) -> float:
        return scrape(self.query_url + "/metrics")[
            (sc.COLLECTOR_REJECTED_TOTAL + "_total", (("reason", reason), ("receiver", receiver)))]

    def rss_mib(self) -> float:
        with open(f"/proc/{self.process.pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def cpu_s(self, thread: int | None = None) -> float:
        """CPU seconds of the process, or of one of its threads (the event loop runs on the
        main thread, whose id is the process id)."""
        path = f"/proc/{self.process.pid}" + (f"/task/{thread}" if thread is not None else "")
        with open(f"{path}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture(scope="module")
def col(tmp_path_factory):
    running = _CollectorProcess(tmp_path_factory.mktemp("collector"))
    try:
        yield running
    finally:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(30)
        except subprocess.TimeoutExpired:
            running.process.kill()


def _too_large(col, receiver: str) -> float:
    return col.rejected(receiver, "too_large")


class _Cost:
    """The collector's CPU seconds and peak RSS growth (sampled every 5 ms) over a block."""

    def __init__(self, col) -> None:
        self.col, self.peak_mib, self.cpu_s = col, 0.0, 0.0
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak_mib = max(self.peak_mib, self.col.rss_mib() - self._rss0)
            time.sleep(0.005)

    def __enter__(self):
        self._rss0, self._cpu0 = self.col.rss_mib(), self.col.cpu_s()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(5)
        self.cpu_s = self.col.cpu_s() - self._cpu0


@pytest.mark.parametrize("kind,body", [
    ("traces", _empty_resources(4_000_000)),  # 8 MB: 4.5-6.3 s and +1 GB before
    ("metrics", _empty_metrics(4_000_000)),
    ("traces", _empty_spans(4_000_000)),
    ("traces", _bare_attributes(4_000_000)),
], ids=["resources", "metrics", "spans", "attributes"])
def test_millions_of_empty_messages_are_413_before_parsing(col, kind, body):
    before = _too_large(col, "otlp_http")
    with _Prober(col.query_url) as prober, _Cost(col) as cost:
        status, _, response = post(col.http_url + f"/v1/{kind}", body, PB, timeout=60)
    assert status == 413, status
    assert "one request may hold" in status_pb2.Status.FromString(response).message
    assert _too_large(col, "otlp_http") == before + 1
    assert cost.cpu_s < 0.5, f"{cost.cpu_s:.2f} s of collector CPU"  # the walk stops at the cap
    assert cost.peak_mib < 64, f"RSS +{cost.peak_mib:.0f} MiB"  # the body itself: 8 MB
    assert prober.slowest < 0.5, f"/healthz took {prober.slowest:.2f} s"  # ms of work: the rest is the machine


def test_a_small_gzip_body_inflating_a_thousandfold_is_413(col):
    """32 KB of gzip held 16,000,000 empty ResourceSpans: 23 s with the event loop stalled."""
    body = gzip.compress(_empty_resources(4_000_000), 9)  # ~8 KB on the wire, 8 MB inflated
    assert len(body) < 16 * 1024
    before = _too_large(col, "otlp_http")
    with _Cost(col) as cost:
        status, _, response = post(col.http_url + "/v1/traces", body, {**PB, "Content-Encoding": "gzip"}, timeout=60)
    assert status == 413 and cost.cpu_s < 0.5 and cost.peak_mib < 64, (cost.cpu_s, cost.peak_mib)
    assert f"limit for a {len(body)}-byte body" in status_pb2.Status.FromString(response).message
    assert _too_large(col, "otlp_http") == before + 1


def test_grpc_refuses_empty_messages_by_the_million_with_resource_exhausted(col):
    """A gzip-compressed gRPC message is inflated by the receiver under the same ratio as an
    HTTP body: refused before the walk, let alone the parse."""
    before = _too_large(col, "otlp_grpc")
    with grpc.insecure_channel(col.grpc_target, compression=grpc.Compression.Gzip) as channel:
        export = channel.unary_unary(TRACE_EXPORT)
        with _Cost(col) as cost, pytest.raises(grpc.RpcError) as refused:
            export(_empty_resources(4_000_000), timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "-byte limit for a " in refused.value.details()
    assert _too_large(col, "otlp_grpc") == before + 1
    assert cost.cpu_s < 0.5 and cost.peak_mib < 64, (cost.cpu_s, cost.peak_mib)


@pytest.mark.parametrize("url,body", [
    ("/api/v2/spans", b"[" + b"{}," * 2_000_000 + b"{}]"),  # 8 MB of empty objects: +190 MB on json.loads
    ("/v1/traces", b'{"resourceSpans": [' + b"[]," * 2_000_000 + b"[]]}"),  # 2.5 s of json.loads
], ids=["zipkin", "otlp_json"])
def test_json_of_empty_containers_is_413_before_it_is_loaded(col, url, body):
    receiver = "zipkin" if "spans" in url else "otlp_http"
    before = _too_large(col, receiver)
    base = col.zipkin_url if receiver == "zipkin" else col.http_url
    with _Cost(col) as cost:
        status, _, _ = post(base + url, body, {"Content-Type": "application/json"}, timeout=60)
    assert status == 413 and cost.cpu_s < 0.5 and cost.peak_mib < 64, (cost.cpu_s, cost.peak_mib)
    assert _too_large(col, receiver) == before + 1


def test_large_json_bodies_are_parsed_off_the_event_loop(col):
    """OTLP/JSON parses at ~3 MB/s in Python: three bodies within the caps took the event loop
    (and /healthz) for over a second before; now the decoder threads parse them."""
    bodies = [json.dumps(to_otlp_json(trace_request(800, seed=31 + i, attributes=12))).encode() for i in range(3)]
    assert 40_000 < json_values(bodies[0]) < 49_152
    loop_cpu = col.cpu_s(col.process.pid)
    with _Cost(col) as cost:
        threads = [threading.Thread(target=post, args=(col.http_url + "/v1/traces", body,
                                                       {"Content-Type": "application/json"}, 60))
                   for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    loop_cpu = col.cpu_s(col.process.pid) - loop_cpu
    # the loop's share: reading the bodies, the id checks, the answers (the machine's load does
    # not change what ran on which thread)
    assert loop_cpu < 0.25 * cost.cpu_s, f"the event loop spent {loop_cpu:.2f} of {cost.cpu_s:.2f} CPU seconds"


def test_the_queue_charges_a_request_its_parsed_size():
    """Before: the queue charged the wire size, 32 MB for about 1 GB of parsed objects."""
    body = trace_request(2_000, seed=8, attributes=12).SerializeToString()  # ~0.8 MB, ~3 MB parsed
    sink = GatedAggregator()
    with running_collector(sink=sink, queue_max_bytes=4 * 1024 * 1024) as col:
        sink.inner = col.collector.aggregator
        fresh = fresh_copies(trace_request(2_000, seed=8, attributes=12))
        sink.gate.clear()
        try:
            assert post(col.http_url + "/v1/traces", next(fresh), PB)[0] == 200  # taken by the worker, gated
            deadline = time.monotonic() + 10
            while col.collector.pipeline.depth and time.monotonic() < deadline:
                time.sleep(0.01)
            assert post(col.http_url + "/v1/traces", next(fresh), PB)[0] == 200  # an empty queue takes any one
            charged = col.collector.pipeline.queued_bytes
            assert charged > 3 * len(body), (charged, len(body))
            status, headers, _ = post(col.http_url + "/v1/traces", next(fresh), PB)
            assert status == 429 and headers["Retry-After"] == "1"  # 2 x 0.8 MB on the wire would fit
        finally:
            sink.gate.set()
        col.idle()
