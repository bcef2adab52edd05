"""OTLP capture files: spans and metrics made by the real SDK, written, read back identical."""

from __future__ import annotations

import gzip
import json
import threading

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link

from sightline.instrumentation import semconv
from sightline.instrumentation.capture import (
    CaptureMetricExporter,
    CaptureSpanExporter,
    CaptureWriter,
    from_otlp_json,
    read_capture,
    to_otlp_json,
)
from sightline.instrumentation.config import TelemetryConfig, TraceLevel
from sightline.instrumentation.tracing import Telemetry


def _make_spans():
    """Real SDK spans with a parent, a link, events and typed attributes."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("capture-test")
    step = tracer.start_span(semconv.SPAN_ENGINE_STEP, attributes={semconv.STEP_ID: 4})
    step.end()
    with tracer.start_as_current_span("POST /v1/completions",
                                      attributes={semconv.REQUEST_PRIORITY: 2, "f": 0.5,
                                                  "arr": ("stop",), "b": True}):
        with tracer.start_as_current_span("prefill", links=[Link(step.get_span_context())]) as span:
            span.add_event(semconv.EVENT_FIRST_TOKEN, {"n": 1})
    provider.shutdown()
    return memory.get_finished_spans()


@pytest.mark.parametrize("name", ["cap.jsonl", "cap.jsonl.gz"])
def test_span_round_trip(tmp_path, name):
    spans = _make_spans()
    path = tmp_path / name
    exporter = CaptureSpanExporter(path)
    assert exporter.export(spans[:1]) is SpanExportResult.SUCCESS
    assert exporter.export(spans[1:]) is SpanExportResult.SUCCESS
    exporter.shutdown()

    records = list(read_capture(path))
    assert [r.signal for r in records] == ["traces", "traces"]
    assert records[0].time_unix_nano <= records[1].time_unix_nano
    assert records[0].request == encode_spans(spans[:1])
    assert records[1].request == encode_spans(spans[1:])
    # the file holds OTLP/JSON: hex ids (not base64), integer enums, camelCase keys
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        line = json.loads(handle.readlines()[1])
    assert set(line) == {"signal", "time_unix_nano", "request"}
    otlp_spans = [s for rs in line["request"]["resourceSpans"] for ss in rs["scopeSpans"]
                  for s in ss["spans"]]
    by_name = {s["name"]: s for s in otlp_spans}
    prefill = by_name["prefill"]
    server = by_name["POST /v1/completions"]
    assert prefill["traceId"] == format(spans[1].context.trace_id, "032x")
    assert prefill["parentSpanId"] == format(server_id := spans[2].context.span_id, "016x")
    assert server["spanId"] == format(server_id, "016x")
    assert prefill["links"][0]["spanId"] == format(spans[0].context.span_id, "016x")
    assert prefill["kind"] == 1


def test_metrics_round_trip_and_shared_writer(tmp_path):
    path = tmp_path / "mixed.jsonl.gz"
    writer = CaptureWriter(path)
    exporter = CaptureMetricExporter(writer)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    counter = provider.get_meter("t").create_counter("requests")
    hist = provider.get_meter("t").create_histogram(semconv.METRIC_CTA_DURATION, unit="s")
    counter.add(3, {"model": "m"})
    hist.record(1e-5, {semconv.ATTR_SM_ID: 7})
    data = reader.get_metrics_data()
    assert exporter.export(data).name == "SUCCESS"
    CaptureSpanExporter(writer).export(_make_spans())
    exporter.shutdown()  # a shared writer stays open
    assert not writer.closed
    writer.close()

    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    records = list(read_capture(path))
    assert [r.signal for r in records] == ["metrics", "traces"]
    assert records[0].request == encode_metrics(data)


def test_concurrent_writers_keep_lines_whole(tmp_path):
    path = tmp_path / "threads.jsonl"
    spans = _make_spans()
    writer = CaptureWriter(path)

    def work():
        for _ in range(25):
            writer.write_traces(encode_spans(spans))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    records = list(read_capture(path))
    assert len(records) == 100
    assert all(r.request == encode_spans(spans) for r in records)


def test_truncated_tail_is_tolerated_and_bad_lines_are_named(tmp_path, caplog):
    spans = _make_spans()
    path = tmp_path / "cut.jsonl"
    with CaptureWriter(path) as writer:
        writer.write_traces(encode_spans(spans))
        writer.write_traces(encode_spans(spans))
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # the writer died mid-line
    assert len(list(read_capture(path))) == 1

    gz = tmp_path / "cut.jsonl.gz"
    with CaptureWriter(gz) as writer:
        for _ in range(3):
            writer.write_traces(encode_spans(spans))
    raw = gz.read_bytes()
    gz.write_bytes(raw[: len(raw) - 30])  # no gzip trailer, last block cut
    assert 1 <= len(list(read_capture(gz))) <= 3

    bad = tmp_path / "bad.jsonl"
    bad.write_text(text.splitlines()[0] + "\n" + '{"signal": "logs", "time_unix_nano": 1, "request": {}}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'logs'"):
        list(read_capture(bad))


def test_ids_accept_base64_and_reject_junk():
    request = encode_spans(_make_spans())
    as_json = to_otlp_json(request)
    assert from_otlp_json("traces", as_json) == request
    from google.protobuf import json_format

    base64_form = json_format.MessageToDict(request)  # protobuf-JSON (base64 ids)
    assert from_otlp_json("traces", base64_form) == request
    broken = to_otlp_json(request)
    broken["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["spanId"] = "not an id!"
    with pytest.raises(ValueError, match="neither hex nor base64"):
        from_otlp_json("traces", broken)
    with pytest.raises(TypeError, match="ExportTraceServiceRequest"):
        CaptureWriter.write(None, "traces", object())  # type: ignore[arg-type]


def test_telemetry_records_a_capture(tmp_path):
    path = tmp_path / "engine.jsonl.gz"
    telemetry = Telemetry.start(TelemetryConfig(
        level=TraceLevel.STEPS, exporter="none", capture_path=str(path), schedule_delay_s=0.01,
        metric_export_interval_s=60))
    req = telemetry.start_request(route="/v1/completions", headers={}, model="m",
                                  operation="text_completion", request_id="cap", priority=1)
    step = telemetry.start_step(1, requests=[req], attributes={})
    step.end()
    req.finish(status_code=200, finish_reason="stop", input_tokens=2, output_tokens=1)
    telemetry.meter.create_counter("c").add(1)
    telemetry.shutdown()
    names, signals = [], set()
    for record in read_capture(path):
        signals.add(record.signal)
        if record.signal == "traces":
            assert isinstance(record.request, ExportTraceServiceRequest)
            for rs in record.request.resource_spans:
                for ss in rs.scope_spans:
                    names += [s.name for s in ss.spans]
    assert sorted(names) == sorted([semconv.SPAN_HTTP_COMPLETIONS, semconv.SPAN_ENGINE_STEP])
    assert signals == {"traces", "metrics"}
    assert telemetry.exported_spans() == 2
