"""OTLP protobuf ingest (HTTP or gRPC): spans/s per core and memory, Sightline's collector vs rotel.

    python -m bench.collector_ingest [--protocol grpc] [--mix no-kernel] [--baseline-rev REV]

Targets (see ``Server``): ``sightline-e2e`` (the collector as deployed), ``sightline-e2e-eager``
(``--trace-store eager``), ``sightline-ingest`` (a discard sink instead of the aggregator),
``rotel-blackhole`` (rotel's counterpart); ``<target>@base``: commit REV's code, interleaved.

Method: a separate process serves; this one sends pre-serialized export requests of one
span mix (``--mix``), every send with fresh trace ids (``FreshIds``), over keep-alive HTTP
connections or gRPC channels (one call in flight per connection or channel).
Spans/s per core = spans acknowledged / server CPU seconds in the window (so it does not
depend on how many cores the loader leaves the server); wall-clock spans/s and peak RSS
too. Each target runs ``--repeats`` times, interleaved; medians.
Results: bench/results/collector_ingest.json and .md (with the git commit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from sightline.instrumentation import semconv as sc

from ._common import ROOT, git_commit, process_cpu_s, utc_now, write_report

RESULTS = ROOT / "bench" / "results"


@dataclass
class RunResult:
    target: str
    repeat: int
    seconds: float
    spans_acked: int
    requests_acked: int
    requests_429: int
    requests_failed: int
    server_cpu_s: float
    spans_per_s_wall: float
    spans_per_cpu_s: float
    spans_aggregated: int | None  # sightline-e2e: acked in the window minus queue growth
    aggregated_per_cpu_s: float | None
    server_rss_mib: float
    server_peak_rss_mib: float
    load_avg_1m: float  # the machine's, at the end of the window (2 shared CPUs: context)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_payloads(n_requests: int, spans_per_request: int) -> list[bytes]:
    """Engine-like spans: decode/step names, 16/8-byte ids, 6 attributes each."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    names = ("queue", "prefill", "decode", "engine.step", "detokenize", "POST /v1/completions")
    payloads = []
    for r in range(n_requests):
        request = ExportTraceServiceRequest()
        rs = request.resource_spans.add()
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = "service.name", "sightline-engine"
        scope = rs.scope_spans.add()
        scope.scope.name = "sightline"
        for i in range(spans_per_request):
            span = scope.spans.add()
            span.trace_id = os.urandom(16)
            span.span_id = os.urandom(8)
            span.parent_span_id = os.urandom(8)
            span.name = names[i % len(names)]
            span.kind = 1
            span.start_time_unix_nano = time.time_ns()
            span.end_time_unix_nano = span.start_time_unix_nano + 1_000_000 + i
            for key, value in (("gen_ai.request.model", "tiny-llama"), ("sightline.request.priority", 1),
                               ("sightline.step.id", r * spans_per_request + i),
                               ("sightline.step.batch_size", 32), ("gen_ai.usage.output_tokens", 128),
                               ("sightline.request.id", f"req-{r}-{i}")):
                a = span.attributes.add()
                a.key = key
                if isinstance(value, str):
                    a.value.string_value = value
                else:
                    a.value.int_value = value
        payloads.append(request.SerializeToString())
    return payloads


def make_engine_mix_payloads(n_payloads: int) -> tuple[list[bytes], int]:
    """``sketch_accuracy``'s engine-like exports (28 requests each: 520 spans), distinct ids."""
    return make_mix_payloads("engine", n_payloads)


# mix -> (engine requests per export for sketch_accuracy's _span_mix, which spans to keep):
# engine-like keeps everything (46 % kernel spans), no-kernel drops the kernel spans (request
# trees and steps only), kernel-heavy keeps the kernel spans and their steps (95 % kernel).
_K = sc.SPAN_KERNEL_PREFIX
_MIXES = {"engine": (28, lambda name, kernel_step: True),
          "no-kernel": (52, lambda name, kernel_step: not name.startswith(_K)),
          "kernel-heavy": (60, lambda name, kernel_step: name.startswith(_K) or kernel_step)}
MIXES = ("no-kernel", "engine", "kernel-heavy", "simple")


def make_mix_payloads(mix: str, n_payloads: int) -> tuple[list[bytes], int]:
    """``n_payloads`` exports of ``mix`` (see ``_MIXES``; about 500 spans each), distinct ids;
    returns them and their span count (the same for all)."""
    from .sketch_accuracy import _span_mix

    n_requests, keep = _MIXES[mix]
    payloads, counts = [], set()
    for i in range(n_payloads):
        request = _span_mix(n_requests, seed=100 + i)
        spans = request.resource_spans[0].scope_spans[0].spans
        kernel_parents = {s.parent_span_id for s in spans if s.name.startswith(_K)}
        kept = [s for s in spans if keep(s.name, s.span_id in kernel_parents)]
        if len(kept) != len(spans):
            del spans[:]
            spans.extend(kept)
        counts.add(len(spans))
        payloads.append(request.SerializeToString())
    assert len(counts) == 1, counts
    return payloads, counts.pop()


class FreshIds:
    """The payloads, each send with trace ids never sent before (the collector drops retried spans
    as duplicates, so a loop over a few payloads must not resend the same ids).

    Send ``i`` takes payload ``i % n`` and XORs the cycle number ``i // n`` into the first 8 bytes of
    every trace id in it (spans and links alike, so spans of one trace stay one trace): one numpy
    copy and scatter per send, in the load generator's process."""

    def __init__(self, payloads: list[bytes]) -> None:
        import numpy as np
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self._np = np
        self.payloads = payloads
        self._offsets = []
        for payload in payloads:
            starts = set()
            request = ExportTraceServiceRequest.FromString(payload)
            for rs in request.resource_spans:
                for scope in rs.scope_spans:
                    for span in scope.spans:
                        for ids in (span, *span.links):
                            at = payload.find(b"\n\x10" + ids.trace_id + b"\x12\x08" + ids.span_id)
                            assert at >= 0, "ids not found in the encoding"
                            starts.add(at + 2)
            self._offsets.append(np.array(sorted(starts))[:, None] + np.arange(8))

    def __len__(self) -> int:
        return len(self.payloads)

    def body(self, i: int) -> bytes:
        n = len(self.payloads)
        cycle, index = divmod(i, n)
        if cycle == 0:
            return self.payloads[index]
        data = self._np.frombuffer(self.payloads[index], dtype=self._np.uint8).copy()
        data[self._offsets[index]] ^= self._np.frombuffer(cycle.to_bytes(8, "little"), dtype=self._np.uint8)
        return data.tobytes()


class Server:
    """A collector or rotel process on free ports; ``url`` is its OTLP/HTTP traces URL,
    ``grpc_target`` its OTLP/gRPC address."""

    def __init__(self, target: str, workdir: Path, baseline: Path | None = None) -> None:
        self.target = target
        name, _, variant = target.partition("@")
        http_port, grpc_port = _free_port(), _free_port()
        self.log = workdir / f"{target.replace('@', '-')}.log"
        env = dict(os.environ)
        env.pop("SIGHTLINE_COLLECTOR_TOKEN", None)
        if variant == "base":
            assert baseline is not None, "an @base target needs --baseline-rev"
            env["PYTHONPATH"] = str(baseline) + os.pathsep + env.get("PYTHONPATH", "")
        # sightline-e2e: `sightline collector run` as deployed, end to end: receivers, limits,
        # parse, bounded queue, the real aggregator (span distributions, trace store).
        # sightline-ingest: the same with `--sink discard` (rotel's counterpart).
        # sightline-e2e-eager: the trace store indexes spans as they arrive instead of on the
        # first query. rotel-blackhole: `rotel-agent start --exporter blackhole` (a Rust
        # collector that receives, decodes and batches, then drops). target@base: the same
        # target with commit REV's code (`git archive` into a scratch folder) first on its
        # PYTHONPATH: a before/after ratio from one run.
        if name.startswith("sightline"):
            query_port = _free_port()
            command = [sys.executable, "-m", "sightline.deploy.cli", "collector", "run",
                       "--otlp-http", f"127.0.0.1:{http_port}", "--otlp-grpc", f"127.0.0.1:{grpc_port}",
                       "--zipkin", f"127.0.0.1:{_free_port()}", "--http", f"127.0.0.1:{query_port}",
                       "--log-level", "WARNING",
                       "--sink", "discard" if name == "sightline-ingest" else "aggregator"]
            if name == "sightline-e2e-eager":
                command += ["--trace-store", "eager"]
            ready = f"http://127.0.0.1:{query_port}/readyz"
            self.metrics_url = f"http://127.0.0.1:{query_port}/metrics"
        else:
            import rotel

            command = [str(Path(rotel.__file__).parent / "rotel-agent"), "start",
                       "--otlp-http-endpoint", f"127.0.0.1:{http_port}",
                       "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}",
                       "--pid-file", str(workdir / "rotel.pid"), "--log-file", str(workdir / "rotel-agent.log"),
                       "--exporter", "blackhole"]
            ready = None
            self.metrics_url = None
        self.url = f"http://127.0.0.1:{http_port}/v1/traces"
        self.grpc_target = f"127.0.0.1:{grpc_port}"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{target} exited: {self.log.read_text()[-2000:]}")
            try:
                if ready:
                    urllib.request.urlopen(ready, timeout=1).close()
                else:
                    socket.create_connection(("127.0.0.1", http_port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _queue_depth(metrics_url: str | None) -> float:
    if metrics_url is None:
        return 0.0
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("sightline_collector_queue_depth "):
                return float(line.split()[1])
    return 0.0


_GRPC_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _http_sender(url: str):
    """``(open, send, close)`` for keep-alive OTLP/HTTP connections: ``send(body)`` returns
    200, 429 (retry later) or another status (-1: the connection failed)."""
    headers = {"Content-Type": "application/x-protobuf"}
    state = {}

    async def open_(connections: int) -> None:
        state["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections))

    async def send(k: int, body: bytes) -> int:
        try:
            async with state["session"].post(url, data=body, headers=headers) as response:
                await response.read()
                return response.status
        except aiohttp.ClientError:
            return -1

    async def close() -> None:
        await state["session"].close()

    return open_, send, close


def _grpc_sender(target: str):
    """The same over OTLP/gRPC: one channel per sender, the pre-encoded
    ExportTraceServiceRequest sent as raw bytes; OK is 200, RESOURCE_EXHAUSTED 429."""
    import grpc

    calls = []
    channels = []

    async def open_(connections: int) -> None:
        for _ in range(connections):
            channel = grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
            channels.append(channel)
            calls.append(channel.unary_unary(_GRPC_EXPORT, request_serializer=None, response_deserializer=None))

    async def send(k: int, body: bytes) -> int:
        try:
            await calls[k](body, timeout=30)
            return 200
        except grpc.aio.AioRpcError as error:
            return 429 if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else -1

    async def close() -> None:
        for channel in channels:
            await channel.close()

    return open_, send, close


async def _load(sender, payloads: FreshIds, connections: int, warmup_s: float, seconds: float,
                pid: int, metrics_url: str | None) -> tuple:
    open_, send, close = sender
    counts = {"acked": 0, "429": 0, "failed": 0}
    measuring = False
    stop_at = time.monotonic() + warmup_s + seconds

    async def sender_task(k: int) -> None:
        i = k
        while time.monotonic() < stop_at:
            body = payloads.body(i)
            i += connections
            status = await send(k, body)
            if not measuring:
                continue
            if status == 200:
                counts["acked"] += 1
            elif status == 429:
                counts["429"] += 1
                await asyncio.sleep(0.01)
            else:
                counts["failed"] += 1

    await open_(connections)
    try:
        tasks = [asyncio.create_task(sender_task(k)) for k in range(connections)]
        await asyncio.sleep(warmup_s)
        depth0 = await asyncio.to_thread(_queue_depth, metrics_url)
        measuring = True
        cpu0, t0 = process_cpu_s(pid), time.monotonic()
        await asyncio.sleep(seconds)
        cpu1, t1 = process_cpu_s(pid), time.monotonic()
        measuring = False
        depth1 = await asyncio.to_thread(_queue_depth, metrics_url)
        await asyncio.gather(*tasks)
    finally:
        await close()
    return counts, cpu1 - cpu0, t1 - t0, depth1 - depth0


def baseline_tree(rev: str, workdir: Path) -> Path:
    """A folder whose ``sightline`` package is commit ``rev``'s rooms (for PYTHONPATH)."""
    source, package = workdir / "baseline-src", workdir / "baseline" / "sightline"
    source.mkdir(parents=True, exist_ok=True)
    package.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    for room in ("instrumentation", "engine", "collector", "dashboards", "deploy"):
        (package / room).symlink_to(source / room)
    return package.parent


def run_once(target: str, repeat: int, payloads: FreshIds, args, workdir: Path,
             baseline: Path | None = None) -> RunResult:
    server = Server(target, workdir, baseline)
    try:
        sender = _grpc_sender(server.grpc_target) if args.protocol == "grpc" else _http_sender(server.url)
        counts, cpu_s, wall_s, depth_growth = asyncio.run(_load(
            sender, payloads, args.connections, args.warmup_s, args.seconds, server.process.pid,
            server.metrics_url))
        rss = _status_mib(server.process.pid, "VmRSS")
        peak = _status_mib(server.process.pid, "VmHWM")
    finally:
        server.stop()
    # The rate counts spans acknowledged (HTTP 200) per CPU second of the server process
    # (user + system, from /proc). For sightline-e2e, "aggregated" is what left the queue
    # into the aggregator in the window (acknowledged minus queue growth; once the queue is
    # full the rest is answered 429, which the loader counts and retries later).
    spans = counts["acked"] * args.spans_per_request
    aggregated = int(spans - depth_growth) if target.startswith("sightline-e2e") else None
    return RunResult(target, repeat, round(wall_s, 3), spans, counts["acked"], counts["429"], counts["failed"],
                     round(cpu_s, 3), round(spans / wall_s), round(spans / cpu_s) if cpu_s else 0,
                     aggregated, round(aggregated / cpu_s) if aggregated is not None and cpu_s else None,
                     round(rss, 1), round(peak, 1), round(os.getloadavg()[0], 2))


def _in_process_parse_us(payload: bytes, repeats: int = 50) -> dict[str, float]:
    """Where the receiver's protobuf time goes, without HTTP: parse (into the decoded form the
    receivers parse into), and count."""
    from sightline.collector.decoded_traces import DecodedTraceRequest as ExportTraceServiceRequest
    from sightline.collector.decoding import count_spans

    parse = count = float("inf")
    for _ in range(5):  # best of 5: the machine is shared, the minimum is the cost
        t = time.thread_time()
        for _ in range(repeats):
            message = ExportTraceServiceRequest.FromString(payload)
        parse = min(parse, (time.thread_time() - t) / repeats)
        t = time.thread_time()
        for _ in range(repeats):
            count_spans(message)
        count = min(count, (time.thread_time() - t) / repeats)
    return {"parse_us_per_request": round(parse * 1e6, 1), "count_us_per_request": round(count * 1e6, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="sightline-e2e,rotel-blackhole,sightline-ingest,sightline-e2e-eager")
    parser.add_argument("--spans-per-request", type=int, default=512, help="the OTel SDK's default batch")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http",
                        help="OTLP/HTTP protobuf (keep-alive connections) or OTLP/gRPC (one channel per connection)")
    parser.add_argument("--mix", choices=MIXES, default="simple",
                        help="simple: 6 span names cycling, 6 attributes each, 512 spans per request; engine: "
                             "bench/sketch_accuracy.py's engine-like export (request trees, linked steps, 1 in 10 "
                             "steps with 20 kernel spans of 12 attributes), 520 spans per request; no-kernel: the "
                             "same without kernel spans (520); kernel-heavy: only the kernel spans and their steps "
                             "(504)")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "collector_ingest")
    parser.add_argument("--baseline-rev", default=None,
                        help="also run every sightline target on this commit's code (target@base), interleaved")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.baseline_rev:
        targets = [v for t in targets for v in ((t, t + "@base") if t.startswith("sightline") else (t,))]
    if args.mix != "simple":
        payloads, args.spans_per_request = make_mix_payloads(args.mix, 16)
    else:
        payloads = make_payloads(16, args.spans_per_request)
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sightline-bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    baseline = baseline_tree(args.baseline_rev, workdir) if args.baseline_rev else None
    fresh = FreshIds(payloads)
    runs: list[RunResult] = []
    for repeat in range(args.repeats):
        for target in targets:  # interleaved, so drift in machine load hits every target
            result = run_once(target, repeat, fresh, args, workdir, baseline)
            print(json.dumps(asdict(result)), flush=True)
            runs.append(result)
    summary = {}
    for target in targets:
        mine = [r for r in runs if r.target == target]
        # Through the whole target: what reached the aggregator (e2e), else what was acknowledged.
        through = [r.aggregated_per_cpu_s if r.aggregated_per_cpu_s is not None else r.spans_per_cpu_s
                   for r in mine]
        summary[target] = {
            "median_through_per_cpu_s": statistics.median(through),
            "min_through_per_cpu_s": min(through),
            "max_through_per_cpu_s": max(through),
            "median_spans_per_cpu_s": statistics.median(r.spans_per_cpu_s for r in mine),
            "median_spans_per_s_wall": statistics.median(r.spans_per_s_wall for r in mine),
            "median_server_cpu_cores": round(statistics.median(r.server_cpu_s / r.seconds for r in mine), 2),
            "median_peak_rss_mib": statistics.median(r.server_peak_rss_mib for r in mine),
            "median_aggregated_per_cpu_s": (statistics.median(r.aggregated_per_cpu_s for r in mine)
                                            if mine[0].aggregated_per_cpu_s is not None else None),
            "requests_429": sum(r.requests_429 for r in mine),
            "requests_failed": sum(r.requests_failed for r in mine),
        }
    from google.protobuf.internal import api_implementation

    document = {
        "benchmark": "collector_ingest",
        "git_commit": git_commit(dirty_paths=("collector", "bench/collector_ingest.py")),
        "date_utc": utc_now(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "protobuf_backend": api_implementation.Type(), "platform": platform.platform()},
        "method": {"protocol": args.protocol, "mix": args.mix, "spans_per_request": args.spans_per_request, "payload_bytes": len(payloads[0]),
                   "connections": args.connections, "seconds": args.seconds, "warmup_s": args.warmup_s,
                   "repeats": args.repeats, "baseline_rev": args.baseline_rev,
                   "spans_per_core": "spans acknowledged / server CPU seconds (user+system, all threads)"},
        "receiver_protobuf_cost": _in_process_parse_us(payloads[0]),
        "summary": summary,
        "runs": [asdict(r) for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [
        f"# Collector ingest: OTLP/{'gRPC' if args.protocol == 'grpc' else 'HTTP protobuf'}",
        "",
        f"commit `{document['git_commit']}`, {document['date_utc']}, {os.cpu_count()} CPUs (shared), "
        f"Python {platform.python_version()}, protobuf {api_implementation.Type()}; "
        f"{args.mix} mix, {args.spans_per_request} spans/request ({len(payloads[0])} B), {args.connections} connections, "
        f"{args.repeats} x {args.seconds:g} s per target, medians; load average (1 min) "
        f"{min(r.load_avg_1m for r in runs):.1f}..{max(r.load_avg_1m for r in runs):.1f} at the runs' ends.",
        "",
        "| target | what runs | spans/s per core (median) | min .. max | acked spans/s wall | "
        "server cores busy | peak RSS MiB | 429s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    what = {"sightline-e2e": "receivers + queue + aggregator + trace store",
            "rotel-blackhole": "rotel receive + decode + batch, drop",
            "sightline-ingest": "receivers + queue, discard sink",
            "sightline-e2e-eager": "e2e with `--trace-store eager` (indexed as spans arrive)"}
    for target, s in summary.items():
        lines.append(f"| {target} | {what.get(target.partition('@')[0], '')} | {s['median_through_per_cpu_s']:,.0f} | "
                     f"{s['min_through_per_cpu_s']:,.0f} .. {s['max_through_per_cpu_s']:,.0f} | "
                     f"{s['median_spans_per_s_wall']:,.0f} | {s['median_server_cpu_cores']} | "
                     f"{s['median_peak_rss_mib']:.0f} | {s['requests_429']} |")
    if args.baseline_rev:
        lines += ["", f"Current code / `{args.baseline_rev}` (`@base`), medians of the same interleaved run:"]
        for target, s in summary.items():
            base = summary.get(target + "@base")
            if base:
                lines.append(f"- {target}: {s['median_through_per_cpu_s'] / base['median_through_per_cpu_s']:.3f}")
    cost = document["receiver_protobuf_cost"]
    lines += [
        "",
        f"Receiver protobuf cost per {args.spans_per_request}-span request (in-process thread CPU time, no HTTP, best of 5): "
        f"parse {cost['parse_us_per_request']} µs, count {cost['count_us_per_request']} µs.",
        "",
        "spans/s per core = spans through the target / server CPU seconds (user + system, all threads) in "
        "the window. For `sightline-e2e` that is what left its bounded queue (100,000 spans by default) into "
        "the aggregator (acknowledged minus queue growth), so receiving, parsing, queueing and aggregating "
        "are all paid for by the same CPU seconds; for the others it is what was acknowledged (HTTP 200, gRPC OK). "
        "Peak RSS is the server's VmHWM at the end of a run; the e2e collector's includes its trace store "
        "(bounded: 48 MiB of encoded requests by default). The default trace store keeps each request's "
        "encoding and indexes it on the first query (explain, /api/v1/traces), so that cost is paid at "
        "query time, not here; `sightline-e2e-eager` pays it on ingest.",
    ]
    write_report(args.out, "collector_ingest", argv, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
