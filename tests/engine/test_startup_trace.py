"""The engine's start-up as one trace, received by a real collector.

A real ``sightline collector run`` (OTLP gRPC) and the engine at trace level ``requests``,
its spans built in the telemetry process (the default of ``engine serve``). Once ready, the
start-up trace named in ``/health`` holds an ``engine.startup`` root and exactly one child
span per phase of the report, each inside the root's time, carrying what it ran and
compiled; the root starts no later than the first phase and ends when the engine was ready.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sightline.deploy.processes import free_ports
from sightline.engine.config import EngineConfig
from sightline.engine.api_server import serve_in_thread
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.config import TelemetryConfig

from ..support import wait_for_http

CLI = [sys.executable, "-c", "import sys; from sightline.deploy.cli import main; sys.exit(main())"]


def _trace(query: int, trace_id: str, want: int, timeout_s: float = 30.0) -> list[dict]:
    """The stored spans of ``trace_id`` once ``want`` of them arrived (or the deadline)."""
    deadline = time.monotonic() + timeout_s
    spans: list[dict] = []
    while time.monotonic() < deadline:
        try:
            body = json.loads(urllib.request.urlopen(
                f"http://127.0.0.1:{query}/api/v1/traces/{trace_id}", timeout=5).read())
            spans = body["spans"]
            if len(spans) >= want:
                return spans
        except urllib.error.HTTPError as exc:   # 404 until the spans arrive
            if exc.code != 404:
                raise
        time.sleep(0.2)
    return spans


def test_startup_trace_reaches_the_collector_with_one_span_per_phase():
    grpc, http, zipkin, query = free_ports(4)
    collector = subprocess.Popen(CLI + ["collector", "run", "--otlp-grpc", f"127.0.0.1:{grpc}",
                                        "--otlp-http", f"127.0.0.1:{http}", "--zipkin",
                                        f"127.0.0.1:{zipkin}", "--http", f"127.0.0.1:{query}",
                                        "--log-level", "WARNING"])
    running = None
    try:
        wait_for_http(f"http://127.0.0.1:{query}/healthz", process=collector)
        telemetry = TelemetryConfig(level="requests", otlp_endpoint=f"http://127.0.0.1:{grpc}",
                                    schedule_delay_s=0.05, metrics_enabled=False)
        running = serve_in_thread(EngineConfig(model="tiny", device="cpu", port=0,
                                               kv_cache_gib=0.01, telemetry=telemetry,
                                               shutdown_timeout_s=10))
        report = running.engine.startup_report
        health = json.loads(urllib.request.urlopen(running.url + "/health", timeout=5).read())
        trace_id = health["startup_trace_id"]
        assert trace_id == report.trace_id and len(trace_id) == 32
        spans = _trace(query, trace_id, len(report.phases) + 1)
    finally:
        if running is not None:
            running.stop()
        collector.send_signal(signal.SIGTERM)
        collector.wait(timeout=30)
    [root] = [s for s in spans if s["name"] == sc.SPAN_ENGINE_STARTUP]
    assert root["parent_span_id"] in ("", None)
    assert root["attributes"][sc.STARTUP_DURATION_S] == round(report.total_s, 6)
    assert root["end_time_unix_nano"] == report.ready_ns
    phases = [s for s in spans if s["name"] != sc.SPAN_ENGINE_STARTUP]
    assert len(spans) == len(report.phases) + 1
    assert sorted(s["name"] for s in phases) == sorted(
        sc.SPAN_STARTUP_PHASE_PREFIX + p.name for p in report.phases)   # one span per phase
    by_name = {s["name"]: s for s in phases}
    for phase in report.phases:
        span = by_name[sc.SPAN_STARTUP_PHASE_PREFIX + phase.name]
        assert span["parent_span_id"] == root["span_id"]
        assert (span["start_time_unix_nano"], span["end_time_unix_nano"]) == (phase.start_ns,
                                                                            phase.end_ns)
        assert root["start_time_unix_nano"] <= phase.start_ns <= phase.end_ns <= report.ready_ns
        attributes = span["attributes"]
        assert attributes[sc.STARTUP_PHASE] == phase.name
        assert attributes[sc.STARTUP_STATUS] == "warm"   # the CPU's torch paths compile nothing
        assert attributes[sc.STARTUP_VARIANTS_RUN] == phase.variants_run
        assert attributes[sc.STARTUP_VARIANTS_COMPILED] == 0
    assert by_name[sc.SPAN_STARTUP_PHASE_PREFIX + sc.STARTUP_WARMUP_SAMPLER][
        "attributes"][sc.STARTUP_VARIANTS_RUN] == 2
