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
from tests.collector.test_aggregator import otlp_cta_point, otlp_metrics
from tests.collector.test_receivers import fresh_copies, post, running_collector, trace_request
from tests.collector.test_robustness import GatedAggregator

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


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def col():
    with running_collector() as running:
        yield running


def _too_large(col, receiver: str) -> float:
    return col.rejected(receiver, "too_large")


@pytest.mark.parametrize("signal,body", [
    ("traces", _empty_resources(4_000_000)),  # 8 MB: 4.5-6.3 s and +1 GB before
    ("metrics", _empty_metrics(4_000_000)),
    ("traces", _empty_spans(4_000_000)),
    ("traces", _bare_attributes(4_000_000)),
], ids=["resources", "metrics", "spans", "attributes"])
def test_millions_of_empty_messages_are_413_before_parsing(col, signal, body):
    before = _too_large(col, "otlp_http")
    peak = [_rss_mib()]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak.append(_rss_mib())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with _Prober(col.query_url) as prober:
        started = time.monotonic()
        status, _, response = post(col.http_url + f"/v1/{signal}", body, PB, timeout=60)
        took = time.monotonic() - started
    sampling.set()
    sampler.join(5)
    assert status == 413, status
    assert "one request may hold" in status_pb2.Status.FromString(response).message
    assert _too_large(col, "otlp_http") == before + 1
    assert took < 2.0, f"{took:.2f} s"  # the walk stops at the cap: ~10 ms of work after the upload
    assert prober.slowest < 0.5, f"/healthz took {prober.slowest:.2f} s"
    assert max(peak) - peak[0] < 64, f"RSS +{max(peak) - peak[0]:.0f} MiB"  # the body itself: 8 MB, twice


def test_a_small_gzip_body_inflating_a_thousandfold_is_413(col):
    """32 KB of gzip held 16,000,000 empty ResourceSpans: 23 s with the event loop stalled."""
    body = gzip.compress(_empty_resources(4_000_000), 9)  # ~8 KB on the wire, 8 MB inflated
    assert len(body) < 16 * 1024
    before = _too_large(col, "otlp_http")
    started = time.monotonic()
    status, _, response = post(col.http_url + "/v1/traces", body, {**PB, "Content-Encoding": "gzip"}, timeout=60)
    assert status == 413 and time.monotonic() - started < 2.0
    assert f"limit for a {len(body)}-byte body" in status_pb2.Status.FromString(response).message
    assert _too_large(col, "otlp_http") == before + 1


def test_grpc_refuses_empty_messages_by_the_million_with_resource_exhausted(col):
    """gRPC core inflates the message itself (no ratio to check): the walk refuses it."""
    before = _too_large(col, "otlp_grpc")
    with grpc.insecure_channel(col.grpc_target, compression=grpc.Compression.Gzip) as channel:
        export = channel.unary_unary(TRACE_EXPORT)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            export(_empty_resources(4_000_000), timeout=30)
        took = time.monotonic() - started
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4097 resources" in refused.value.details()
    assert _too_large(col, "otlp_grpc") == before + 1 and took < 3.0


@pytest.mark.parametrize("url,body", [
    ("/api/v2/spans", b"[" + b"{}," * 2_000_000 + b"{}]"),  # 8 MB of empty objects: +190 MB on json.loads
    ("/v1/traces", b'{"resourceSpans": [' + b"[]," * 2_000_000 + b"[]]}"),  # 2.5 s of json.loads
], ids=["zipkin", "otlp_json"])
def test_json_of_empty_containers_is_413_before_it_is_loaded(col, url, body):
    receiver = "zipkin" if "spans" in url else "otlp_http"
    before = _too_large(col, receiver)
    base = f"http://127.0.0.1:{col.ports.zipkin}" if receiver == "zipkin" else col.http_url
    started = time.monotonic()
    status, _, _ = post(base + url, body, {"Content-Type": "application/json"}, timeout=60)
    assert status == 413 and time.monotonic() - started < 2.0
    assert _too_large(col, receiver) == before + 1


def test_large_json_bodies_are_parsed_off_the_event_loop(col):
    """OTLP/JSON parses at ~3 MB/s in Python: three bodies within the caps kept the event loop
    (and /healthz) for a second before; on the decoder threads it stays answering."""
    document = to_otlp_json(trace_request(1_000, seed=31, attributes=12))
    body = json.dumps(document).encode()
    assert 40_000 < json_values(body) < 65_536
    with _Prober(col.query_url) as prober:
        threads = [threading.Thread(target=post, args=(col.http_url + "/v1/traces", body,
                                                       {"Content-Type": "application/json"}, 60))
                   for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert prober.slowest < 0.2, f"/healthz took {prober.slowest:.2f} s"


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
            charged = col.collector.pipeline._bytes
            assert charged > 3 * len(body), (charged, len(body))
            status, headers, _ = post(col.http_url + "/v1/traces", next(fresh), PB)
            assert status == 429 and headers["Retry-After"] == "1"  # 2 x 0.8 MB on the wire would fit
        finally:
            sink.gate.set()
        col.idle()
