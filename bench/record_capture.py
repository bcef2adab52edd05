"""Records a telemetry capture of a real HTTP-served engine run, then checks what it holds.

    python -m bench.record_capture --capture deploy/captures/h200-<date>.jsonl.gz --out <dir>
    python -m bench.record_capture --model tiny --device cpu --requests 8 --out /tmp/rc  # CPU

The engine's own server runs in this process at trace level ``kernels`` (on CUDA: CUPTI
kernel spans and the per-SM CTA probe), its telemetry going only to an OTLP JSON Lines
capture. ``--requests`` streamed requests in ``--waves`` concurrent waves (every sixth a chat
completion; priorities 0, 1, 2 in turn; request 0 carries a W3C ``traceparent``, request 1
Zipkin B3 headers); the server is stopped as SIGTERM would, and the capture read back.

Writes ``<out>/record_capture-<device>-<commit8>.json``: requests, client TTFT, server, step
and kernel spans, kernel spans inside their step (kernel_containment's rule), per-SM points
and exemplars, whether the W3C and B3 trace ids were continued. Exit status 1 when a request
failed or, on CUDA, no kernel span was captured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sightline.deploy.load import LatencyStats, RequestRecord, format_summary, summarize
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.capture import read_capture

from ._common import device_name, git_commit, utc_now
from .kernel_containment import capture_spans, step_containment

SERVER_SPANS = (sc.SPAN_HTTP_COMPLETIONS, sc.SPAN_HTTP_CHAT_COMPLETIONS)
_WORDS = "why was this request slow all the way down to the multiprocessor that ran its block".split()


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send, and the trace context its headers carry ("" when none)."""

    index: int
    route: str
    body: dict
    priority: int
    headers: dict[str, str] = field(default_factory=dict)
    propagation: Literal["w3c", "b3"] | None = None
    trace_id: str = ""         # 32 hex digits
    parent_span_id: str = ""   # 16 hex digits


def _prompt_text(rng: random.Random, length: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(length // 3 + 1)]
    return " ".join(words)[:length]


def _propagation(kind: Literal["w3c", "b3"]) -> tuple[dict[str, str], str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    if kind == "w3c":  # flags 01: sampled, so the parent-based sampler records the request
        return {"traceparent": f"00-{trace_id}-{span_id}-01"}, trace_id, span_id
    return {"X-B3-TraceId": trace_id, "X-B3-SpanId": span_id, "X-B3-Sampled": "1"}, trace_id, span_id


def plan_requests(count: int, model: str, seed: int) -> list[PlannedRequest]:
    rng = random.Random(seed)
    plans = []
    for index in range(count):
        chat = index % 6 == 5
        text = _prompt_text(rng, rng.randint(64, 512))
        body = {"model": model, "max_tokens": rng.randint(16, 64), "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "priority": index % 3,
                **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})}
        kind = {0: "w3c", 1: "b3"}.get(index)
        headers, trace_id, parent = _propagation(kind) if kind else ({}, "", "")
        plans.append(PlannedRequest(index, "/v1/chat/completions" if chat else "/v1/completions",
                                    body, body["priority"], headers, kind, trace_id, parent))
    return plans


async def stream_one(session, base_url: str, plan: PlannedRequest) -> RequestRecord:
    """Sends one streamed request. TTFT is the first chunk with text: the chat role chunk that
    opens every chat stream carries none and comes before any token."""
    import aiohttp

    start = time.perf_counter()
    ttft_s, finish, tokens = None, None, 0

    def failed(error: str, http_status: int | None = None) -> RequestRecord:
        return RequestRecord(index=plan.index, priority=plan.priority, status="error", trace_id=plan.trace_id,
                             e2e_s=time.perf_counter() - start, http_status=http_status, error=error[:300])

    try:
        async with session.post(base_url + plan.route, json=plan.body, headers=plan.headers) as response:
            if response.status != 200:
                return failed(f"HTTP {response.status}: {await response.text()}", response.status)
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    return failed(f"engine error: {chunk['error'].get('message')}", 200)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    text = choice["text"] if "text" in choice else choice["delta"].get("content")
                    if text and ttft_s is None:
                        ttft_s = time.perf_counter() - start
                    finish = choice.get("finish_reason") or finish
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    e2e_s = time.perf_counter() - start
    if finish is None:
        return failed("the stream ended without a finish reason", 200)
    tpot_s = (e2e_s - ttft_s) / (tokens - 1) if ttft_s is not None and tokens > 1 else None
    return RequestRecord(index=plan.index, priority=plan.priority, status="ok", trace_id=plan.trace_id,
                         e2e_s=e2e_s, ttft_s=ttft_s, tpot_s=tpot_s, output_tokens=tokens,
                         finish_reason=finish, http_status=200)


# aiohttp keeps an idle connection 15 s; the engine closes one after 10 s (--http-keepalive-timeout),
# and a request sent as the server closes its connection fails before it arrives. A client that
# lets go first never meets a closing socket.
CLIENT_KEEPALIVE_S = 5.0


def client_session(total_s: float = 900.0):
    """An aiohttp session for streaming to the engine: a connection idle ``CLIENT_KEEPALIVE_S`` is let go."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total_s),
                                 connector=aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEPALIVE_S))


async def drive(base_url: str, plans: list[PlannedRequest], waves: int) -> tuple[list[RequestRecord], float]:
    """Each wave's requests at once, one wave after another; returns the records and the wall time."""
    records: list[RequestRecord] = []
    wall_s = 0.0
    async with client_session() as session:
        for wave in range(waves):
            batch = plans[wave * len(plans) // waves:(wave + 1) * len(plans) // waves]
            start = time.perf_counter()
            records += await asyncio.gather(*(stream_one(session, base_url, p) for p in batch))
            wall_s += time.perf_counter() - start
            print(f"wave {wave}: {len(batch)} requests in {time.perf_counter() - start:.1f} s", flush=True)
    return records, wall_s


def start_server(args: argparse.Namespace, capture: Path, otlp_http_endpoint: str | None = None):
    """The engine's HTTP server on a free loopback port, its telemetry written to ``capture``
    (and, with ``otlp_http_endpoint``, sent there too as OTLP/HTTP)."""
    from sightline.engine.config import EngineConfig
    from sightline.engine.api_server import serve_in_thread
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.tracing import Telemetry

    export = ({"exporter": "otlp", "otlp_protocol": "http/protobuf", "otlp_endpoint": otlp_http_endpoint}
              if otlp_http_endpoint else {"exporter": "none"})
    telemetry = Telemetry.start(TelemetryConfig(
        level="kernels", capture_path=str(capture), **export,
        kernel_sample_ratio=args.kernel_sample_ratio,
        kernel_sample_ratio_slow=getattr(args, "kernel_sample_ratio_slow",
                                         TelemetryConfig.kernel_sample_ratio_slow),
        metric_export_interval_s=getattr(args, "metric_export_interval", 10.0),
        resource_attributes={"host.name": socket.gethostname(),
                             "sightline.capture": "bench/record_capture.py"},
        # A traced step ends hundreds of kernel spans at once: a queue that holds them all
        # keeps the capture whole, and a long shutdown lets the last of them reach the file.
        max_queue_size=1 << 17, shutdown_timeout_s=120.0))
    config = EngineConfig(model=args.model, device=args.device, host="127.0.0.1", port=0)
    return serve_in_thread(config, timeout_s=args.start_timeout, telemetry=telemetry), telemetry


def _attribute(span, key: str):
    for kv in span.attributes:
        if kv.key == key:
            return getattr(kv.value, kv.value.WhichOneof("value"))
    return None


def _cta_points(capture: Path) -> list:
    return [point for signal, _, request in read_capture(capture) if signal == "metrics"
            for resource_metrics in request.resource_metrics for scope in resource_metrics.scope_metrics
            for metric in scope.metrics if metric.name == sc.METRIC_CTA_DURATION
            for point in metric.exponential_histogram.data_points]


def read_back(capture: Path, plans: list[PlannedRequest]) -> dict:
    """What the capture holds: span and point counts, and whether the sent trace ids continued."""
    spans = list(capture_spans(capture))
    server = [s for s in spans if s.name in SERVER_SPANS]
    server_ttft = [t for t in (_attribute(s, sc.REQUEST_TTFT_S) for s in server) if t is not None]
    contained = step_containment(spans)
    points = _cta_points(capture)
    out = {"server_spans": len(server), "server_spans_with_ttft": len(server_ttft),
           "server_ttft": _stats(LatencyStats.of(server_ttft)), "step_spans": contained["steps"],
           "kernel_spans": sum(s.name.startswith(sc.SPAN_KERNEL_PREFIX) for s in spans),
           "kernel_spans_inside_step": contained["inside_step"],
           "kernel_spans_fraction_inside_step": contained["fraction_inside"],
           "per_sm_points": len(points),
           "per_sm_points_with_exemplars": sum(bool(p.exemplars) for p in points)}
    for plan in plans:
        if plan.propagation is not None:  # continued: the server span is the sent span's child
            out[f"{plan.propagation}_trace_id"] = plan.trace_id
            out[f"{plan.propagation}_continued"] = any(
                s.trace_id.hex() == plan.trace_id and s.parent_span_id.hex() == plan.parent_span_id
                for s in server)
    return out


def _stats(stats: LatencyStats | None) -> dict | None:
    return None if stats is None else dataclasses.asdict(stats)


def _ms(stats: dict | None) -> str:
    return "-" if stats is None else f"p50 {stats['p50_s'] * 1e3:.1f} ms, p99 {stats['p99_s'] * 1e3:.1f} ms"


def default_capture() -> str:
    """``h200-capture.jsonl.gz`` in ``$RESULTS_DIR`` (where ``gpu_session.sh`` collects results)."""
    out = os.environ.get("RESULTS_DIR")
    return str(Path(out) / "h200-capture.jsonl.gz") if out else "/tmp/capture.jsonl.gz"


def _summary_text(record: dict) -> str:
    s = record["summary"]
    ttft_count = s["client_ttft"]["count"] if s["client_ttft"] else 0
    return (f"capture {record['capture']} ({record['capture_bytes'] / 1e3:.0f} kB), device {record['device']}\n"
            f"requests ok {s['requests_ok']}/{s['requests_sent']}; client TTFT {_ms(s['client_ttft'])} "
            f"over {ttft_count} requests that streamed text\n"
            f"server spans {s['server_spans']}, with TTFT {s['server_spans_with_ttft']} "
            f"({_ms(s['server_ttft'])}); step spans {s['step_spans']}; kernel spans {s['kernel_spans']}, "
            f"inside their step {s['kernel_spans_inside_step']}\n"
            f"per-SM points {s['per_sm_points']}, with exemplars {s['per_sm_points_with_exemplars']}; "
            f"dropped spans {s['dropped_spans']}\n"
            f"W3C trace {s['w3c_trace_id']} continued: {s['w3c_continued']}; "
            f"B3 trace {s['b3_trace_id']} continued: {s['b3_continued']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b", help="engine preset or model directory")
    ap.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--requests", type=int, default=32, help="requests in all, over the waves")
    ap.add_argument("--waves", type=int, default=2, help="waves of concurrent requests, one after another")
    ap.add_argument("--kernel-sample-ratio", type=float, default=0.05,
                    help="share of steps traced down to the kernels, besides the slow tail")
    ap.add_argument("--capture", default=default_capture(), help="capture file to write (replaced)")
    ap.add_argument("--out", default="bench/results", help="folder for the result JSON")
    ap.add_argument("--seed", type=int, default=0, help="prompts, lengths and max_tokens")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds the engine may take to start")
    args = ap.parse_args(argv)
    if not 1 <= args.waves <= args.requests or args.requests < 2:
        ap.error(f"--requests {args.requests} --waves {args.waves}: need 2 <= requests and "
                 "1 <= waves <= requests (requests 0 and 1 carry the W3C and B3 contexts)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    capture = Path(args.capture)
    capture.unlink(missing_ok=True)  # the writer appends: an old capture would be counted too
    running, telemetry = start_server(args, capture)
    on_cuda = running.engine.runner.device.type == "cuda"
    device = device_name(running.engine.runner.device, cpu_fallback="cpu")
    print(f"[{time.time() - t0:.1f}s] serving {args.model} on {running.url} ({device})", flush=True)
    plans = plan_requests(args.requests, running.engine.model_name, args.seed)
    try:
        records, wall_s = asyncio.run(drive(running.url, plans, args.waves))
    finally:
        running.stop(timeout_s=300.0)  # drain, engine shutdown, telemetry shutdown: the capture closes
    client = summarize(records, wall_s)
    summary = {"requests_sent": len(records), "requests_ok": client.ok, "client_ttft": _stats(client.ttft),
               "client_e2e_s_max": max(r.e2e_s for r in records), "dropped_spans": telemetry.dropped_spans(),
               **read_back(capture, plans), "errors": [r.error for r in records if r.error][:5]}
    commit = git_commit()
    record = {"commit": commit, "device": device, "time_utc": utc_now(),
              "command": "python -m bench.record_capture " + " ".join(sys.argv[1:] if argv is None else argv),
              "wall_s": time.time() - t0, "capture": str(capture), "capture_bytes": capture.stat().st_size,
              "config": {k: v for k, v in vars(args).items() if k not in ("capture", "out")},
              "summary": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"record_capture-{device.replace(' ', '-').lower()}-{commit[:8]}.json"
    path.write_text(json.dumps(record, indent=1))
    print(format_summary(client))
    print(_summary_text(record) + f"\nwrote {path}", flush=True)
    failed = summary["requests_ok"] < summary["requests_sent"] or (on_cuda and summary["kernel_spans"] == 0)
    return 1 if failed else 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
