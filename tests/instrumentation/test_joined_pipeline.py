"""Producers that join an engine core's telemetry: in one process (thread mode) and from other
OS processes into a real telemetry process that exports to a real collector.

The API server's side is a :class:`JoinedPipeline`; the engine core's is the starting
:class:`TelemetryPipeline`, recording ``Queued`` and ``Step`` with the keys the API server gave.
"""

from __future__ import annotations

import os
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from sightline.instrumentation import semconv as sc
from sightline.instrumentation.config import TelemetryConfig
from sightline.instrumentation.lifecycle import PRODUCER_KEY_SHIFT, Detokenized, Queued, Step
from sightline.instrumentation.telemetry_pipeline import TelemetryPipeline

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
