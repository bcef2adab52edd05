"""The telemetry process under load: killed mid-load, the engine serves on, counts what it
could not hand over, restarts it, and the spans of later requests reach a real collector.

A real ``sightline collector run`` (OTLP gRPC) and the engine with its telemetry in a
separate process (the default of ``engine serve``); requests from the openai SDK. On the CPU
at level steps; on a GPU (``gpu`` marker) at level kernels, CUPTI and the SM probe on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest

from sightline.deploy.processes import free_ports
from sightline.engine.config import EngineConfig
from sightline.engine.api_server import serve_in_thread
from sightline.instrumentation.config import TelemetryConfig

from ..support import wait_for_http

CLI = [sys.executable, "-c", "import sys; from sightline.deploy.cli import main; sys.exit(main())"]


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _stream(client: openai.OpenAI, trace_id: str | None = None) -> str:
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"} if trace_id else None
    chunks = list(client.completions.create(model="tiny", prompt="hello telemetry", max_tokens=8,
                                            stream=True, temperature=0, extra_headers=headers,
                                            extra_body={"ignore_eos": True}))
    return chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("device, level", [
    ("cpu", "steps"), pytest.param("cuda", "kernels", marks=pytest.mark.gpu)])
def test_killed_telemetry_process_is_restarted_and_requests_never_fail(device, level):
    grpc, http, zipkin, query = free_ports(4)
    collector = subprocess.Popen(CLI + ["collector", "run", "--otlp-grpc", f"127.0.0.1:{grpc}",
                                        "--otlp-http", f"127.0.0.1:{http}", "--zipkin", f"127.0.0.1:{zipkin}",
                                        "--http", f"127.0.0.1:{query}", "--log-level", "WARNING"])
    running = None
    try:
        wait_for_http(f"http://127.0.0.1:{query}/healthz", process=collector)
        telemetry = TelemetryConfig(level=level, otlp_endpoint=f"http://127.0.0.1:{grpc}",
                                    schedule_delay_s=0.05, metrics_enabled=False)
        running = serve_in_thread(EngineConfig(model="tiny", device=device, port=0, kv_cache_gib=0.05,
                                               telemetry=telemetry, shutdown_timeout_s=10))
        pipeline = running.server.telemetry
        assert pipeline.mode == "process" and pipeline.pid is not None
        first_pid = pipeline.pid
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        results: list[str] = []
        errors: list[BaseException] = []

        def load(n: int) -> None:
            for _ in range(n):
                try:
                    results.append(_stream(client))
                except BaseException as exc:  # counted below: none may fail
                    errors.append(exc)

        threads = [threading.Thread(target=load, args=(6,)) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        os.kill(first_pid, signal.SIGKILL)              # mid-load
        for t in threads:
            t.join(timeout=120)
        assert errors == [] and results == ["length"] * 24
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (pipeline.pid in (None, first_pid)):
            time.sleep(0.1)
        assert pipeline.pid not in (None, first_pid)
        assert _metric(running.url, "sightline_telemetry_process_restarts_total") >= 1
        assert _metric(running.url, "sightline_telemetry_process_up") == 1
        # what the dead process could not take is counted under its own reason
        metrics = urllib.request.urlopen(running.url + "/metrics", timeout=5).read().decode()
        assert 'sightline_telemetry_events_dropped_total{reason="process_down"}' in metrics
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        assert _stream(client, trace_id) == "length"    # after the restart
        running.stop()
        running = None
        expected = {"POST /v1/completions", "tokenize", "queue", "prefill", "decode", "detokenize"}
        deadline = time.monotonic() + 30
        names: list[str] = []
        while time.monotonic() < deadline:   # the server span may be stored in a later batch
            try:
                body = json.loads(urllib.request.urlopen(
                    f"http://127.0.0.1:{query}/api/v1/traces/{trace_id}", timeout=5).read())
                names = sorted({s["name"] for s in body.get("spans", [])})
                if expected <= set(names):
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert expected <= set(names), names
    finally:
        if running is not None:
            running.stop()
        collector.send_signal(signal.SIGTERM)
        collector.wait(timeout=30)


def test_the_telemetry_process_and_its_threads_yield_the_cpu_to_the_engine():
    """The telemetry process shares the engine's CPUs: it runs at the configured nice value,
    every one of its threads (exporters' included), so that it takes none from the engine."""
    from sightline.instrumentation.telemetry_pipeline import TelemetryPipeline

    pipeline = TelemetryPipeline.start(TelemetryConfig(level="steps", exporter="none",
                                                       metrics_enabled=False, process_nice=7))
    try:
        pid = pipeline.pid
        assert pid is not None

        def nice_values() -> set[int]:
            values = set()
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    values.add(int(f.read().rsplit(")", 1)[1].split()[16]))   # field 19: nice
            return values

        deadline = time.monotonic() + 30   # until it has read its config and started its threads
        while time.monotonic() < deadline and len(os.listdir(f"/proc/{pid}/task")) < 2:
            time.sleep(0.1)
        assert len(os.listdir(f"/proc/{pid}/task")) >= 2
        assert nice_values() == {max(7, os.nice(0))}
    finally:
        pipeline.shutdown()
