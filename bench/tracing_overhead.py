"""CPU cost of the tracing calls an engine makes, per request and per step, at each level.

    python -m bench.tracing_overhead --engine     # writes bench/results/tracing_overhead_cpu.json

Timed: the calling thread's wall and CPU time around exactly the engine's calls, with the
real SDK pipeline behind them (batch processor into an exporter that discards): span
creation, validation, links and the queue append, not the export. Medians over
``--repeats`` runs, ns per call, of ``request`` (one request's lifecycle), ``step/B`` (a
step serving B requests), ``bare_sdk_span`` (the SDK's own span, to compare machines), the
level-``off`` branch, and ``traced_step_kernel_spans_encode`` (the capture's largest traced
step's kernel spans OTLP-encoded as the exporter thread does it: thread CPU ms).

``--engine``: the tiny engine loop (offline, CPU) at levels off, requests and steps,
interleaved repeats; and, since run-to-run noise can exceed the cost on a shared machine,
runs that time the tracing calls in place (``in_situ_*``, an upper bound).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from sightline.instrumentation import semconv
from sightline.instrumentation.config import TelemetryConfig, TraceLevel
from sightline.instrumentation.tracing import Telemetry

from ._common import DiscardExporter, InSituTimer, git_commit
from .kernel_containment import attribute, capture_spans

RESULTS = Path(__file__).parent / "results" / "tracing_overhead_cpu.json"
CAPTURE = Path(__file__).parent.parent / "deploy" / "captures" / "h200-20261130-http.jsonl.gz"
PHASES = semconv.REQUEST_PHASE_SPANS


def _telemetry(level: TraceLevel) -> Telemetry:
    config = TelemetryConfig(level=level, exporter="none", metrics_enabled=False,
                             max_queue_size=65536, max_export_batch_size=512,
                             schedule_delay_s=0.05)
    # no encoding: this measures the calling thread, and span calls in a tight loop outrun
    # an encoding exporter (bench/overhead.py measures the encoding where it belongs)
    return Telemetry.start(config, span_exporters=[DiscardExporter(encode=False)])


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


def _traced_step_kernel_spans(capture: Path) -> list:
    """The kernel spans of the capture's largest traced step, rebuilt as the GPU telemetry
    worker builds them now (its span name and attributes from CUPTI-like records)."""
    from opentelemetry.sdk.trace import TracerProvider

    from sightline.instrumentation.cupti_tracer import KernelRecord
    from sightline.instrumentation.finished_spans import FinishedSpans
    from sightline.instrumentation.gpu_telemetry import kernel_span_attributes, kernel_span_name
    from sightline.instrumentation.otel_setup import build_resource

    by_step: dict[bytes, list] = {}
    for span in capture_spans(capture):
        if span.name.startswith(semconv.SPAN_KERNEL_PREFIX):
            by_step.setdefault(span.parent_span_id, []).append(span)
    kernels = max(by_step.values(), key=len)

    collected = []

    class Collect:
        def on_end(self, span):
            collected.append(span)

    provider = TracerProvider(resource=build_resource(TelemetryConfig()))
    spans = FinishedSpans(provider, (Collect(),), semconv.INSTRUMENTATION_SCOPE)
    parent = spans.root_context(semconv.SPAN_ENGINE_STEP)
    for i, k in enumerate(kernels):
        grid = tuple(int(x) for x in attribute(k, semconv.CUDA_GRID, "1,1,1").split(","))
        block = tuple(int(x) for x in attribute(k, semconv.CUDA_BLOCK, "1,1,1").split(","))
        record = KernelRecord(attribute(k, semconv.CUDA_KERNEL_NAME, k.name), k.start_time_unix_nano,
                              k.end_time_unix_nano, grid, block, attribute(k, semconv.CUDA_REGISTERS, 0),
                              attribute(k, semconv.CUDA_SHARED_MEMORY_BYTES, 0), 0,
                              attribute(k, semconv.CUDA_STREAM, 0), 0, i, 1)
        spans.emit(kernel_span_name(record.name), spans.child_context(parent), parent,
                   record.start_ns, record.end_ns, kernel_span_attributes(record, 0))
    return collected


def kernel_span_encoding(kernel_spans: list, rounds: int) -> list[dict]:
    """Thread-CPU ms to OTLP-encode a traced step's kernel spans as they are now and as they
    were before (3 more attributes each — step id, trace reason, cuda.device.id — and the
    SDK's Resource, hashed per span by the encoder); rounds alternate the two."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan

    extra = {semconv.STEP_ID: 101, semconv.STEP_TRACE_REASON: "sampled", semconv.CUDA_DEVICE: 0}
    sdk_resource = Resource(dict(kernel_spans[0].resource.attributes))
    before = [ReadableSpan(name=s.name, context=s.context, parent=s.parent, resource=sdk_resource,
                           attributes={**s.attributes, **extra}, kind=s.kind,
                           start_time=s.start_time, end_time=s.end_time,
                           instrumentation_scope=s.instrumentation_scope)
              for s in kernel_spans]
    variants = {"now": kernel_spans,
                "before: +step id, trace reason, cuda.device.id; Resource hashed per span": before}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(rounds):
        for name in (list(variants) if i % 2 else list(variants)[::-1]):
            c0 = time.thread_time_ns()
            encode_spans(variants[name]).SerializeToString()
            runs[name].append((time.thread_time_ns() - c0) / 1e6)
    return [{"level": "kernels", "op": "traced_step_kernel_spans_encode", "variant": name,
             "spans": len(kernel_spans), "cpu_ms_median": round(statistics.median(r), 1),
             "cpu_ms_runs": [round(x, 1) for x in r]} for name, r in runs.items()]


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


def engine_comparison(levels: list[TraceLevel], num_requests: int, max_tokens: int,
                      repeats: int) -> list[dict]:
    """The tiny model on the CPU, offline (no HTTP), at each level: wall time of the engine
    loop for ``num_requests`` requests of ``max_tokens`` tokens each, median of ``repeats``.

    Requests are traced the way the server does it (start_request, engine phases and steps,
    finish). Levels are interleaved within each repeat so that drift on a shared machine
    hits them alike.
    """
    from sightline.engine.config import EngineConfig
    from sightline.engine.llm_engine import LLMEngine
    from sightline.engine.request import SamplingParams

    engines = {}
    for level in levels:
        telemetry = _telemetry(level)
        engines[level] = (LLMEngine(EngineConfig(model="tiny", device="cpu"), telemetry), telemetry)
    prompt = list(range(1, 33))
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    runs: dict[TraceLevel, list[tuple[float, int, float]]] = {level: [] for level in levels}

    def one_run(engine, telemetry) -> tuple[float, int, float]:
        traces = []
        steps = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(num_requests):
            request_id = engine.new_request_id("bench")
            trace = telemetry.start_request(route="/v1/completions", headers={}, model="tiny",
                                            operation="text_completion", request_id=request_id,
                                            priority=0)
            engine.add_request(request_id, prompt, sampling, trace=trace)
            traces.append(trace)
        while engine.scheduler.has_work:
            engine.step()
            steps += 1
        for trace in traces:
            if trace is not None:
                trace.finish(status_code=200, finish_reason="length", input_tokens=len(prompt),
                             output_tokens=max_tokens)
        return time.perf_counter() - t0, steps, time.process_time() - c0

    for engine, telemetry in engines.values():  # warm-up
        one_run(engine, telemetry)
    in_situ: dict[TraceLevel, list[tuple[int, int, float]]] = {level: [] for level in levels}
    for _ in range(repeats):
        for level in levels:
            runs[level].append(one_run(*engines[level]))
        for level in levels:  # separate timed runs, so the wrapper never inflates the above
            with InSituTimer() as timer:
                wall, _, _ = one_run(*engines[level])
            in_situ[level].append((timer.ns, timer.calls, wall))
    out = []
    for level in levels:
        walls = [w for w, _, _ in runs[level]]
        cpus = [c for _, _, c in runs[level]]
        steps = runs[level][0][1]
        median = statistics.median(walls)
        out.append({"level": level.name.lower(), "requests": num_requests,
                    "max_tokens": max_tokens, "steps": steps,
                    "wall_s_median": round(median, 4), "wall_s_runs": [round(w, 4) for w in walls],
                    "process_cpu_s_median": round(statistics.median(cpus), 4),
                    "process_cpu_s_runs": [round(c, 4) for c in cpus],
                    "ms_per_step_median": round(median / steps * 1000, 3),
                    "output_tokens_per_s": round(num_requests * max_tokens / median, 1),
                    # time inside tracing calls during real engine runs (upper bound)
                    "in_situ_tracing_ms_per_run_median": round(
                        statistics.median(ns for ns, _, _ in in_situ[level]) / 1e6, 3),
                    "in_situ_tracing_calls_per_run": in_situ[level][0][1],
                    "in_situ_tracing_share_of_loop_pct_median": round(statistics.median(
                        100 * ns / 1e9 / wall for ns, _, wall in in_situ[level]), 3),
                    "spans_dropped": engines[level][1].dropped_spans()})
    for engine, telemetry in engines.values():
        engine.shutdown()
        telemetry.shutdown()
    base, base_cpu = out[0]["wall_s_median"], out[0]["process_cpu_s_median"]
    for row in out:
        row["overhead_vs_off_pct"] = round((row["wall_s_median"] / base - 1) * 100, 2)
        row["cpu_overhead_vs_off_pct"] = round((row["process_cpu_s_median"] / base_cpu - 1) * 100, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--capture", type=Path, default=CAPTURE,
                        help="capture whose largest traced step's kernel spans are encoded")
    parser.add_argument("--engine", action="store_true",
                        help="also compare the tiny model's engine loop at each level (CPU)")
    parser.add_argument("--engine-requests", type=int, default=16)
    parser.add_argument("--engine-tokens", type=int, default=32)
    parser.add_argument("--engine-repeats", type=int, default=5)
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

    # A traced step's kernel spans, OTLP-encoded by the span exporter's thread in this
    # process: the largest part of a traced step's CPU that runs outside CUPTI.
    kernel_spans = _traced_step_kernel_spans(args.capture)
    for row in kernel_span_encoding(kernel_spans, rounds=15):
        results.append(row)
        print(f"kernels   encode {row['spans']} kernel spans {row['cpu_ms_median']:7.1f} ms cpu "
              f"({row['variant']})")

    engine_results = None
    if args.engine:
        engine_results = engine_comparison(
            [TraceLevel.OFF, TraceLevel.REQUESTS, TraceLevel.STEPS],
            args.engine_requests, args.engine_tokens, args.engine_repeats)
        for row in engine_results:
            print(f"engine {row['level']:9s} {row['wall_s_median']:8.3f} s "
                  f"({row['ms_per_step_median']:.2f} ms/step, {row['output_tokens_per_s']} tok/s, "
                  f"{row['overhead_vs_off_pct']:+.2f}% wall, {row['cpu_overhead_vs_off_pct']:+.2f}% CPU vs off; "
                  f"in situ {row['in_situ_tracing_ms_per_run_median']} ms in "
                  f"{row['in_situ_tracing_calls_per_run']} tracing calls = "
                  f"{row['in_situ_tracing_share_of_loop_pct_median']}% of the loop)")

    from opentelemetry.sdk.version import __version__ as sdk_version

    record = {
        "benchmark": "tracing_overhead_cpu",
        "git_commit": git_commit(),
        "time_unix": int(time.time()),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "opentelemetry_sdk": sdk_version,
                    "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "method": "calling-thread wall and CPU ns per call, median of repeats; real SDK "
                  "BatchSpanProcessor into a discarding exporter",
        "repeats": args.repeats,
        "results": results,
        "engine": engine_results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
