"""Real collectors and API servers on free loopback ports, and the clients the tests drive them with."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager

import numpy as np
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from sightline.collector.api import add_api_routes
from sightline.collector import compiled
from sightline.collector.app import Collector
from sightline.collector.config import CollectorConfig
from sightline.instrumentation import semconv as sc
from tests.support import COLLECTOR_READY_TIMEOUT_S, free_port, wait_for_collector


class RunningCollector:
    """A real Collector on free loopback ports, its asyncio loop on a background thread."""

    def __init__(self, sink=None, aggregation=None, **overrides) -> None:
        # port 0: the collector binds and reports its ports, so nothing can take them first
        fields = {f"{name}_address": "127.0.0.1:0" for name in ("otlp_grpc", "otlp_http", "zipkin", "http")}
        # a token in the developer's environment must not switch auth on in tests
        fields["auth_token_env"] = "SIGHTLINE_TEST_TOKEN_NEVER_SET"
        fields.update(overrides)
        self.config = CollectorConfig(**fields)
        self.loop = asyncio.new_event_loop()
        self.collector = Collector(self.config, aggregation, sink=sink)
        self.ports = self.loop.run_until_complete(self.collector.start())
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.summary = None
        # what /readyz waits for: tests time and load the compiled paths, not the Python ones
        assert compiled.wait(COLLECTOR_READY_TIMEOUT_S), compiled.state().reason

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.otlp_http}"

    @property
    def zipkin_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.zipkin}/api/v2/spans"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.ports.otlp_grpc}"

    @property
    def query_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return scrape(self.query_url + "/metrics")

    def received(self, receiver: str, what: str = "spans") -> float:
        name = sc.COLLECTOR_SPANS_RECEIVED_TOTAL if what == "spans" else sc.COLLECTOR_DATAPOINTS_RECEIVED_TOTAL
        return self.metrics()[(name + "_total", (("receiver", receiver),))]

    def rejected(self, receiver: str, reason: str) -> float:
        return self.metrics()[(sc.COLLECTOR_REJECTED_TOTAL + "_total",
                               (("reason", reason), ("receiver", receiver)))]

    def dropped(self, reason: str) -> float:
        return self.metrics()[(sc.COLLECTOR_DROPPED_TOTAL + "_total", (("reason", reason),))]

    def idle(self) -> None:
        assert self.collector.pipeline.wait_idle(30), "pipeline did not drain"

    def stop(self):
        if self.summary is None:
            future = asyncio.run_coroutine_threadsafe(self.collector.stop(), self.loop)
            self.summary = future.result(60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        return self.summary


@contextmanager
def running_collector(sink=None, aggregation=None, **overrides):
    running = RunningCollector(sink=sink, aggregation=aggregation, **overrides)
    try:
        yield running
    finally:
        running.stop()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted label pairs): value}."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def trace_request(n_spans: int, *, service: str = "bench", seed: int = 0,
                  attributes: int = 6) -> ExportTraceServiceRequest:
    """An export request of ``n_spans`` engine-like spans with distinct ids."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = sc.RESOURCE_SERVICE_NAME, service
    scope = rs.scope_spans.add()
    scope.scope.name = sc.INSTRUMENTATION_SCOPE
    for i in range(n_spans):
        span = scope.spans.add()
        span.trace_id = (seed * 1_000_003 + i // 4 + 1).to_bytes(16, "big")
        span.span_id = (seed * 1_000_003 + i + 1).to_bytes(8, "big")
        span.name = sc.SPAN_DECODE
        span.kind = trace_pb2.Span.SPAN_KIND_INTERNAL
        span.start_time_unix_nano = 1_700_000_000_000_000_000 + i * 1000
        span.end_time_unix_nano = span.start_time_unix_nano + 500_000
        for k in range(attributes):
            a = span.attributes.add()
            a.key, a.value.int_value = f"sightline.test.attr{k}", k
    return request


def fresh_copies(request: ExportTraceServiceRequest):
    """Endless encodings of ``request``, each with trace ids never sent before: the collector
    counts a span sent twice (a retry) once, so load that repeats a body must change ids."""
    encoded = request.SerializeToString()
    starts = []
    for rs in request.resource_spans:
        for scope in rs.scope_spans:
            for span in scope.spans:
                starts.append(encoded.find(b"\n\x10" + span.trace_id + b"\x12\x08" + span.span_id) + 2)
    assert min(starts) >= 2
    body = np.frombuffer(encoded, dtype=np.uint8).copy()
    where = np.asarray(starts)[:, None] + np.arange(8)  # the first 8 of 16 bytes of each trace id
    for k in itertools.count(1):
        body[where] = np.frombuffer(k.to_bytes(8, "big"), dtype=np.uint8)  # a trace stays one trace
        yield body.tobytes()


def post(url: str, body: bytes, headers: dict[str, str], timeout: float = 10.0):
    """POST; returns (status, headers, body) for 2xx and errors alike."""
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def sdk_tracer(exporter):
    """An SDK TracerProvider exporting through ``exporter`` (flush with .shutdown())."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({sc.RESOURCE_SERVICE_NAME: "test-sdk"}))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=128))
    return provider


def emit_spans(provider, n: int) -> None:
    tracer = provider.get_tracer("sightline-test")
    for i in range(n // 2):
        with tracer.start_as_current_span("parent", attributes={"i": i}):
            with tracer.start_as_current_span("child"):
                pass
    provider.shutdown()  # flushes; raises nothing, so the counts below are the check


class ApiServer:
    """The API on a real aiohttp server on a free loopback port (own thread and loop)."""

    def __init__(self, aggregator) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(aggregator,), daemon=True)
        self.thread.start()
        assert self._ready.wait(10)

    def _run(self, aggregator) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        add_api_routes(app, aggregator)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class GatedAggregator:
    """The real aggregator behind a gate: closing it stalls the pipeline's worker."""

    def __init__(self) -> None:
        self.inner = None
        self.gate = threading.Event()
        self.gate.set()

    def consume_traces(self, request, encoded=None) -> int:
        self.gate.wait(30)
        return self.inner.consume_traces(request, encoded)

    def consume_metrics(self, request) -> int:
        self.gate.wait(30)
        return self.inner.consume_metrics(request)


def collector_process(tmp_path, *extra):
    """``sightline collector run`` as a process (torch and triton unimportable) on free ports:
    (process, ports, summary file path)."""
    ports = {name: free_port() for name in ("grpc", "http", "zipkin", "query")}
    summary = tmp_path / "summary.json"
    # torch and triton made unimportable: the collector must run on a machine without them.
    command = [sys.executable, "-c", "import sys; sys.modules['torch'] = sys.modules['triton'] = None; "
               "from sightline.deploy.cli import main; sys.exit(main())",
               "collector", "run", "--otlp-grpc", f"127.0.0.1:{ports['grpc']}",
               "--otlp-http", f"127.0.0.1:{ports['http']}", "--zipkin", f"127.0.0.1:{ports['zipkin']}",
               "--http", f"127.0.0.1:{ports['query']}", "--summary-file", str(summary),
               "--log-level", "WARNING", *extra]
    env = {k: v for k, v in os.environ.items() if k != "SIGHTLINE_COLLECTOR_TOKEN"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for_collector(f"http://127.0.0.1:{ports['query']}", process)
    return process, ports, summary
