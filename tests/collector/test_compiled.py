"""The byte walks compile off the loop and are exact before they are compiled.

- every compiled function's Python path gives what the compiled code gives, on valid,
  truncated, hostile and random bodies (what a request meets before the compile is done);
- a real collector started on an empty numba cache answers /healthz at once, says on
  /readyz why it is not ready, and accepts and counts real OTLP exports (gRPC and HTTP)
  sent before it is ready.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sightline.collector import compiled, request_shape, span_ids
from sightline.instrumentation import semconv as sc
from tests.collector.servers import scrape
from tests.collector.random_requests import random_metrics as _metrics, random_traces as _traces
from tests.support import free_port, get_json


@pytest.fixture(scope="module", autouse=True)
def _warm():
    compiled.warm()


def _bodies(rng, n: int) -> list[tuple[bytes, int]]:
    """(body, signal): valid requests, each also truncated and with a byte flipped; random bytes."""
    bodies = []
    for _ in range(n):
        signal_ = int(rng.integers(0, 2))
        request, _ = (_traces if signal_ == 0 else _metrics)(rng)
        spans = [s for rs in getattr(request, "resource_spans", ()) for ss in rs.scope_spans for s in ss.spans]
        for span in spans:
            span.trace_id = rng.integers(1, 256, 16, dtype=np.uint8).tobytes()
            span.span_id = rng.integers(1, 256, 8, dtype=np.uint8).tobytes()
        if spans and rng.random() < 0.5:  # one bad id: all zeros, or too short
            bad = spans[int(rng.integers(0, len(spans)))]
            if rng.random() < 0.5:
                bad.trace_id = bytes(16)
            else:
                bad.span_id = bad.span_id[:7]
        body = request.SerializeToString()
        bodies.append((body, signal_))
        if body:
            cut = int(rng.integers(0, len(body)))
            bodies.append((body[:cut], signal_))
            flipped = bytearray(body)
            flipped[cut] ^= int(rng.integers(1, 256))
            bodies.append((bytes(flipped), signal_))
    bodies += [(rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes(), 0) for _ in range(n)]
    return bodies


def test_every_compiled_function_is_registered_and_compiled():
    names = {f.__name__ for f in compiled._registry}
    assert names == {"_walk", "_walk_ids", "_fingerprint_rows", "_lookup", "_remember"}
    assert all(f.compiled for f in compiled._registry) and compiled.state().ready


def test_the_python_paths_walk_requests_exactly_as_the_compiled_ones():
    rng = np.random.default_rng(7)
    bodies = _bodies(rng, 60)
    statuses = set()
    for body, signal_ in bodies:
        buf = np.frombuffer(body, dtype=np.uint8)
        caps = np.full(6, np.iinfo(np.int64).max, dtype=np.int64)
        if rng.random() < 0.3:
            caps[:] = rng.integers(0, 6, 6)  # the walk stops at a cap
        counts = [np.zeros(6, dtype=np.int64) for _ in range(2)]
        results = [request_shape._walk(buf, signal_, counts[0], caps),
                   request_shape._walk.python(buf, signal_, counts[1], caps)]
        assert results[0] == results[1] and (counts[0] == counts[1]).all(), body.hex()
        statuses.add(results[0])
        if signal_ == 0:
            out = [np.zeros((len(body) // 30 + 1, 3), dtype=np.uint64) for _ in range(2)]
            n = [span_ids._walk_ids(buf, out[0]), span_ids._walk_ids.python(buf, out[1])]
            assert n[0] == n[1] and (out[0][:max(n[0], 0)] == out[1][:max(n[1], 0)]).all(), body.hex()
            statuses.add(("ids", np.sign(n[0])))
    assert statuses >= {0, -1, ("ids", 1), ("ids", -1)}  # read, refused, ids read and refused


def test_the_python_paths_fingerprint_and_look_up_exactly_as_the_compiled_ones():
    rng = np.random.default_rng(11)
    words = rng.integers(0, 2**64, (500, 3), dtype=np.uint64, endpoint=False)
    words[::7] = words[::5][:len(words[::7])]  # repeats within the request
    fp = [np.empty(len(words), dtype=np.uint64) for _ in range(2)]
    span_ids._fingerprint_rows(words, fp[0])
    span_ids._fingerprint_rows.python(words, fp[1])
    assert (fp[0] == fp[1]).all()
    tables = [np.zeros((64, 4), dtype=np.uint64) for _ in range(2)]  # 256 spans: it forgets
    shift, salt = np.uint64(64 - 6), np.uint64(int(rng.integers(0, 2**63)) * 2 + 1)
    scratch_shift = np.uint64(65 - 2048 .bit_length())
    for chunk in np.array_split(fp[0], 5):
        seen = [np.empty(len(chunk), dtype=np.bool_) for _ in range(2)]
        repeats = [span_ids._lookup(tables[0], shift, chunk, np.zeros(2048, np.uint64), scratch_shift, salt, seen[0]),
                   span_ids._lookup.python(tables[1], shift, chunk, np.zeros(2048, np.uint64), scratch_shift, salt,
                                           seen[1])]
        assert repeats[0] == repeats[1] and (seen[0] == seen[1]).all()
        span_ids._remember(tables[0], shift, chunk)
        span_ids._remember.python(tables[1], shift, chunk)
        assert (tables[0] == tables[1]).all()


def _spans(n: int):
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({sc.RESOURCE_SERVICE_NAME: "cold-start"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("sightline-test")
    for i in range(n):
        with tracer.start_as_current_span("request", attributes={"i": i}):
            pass
    provider.shutdown()
    return memory.get_finished_spans()


def test_a_collector_on_a_cold_cache_is_live_at_once_and_serves_exports_before_it_is_ready(tmp_path):
    ports = {name: free_port() for name in ("grpc", "http", "zipkin", "query")}
    query = f"http://127.0.0.1:{ports['query']}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SIGHTLINE_COLLECTOR")},
           "NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # empty: every walk compiles in this process
    began = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "sightline.deploy.cli", "collector", "run", "--log-level", "WARNING",
         "--otlp-grpc", f"127.0.0.1:{ports['grpc']}", "--otlp-http", f"127.0.0.1:{ports['http']}",
         "--zipkin", f"127.0.0.1:{ports['zipkin']}", "--http", f"127.0.0.1:{ports['query']}",
         "--summary-file", str(tmp_path / "summary.json")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() - began < 10, "/healthz did not answer within 10 s of the start"
            try:
                if get_json(query + "/healthz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        status, body = get_json(query + "/readyz")
        assert status == 503 and "compiling the byte walks" in body["reason"], body

        spans = _spans(6)
        grpc = GrpcSpanExporter(endpoint=f"127.0.0.1:{ports['grpc']}", insecure=True, timeout=20)
        http = HttpSpanExporter(endpoint=f"http://127.0.0.1:{ports['http']}/v1/traces", timeout=20)
        assert grpc.export(spans[:4]) is SpanExportResult.SUCCESS
        assert http.export(spans[4:]) is SpanExportResult.SUCCESS
        grpc.shutdown()
        http.shutdown()
        assert get_json(query + "/readyz")[0] == 503, "ready before the exports: they did not test the Python paths"
        samples = scrape(query + "/metrics")
        received = sc.COLLECTOR_SPANS_RECEIVED_TOTAL + "_total"
        assert samples[(received, (("receiver", "otlp_grpc"),))] == 4
        assert samples[(received, (("receiver", "otlp_http"),))] == 2
        # the same spans again: recognised as repeats by the window, on the Python path too
        assert GrpcSpanExporter(endpoint=f"127.0.0.1:{ports['grpc']}", insecure=True,
                                timeout=20).export(spans[:4]) is SpanExportResult.SUCCESS
        assert scrape(query + "/metrics")[(sc.COLLECTOR_DROPPED_TOTAL + "_total", (("reason", "duplicate"),))] == 4
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0].decode()
    assert process.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["spans_acknowledged"], summary["spans_aggregated"], summary["spans_duplicate"],
            summary["dropped"]) == (10, 6, 4, 0), summary
