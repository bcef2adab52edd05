"""Producers that join an engine core's telemetry: in one process (thread mode) and from other
OS processes into a real telemetry process that exports to a real collector.

The API server's side is a :class:`JoinedPipeline`; the engine core's is the starting
:class:`TelemetryPipeline`, recording ``Queued`` and ``Step`` with the keys the API server gave.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from sightline.instrumentation import semconv as sc
from sightline.instrumentation.config import TelemetryConfig
from sightline.instrumentation.event_wire import from_wire
from sightline.instrumentation.lifecycle import (PRODUCER_KEY_SHIFT, Detokenized, Queued, RequestEnd,
                                                 RequestStart, Step, Tokenized)
from sightline.instrumentation.producer_link import ProducerInbox, private_endpoint, remove_endpoint
from sightline.instrumentation.telemetry_pipeline import TelemetryPipeline

from sightline.deploy.processes import free_ports

from ..support import wait_for_http

CONFIG = TelemetryConfig(level="steps", exporter="none", metrics_enabled=False,
                         schedule_delay_s=0.01)


def _step(step_id: int, start_ns: int, end_ns: int, key: int, prefill_done: bool) -> Step:
    return Step(step_id, start_ns, end_ns, 0, 0, (key,), 1, (), (key,) if prefill_done else (),
                3 if prefill_done else 0, 0 if prefill_done else 1, int(prefill_done),
                int(not prefill_done), 1, 16)


def test_a_producer_in_the_same_process_joins_a_thread_mode_pipeline():
    exporter = InMemorySpanExporter()
    core = TelemetryPipeline.start(CONFIG, mode="thread", span_exporters=[exporter])
    endpoint = core.producer_endpoint
    assert endpoint.startswith("ipc://") and endpoint == core.producer_endpoint
    api = TelemetryPipeline.join(CONFIG, endpoint, 5)
    try:
        handle = api.recorder.start_request(route="/v1/completions", headers={}, model="tiny",
                                            operation="text_completion", request_id="r1")
        assert handle.key >> PRODUCER_KEY_SHIFT == 5
        t0 = time.time_ns()
        handle.tokenized(t0, t0 + 1000)
        core.recorder.record(Queued(handle.key, t0 + 2000))
        core.recorder.record_later(_step, 1, t0 + 3000, t0 + 4000, handle.key, True)
        core.recorder.record(_step(2, t0 + 4000, t0 + 5000, handle.key, False))
        api.recorder.record(Detokenized(handle.key, t0 + 6000, t0 + 7000))
        handle.finish(status_code=200, finish_reason="length", input_tokens=3, output_tokens=2,
                      end_time_ns=t0 + 8000)
        names: list[str] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sc.SPAN_HTTP_COMPLETIONS not in names:
            core.force_flush()
            names = [s.name for s in exporter.get_finished_spans()]
            time.sleep(0.05)
        spans = exporter.get_finished_spans()
        assert sorted(s.name for s in spans) == sorted([
            sc.SPAN_HTTP_COMPLETIONS, sc.SPAN_TOKENIZE, sc.SPAN_QUEUE, sc.SPAN_PREFILL,
            sc.SPAN_DECODE, sc.SPAN_DETOKENIZE, sc.SPAN_ENGINE_STEP, sc.SPAN_ENGINE_STEP])
        server = next(s for s in spans if s.name == sc.SPAN_HTTP_COMPLETIONS)
        assert server.context.trace_id == handle.trace_id and server.context.span_id == handle.span_id
        for s in spans:
            if s.name != sc.SPAN_ENGINE_STEP:
                assert s.context.trace_id == handle.trace_id
            else:
                assert [link.context.span_id for link in s.links] == [handle.span_id]
        roles = {s.name: s.attributes[sc.PROCESS_ROLE] for s in spans}
        assert roles[sc.SPAN_HTTP_COMPLETIONS] == roles[sc.SPAN_DETOKENIZE] == sc.PROCESS_ROLE_API_SERVER
        assert roles[sc.SPAN_PREFILL] == roles[sc.SPAN_ENGINE_STEP] == sc.PROCESS_ROLE_ENGINE_CORE
        assert {s.attributes[sc.PROCESS_PID] for s in spans} == {os.getpid()}
        assert core.counters()["orphan_events"] == 0
        metrics = generate_latest(api.registry).decode()
        assert 'sightline_telemetry_events_dropped_total{reason="queue_full"} 0.0' in metrics
        assert "sightline_telemetry_process_up 1.0" in metrics
        assert "sightline_telemetry_spans_exported" not in metrics   # the core's registry has them
    finally:
        api.shutdown()
        core.shutdown()
    assert not os.path.exists(endpoint[len("ipc://"):])


def test_join_refuses_a_bad_producer_id_and_endpoint():
    with pytest.raises(ValueError, match=r"producer_id=0 is not an integer in \[1, 32767\]"):
        TelemetryPipeline.join(CONFIG, "ipc:///tmp/x/producers", 0)
    with pytest.raises(ValueError, match="is not an ipc:// endpoint"):
        TelemetryPipeline.join(CONFIG, "tcp://127.0.0.1:1", 1)
    assert TelemetryPipeline.join(CONFIG.replace(level="off"), "ipc:///tmp/x/producers", 1) is None


def test_drops_joined_producers_report_are_counted_once_on_the_starting_pipeline():
    core = TelemetryPipeline.start(CONFIG, mode="thread", span_exporters=[InMemorySpanExporter()])
    try:
        name = sc.TELEMETRY_EVENTS_DROPPED_TOTAL + "_total"

        def dropped() -> dict[str, float]:
            text = generate_latest(core.registry).decode()
            return {line.split('"')[1]: float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines() if line.startswith(name + "{")}

        core.recorder.dropped = 2                           # this process's own buffer_full
        core.count_producer_drops(1, {"queue_full": 3})
        core.count_producer_drops(2, {"queue_full": 1, "process_down": 4})
        core.count_producer_drops(1, {"queue_full": 5})     # a later report replaces the first
        assert dropped() == {"buffer_full": 2, "build_error": 0, "process_down": 4, "queue_full": 6}
    finally:
        core.shutdown()


def _one_request(api) -> None:
    handle = api.recorder.start_request(route="/v1/completions", headers={}, model="tiny",
                                        operation="text_completion", request_id="r1")
    t0 = time.time_ns()
    handle.tokenized(t0, t0 + 1000)
    handle.finish(status_code=200, finish_reason="length", input_tokens=3, output_tokens=2,
                  end_time_ns=t0 + 2000)


def test_a_producer_stopping_before_the_telemetry_process_binds_waits_for_it():
    """A telemetry process started at a low priority can bind its endpoint after an API
    server has finished its requests and is stopping: the last frames wait for it (they
    were discarded unseen when the socket closed unconnected), the last one says done."""
    endpoint = private_endpoint()
    frames = []
    api = TelemetryPipeline.join(CONFIG, endpoint, 3, ship_interval_s=0.01)
    inbox = None
    try:
        _one_request(api)
        time.sleep(0.1)                        # shipped: queued in ZMQ, nobody bound
        assert not api.process_up()

        def bind_late() -> None:
            nonlocal inbox
            time.sleep(0.5)
            inbox = ProducerInbox(endpoint, lambda *frame: frames.append(frame))

        binder = threading.Thread(target=bind_late)
        binder.start()
        started = time.monotonic()
        api.shutdown(timeout_s=5.0)
        assert 0.4 < time.monotonic() - started < 5.0
        binder.join()
        _wait(lambda: frames and frames[-1][3], what="the last frame")
        items = [item for frame in frames for item in from_wire(frame[2])]
        assert [type(item) for item in items] == [RequestStart, Tokenized, RequestEnd]
        assert [frame[3] for frame in frames].count(True) == 1 and frames[-1][3] is True
        assert {frame[0].producer_id for frame in frames} == {3}
        assert api.dropped_events()["process_down"] == 0
    finally:
        api.shutdown(timeout_s=0.1)
        if inbox is not None:
            inbox.close()
        remove_endpoint(endpoint)


def test_a_producer_whose_telemetry_process_never_binds_counts_what_it_lost(caplog):
    endpoint = private_endpoint()
    api = TelemetryPipeline.join(CONFIG, endpoint, 4, ship_interval_s=0.01)
    try:
        _one_request(api)
        time.sleep(0.1)
        started = time.monotonic()
        api.shutdown(timeout_s=0.3)
        assert time.monotonic() - started < 2.0          # bounded by the timeout
        assert api.dropped_events()["process_down"] == 3
        assert "3 events of producer 4 are lost" in caplog.text
    finally:
        remove_endpoint(endpoint)


# -- other OS processes: an API server process, a real telemetry process, a real collector --

CLI = [sys.executable, "-c", "import sys; from sightline.deploy.cli import main; sys.exit(main())"]


def api_server_process(endpoint: str, producer_id: int, conn) -> None:
    """A stand-alone API server's telemetry: starts and finishes requests on command. It
    ships only when told (``flush``), so the test decides what reaches the telemetry process
    first."""
    api = TelemetryPipeline.join(CONFIG, endpoint, producer_id, ship_interval_s=10.0)
    handles = {}
    while True:
        command, *args = conn.recv()
        if command == "start":
            request_id, trace_id = args
            t0 = time.time_ns()
            handle = api.recorder.start_request(
                route="/v1/completions", model="tiny", operation="text_completion",
                request_id=request_id, headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
            handle.tokenized(t0, time.time_ns())
            handles[request_id] = handle
            conn.send((handle.key, handle.span_id))
        elif command == "finish":
            handle = handles.pop(args[0])
            t0 = time.time_ns()
            api.recorder.record(Detokenized(handle.key, t0, t0 + 1000))
            handle.finish(status_code=200, finish_reason="length", input_tokens=3,
                          output_tokens=2, end_time_ns=t0 + 2000)
            conn.send(True)
        elif command == "flush":
            conn.send(api.force_flush())
        elif command == "state":
            conn.send((api.dropped_events(), api.restarts, api.process_up(), os.getpid()))
        else:
            api.shutdown()
            conn.send(True)
            return


@pytest.fixture(scope="module")
def collector():
    grpc, http, zipkin, query = free_ports(4)
    process = subprocess.Popen(CLI + ["collector", "run", "--otlp-grpc", f"127.0.0.1:{grpc}",
                                      "--otlp-http", f"127.0.0.1:{http}", "--zipkin",
                                      f"127.0.0.1:{zipkin}", "--http", f"127.0.0.1:{query}",
                                      "--log-level", "WARNING"])
    try:
        wait_for_http(f"http://127.0.0.1:{query}/healthz", process=process)
        yield f"http://127.0.0.1:{grpc}", f"http://127.0.0.1:{query}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


class ApiServer:
    """The test's handle on :func:`api_server_process` in a spawned process."""

    def __init__(self, endpoint: str, producer_id: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=api_server_process,
                                       args=(endpoint, producer_id, child), daemon=True)
        self.process.start()

    def __call__(self, *command):
        self.conn.send(command)
        assert self.conn.poll(60), f"the API server process did not answer {command}"
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self("stop")
        self.process.join(timeout=30)


def _wait(predicate, timeout_s: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _trace(query: str, trace_id: str, names: set[str]) -> list[dict]:
    """The stored trace once it holds spans of every name in ``names``."""
    def spans():
        try:
            body = json.loads(urllib.request.urlopen(f"{query}/api/v1/traces/{trace_id}",
                                                     timeout=5).read())
        except OSError:
            return None
        got = body.get("spans", [])
        return got if names <= {s["name"] for s in got} else None
    return _wait(spans, what=f"trace {trace_id} with {sorted(names)}")


def _core_serves(core: TelemetryPipeline, key: int, step_id: int) -> None:
    """The engine core's records for a request it got with ``key``: queued, one prefill
    step (its first token), one decode step."""
    t0 = time.time_ns()
    core.recorder.record(Queued(key, t0))
    core.recorder.record(_step(step_id, t0 + 1000, t0 + 2000, key, True))
    core.recorder.record(_step(step_id + 1, t0 + 2000, t0 + 3000, key, False))


REQUEST_SPANS = {sc.SPAN_HTTP_COMPLETIONS, sc.SPAN_TOKENIZE, sc.SPAN_QUEUE, sc.SPAN_PREFILL,
                 sc.SPAN_DECODE, sc.SPAN_DETOKENIZE}


def _assert_one_trace_from_two_processes(spans: list[dict], api_pid: int, span_id: int) -> None:
    by_name = {s["name"]: s for s in spans}
    assert len(spans) == len(REQUEST_SPANS) and set(by_name) == REQUEST_SPANS
    server = by_name[sc.SPAN_HTTP_COMPLETIONS]
    assert server["span_id"] == format(span_id, "016x")
    assert server["parent_span_id"] == "00f067aa0ba902b7"          # the caller's span
    for name in REQUEST_SPANS - {sc.SPAN_HTTP_COMPLETIONS}:
        assert by_name[name]["parent_span_id"] == server["span_id"], name
    processes = {name: (s["attributes"][sc.PROCESS_ROLE], s["attributes"][sc.PROCESS_PID])
                 for name, s in by_name.items()}
    api, core = (sc.PROCESS_ROLE_API_SERVER, api_pid), (sc.PROCESS_ROLE_ENGINE_CORE, os.getpid())
    assert processes == {sc.SPAN_HTTP_COMPLETIONS: api, sc.SPAN_TOKENIZE: api,
                         sc.SPAN_QUEUE: core, sc.SPAN_PREFILL: core, sc.SPAN_DECODE: core,
                         sc.SPAN_DETOKENIZE: api}


def test_two_processes_feed_one_telemetry_process_into_one_trace(collector):
    """The engine core's queue and step records reach the telemetry process before the API
    server's RequestStart: they are held (exactly 4) and applied; nothing is orphaned."""
    otlp, query = collector
    core = TelemetryPipeline.start(CONFIG.replace(exporter="otlp", otlp_endpoint=otlp,
                                                  hold_unstarted_s=60.0))
    api = ApiServer(core.producer_endpoint, 1)
    try:
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        key, span_id = api("start", "r1", trace_id)
        assert key >> PRODUCER_KEY_SHIFT == 1
        _core_serves(core, key, 1)
        _wait(lambda: core.counters().get("held_events") == 4, what="4 held events")
        assert api("flush")
        assert api("finish", "r1") and api("flush")
        _, _, up, api_pid = _wait(lambda: (s := api("state"))[2] and s, what="connected")
        spans = _trace(query, trace_id, REQUEST_SPANS)
        _assert_one_trace_from_two_processes(spans, api_pid, span_id)
        counters = core.counters()
        assert (counters["held_events"], counters["orphan_events"]) == (4, 0)
        metrics = generate_latest(core.registry).decode()
        assert "sightline_telemetry_events_held_total 4.0" in metrics
        assert "sightline_telemetry_events_orphaned_total 0.0" in metrics
        # the step spans: from the core, linked to the request's server span
        prefill = next(s for s in spans if s["name"] == sc.SPAN_PREFILL)
        (link,) = prefill["links"]
        (step,) = _trace(query, link["trace_id"], {sc.SPAN_ENGINE_STEP})
        assert step["links"] == [{"trace_id": trace_id, "span_id": format(span_id, "016x")}]
        assert step["attributes"][sc.PROCESS_ROLE] == sc.PROCESS_ROLE_ENGINE_CORE
        dropped, restarts, up, _ = api("state")
        assert dropped == {"queue_full": 0, "process_down": 0, "buffer_full": 0,
                           "build_error": 0} and restarts == 0 and up
    finally:
        api.stop()
        core.shutdown()


def test_held_events_of_a_request_that_never_starts_expire_as_orphans():
    core = TelemetryPipeline.start(CONFIG.replace(hold_unstarted_s=0.2))
    try:
        lost = (9 << PRODUCER_KEY_SHIFT) + 1
        _core_serves(core, lost, 1)
        _wait(lambda: core.counters().get("orphan_events") == 4, what="4 orphans")
        time.sleep(0.6)                      # the counts settle: nothing else is counted
        counters = core.counters()
        assert (counters["held_events"], counters["orphan_events"]) == (4, 4)
        assert "sightline_telemetry_events_orphaned_total 4.0" in \
            generate_latest(core.registry).decode()
    finally:
        core.shutdown()


def test_a_joined_producer_survives_a_telemetry_process_restart(collector):
    otlp, query = collector
    core = TelemetryPipeline.start(CONFIG.replace(exporter="otlp", otlp_endpoint=otlp))
    api = ApiServer(core.producer_endpoint, 2)
    try:
        first_pid = _wait(lambda: core.pid and api("state")[2] and core.pid, what="connected")
        os.kill(first_pid, signal.SIGKILL)
        _wait(lambda: core.pid not in (None, first_pid), what="a new telemetry process")
        _wait(lambda: api("state")[1] >= 1, what="the API server reconnected")
        trace_id = "0af7651916cd43dd8448eb211c80319c"
        key, span_id = api("start", "after-restart", trace_id)
        _core_serves(core, key, 10)
        assert api("finish", "after-restart") and api("flush")
        spans = _trace(query, trace_id, REQUEST_SPANS)
        _assert_one_trace_from_two_processes(spans, api("state")[3], span_id)
        assert core.restarts == 1 and core.counters()["orphan_events"] == 0
    finally:
        api.stop()
        core.shutdown()
