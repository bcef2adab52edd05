"""CPU cost of the tracing calls an engine makes, per request and per step, at each level.

What is timed is the calling thread's wall time (``time.perf_counter_ns``) and CPU time
(``time.thread_time_ns``, less disturbed by other processes on a shared box) around exactly
the calls the engine makes, with the real SDK pipeline behind them (BatchSpanProcessor
into an exporter that discards), so the cost includes span creation, attribute
validation, links, and the queue append — but not the export, which runs on the SDK's
worker thread. Each figure is the median over ``--repeats`` runs of ``--iterations``
calls, in ns per call.

- ``request``: one request's lifecycle: start_request, five phases opened and closed,
  first_token, finish (the per-request cost, excluding steps).
- ``bare_sdk_span``: reference, the SDK's own start+end of one span without processors;
  divide by it to compare machines.
- ``step/B``: one engine step serving B requests: start_step with B links, B link_step
  calls, end.
At level ``off`` the engine's pattern is timed: the call returns None and the caller
branches on it.

Run: ``.venv/bin/python bench/tracing_overhead.py`` (writes
bench/results/tracing_overhead_cpu.json with the git commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from sightline.instrumentation import semconv
from sightline.instrumentation.config import TelemetryConfig, TraceLevel
from sightline.instrumentation.tracing import Telemetry

RESULTS = Path(__file__).parent / "results" / "tracing_overhead_cpu.json"
PHASES = semconv.REQUEST_PHASE_SPANS


class DiscardExporter(SpanExporter):
    """Accepts and forgets spans (stands where the OTLP exporter would be)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans):
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def _telemetry(level: TraceLevel) -> Telemetry:
    config = TelemetryConfig(level=level, exporter="none", metrics_enabled=False,
                             max_queue_size=65536, max_export_batch_size=512,
                             schedule_delay_s=0.05)
    return Telemetry.start(config, span_exporters=[DiscardExporter()])


def _request_lifecycle(telemetry: Telemetry, n: int) -> int:
    """n request lifecycles; returns (wall ns, thread CPU ns)."""
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for i in range(n):
        req = telemetry.start_request(route="/v1/completions", headers=headers, model="m",
                                      operation="text_completion", request_id="r", priority=0)
        if req is not None:
            for phase in PHASES:
                req.start_phase(phase)
                if phase == semconv.SPAN_PREFILL:
                    req.end_phase(phase)
                    req.first_token()
                else:
                    req.end_phase(phase)
            req.finish(status_code=200, finish_reason="stop", input_tokens=16, output_tokens=16,
                       ttft_s=0.1, tpot_s=0.01, queue_s=0.001, e2e_s=0.3, preemptions=0)
    return time.perf_counter_ns() - t0, time.thread_time_ns() - c0


def _steps(telemetry: Telemetry, batch: int, n: int) -> int:
    """n steps of ``batch`` requests (each in decode); returns (wall ns, thread CPU ns)."""
    reqs = []
    for i in range(batch):
        req = telemetry.start_request(route="/v1/completions", headers={}, model="m",
                                      operation="text_completion", request_id=str(i), priority=0)
        if req is not None:
            req.start_phase(semconv.SPAN_DECODE)
        reqs.append(req)
    attrs = {semconv.STEP_DECODE_TOKENS: batch, semconv.STEP_PREFILL_TOKENS: 0}
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for i in range(n):
        step = telemetry.start_step(i, requests=reqs, attributes=attrs)
        if step is not None:
            for req in reqs:
                req.link_step(step)
            step.end()
    elapsed = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
    for req in reqs:
        if req is not None:
            req.finish(status_code=200, finish_reason="stop", input_tokens=1, output_tokens=1)
    return elapsed


def _bare_sdk_span(n: int) -> tuple[int, int]:
    """Reference: the SDK's own cost of one span with no processor (start + end)."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("bench")
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(n):
        tracer.start_span("s").end()
    return time.perf_counter_ns() - t0, time.thread_time_ns() - c0


def _measure(fn, iterations: int, repeats: int) -> dict:
    """Median and runs of wall and thread-CPU ns per call."""
    fn(max(1, iterations // 10))  # warm-up
    runs = [fn(iterations) for _ in range(repeats)]
    wall = [w / iterations for w, _ in runs]
    cpu = [c / iterations for _, c in runs]
    return {"ns_per_call_median": round(statistics.median(wall)),
            "cpu_ns_per_call_median": round(statistics.median(cpu)),
            "ns_per_call_runs": [round(r) for r in wall],
            "cpu_ns_per_call_runs": [round(r) for r in cpu],
            "iterations": iterations}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    results = []
    m = _measure(_bare_sdk_span, args.iterations, args.repeats)
    results.append({"level": "sdk_reference", "op": "bare_sdk_span", "batch": None, **m})
    print(f"reference bare SDK span {m['ns_per_call_median'] / 1000:7.2f} us wall"
          f" {m['cpu_ns_per_call_median'] / 1000:9.2f} us cpu")
    for level in (TraceLevel.OFF, TraceLevel.REQUESTS, TraceLevel.STEPS):
        telemetry = _telemetry(level)
        m = _measure(lambda n: _request_lifecycle(telemetry, n), args.iterations, args.repeats)
        results.append({"level": level.name.lower(), "op": "request", "batch": None, **m})
        print(f"{level.name.lower():9s} request      {m['ns_per_call_median'] / 1000:9.2f} us wall"
              f" {m['cpu_ns_per_call_median'] / 1000:9.2f} us cpu")
        for batch in args.batches:
            iterations = max(50, args.iterations // max(1, batch // 4))
            m = _measure(lambda n: _steps(telemetry, batch, n), iterations, args.repeats)
            results.append({"level": level.name.lower(), "op": "step", "batch": batch, **m})
            print(f"{level.name.lower():9s} step/{batch:<7d} {m['ns_per_call_median'] / 1000:9.2f} us wall"
                  f" {m['cpu_ns_per_call_median'] / 1000:9.2f} us cpu")
        telemetry.shutdown()
        assert telemetry.dropped_spans() == 0, "bench queue overflowed; raise max_queue_size"

    from opentelemetry.sdk.version import __version__ as sdk_version

    record = {
        "benchmark": "tracing_overhead_cpu",
        "git_commit": _git_commit(),
        "time_unix": int(time.time()),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "opentelemetry_sdk": sdk_version,
                    "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "method": "calling-thread wall and CPU ns per call, median of repeats; real SDK "
                  "BatchSpanProcessor into a discarding exporter",
        "repeats": args.repeats,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
