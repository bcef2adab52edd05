"""Tracing API against real OTLP peers: the SDK's exporters -> rotel -> an OTLP gRPC sink.

The sink is a gRPC server made from opentelemetry-proto's service stubs (a real protocol
peer); rotel (a real OTLP collector) sits between the engine's exporters and the sink, as
the sidecar does in production. Assertions compare the spans received with the spans the
test made: names, parents, kinds, attributes, links, trace ids.
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import CollectorRegistry

import rotel as rotel_pkg
from sightline.instrumentation import semconv
from sightline.instrumentation.config import TelemetryConfig, TraceLevel
from sightline.instrumentation.tracing import Telemetry
from tests.support import free_port

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer,
               metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP/gRPC receiver that keeps everything it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        with self._lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                self.trace_requests.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()
            self.metric_requests.append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def spans(self, request_id: str | None = None) -> list[tuple[dict, trace_pb2.Span]]:
        """(resource attributes, span) pairs; with ``request_id``, only that request's trace."""
        with self._lock:
            out = []
            for req in self.trace_requests:
                for rs in req.resource_spans:
                    resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            out.append((resource, span))
        if request_id is None:
            return out
        trace_ids = {s.trace_id for _, s in out if _attrs(s).get(semconv.REQUEST_ID) == request_id}
        return [(r, s) for r, s in out if s.trace_id in trace_ids]

    def wait_spans(self, request_id: str, count: int, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.spans(request_id)
            if len(got) >= count:
                return got
            time.sleep(0.02)
        raise AssertionError(f"{request_id}: {len(self.spans(request_id))} spans, wanted {count}")

    def stop(self) -> None:
        self._server.stop(0)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind)


def _attrs(span) -> dict:
    return {kv.key: _value(kv.value) for kv in span.attributes}


def _rotel_binary() -> str:
    return str(Path(rotel_pkg.__file__).parent / "rotel-agent")


@pytest.fixture(scope="module")
def sink():
    sink = OtlpSink()
    yield sink
    sink.stop()


@pytest.fixture(scope="module")
def rotel(sink, tmp_path_factory):
    """rotel receiving OTLP gRPC + HTTP, forwarding OTLP/gRPC to the sink."""
    grpc_port, http_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("rotel") / "rotel.log"
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            [_rotel_binary(), "start",
             "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}",
             "--otlp-http-endpoint", f"127.0.0.1:{http_port}",
             "--exporter", "otlp",
             "--otlp-exporter-endpoint", f"http://127.0.0.1:{sink.port}",
             "--otlp-exporter-protocol", "grpc",
             "--batch-timeout", "20ms"],
            stdout=log_file, stderr=subprocess.STDOUT,
        )
    import socket

    deadline = time.monotonic() + 15
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"rotel exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", http_port), 0.2).close()
            socket.create_connection(("127.0.0.1", grpc_port), 0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield {"grpc": f"http://127.0.0.1:{grpc_port}", "http/protobuf": f"http://127.0.0.1:{http_port}"}
    process.terminate()
    process.wait(timeout=10)


def _start(endpoint: str, protocol: str, **kw) -> Telemetry:
    config = TelemetryConfig(
        level=kw.pop("level", TraceLevel.STEPS), otlp_endpoint=endpoint, otlp_protocol=protocol,
        schedule_delay_s=0.05, metrics_enabled=kw.pop("metrics_enabled", False),
        service_name="test-engine", resource_attributes={"deployment.environment": "test"}, **kw,
    )
    return Telemetry.start(config, registry=CollectorRegistry())


def _run_request(telemetry: Telemetry, request_id: str, headers: dict, steps: int = 3):
    """Drives one request through every phase with ``steps`` decode steps; returns the steps."""
    req = telemetry.start_request(
        route="/v1/chat/completions", headers=headers, model="tiny-llama", operation="chat",
        request_id=request_id, priority=3,
    )
    assert req is not None
    req.start_phase(semconv.SPAN_TOKENIZE)
    req.end_phase(semconv.SPAN_TOKENIZE)
    req.start_phase(semconv.SPAN_QUEUE)
    req.end_phase(semconv.SPAN_QUEUE)
    req.start_phase(semconv.SPAN_PREFILL)
    step_traces = []
    prefill_step = telemetry.start_step(0, requests=[req], attributes={semconv.STEP_PREFILL_TOKENS: 7})
    req.link_step(prefill_step)
    prefill_step.end({semconv.STEP_DECODE_TOKENS: 0})
    step_traces.append(prefill_step)
    req.end_phase(semconv.SPAN_PREFILL, {semconv.REQUEST_PREFILL_CHUNKS: 1})
    req.first_token()
    req.start_phase(semconv.SPAN_DECODE)
    for i in range(1, steps):
        step = telemetry.start_step(i, requests=[req], attributes={semconv.STEP_DECODE_TOKENS: 1})
        req.link_step(step)
        step.end()
        step_traces.append(step)
    req.end_phase(semconv.SPAN_DECODE)
    req.start_phase(semconv.SPAN_DETOKENIZE)
    req.end_phase(semconv.SPAN_DETOKENIZE)
    req.set_content("the prompt", "the completion")
    req.finish(status_code=200, finish_reason="stop", input_tokens=7, output_tokens=steps,
               ttft_s=0.25, tpot_s=0.02, queue_s=0.01, e2e_s=0.5, preemptions=0)
    return req, step_traces


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_request_tree_through_rotel(sink, rotel, protocol):
    telemetry = _start(rotel[protocol], protocol)
    request_id = f"tree-{protocol}"
    headers = {"TRACEPARENT": f"00-{TRACE_ID[:-4]}{protocol[:1].encode().hex()}00-{PARENT_ID}-01",
               "tracestate": "vendor=1", "baggage": "tenant=acme"}
    req, steps = _run_request(telemetry, request_id, headers)
    assert telemetry.force_flush()
    telemetry.shutdown()

    got = sink.wait_spans(request_id, 6)
    assert len(got) == 6
    resource = got[0][0]
    assert resource["service.name"] == "test-engine"
    assert resource["deployment.environment"] == "test"
    spans = {s.name: s for _, s in got}
    server = spans[semconv.SPAN_HTTP_CHAT_COMPLETIONS]
    # the caller's context continues: same trace id, parent = the caller's span
    assert server.trace_id.hex() == headers["TRACEPARENT"].split("-")[1]
    assert server.parent_span_id.hex() == PARENT_ID
    assert server.trace_state == "vendor=1"
    assert server.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert _attrs(server) == {
        semconv.HTTP_REQUEST_METHOD: "POST",
        semconv.HTTP_ROUTE: "/v1/chat/completions",
        semconv.URL_PATH: "/v1/chat/completions",
        semconv.GEN_AI_SYSTEM: semconv.GEN_AI_SYSTEM_VALUE,
        semconv.GEN_AI_OPERATION_NAME: "chat",
        semconv.GEN_AI_REQUEST_MODEL: "tiny-llama",
        semconv.REQUEST_ID: request_id,
        semconv.REQUEST_PRIORITY: 3,
        semconv.HTTP_RESPONSE_STATUS_CODE: 200,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: 7,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: 3,
        semconv.REQUEST_PREEMPTIONS: 0,
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ("stop",),
        semconv.REQUEST_TTFT_S: 0.25,
        semconv.REQUEST_TPOT_S: 0.02,
        semconv.REQUEST_QUEUE_S: 0.01,
        semconv.REQUEST_E2E_S: 0.5,
    }  # capture_content is off: no prompt/completion text
    assert [e.name for e in server.events] == [semconv.EVENT_FIRST_TOKEN]
    assert server.status.code == trace_pb2.Status.STATUS_CODE_UNSET

    phases = [s for _, s in got if s.name != server.name]
    phases.sort(key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in phases] == list(semconv.REQUEST_PHASE_SPANS)
    for earlier, later in zip(phases, phases[1:]):
        assert earlier.end_time_unix_nano <= later.start_time_unix_nano
    for phase in phases:
        assert phase.parent_span_id == server.span_id
        assert phase.trace_id == server.trace_id
        assert phase.kind == trace_pb2.Span.SPAN_KIND_INTERNAL
        assert server.start_time_unix_nano <= phase.start_time_unix_nano
        assert phase.end_time_unix_nano <= server.end_time_unix_nano
    assert _attrs(spans[semconv.SPAN_PREFILL]) == {semconv.REQUEST_PREFILL_CHUNKS: 1}

    # prefill links to step 0, decode to steps 1..2; steps link back to the server span
    step_ids = [s.span_context.span_id.to_bytes(8, "big") for s in steps]
    assert [l.span_id for l in spans[semconv.SPAN_PREFILL].links] == step_ids[:1]
    assert [l.span_id for l in spans[semconv.SPAN_DECODE].links] == step_ids[1:]
    step_spans = [s for _, s in sink.spans() if s.span_id in step_ids]
    assert len(step_spans) == 3
    for step_span in step_spans:
        assert step_span.name == semconv.SPAN_ENGINE_STEP
        assert step_span.parent_span_id == b""  # a root
        assert step_span.trace_id != server.trace_id
        assert [(l.trace_id, l.span_id) for l in step_span.links] == [(server.trace_id, server.span_id)]
    step0 = next(s for s in step_spans if s.span_id == step_ids[0])
    assert _attrs(step0) == {semconv.STEP_ID: 0, semconv.STEP_BATCH_SIZE: 1,
                             semconv.STEP_PREFILL_TOKENS: 7, semconv.STEP_DECODE_TOKENS: 0}
    assert steps[0].duration_s == pytest.approx(
        (step0.end_time_unix_nano - step0.start_time_unix_nano) / 1e9)
    assert telemetry.dropped_spans() == 0
    assert telemetry.exported_spans() == 9


@pytest.mark.parametrize("style", ["single", "multi"])
def test_b3_continuation(sink, rotel, style):
    telemetry = _start(rotel["grpc"], "grpc", level=TraceLevel.REQUESTS)
    trace_id = "463ac35c9f6413ad48485a3953bb61" + ("01" if style == "single" else "02")
    span_id = "a2fb4a1d1a96d312"
    if style == "single":
        headers = {"b3": f"{trace_id}-{span_id}-1"}
    else:
        headers = {"X-B3-TraceId": trace_id, "X-B3-SpanId": span_id, "X-B3-Sampled": "1"}
    request_id = f"b3-{style}"
    req = telemetry.start_request(route="/v1/completions", headers=headers, model="m",
                                  operation="text_completion", request_id=request_id, priority=0)
    assert req.span_context.trace_id == int(trace_id, 16)
    assert telemetry.start_step(1, requests=[req], attributes={}) is None  # steps are off
    req.finish(status_code=200, finish_reason="length", input_tokens=1, output_tokens=1)
    telemetry.shutdown()
    (_, server), = sink.wait_spans(request_id, 1)
    assert server.name == semconv.SPAN_HTTP_COMPLETIONS
    assert server.trace_id.hex() == trace_id
    assert server.parent_span_id.hex() == span_id


def test_level_off_emits_nothing(sink):
    telemetry = Telemetry.start(TelemetryConfig(
        level=TraceLevel.OFF, otlp_endpoint=f"http://127.0.0.1:{sink.port}", schedule_delay_s=0.01))
    assert (telemetry.requests_on, telemetry.steps_on, telemetry.kernels_on) == (False, False, False)
    assert telemetry.tracer_provider is None
    assert telemetry.start_request(route="/v1/completions", headers={}, model="m",
                                   operation="text_completion", request_id="off", priority=0) is None
    assert telemetry.start_step(1, requests=[], attributes={}) is None
    telemetry.shutdown()
    disabled = Telemetry.disabled()
    assert not disabled.requests_on and disabled.dropped_spans() == 0
    time.sleep(0.1)
    assert sink.spans("off") == []


def test_capture_content_opt_in(sink):
    endpoint = f"http://127.0.0.1:{sink.port}"
    telemetry = _start(endpoint, "grpc", level=TraceLevel.REQUESTS, capture_content=True,
                       content_max_chars=5)
    req = telemetry.start_request(route="/v1/completions", headers={}, model="m",
                                  operation="text_completion", request_id="content-on", priority=0)
    req.set_content("hello world", "bye")
    req.finish(status_code=200, finish_reason="stop", input_tokens=2, output_tokens=1)
    telemetry.shutdown()
    (_, server), = sink.wait_spans("content-on", 1)
    attrs = _attrs(server)
    assert attrs[semconv.GEN_AI_PROMPT] == "hello"  # truncated to content_max_chars
    assert attrs[semconv.GEN_AI_COMPLETION] == "bye"


def test_link_caps_preemption_and_errors(sink):
    telemetry = _start(f"http://127.0.0.1:{sink.port}", "grpc", max_links_per_span=3)
    reqs = []
    for i in range(5):
        req = telemetry.start_request(route="/v1/completions", headers={}, model="m",
                                      operation="text_completion", request_id=f"cap-{i}", priority=i)
        req.start_phase(semconv.SPAN_PREFILL)
        reqs.append(req)
    step = telemetry.start_step(7, requests=reqs + [None], attributes={})
    for req in reqs:
        req.link_step(step)
    step.end()
    first = reqs[0]
    for i in range(4):  # 5 steps in total on prefill of cap-0: 3 links + 2 counted
        extra = telemetry.start_step(100 + i, requests=[first], attributes={})
        first.link_step(extra)
        extra.end()
    first.preempted()  # ends prefill with an event
    first.start_phase(semconv.SPAN_QUEUE)
    first.end_phase(semconv.SPAN_QUEUE)
    first.start_phase(semconv.SPAN_PREFILL)  # recompute: a second prefill span
    first.finish(status_code=500, finish_reason=None, input_tokens=1, output_tokens=0,
                 error_type="EngineDead")
    first.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=0)  # no-op
    first.start_phase(semconv.SPAN_DECODE)  # after finish: no-op
    for req in reqs[1:]:
        req.finish(status_code=400, finish_reason=None, input_tokens=0, output_tokens=0,
                   error_type="invalid_request_error")
    telemetry.shutdown()

    step_span = next(s for _, s in sink.spans() if s.name == semconv.SPAN_ENGINE_STEP
                     and _attrs(s).get(semconv.STEP_ID) == 7)
    assert len(step_span.links) == 3
    assert _attrs(step_span)[semconv.SPAN_LINKS_DROPPED] == 2
    assert _attrs(step_span)[semconv.STEP_BATCH_SIZE] == 6

    got = [s for _, s in sink.wait_spans("cap-0", 4)]
    names = sorted(s.name for s in got)
    assert names == sorted([semconv.SPAN_HTTP_COMPLETIONS, semconv.SPAN_PREFILL,
                            semconv.SPAN_PREFILL, semconv.SPAN_QUEUE])
    prefills = sorted((s for s in got if s.name == semconv.SPAN_PREFILL),
                      key=lambda s: s.start_time_unix_nano)
    assert len(prefills[0].links) == 3
    assert _attrs(prefills[0])[semconv.SPAN_LINKS_DROPPED] == 2
    assert [e.name for e in prefills[0].events] == [semconv.EVENT_PREEMPTED]
    assert len(prefills[1].links) == 0
    server = next(s for s in got if s.name == semconv.SPAN_HTTP_COMPLETIONS)
    assert [e.name for e in server.events] == [semconv.EVENT_PREEMPTED]
    assert _attrs(server)[semconv.REQUEST_PREEMPTIONS] == 1
    assert _attrs(server)[semconv.ERROR_TYPE] == "EngineDead"
    assert _attrs(server)[semconv.HTTP_RESPONSE_STATUS_CODE] == 500
    assert server.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    client_error = next(s for _, s in sink.wait_spans("cap-1", 2)
                        if s.name == semconv.SPAN_HTTP_COMPLETIONS)
    assert client_error.status.code == trace_pb2.Status.STATUS_CODE_UNSET  # 4xx: the client's


def _request_loop(telemetry: Telemetry, n: int) -> tuple[float, float]:
    """(wall s, this thread's CPU s) for n request spans started and finished."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for i in range(n):
        req = telemetry.start_request(route="/v1/completions", headers={}, model="m",
                                      operation="text_completion", request_id=str(i), priority=0)
        req.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=1)
    return time.perf_counter() - t0, time.thread_time() - c0


def test_endpoint_down_drops_counted_and_calls_stay_fast(caplog):
    caplog.set_level(logging.CRITICAL)  # the exporter's retry warnings are expected here
    common = dict(level=TraceLevel.STEPS, otlp_protocol="grpc", max_queue_size=256,
                  max_export_batch_size=128, schedule_delay_s=0.01, export_timeout_s=0.5,
                  shutdown_timeout_s=1.0, metrics_enabled=False)
    # Interleaved chunks against a pipeline with no exporter, compared by median, so a
    # noisy machine (stolen CPU, a busy neighbour) moves both sides alike.
    chunks, chunk_n = 10, 1000
    n = chunks * chunk_n
    baseline = Telemetry.start(TelemetryConfig(exporter="none", **common))
    registry = CollectorRegistry()
    dead = f"http://127.0.0.1:{free_port()}"
    telemetry = Telemetry.start(TelemetryConfig(otlp_endpoint=dead, **common), registry=registry)
    base_cpu, down_cpu, down_wall = [], [], []
    for _ in range(chunks):
        base_cpu.append(_request_loop(baseline, chunk_n)[1])
        wall, cpu = _request_loop(telemetry, chunk_n)
        down_cpu.append(cpu)
        down_wall.append(wall)
    baseline.shutdown()
    # The caller pays what it pays with no exporter at all (the worker backs off instead of
    # spinning, a full queue drops without logging), and never waits on the dead endpoint:
    # 10k calls blocked by 0.5 s export timeouts would take hours.
    base, down = statistics.median(base_cpu), statistics.median(down_cpu)
    assert down < 1.5 * base + 0.03, f"down: {down * 1e3:.1f} ms CPU per {chunk_n} calls " \
                                     f"vs {base * 1e3:.1f} ms without exporter"
    assert sum(down_wall) < 10.0, f"{n} start/finish took {sum(down_wall):.2f}s with the endpoint down"
    exposed = registry.get_sample_value(semconv.TELEMETRY_SPANS_DROPPED_TOTAL + "_total",
                                        {semconv.LABEL_REASON: "queue_full"})
    assert exposed == telemetry.providers.counters.spans_dropped["queue_full"] > 0
    t1 = time.perf_counter()
    telemetry.shutdown()
    assert time.perf_counter() - t1 < 3.0
    # every span is lost: queue overflow, failed export, or left at the shutdown deadline;
    # all counted (an export in flight at shutdown is counted when it fails, within 0.5 s)
    deadline = time.monotonic() + 3.0
    while telemetry.dropped_spans() < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert telemetry.dropped_spans() == n
    assert telemetry.exported_spans() == 0
    by_reason = telemetry.providers.counters.spans_dropped
    assert by_reason["queue_full"] > 0 and by_reason["export_failed"] > 0, by_reason
    assert sum(by_reason.values()) == n
    assert telemetry.providers.counters.export_failures["traces"] >= 1
    assert set(by_reason) <= {"queue_full", "export_failed", "shutdown_timeout"}


class _BrokenExporter:
    """A span exporter that raises: the failure must be counted, not raised."""

    def export(self, spans):
        raise RuntimeError("disk on fire")

    def shutdown(self):
        raise RuntimeError("still on fire")

    def force_flush(self, timeout_millis=0):
        return True


def test_exporter_exceptions_never_reach_the_caller(caplog):
    caplog.set_level(logging.CRITICAL)
    telemetry = Telemetry.start(
        TelemetryConfig(level=TraceLevel.REQUESTS, exporter="none", metrics_enabled=False,
                        schedule_delay_s=0.01),
        span_exporters=[_BrokenExporter()])
    req = telemetry.start_request(route="/x", headers={"traceparent": "garbage"}, model="m",
                                  operation="chat", request_id="broken", priority=0)
    assert req is not None and req.span_context.is_valid  # bad traceparent: a fresh trace
    odd = telemetry.start_request(route="/x", headers={"traceparent": b"\xff", "b3": None},
                                  model="m", operation="chat", request_id="odd", priority=0)
    assert odd is not None and odd.span_context.is_valid  # undecodable headers: still traced
    odd.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=1)
    req.set_attributes({"bad": object()})  # the SDK rejects the value; nothing raises
    req.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=1)
    assert telemetry.force_flush()
    telemetry.shutdown()
    assert telemetry.export_failures() >= 1  # one batch or two, by timing
    assert telemetry.dropped_spans() == 2


def test_threads_share_one_request_trace(sink):
    telemetry = _start(f"http://127.0.0.1:{sink.port}", "grpc", max_links_per_span=1000,
                       max_phase_links=1000)
    req = telemetry.start_request(route="/v1/completions", headers={}, model="m",
                                  operation="text_completion", request_id="threads", priority=0)
    req.start_phase(semconv.SPAN_DECODE)
    per_thread, threads = 100, 4

    def work():
        for i in range(per_thread):
            step = telemetry.start_step(i, requests=[req], attributes={})
            req.link_step(step)
            step.end()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    req.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=1)
    telemetry.shutdown()
    got = sink.wait_spans("threads", 2)
    decode = next(s for _, s in got if s.name == semconv.SPAN_DECODE)
    assert len(decode.links) == per_thread * threads
    assert telemetry.dropped_spans() == 0


def test_meter_exports_exponential_histogram(sink, rotel):
    telemetry = _start(rotel["grpc"], "grpc", metrics_enabled=True, metric_export_interval_s=60)
    hist = telemetry.meter.create_histogram(semconv.METRIC_CTA_DURATION,
                                            unit=semconv.METRIC_CTA_DURATION_UNIT)
    for value in (1e-5, 2e-5, 4e-5):
        hist.record(value, {semconv.ATTR_GPU_ID: "0", semconv.ATTR_SM_ID: 5,
                            semconv.ATTR_KERNEL_NAME: "probe-test"})
    telemetry.force_flush()
    telemetry.shutdown()
    deadline = time.monotonic() + 10
    found = None
    while found is None and time.monotonic() < deadline:
        for req in list(sink.metric_requests):
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        if metric.name == semconv.METRIC_CTA_DURATION and \
                                metric.WhichOneof("data") == "exponential_histogram":
                            for point in metric.exponential_histogram.data_points:
                                kernel = [kv.value.string_value for kv in point.attributes
                                          if kv.key == semconv.ATTR_KERNEL_NAME]
                                if kernel == ["probe-test"]:
                                    found = (metric, point)
        time.sleep(0.05)
    assert found is not None, "no exponential histogram reached the sink"
    metric, point = found
    assert point.count == 3
    assert point.sum == pytest.approx(7e-5)
    assert metric.exponential_histogram.aggregation_temporality == 1  # DELTA


def test_config_env_precedence_and_errors():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "svc",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p%201,service.name=ignored",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10",
        "OTEL_BSP_SCHEDULE_DELAY": "250",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1500",
        "OTEL_PROPAGATORS": "tracecontext,b3",
        "SIGHTLINE_TRACE_LEVEL": "Kernels",
    }
    config = TelemetryConfig.from_env(env, max_queue_size=50)
    assert config.level is TraceLevel.KERNELS
    assert config.traces_endpoint == "http://collector:4318/v1/traces"
    assert config.metrics_endpoint == "http://collector:4318/v1/metrics"
    assert config.service_name == "svc"
    assert config.resource_attributes == {"k8s.pod.name": "p 1", "service.name": "ignored"}
    assert (config.sampler, config.sampler_arg) == ("parentbased_traceidratio", 0.25)
    assert config.max_queue_size == 50  # argument beats env
    assert config.max_export_batch_size == 10
    assert config.schedule_delay_s == 0.25
    assert config.export_timeout_s == 1.5
    assert config.propagators == ("tracecontext", "b3")
    traces_only = TelemetryConfig.from_env(
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:1/custom", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert traces_only.traces_endpoint == "http://x:1/custom"
    assert TelemetryConfig.from_env({}).traces_endpoint == "http://localhost:4317"
    assert TelemetryConfig(otlp_endpoint="collector:4317").traces_endpoint == "http://collector:4317"
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_ENDPOINT='ftp://x': otlp_endpoint 'ftp://x' is not"):
        TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://x"})
    with pytest.raises(ValueError, match=r"OTEL_TRACES_SAMPLER_ARG='2': sampler_arg=2.0 is not"):
        TelemetryConfig.from_env({"OTEL_TRACES_SAMPLER_ARG": "2"})
    assert TelemetryConfig.from_env({"OTEL_SDK_DISABLED": "true"}).level is TraceLevel.OFF
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_PROTOCOL='udp': .*'udp'.*grpc\|http/protobuf"):
        TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "udp"})
    with pytest.raises(ValueError, match=r"OTEL_BSP_MAX_QUEUE_SIZE='many'"):
        TelemetryConfig.from_env({"OTEL_BSP_MAX_QUEUE_SIZE": "many"})
    with pytest.raises(ValueError, match=r"trace level 'verbose' is not one of off\|requests\|steps\|kernels"):
        TelemetryConfig.from_env({"SIGHTLINE_TRACE_LEVEL": "verbose"})
    with pytest.raises(ValueError, match=r"sampler_arg=1.5 is not a number in \[0.0, 1.0\]"):
        TelemetryConfig(sampler_arg=1.5)
    with pytest.raises(ValueError, match=r"max_export_batch_size=10 .* \[1, 5\]"):
        TelemetryConfig(max_queue_size=5, max_export_batch_size=10)
    with pytest.raises(TypeError, match="unknown TelemetryConfig field 'levle'"):
        TelemetryConfig.from_env({}, levle="off")
    assert TraceLevel.parse("steps") is TraceLevel.STEPS and TraceLevel.parse(3) is TraceLevel.KERNELS


def test_sampling_decisions_are_honoured(sink):
    endpoint = f"http://127.0.0.1:{sink.port}"
    never = _start(endpoint, "grpc", level=TraceLevel.REQUESTS, sampler="always_off")
    req = never.start_request(route="/v1/completions", headers={}, model="m",
                              operation="text_completion", request_id="sampled-out", priority=0)
    assert req is not None and not req.span_context.trace_flags.sampled
    req.start_phase(semconv.SPAN_QUEUE)
    req.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=1)
    never.shutdown()
    # parent-based: the caller's "not sampled" flag is followed, its "sampled" flag too
    follow = _start(endpoint, "grpc", level=TraceLevel.REQUESTS)
    for request_id, flags in (("parent-unsampled", "00"), ("parent-sampled", "01")):
        req = follow.start_request(
            route="/v1/completions", model="m", operation="text_completion",
            request_id=request_id, priority=0,
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-{flags}"})
        req.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=1)
    follow.shutdown()
    # both requests share the caller's trace id: only the sampled one may be in it
    assert [s.name for _, s in sink.wait_spans("parent-sampled", 1)] == [semconv.SPAN_HTTP_COMPLETIONS]
    assert sink.spans("sampled-out") == [] and sink.spans("parent-unsampled") == []
    assert never.exported_spans() == 0 and never.dropped_spans() == 0


def test_step_spans_follow_a_ratio_sampler_exactly():
    """Step spans are roots built finished: the provider's sampler decides each one. With
    a 0.5 trace-id ratio, exactly the steps whose context says sampled are exported, with
    their own attributes."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    memory = InMemorySpanExporter()
    telemetry = Telemetry.start(TelemetryConfig(
        level=TraceLevel.STEPS, exporter="none", metrics_enabled=False, schedule_delay_s=0.05,
        sampler="traceidratio", sampler_arg=0.5), span_exporters=[memory])
    steps = []
    for i in range(400):
        step = telemetry.start_step(i, requests=[], attributes={semconv.STEP_DECODE_TOKENS: i})
        step.end()
        steps.append(step)
    telemetry.shutdown()
    sampled = {st.span_context.span_id for st in steps if st.span_context.trace_flags.sampled}
    got = memory.get_finished_spans()
    assert 100 < len(sampled) < 300                    # the ratio was applied, not 0 or 1
    assert {s.context.span_id for s in got} == sampled and len(got) == len(sampled)
    assert all(s.name == semconv.SPAN_ENGINE_STEP and s.parent is None for s in got)
    assert {s.attributes[semconv.STEP_ID] for s in got} == {
        st.step_id for st in steps if st.span_context.span_id in sampled}


def test_downstream_calls_continue_the_request():
    telemetry = Telemetry.start(TelemetryConfig(
        level=TraceLevel.REQUESTS, exporter="none", metrics_enabled=False,
        propagators=("tracecontext", "baggage", "b3")))
    req = telemetry.start_request(
        route="/v1/completions", model="m", operation="text_completion", request_id="down",
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "baggage": "tenant=acme"})
    sc = req.span_context
    headers = req.inject()
    assert headers == {
        "traceparent": f"00-{TRACE_ID}-{sc.span_id:016x}-01",
        "baggage": "tenant=acme",
        "b3": f"{TRACE_ID}-{sc.span_id:016x}-1",
    }
    assert telemetry.inject(context=req.context) == headers
    req.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=1)
    telemetry.shutdown()
    assert telemetry.start_request(route="/x", headers={}, model="m", operation="chat",
                                   request_id="after", priority=0) is None  # shut down: off


def test_resource_is_hashed_once_and_groups_like_the_sdks():
    """The process resource caches its hash (the OTLP encoder hashes it per span), and
    equals, and hashes like, the SDK's Resource with the same attributes, so spans made by
    either land in one resource group."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    from sightline.instrumentation.otel_setup import build_resource

    ours = build_resource(TelemetryConfig(service_name="svc", resource_attributes={"a": "1"}))
    sdk = Resource(dict(ours.attributes))
    assert ours == sdk and hash(ours) == hash(sdk)
    assert ours._hash == hash(ours)
    spans = [ReadableSpan(name=f"s{i}", context=SpanContext(1, i + 1, False, TraceFlags(1)),
                          resource=resource, start_time=1, end_time=2)
             for i, resource in enumerate((ours, sdk, ours))]
    request = encode_spans(spans)
    assert len(request.resource_spans) == 1
    assert sorted(s.name for s in request.resource_spans[0].scope_spans[0].spans) == ["s0", "s1", "s2"]
