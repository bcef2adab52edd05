"""One parse per received request: real OTel SDK exports through a real collector, parses counted.

Every protobuf parse in the process is counted by message type (the protobuf backend's
``FromString``, ``ParseFromString`` and ``MergeFromString``, wrapped on the class that
defines them). One export request through the gRPC and one through the HTTP exporter feeds
the span series (a request root, a step and a kernel span, each read by its handler) and the
trace store, which a query then indexes and reads back; each request must have been parsed
exactly once, and no span or part of a request parsed on its own. Attribute values are
decoded where they are read (``KeyValue``), so those are not request parses.
"""

from __future__ import annotations

import collections
import json
import threading
import urllib.request

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from sightline.instrumentation import semconv as sc
from tests.collector.servers import running_collector

_REQUEST = ExportTraceServiceRequest.DESCRIPTOR.full_name
_ATTRIBUTE = "opentelemetry.proto.common.v1.KeyValue"


@pytest.fixture
def parses(monkeypatch):
    """``Counter`` of parses by message full name, from now until the test ends."""
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()  # decoder threads and the pipeline worker parse too

    def count(cls) -> None:
        with lock:
            counts[cls.DESCRIPTOR.full_name] += 1

    for name in ("FromString", "ParseFromString", "MergeFromString"):
        owner = next(c for c in ExportTraceServiceRequest.__mro__ if name in vars(c))
        original = vars(owner)[name]
        if name == "FromString":
            def wrapped(cls, data, _original=original):
                count(cls)
                return _original.__get__(None, cls)(data)
            monkeypatch.setattr(owner, name, classmethod(wrapped))
        else:
            def wrapped(self, data, _original=original):
                count(type(self))
                return _original(self, data)
            monkeypatch.setattr(owner, name, wrapped)
    return counts


def _sdk_spans(trace_salt: int):
    """A request root, one engine step and one kernel span, made and ended by the OTel SDK."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind as OtelSpanKind

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({sc.RESOURCE_SERVICE_NAME: "decode-once",
                                                        sc.RESOURCE_SERVICE_INSTANCE_ID: f"node-{trace_salt}"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("sightline-test")
    with tracer.start_as_current_span(sc.SPAN_HTTP_COMPLETIONS, kind=OtelSpanKind.SERVER, attributes={
            sc.GEN_AI_REQUEST_MODEL: "tiny", sc.REQUEST_PRIORITY: 1, sc.REQUEST_TTFT_S: 0.02}):
        with tracer.start_as_current_span(sc.SPAN_ENGINE_STEP, attributes={
                sc.STEP_PREFILL_TOKENS: 16, sc.STEP_DECODE_TOKENS: 0}):
            with tracer.start_as_current_span(sc.SPAN_KERNEL_PREFIX + "fa2_prefill", attributes={
                    sc.CUDA_KERNEL_NAME: "fa2_prefill", sc.HW_GPU_ID: 0}):
                pass
    provider.shutdown()
    return memory.get_finished_spans()


def _exporter(kind: str, collector):
    if kind == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=collector.grpc_target, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=collector.http_url + "/v1/traces")


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_each_received_request_is_parsed_exactly_once(kind, parses):
    from opentelemetry.sdk.trace.export import SpanExportResult

    spans = _sdk_spans(1 if kind == "grpc" else 2)
    trace_id = format(spans[0].context.trace_id, "032x")
    with running_collector() as collector:
        aggregator = collector.collector.aggregator
        parses.clear()
        exporter = _exporter(kind, collector)
        assert exporter.export(spans) == SpanExportResult.SUCCESS  # one export request
        exporter.shutdown()
        collector.idle()
        # the series read the request: each handler took its span
        assert aggregator.spans_seen == 3
        assert aggregator.latency_window("ttft", ("tiny", "1")).count == 1
        assert aggregator.latency_window("step", "prefill").count == 1
        assert aggregator.latency_window("kernel", ("0", "fa2_prefill")).count == 1
        # the trace store: indexed by this query, every span read back whole
        with urllib.request.urlopen(f"{collector.query_url}/api/v1/traces/{trace_id}", timeout=10) as response:
            stored = json.loads(response.read())
        assert [s["name"] for s in stored["spans"]] == [
            sc.SPAN_HTTP_COMPLETIONS, sc.SPAN_ENGINE_STEP, sc.SPAN_KERNEL_PREFIX + "fa2_prefill"]
        assert stored["spans"][2]["attributes"] == {sc.CUDA_KERNEL_NAME: "fa2_prefill", sc.HW_GPU_ID: 0}
    requests = {name: n for name, n in parses.items() if name != _ATTRIBUTE and not name.endswith("Response")}
    assert requests == {_REQUEST: 1}
