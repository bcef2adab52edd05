"""Hostile requests and clients against one collector process: CPU, RSS and /healthz for each.

``sightline collector run`` (own process) is brought to a steady ingest (``--gpus`` x 132 SMs
x ``--kernels`` kernels of CTA points, 512-span trace requests, for ``--warmup-s``): its RSS
then is the *steady* RSS. The load stopped, each body of at most 8 MB below (empty messages
by the million, compression bombs, JSON of empty containers, bodies at each cap) is sent once:
the collector's CPU until idle, its peak RSS over the RSS before (every 5 ms), the slowest
``/healthz`` meanwhile (every 20 ms); bounds 0.5 s, 64 MiB, 100 ms. Then the peak RSS over the
steady RSS (bound 2x) of ``--instances`` distinct ``service.instance.id`` values, ``--names``
1 MB names and ``--scrapers`` /metrics readers of the fleet-sized page at 4 KB/s each.
``--only healthz``: /healthz's p50, p99 and max (asked every 20 ms by a separate process)
while the identities arrive and while the scrapers read; ``--baseline-rev REV`` adds commit
REV's collector in the same run. Results: bench/results/collector_limits.json and .md;
``--only healthz``: collector_limits-healthz-cpu-<commit>.json and .md.
Run: ``.venv/bin/python -m bench.collector_limits [--only healthz --baseline-rev REV]``
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ._collector import CollectorProcess
from ._common import ROOT, git_commit, utc_now, write_report
from .collector_ingest import make_payloads
from .collector_scale import _START, _TIME, build_requests, kernel_names

RESULTS = ROOT / "bench" / "results"
MiB = 1024 * 1024
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
BOUND_CPU_S, BOUND_RSS_MIB, BOUND_HEALTHZ_S, BOUND_RSS_RATIO = 0.5, 64.0, 0.1, 2.0


# -- bodies -------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(tag: int, content: bytes) -> bytes:
    return bytes([tag]) + _varint(len(content)) + content


def empty_resources(n: int) -> bytes:
    """An ExportTraceServiceRequest of ``n`` empty ResourceSpans (2 bytes each)."""
    return b"\x0a\x00" * n


def empty_spans(n: int) -> bytes:
    """One resource, one scope, ``n`` empty Spans."""
    return _field(0x0A, _field(0x12, b"\x12\x00" * n))


def empty_metrics(n: int) -> bytes:
    """One resource, one scope, ``n`` empty Metrics (an ExportMetricsServiceRequest)."""
    return _field(0x0A, _field(0x12, b"\x12\x00" * n))


def bare_attributes(n: int) -> bytes:
    """One span with ``n`` empty attributes."""
    return _field(0x0A, _field(0x12, _field(0x12, b"\x4a\x00" * n)))


@dataclass
class Body:
    name: str
    receiver: str  # otlp_http | otlp_grpc | zipkin
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def hostile_bodies() -> list[Body]:
    """Bodies of at most 8 MB on the wire that cost seconds and gigabytes before."""
    pb = {"Content-Type": "application/x-protobuf"}
    gz = {**pb, "Content-Encoding": "gzip"}
    js = {"Content-Type": "application/json"}
    return [
        Body("4,000,000 empty ResourceSpans (8 MB)", "otlp_http", "/v1/traces", empty_resources(4_000_000), pb),
        Body("4,000,000 empty Spans (8 MB)", "otlp_http", "/v1/traces", empty_spans(4_000_000), pb),
        Body("4,000,000 empty Metrics (8 MB)", "otlp_http", "/v1/metrics", empty_metrics(4_000_000), pb),
        Body("a span of 4,000,000 empty attributes (8 MB)", "otlp_http", "/v1/traces", bare_attributes(4_000_000), pb),
        Body("gzip: 16,000,000 empty ResourceSpans (32 KB, 32 MB inflated)", "otlp_http", "/v1/traces",
             gzip.compress(empty_resources(16_000_000), 9), gz),
        Body("gRPC, gzip: 4,000,000 empty ResourceSpans", "otlp_grpc", TRACE_EXPORT, empty_resources(4_000_000)),
        Body("gRPC: 4,000,000 empty Spans (8 MB)", "otlp_grpc", TRACE_EXPORT, empty_spans(4_000_000)),
        Body("Zipkin: 2,700,000 empty objects (8 MB)", "zipkin", "/api/v2/spans", b"[" + b"{}," * 2_700_000 + b"{}]", js),
        Body("OTLP/JSON: 2,700,000 empty arrays (8 MB)", "otlp_http", "/v1/traces",
             b'{"resourceSpans": [' + b"[]," * 2_700_000 + b"[]]}", js),
    ]


def cap_bodies(gpus_for_points: int = 2) -> list[Body]:
    """Legitimate bodies at (or just past) the default caps: what the largest allowed request costs."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from sightline.collector.otlp_http import to_otlp_json
    from sightline.collector.request_shape import RequestLimits, json_values

    pb = {"Content-Type": "application/x-protobuf"}
    limits = RequestLimits()
    spans = make_payloads(1, 28_000)[0]  # ~7.8 MB: the largest such body under the 8 MiB wire limit
    points = ExportMetricsServiceRequest()
    bodies, _ = build_requests(gpus_for_points, kernel_names(16), ctas=64, seed=7)  # 2,112 points per GPU
    for body in bodies:
        points.MergeFrom(ExportMetricsServiceRequest.FromString(body.replace(_TIME, _now_ns()).replace(_START, _now_ns(-10))))
    while sum(len(m.exponential_histogram.data_points) for rm in points.resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics) > limits.max_points:
        del points.resource_metrics[-1].scope_metrics[0].metrics[0].exponential_histogram.data_points[-1]
    cap = limits.max_json_values

    def otlp_json(n: int) -> bytes:
        return json.dumps(to_otlp_json(ExportTraceServiceRequest.FromString(make_payloads(1, n)[0]))).encode()

    def zipkin_json(n: int) -> bytes:
        return json.dumps([{"traceId": os.urandom(16).hex(), "id": os.urandom(8).hex(), "name": "get /api",
                            "kind": "SERVER", "timestamp": int(time.time() * 1e6), "duration": 1000,
                            "localEndpoint": {"serviceName": "frontend"}, "tags": {"http.method": "GET", "k": "v"}}
                           for _ in range(n)]).encode()

    def near_cap(build) -> bytes:  # the most spans whose body stays within the JSON value cap
        per_span = json_values(build(100)) / 100
        n = int(cap / per_span)
        while json_values(body := build(n)) > cap:
            n -= max(1, n // 100)
        return body

    json_spans, zipkin = near_cap(otlp_json), near_cap(zipkin_json)
    return [
        Body("28,000 spans (7.8 MB, protobuf)", "otlp_http", "/v1/traces", spans, pb),
        Body(f"{limits.max_items:,} spans, the span cap, gzip", "otlp_http", "/v1/traces",
             gzip.compress(make_payloads(1, limits.max_items)[0], 6), {**pb, "Content-Encoding": "gzip"}),
        Body(f"{limits.max_items + 1:,} spans, one past the cap, gzip", "otlp_http", "/v1/traces",
             gzip.compress(make_payloads(1, limits.max_items + 1)[0], 6), {**pb, "Content-Encoding": "gzip"}),
        Body(f"{limits.max_points:,} CTA points, the point cap", "otlp_http", "/v1/metrics",
             points.SerializeToString(), pb),
        Body("OTLP/JSON near the JSON value cap", "otlp_http", "/v1/traces", json_spans, {"Content-Type": "application/json"}),
        Body("Zipkin near the JSON value cap", "zipkin", "/api/v2/spans", zipkin, {"Content-Type": "application/json"}),
    ]


def _now_ns(offset_s: float = 0.0) -> bytes:
    return int((time.time() + offset_s) * 1e9).to_bytes(8, "little")


# -- the collector process ------------------------------------------------------------------
class Collector(CollectorProcess):
    """The collector process (bench/_collector.py), with what this bench reads of it;
    ``pythonpath``: a folder whose ``sightline`` runs instead of this checkout's
    (``collector_ingest.baseline_tree``)."""

    def __init__(self, workdir: Path, extra: list[str], pythonpath: Path | None = None) -> None:
        super().__init__(workdir / "collector.log", extra, pythonpath=pythonpath, ready_timeout_s=90)

    def rss_mib(self) -> float:
        with open(f"/proc/{self.pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB

    def queue_depth(self) -> int:
        with urllib.request.urlopen(self.url("query", "/readyz"), timeout=30) as response:
            return int(json.loads(response.read())["queue_depth"])

    def wait_idle(self, settle_s: float = 0.3) -> None:
        """Until the queue is empty and the process has used no CPU for a while."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            before = self.cpu_s()
            time.sleep(settle_s)
            if self.queue_depth() == 0 and self.cpu_s() - before < 0.05:
                return


def send(collector: Collector, body: Body, timeout_s: float = 120.0) -> str:
    """Sends ``body``; returns its answer (HTTP status or gRPC code)."""
    if body.receiver == "otlp_grpc":
        import grpc

        compression = grpc.Compression.Gzip if "gzip" in body.name else None
        with grpc.insecure_channel(f"127.0.0.1:{collector.ports['grpc']}", compression=compression,
                                   options=[("grpc.max_send_message_length", 64 * MiB)]) as channel:
            try:
                channel.unary_unary(body.path)(body.body, timeout=timeout_s)
                return "OK"
            except grpc.RpcError as error:
                return error.code().name
    port = "zipkin" if body.receiver == "zipkin" else "http"
    request = urllib.request.Request(collector.url(port, body.path), data=body.body, headers=body.headers,
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return str(response.status)
    except urllib.error.HTTPError as error:
        return str(error.code)


class Watch:
    """While open: the collector's peak RSS (every 5 ms) and the slowest /healthz answer (every 20 ms)."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.peak_rss_mib = self.healthz_max_s = 0.0
        self._done = threading.Event()

    def _rss(self) -> None:
        while not self._done.is_set():
            self.peak_rss_mib = max(self.peak_rss_mib, self.collector.rss_mib())
            time.sleep(0.005)

    def _healthz(self) -> None:
        url = self.collector.url("query", "/healthz")
        while not self._done.is_set():
            started = time.monotonic()
            urllib.request.urlopen(url, timeout=60).close()
            self.healthz_max_s = max(self.healthz_max_s, time.monotonic() - started)
            time.sleep(0.02)

    def __enter__(self):
        self.rss0, self.cpu0 = self.collector.rss_mib(), self.collector.cpu_s()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._rss, self._healthz)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(60)
        self.cpu_s = self.collector.cpu_s() - self.cpu0


class HealthzProbe:
    """While open: /healthz asked every ``every_s`` by a separate process (its latencies are
    then the collector's, not this process's GIL's); ``latencies_s`` once closed."""

    def __init__(self, collector: Collector, workdir: Path, every_s: float = 0.02) -> None:
        self.url, self.out, self.every_s = collector.url("query", "/healthz"), workdir / "healthz.json", every_s
        self.latencies_s: list[float] = []

    def __enter__(self):
        self.out.unlink(missing_ok=True)
        self._process = subprocess.Popen([sys.executable, "-c", "import sys; from bench.collector_limits import "
                                          "probe_healthz; probe_healthz(*sys.argv[1:])", self.url, str(self.out),
                                          str(self.every_s)], cwd=ROOT)
        return self

    def __exit__(self, *exc) -> None:
        self._process.terminate()
        self._process.wait(60)
        self.latencies_s = json.loads(self.out.read_text())

    def summary(self) -> dict:
        ordered = sorted(self.latencies_s)
        at = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 1)  # noqa: E731
        return {"probes": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(ordered[-1] * 1e3, 1),
                "over_100_ms": sum(x > 0.1 for x in ordered)}


def probe_healthz(url: str, out: str, every_s: str) -> None:
    """The probing process: GET ``url`` every ``every_s`` until SIGTERM; latencies to ``out``."""
    import signal

    latencies: list[float] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        started = time.monotonic()
        urllib.request.urlopen(url, timeout=60).close()
        latencies.append(time.monotonic() - started)
        stop.wait(float(every_s))
    Path(out).write_text(json.dumps(latencies))


# -- load -----------------------------------------------------------------------------------
def steady_load(collector: Collector, gpus: int, kernels: int, seconds: float, fleet_every_s: float = 10.0) -> float:
    """The fleet's per-SM exports every ``fleet_every_s`` and ten 512-span trace requests a
    second, for ``seconds``; returns the RSS at the end (median of the last 5 s)."""
    fleet, _ = build_requests(gpus, kernel_names(kernels), ctas=64)
    traces = make_payloads(64, 512)
    samples: list[float] = []
    started = time.monotonic()
    sent = 0
    pb = {"Content-Type": "application/x-protobuf"}
    fleet_sent = -fleet_every_s
    while time.monotonic() - started < seconds:
        tick = time.monotonic()
        if tick - fleet_sent >= fleet_every_s:
            fleet_sent = tick
            for body in fleet:
                send(collector, Body("fleet", "otlp_http", "/v1/metrics",
                                     body.replace(_TIME, _now_ns()).replace(_START, _now_ns(-fleet_every_s)), pb))
        for _ in range(10):
            traces_body = traces[sent % len(traces)]
            if sent >= len(traces):  # fresh ids: a repeat would be dropped as a duplicate
                traces_body = make_payloads(1, 512)[0]
            send(collector, Body("traces", "otlp_http", "/v1/traces", traces_body, pb))
            sent += 1
        if time.monotonic() - started > seconds - 5:
            samples.append(collector.rss_mib())
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    collector.wait_idle()
    return statistics.median(samples or [collector.rss_mib()])


def many_identities(collector: Collector, instances: int) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import KeyValue

    from sightline.instrumentation import ExpHistogram
    from sightline.instrumentation import semconv as sc

    one = ExpHistogram(scale=6)
    one.record([1e-5])
    pb = {"Content-Type": "application/x-protobuf"}
    for start in range(0, instances, 4_096):
        request = ExportMetricsServiceRequest()
        now = int(time.time() * 1e9)
        for i in range(start, min(instances, start + 4_096)):
            rm = request.resource_metrics.add()
            rm.resource.attributes.append(KeyValue(key=sc.RESOURCE_SERVICE_INSTANCE_ID))
            rm.resource.attributes[0].value.string_value = f"instance-{i:07d}"
            metric = rm.scope_metrics.add().metrics.add(name=sc.METRIC_CTA_DURATION)
            metric.exponential_histogram.aggregation_temporality = 1
            p = metric.exponential_histogram.data_points.add(count=1, sum=1e-5, scale=6, time_unix_nano=now,
                                                             start_time_unix_nano=now - 10**9, min=1e-5, max=1e-5)
            for key, value in ((sc.ATTR_GPU_ID, "0"), (sc.ATTR_SM_ID, "1"), (sc.ATTR_KERNEL_NAME, "k")):
                kv = p.attributes.add(key=key)
                kv.value.string_value = value
            p.positive.offset = one.offset
            p.positive.bucket_counts.extend(int(c) for c in one.counts)
        send(collector, Body("identities", "otlp_http", "/v1/metrics", request.SerializeToString(), pb))
    collector.wait_idle()


def long_names(collector: Collector, names: int) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from sightline.instrumentation import semconv as sc

    pb = {"Content-Type": "application/x-protobuf"}
    megabyte = "x" * MiB
    now = time.time_ns()
    for start in range(0, 2 * names, 6):  # 6 spans of ~1 MB a request (under 8 MB)
        request = ExportTraceServiceRequest()
        scope = request.resource_spans.add().scope_spans.add()
        for i in range(start, min(2 * names, start + 6)):
            span = scope.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8),
                                   start_time_unix_nano=now - 10**6, end_time_unix_nano=now)
            if i % 2:
                span.name = f"{i}{megabyte}"
            else:
                span.name = sc.SPAN_KERNEL_PREFIX + "k"
                for key, value in ((sc.CUDA_KERNEL_NAME, f"{i}{megabyte}"), (sc.HW_GPU_ID, "0")):
                    kv = span.attributes.add(key=key)
                    kv.value.string_value = value
        send(collector, Body("names", "otlp_http", "/v1/traces", request.SerializeToString(), pb))
    collector.wait_idle()


def slow_scrapers(collector: Collector, scrapers: int, hold_s: float, rate_bytes_s: int = 4096) -> dict:
    """``scrapers`` /metrics readers, each reading ``rate_bytes_s`` a second, for ``hold_s``."""
    selector = selectors.DefaultSelector()
    socks = []
    for _ in range(scrapers):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rate_bytes_s)
        sock.connect(("127.0.0.1", collector.ports["query"]))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n")
        sock.setblocking(False)
        socks.append(sock)
    received = [0] * scrapers
    cut = 0
    started = time.monotonic()
    while time.monotonic() - started < hold_s:
        tick = time.monotonic()
        for i, sock in enumerate(socks):
            if sock is None:
                continue
            try:
                chunk = sock.recv(rate_bytes_s)
            except BlockingIOError:
                continue
            except ConnectionError:
                chunk = b""
            if not chunk:
                sock.close()
                socks[i] = None
                cut += 1
            received[i] += len(chunk)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    for sock in socks:
        if sock is not None:
            sock.close()
    selector.close()
    return {"scrapers": scrapers, "seconds": hold_s, "ended_by_the_collector": cut,
            "median_bytes_read": int(statistics.median(received))}


# -- main -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--kernels", type=int, default=20)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--instances", type=int, default=1_000_000)
    parser.add_argument("--names", type=int, default=1_000)
    parser.add_argument("--scrapers", type=int, default=100)
    parser.add_argument("--scrape-hold-s", type=float, default=45.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", choices=["healthz"], default=None,
                        help="healthz: /healthz latency under the identities and the scrapers only")
    parser.add_argument("--baseline-rev", default=None, help="with --only healthz: also measure this commit")
    args = parser.parse_args(argv)
    if args.only == "healthz":
        return healthz_main(args, argv)
    args.out = args.out or RESULTS / "collector_limits.json"
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sightline-limits-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    result = {"bench": "collector_limits", "commit": git_commit(dirty_paths=["collector", "bench"]),
              "utc": utc_now(), "python": platform.python_version(), "cpus": os.cpu_count(),
              "load_average_at_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
              "bodies": [], "memory": {}}
    # the default configuration for bodies, identities and names; per-SM histograms on
    # /metrics (the fleet-sized page) for the scrapers
    collector = Collector(workdir, [])
    try:
        steady = result["steady_rss_mib"] = steady_load(collector, args.gpus, args.kernels, args.warmup_s)
        for body in hostile_bodies() + cap_bodies():
            collector.wait_idle()
            with Watch(collector) as watch:
                answer = send(collector, body)
                collector.wait_idle(0.2)
            result["bodies"].append({
                "body": body.name, "receiver": body.receiver, "wire_bytes": len(body.body), "answer": answer,
                "cpu_s": round(watch.cpu_s, 3), "peak_rss_over_mib": round(watch.peak_rss_mib - watch.rss0, 1),
                "healthz_max_ms": round(watch.healthz_max_s * 1e3, 1)})
            print(result["bodies"][-1], flush=True)
        _memory(result, "instances", collector, steady, lambda: many_identities(collector, args.instances))
        _memory(result, "names", collector, steady, lambda: long_names(collector, args.names))
    finally:
        collector.stop()
    collector = Collector(workdir, ["--expose-sm-histograms"])
    try:
        steady = result["steady_rss_with_sm_histograms_mib"] = steady_load(collector, args.gpus, args.kernels,
                                                                          args.warmup_s)
        page = len(urllib.request.urlopen(collector.url("query", "/metrics"), timeout=120).read())
        result["metrics_page_bytes"] = page
        _memory(result, "scrapers", collector, steady,
                lambda: slow_scrapers(collector, args.scrapers, args.scrape_hold_s))
        metrics = urllib.request.urlopen(collector.url("query", "/metrics"), timeout=120).read().decode()
        cut = [line for line in metrics.splitlines() if line.startswith("sightline_collector_scrapes_cut_total ")]
        result["memory"]["scrapers"]["cut_by_the_deadline"] = float(cut[0].split()[1]) if cut else None
    finally:
        collector.stop()
    result["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    write_report(args.out, "collector_limits", argv, _report(result, args))
    return 0


def healthz_main(args, argv) -> int:
    """``--only healthz``: see the module docstring."""
    from .collector_ingest import baseline_tree

    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sightline-limits-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    commit = git_commit(dirty_paths=["collector", "bench"])
    result = {"bench": "collector_limits-healthz", "commit": commit, "utc": utc_now(),
              "python": platform.python_version(), "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
              "args": {k: str(v) for k, v in vars(args).items()}, "trees": {}}
    trees = {"current": None}
    if args.baseline_rev:
        trees[f"baseline {args.baseline_rev}"] = baseline_tree(args.baseline_rev, workdir)
    for name, tree in trees.items():
        cases = result["trees"][name] = {}
        for case, flags in (("instances", []), ("scrapers", ["--expose-sm-histograms"])):
            collector = Collector(workdir, flags, tree)
            try:
                steady_load(collector, args.gpus, args.kernels, args.warmup_s)
                started = time.monotonic()
                with HealthzProbe(collector, workdir) as probe:
                    if case == "instances":
                        many_identities(collector, args.instances)
                    else:
                        slow_scrapers(collector, args.scrapers, args.scrape_hold_s)
                cases[case] = {**probe.summary(), "seconds": round(time.monotonic() - started, 1)}
                print(name, case, cases[case], flush=True)
            finally:
                collector.stop()
    result["load_average_at_end"] = os.getloadavg()
    out = args.out or RESULTS / f"collector_limits-healthz-cpu-{commit[:8]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    labels = {"instances": f"{args.instances:,} distinct instance ids arriving",
              "scrapers": f"{args.scrapers} /metrics readers at 4 KB/s (`--expose-sm-histograms`)"}
    lines = ["# /healthz latency while identities arrive and slow scrapers read", "",
             f"commit `{commit}`, {result['utc']}, {result['cpus']} CPUs (load average "
             f"{result['load_average_at_start'][0]:.1f} at the start, {result['load_average_at_end'][0]:.1f} at the end: "
             f"the machine is shared), Python {result['python']}; each case after {args.warmup_s:.0f} s of steady "
             f"ingest ({args.gpus} GPUs x 132 SMs x {args.kernels} kernels of CTA points every 10 s, ten 512-span "
             "trace requests a second), /healthz asked every 20 ms by a separate process. Bound: 100 ms.", "",
             "| collector | case | probes | p50 ms | p99 ms | max ms | over 100 ms | seconds |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, cases in result["trees"].items():
        for case, m in cases.items():
            lines.append(f"| {name} | {labels[case]} | {m['probes']} | {m['p50_ms']} | {m['p99_ms']} | {m['max_ms']} "
                         f"| {m['over_100_ms']} | {m['seconds']} |")
    write_report(out, "collector_limits", argv, lines)
    return 0


def _memory(result: dict, name: str, collector: Collector, steady: float, run) -> None:
    started = time.monotonic()
    with Watch(collector) as watch:
        detail = run()
    result["memory"][name] = {"steady_rss_mib": round(steady, 1), "peak_rss_mib": round(watch.peak_rss_mib, 1),
                              "rss_after_mib": round(collector.rss_mib(), 1),
                              "ratio_to_steady": round(watch.peak_rss_mib / steady, 2),
                              "healthz_max_ms": round(watch.healthz_max_s * 1e3, 1),
                              "seconds": round(time.monotonic() - started, 1), **(detail or {})}
    print(name, result["memory"][name], flush=True)


def _report(result: dict, args) -> list[str]:
    ok = lambda good: "yes" if good else "**no**"  # noqa: E731
    lines = ["# Collector limits: hostile bodies and clients", "",
             f"commit `{result['commit']}`, {result['utc']}, {result['cpus']} CPUs (load average "
             f"{result['load_average_at_start'][0]:.1f} at the start, {result['load_average_at_end'][0]:.1f} at the "
             f"end: the machine is shared), Python {result['python']}; steady ingest of {args.gpus} GPUs x 132 SMs x "
             f"{args.kernels} kernels of CTA points (every 10 s) plus ten 512-span trace requests a second: steady RSS "
             f"{result['steady_rss_mib']:.0f} MiB with the default flags, "
             f"{result['steady_rss_with_sm_histograms_mib']:.0f} MiB with `--expose-sm-histograms` (a "
             f"{result['metrics_page_bytes'] / MiB:.0f} MiB /metrics page, for the scrapers).", "",
             "Each body once, the steady load stopped: the collector's CPU until idle again, its peak RSS over "
             "the RSS before it, the slowest /healthz meanwhile. Bounds: 0.5 s, 64 MiB, 100 ms.", "",
             "| body | wire bytes | answer | CPU s | peak RSS + MiB | /healthz max ms | within the bounds |",
             "|---|---:|---|---:|---:|---:|---|"]
    for b in result["bodies"]:
        within = (b["cpu_s"] <= BOUND_CPU_S and b["peak_rss_over_mib"] <= BOUND_RSS_MIB
                  and b["healthz_max_ms"] <= BOUND_HEALTHZ_S * 1e3)
        lines.append(f"| {b['body']} | {b['wire_bytes']:,} | {b['answer']} | {b['cpu_s']} | {b['peak_rss_over_mib']} "
                     f"| {b['healthz_max_ms']} | {ok(within)} |")
    lines += ["", "Memory after many identities, long names and slow scrapers (bound: peak RSS at most 2x the "
              "steady RSS):", "", "| what | steady RSS MiB | peak RSS MiB | RSS after MiB | peak / steady | "
              "/healthz max ms | seconds | within |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    labels = {"instances": f"{args.instances:,} distinct instance ids", "names": f"{args.names:,} span names and "
              f"{args.names:,} kernel names of 1 MB", "scrapers": f"{args.scrapers} /metrics readers at 4 KB/s"}
    for name, m in result["memory"].items():
        lines.append(f"| {labels[name]} | {m['steady_rss_mib']} | {m['peak_rss_mib']} | {m['rss_after_mib']} | "
                     f"{m['ratio_to_steady']} | "
                     f"{m['healthz_max_ms']} | {m['seconds']} | {ok(m['ratio_to_steady'] <= BOUND_RSS_RATIO)} |")
    if "scrapers" in result["memory"]:
        s = result["memory"]["scrapers"]
        lines += ["", f"Scrapers: {s['cut_by_the_deadline']:.0f} of {s['scrapers']} cut at the collector's write "
                  f"deadline (`sightline_collector_scrapes_cut_total`; {s['ended_by_the_collector']} seen reset by "
                  f"the readers within {s['seconds']} s), each having read a median {s['median_bytes_read']:,} bytes."]
    return lines


if __name__ == "__main__":
    sys.exit(main())
