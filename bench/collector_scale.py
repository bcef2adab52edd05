"""Per-SM data at fleet scale on one collector replica: CPU, /metrics, RSS, heatmap latency.

A simulated fleet (``--gpus`` GPUs x 132 SMs x ``--kernels`` kernels) sends one delta
export per GPU every ``--interval-s`` seconds to ``sightline collector run`` in its own
process. Over ``--rounds`` intervals after ``--warmup-rounds`` it measures the collector's
CPU (cores busy), whether each interval kept up (every export answered within the interval,
no 429, the collector's queue empty at its end: read from ``/readyz``, so the bench's own
reads cost the collector nothing), ``/metrics`` size and scrape time during ingest (plain
text, and OpenMetrics gzipped as Prometheus asks), heatmap query latency, RSS and peak RSS.
Guarantee: every per-SM P99 gauge is checked against the exact P99 of the values sent.
Cost: (warm-up + measured rounds) x ``--interval-s`` of wall time plus building the
exports; the load runs on the collector's machine.

Results: bench/results/collector_scale.json and .md (with the git commit).
Run: ``.venv/bin/python -m bench.collector_scale``
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import math
import os
import platform
import random
import re
import shlex
import statistics
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from ._collector import CollectorProcess
from ._common import ROOT, git_commit, utc_now, write_report
from .collector_ingest import _status_mib

RESULTS = ROOT / "bench" / "results"
SMS = 132
# what Prometheus sends (OpenMetrics preferred, gzip)
PROMETHEUS_ACCEPT = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
_TIME, _START = bytes.fromhex("a73c915ed2086bf4"), bytes.fromhex("5be2c4790f1a8e3d")  # timestamp placeholders


def kernel_names(n: int) -> list[str]:
    """The CUPTI kernel names of the committed capture (then numbered copies, if more are asked)."""
    names: list[str] = []
    for path in sorted((ROOT / "deploy" / "captures").glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for name in re.findall(r'"cuda\.kernel\.name","value":\{"stringValue":"([^"]+)"', f.read()):
                if name not in names:
                    names.append(name)
    names = names or ["flash_fwd_kernel"]
    return [names[i % len(names)] + ("" if i < len(names) else f"_{i // len(names)}") for i in range(n)]


def build_requests(gpus: int, kernels: list[str], ctas: int, seed: int = 0):
    """Per GPU: its encoded export (timestamps as placeholders) and the exact P99 per (gpu label, sm, kernel)."""
    # The fleet as engines export it: 8 GPUs per host, one engine process per GPU, each its own
    # OTLP resource with service.instance.id; every point carries gpu.id and gpu.uuid.
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import KeyValue

    from sightline.collector.otlp_points import MAX_LABEL_CHARS
    from sightline.collector.sm_store import kernel_label
    from sightline.instrumentation import semconv as sc
    from sightline.instrumentation.exphist import ExpHistogram

    def kv(key, value):
        out = KeyValue(key=key)
        if isinstance(value, str):
            out.value.string_value = value
        else:
            out.value.int_value = value
        return out

    rng = np.random.default_rng(seed)
    base = np.exp(rng.uniform(math.log(5e-6), math.log(500e-6), len(kernels)))  # per kernel
    bodies, exact = [], {}
    for g in range(gpus):
        uuid = f"GPU-{g:08x}-5e1f-4c1a-9d2b-{rng.integers(1 << 47):012x}"
        request = ExportMetricsServiceRequest()
        rm = request.resource_metrics.add()
        rm.resource.attributes.extend([kv(sc.RESOURCE_SERVICE_NAME, sc.SERVICE_NAME_ENGINE),
                                       kv(sc.RESOURCE_HOST_NAME, f"gpu-node-{g // 8:03d}"),
                                       kv(sc.RESOURCE_SERVICE_INSTANCE_ID, f"gpu-node-{g // 8:03d}-{g % 8}")])
        metric = rm.scope_metrics.add().metrics.add()
        metric.name, metric.unit = sc.METRIC_CTA_DURATION, sc.METRIC_CTA_DURATION_UNIT
        metric.exponential_histogram.aggregation_temporality = 1  # DELTA
        sm_factor = rng.lognormal(0.0, 0.03, SMS)
        sm_factor[g % SMS] *= 1.4  # one slow SM per GPU
        for k, kernel in enumerate(kernels):
            for sm in range(SMS):
                values = base[k] * sm_factor[sm] * rng.lognormal(0.0, 0.25, ctas)
                h = ExpHistogram(scale=6)
                h.record(values)
                p = metric.exponential_histogram.data_points.add(
                    count=h.count, sum=h.sum, scale=h.scale, zero_count=h.zero_count, min=h.min, max=h.max)
                p.attributes.extend([kv(sc.ATTR_GPU_ID, g % 8), kv(sc.ATTR_GPU_UUID, uuid), kv(sc.ATTR_SM_ID, sm),
                                     kv(sc.ATTR_KERNEL_NAME, kernel)])
                p.positive.offset = h.offset
                p.positive.bucket_counts.extend(h.counts.tolist())
                p.exemplars.add(as_double=float(values.max()), trace_id=os.urandom(16), span_id=os.urandom(8))
                s = np.sort(values)
                exact[(uuid, str(sm), kernel_label(kernel[:MAX_LABEL_CHARS]))] = float(s[max(1, math.ceil(0.99 * s.size)) - 1])
        for p in metric.exponential_histogram.data_points:
            p.time_unix_nano = struct.unpack("<Q", _TIME)[0]
            p.start_time_unix_nano = struct.unpack("<Q", _START)[0]
            p.exemplars[0].time_unix_nano = struct.unpack("<Q", _TIME)[0]
        bodies.append(request.SerializeToString())
    return bodies, exact


class Collector(CollectorProcess):
    """The collector process (bench/_collector.py), with a timed GET of its query API."""

    def __init__(self, workdir: Path, extra: list[str]) -> None:
        super().__init__(workdir / "collector.log", extra, ready_timeout_s=60)

    def get(self, path: str, as_prometheus: bool = False) -> tuple[bytes, float]:
        headers = {"Accept-Encoding": "gzip", "Accept": PROMETHEUS_ACCEPT} if as_prometheus else {}
        started = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(self.url("query", path), headers=headers),
                                    timeout=120) as response:
            body = response.read()
        return body, time.perf_counter() - started


def queue_depth(collector: Collector) -> int:
    """Data points and spans waiting in the collector's queue, from /readyz (cheap)."""
    return int(json.loads(collector.get("/readyz")[0])["queue_depth"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--kernels", type=int, default=20)
    parser.add_argument("--ctas", type=int, default=64, help="CTAs per SM, kernel and export")
    parser.add_argument("--interval-s", type=float, default=10.0)
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--scrapes", type=int, default=3)
    parser.add_argument("--heatmap-queries", type=int, default=20)
    parser.add_argument("--collector-args", default="", help="extra flags for sightline collector run")
    parser.add_argument("--out", type=Path, default=RESULTS / "collector_scale")
    args = parser.parse_args(argv)
    kernels = kernel_names(args.kernels)
    t0 = time.monotonic()
    bodies, exact = build_requests(args.gpus, kernels, args.ctas)
    print(f"built {len(bodies)} exports, {len(exact)} series, {sum(map(len, bodies)) / 1e6:.1f} MB per round "
          f"in {time.monotonic() - t0:.0f} s", flush=True)
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sightline-scale-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    collector = Collector(workdir, shlex.split(args.collector_args))
    points_per_round = len(exact)
    rounds, scrapes, heatmaps = [], [], []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", collector.ports["http"], timeout=60)
        stop = threading.Event()

        def probe() -> None:  # scrapes and heatmap queries while ingest runs
            rng = random.Random(1)
            while not stop.is_set():
                if len(scrapes) < args.scrapes:
                    body, seconds = collector.get("/metrics")
                    gz, gz_seconds = collector.get("/metrics", as_prometheus=True)
                    scrapes.append({"bytes": len(body), "gzip_bytes": len(gz), "seconds": round(seconds, 3),
                                    "gzip_seconds": round(gz_seconds, 3),
                                    "lines": body.count(b"\n")})
                elif len(heatmaps) < args.heatmap_queries:  # JSON, both views, random GPUs and kernels
                    g, k = rng.randrange(args.gpus), rng.randrange(args.kernels)
                    kind = ("time_sm", "sm_latency")[len(heatmaps) % 2]
                    query = (f"/api/v1/heatmap?instance_id=gpu-node-{g // 8:03d}-{g % 8}&gpu={g % 8}"
                             f"&kernel={urllib.parse.quote(kernels[k])}&kind={kind}")
                    body, seconds = collector.get(query)
                    heatmaps.append({"kind": kind, "seconds": round(seconds, 4), "bytes": len(body),
                                     "sms": len(json.loads(body)["sms"])})
                stop.wait(2.0)

        prober = None
        for r in range(args.warmup_rounds + args.rounds):
            measured = r >= args.warmup_rounds
            if measured and prober is None:
                prober = threading.Thread(target=probe, daemon=True)
                prober.start()
            round_start = time.monotonic()
            retries, late = 0, 0.0
            cpu0 = collector.cpu_s()
            for g, body in enumerate(bodies):
                due = round_start + args.interval_s * g / len(bodies)  # spread evenly over the interval
                time.sleep(max(0.0, due - time.monotonic()))
                late = max(late, time.monotonic() - due)
                now_ns = time.time_ns()
                payload = body.replace(_TIME, struct.pack("<Q", now_ns)).replace(
                    _START, struct.pack("<Q", now_ns - int(args.interval_s * 1e9)))
                while True:  # as an exporter does: a 429 is retried after its Retry-After
                    conn.request("POST", "/v1/metrics", payload, {"Content-Type": "application/x-protobuf"})
                    response = conn.getresponse()
                    answer = response.read()
                    if response.status != 429:
                        break
                    retries += 1
                    time.sleep(float(response.headers.get("Retry-After", "1")))
                if response.status != 200:
                    raise RuntimeError(f"export refused: {response.status} {answer[:300]!r}")
            sent = time.monotonic() - round_start  # the last export answered
            time.sleep(max(0.0, round_start + args.interval_s - time.monotonic()))
            cpu1 = collector.cpu_s()
            wall = time.monotonic() - round_start
            depth = queue_depth(collector)
            # a backlog is waited out (and timed) before the next interval starts
            drain_start = time.monotonic()
            while queue_depth(collector) and time.monotonic() < drain_start + args.interval_s:
                time.sleep(0.05)
            rounds.append({"round": r, "measured": measured, "wall_s": round(wall, 2), "sent_s": round(sent, 2),
                           "max_send_late_s": round(late, 3), "retries_429": retries,
                           "cpu_s": round(cpu1 - cpu0, 2), "cores": round((cpu1 - cpu0) / wall, 3),
                           "queue_depth_at_end": depth,
                           "drained_after_s": round(time.monotonic() - drain_start, 2) if depth else 0.0,
                           "rss_mib": round(_status_mib(collector.pid, "VmRSS"), 1)})
            print(json.dumps(rounds[-1]), flush=True)
        stop.set()
        if prober is not None:
            prober.join(120)
        metrics, _ = collector.get("/metrics")
        received = sum(float(m) for m in re.findall(
            r"^sightline_collector_data_points_received_total\{[^}]*\} (\S+)", metrics.decode(), re.M))
        errors = []
        pattern = re.compile(r'^sightline_sm_cta_p99_seconds\{gpu="([^"]*)",kernel="([^"]*)",sm="([^"]*)"\} (\S+)$', re.M)
        for gpu, kernel, sm, value in pattern.findall(metrics.decode()):
            want = exact[(gpu, sm, kernel)]
            errors.append(abs(float(value) - want) / want)
        rss, peak = _status_mib(collector.pid, "VmRSS"), _status_mib(collector.pid, "VmHWM")
    finally:
        collector.stop()
    measured = [r for r in rounds if r["measured"]]
    cores = [r["cores"] for r in measured]
    summary = {
        "series": len(exact), "p99_gauges_checked": len(errors),
        "p99_max_relative_error": max(errors) if errors else None,
        "p99_median_relative_error": statistics.median(errors) if errors else None,
        "collector_cores_median": statistics.median(cores), "collector_cores_min": min(cores),
        "collector_cores_max": max(cores), "share_of_machine_median": statistics.median(cores) / os.cpu_count(),
        "rounds_kept_up": sum(1 for r in measured if r["queue_depth_at_end"] == 0 and not r["retries_429"]
                              and r["sent_s"] <= args.interval_s),
        "max_send_late_s": max(r["max_send_late_s"] for r in measured),
        "max_drained_after_s": max(r["drained_after_s"] for r in measured),
        "data_points_received": received, "data_points_sent": len(rounds) * points_per_round,
        "rounds_measured": len(measured), "retries_429": sum(r["retries_429"] for r in measured),
        "cpu_s_per_1k_points_median": round(statistics.median(1000 * r["cpu_s"] / points_per_round for r in measured), 3),
        "metrics_bytes": [s["bytes"] for s in scrapes], "metrics_gzip_bytes": [s["gzip_bytes"] for s in scrapes],
        "metrics_lines": [s["lines"] for s in scrapes],
        "scrape_seconds": [s["seconds"] for s in scrapes], "scrape_gzip_seconds": [s["gzip_seconds"] for s in scrapes],
        "heatmap_seconds_median": statistics.median(h["seconds"] for h in heatmaps) if heatmaps else None,
        "heatmap_seconds_max": max(h["seconds"] for h in heatmaps) if heatmaps else None,
        "rss_mib_end": round(rss, 1), "peak_rss_mib": round(peak, 1),
        "points_per_round": points_per_round, "bytes_per_round": sum(map(len, bodies)),
    }
    document = {
        "benchmark": "collector_scale", "git_commit": git_commit(dirty_paths=("collector", "bench/collector_scale.py")),
        "date_utc": utc_now(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "method": {"gpus": args.gpus, "sms": SMS, "kernels": args.kernels, "ctas_per_point": args.ctas,
                   "interval_s": args.interval_s, "warmup_rounds": args.warmup_rounds, "rounds": args.rounds,
                   "collector_args": args.collector_args},
        "summary": summary, "rounds": rounds, "scrapes": scrapes, "heatmaps": heatmaps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    s = summary
    mb = lambda v: f"{min(v) / 1e6:.1f} .. {max(v) / 1e6:.1f}"  # noqa: E731
    lines = [
        "# Collector at fleet scale: per-SM data on one replica",
        "",
        f"commit `{document['git_commit']}`, {document['date_utc']}, {os.cpu_count()} CPUs (shared with the load "
        f"generator and other work), Python {platform.python_version()}; {args.gpus} GPUs x {SMS} SMs x "
        f"{args.kernels} kernels = {s['series']:,} per-SM series, one delta export per GPU every {args.interval_s:g} s "
        f"({s['bytes_per_round'] / 1e6:.0f} MB of OTLP per interval), {args.warmup_rounds} warm-up + "
        f"{args.rounds} measured intervals.",
        "",
        "| measure | result | goal |",
        "|---|---|---|",
        f"| collector CPU, cores busy (median, min .. max over intervals) | {s['collector_cores_median']:.2f} "
        f"({min(cores):.2f} .. {max(cores):.2f}) = {100 * s['share_of_machine_median']:.0f} % of {os.cpu_count()} cores "
        f"| <= 50 % |",
        f"| intervals that kept up (every export answered within the interval, no 429, queue empty at its end) "
        f"| {s['rounds_kept_up']} of {s['rounds_measured']} ({s['retries_429']} exports answered 429 and retried; "
        f"an export sent at most {s['max_send_late_s']} s after its time; backlog drained within "
        f"{s['max_drained_after_s']} s) | all |",
        f"| data points acknowledged / sent | {s['data_points_received']:,.0f} / {s['data_points_sent']:,} | equal |",
        f"| collector CPU per 1,000 points (median) | {s['cpu_s_per_1k_points_median']} s | |",
        f"| /metrics size, MB: text (OpenMetrics + gzip, as Prometheus asks) | {mb(s['metrics_bytes'])} "
        f"({mb(s['metrics_gzip_bytes'])}) | <= 30 |",
        f"| /metrics lines | {min(s['metrics_lines']):,} .. {max(s['metrics_lines']):,} | |",
        f"| scrape time, s: text (OpenMetrics + gzip), during ingest | {min(s['scrape_seconds'])} .. "
        f"{max(s['scrape_seconds'])} "
        f"({min(s['scrape_gzip_seconds'])} .. {max(s['scrape_gzip_seconds'])}) | <= 3 |",
        f"| RSS at end / peak, MiB | {s['rss_mib_end']:.0f} / {s['peak_rss_mib']:.0f} | <= 2,048 |",
        f"| heatmap query (JSON, 132 SMs), median / max s | {s['heatmap_seconds_median']} / {s['heatmap_seconds_max']} "
        f"| <= 0.2 |",
        f"| per-SM P99 gauges vs exact P99 of the values sent: max (median) relative error, {s['p99_gauges_checked']:,} "
        f"gauges | {100 * s['p99_max_relative_error']:.3f} % ({100 * s['p99_median_relative_error']:.3f} %) | <= 1 % |",
        "",
        "Cores busy = the collector process's CPU seconds (user + system, all threads) / wall seconds per interval. "
        "The load generator (this script) runs on the same machine; scrapes and heatmap queries run during "
        "ingest; the interval's end is read from /readyz (queue depth), not from a scrape. 1,000 GPUs: 16 such replicas behind the gateway's resource-routing exporter "
        "(tests/collector/test_replicas.py shows routed replicas answer like one collector).",
    ]
    write_report(args.out, "collector_scale", argv, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
