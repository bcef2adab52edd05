"""Per-SM P99 accuracy of the collector's sketches vs the exact P99 and vs Prometheus.

    python -m bench.sketch_accuracy [--samples 20000] [--freshness]

For each distribution family (lognormal, bimodal, heavy-tailed Pareto, one slow SM) it draws
CTA durations for 132 SMs, sends them through the real path (OTLP exponential histogram
points as the SM probe emits them -> ``Aggregator.consume_metrics`` -> the per-SM window)
and compares the window's P99 with the exact P99 (rank ``ceil(0.99 n)``; the bound is
``relative_error(scale)``, the goal <= 1 %), with Prometheus's ``histogram_quantile`` over
classic buckets (``semconv.CTA_BUCKETS_S``, Prometheus's interpolation on exact counts), and
with 3 replicas' merged histograms. ``--freshness`` also starts a real collector and times
an OTLP/HTTP export until it is visible in ``/api/v1/heatmap``.

Writes ``bench/results/sketch_accuracy.json`` and ``.md`` (with the git commit).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from sightline.collector.aggregator import AggregationConfig, Aggregator
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.exphist import ExpHistogram, relative_error

from ._collector import CollectorProcess
from ._common import ROOT, git_commit, utc_now

RESULTS = ROOT / "bench" / "results"
N_SMS = 132
KERNEL = "fa2_fwd"
T_S = 1_800_000_000.0


# -- distributions (seconds) ----------------------------------------------------------------
def lognormal(rng, sm, n):
    return rng.lognormal(math.log(25e-6 * (1 + 0.002 * sm)), 0.35, n)


def bimodal(rng, sm, n):
    slow = rng.random(n) < 0.08
    return np.where(slow, rng.lognormal(math.log(70e-6), 0.1, n), rng.lognormal(math.log(20e-6), 0.1, n))


def heavy_tailed(rng, sm, n):
    return 10e-6 * (1.0 + rng.pareto(1.8, n))


def one_slow_sm(rng, sm, n):
    return rng.lognormal(math.log(30e-6 * (2.0 if sm == 17 else 1.0)), 0.2, n)


def wide_uniform_log(rng, sm, n):
    return np.exp(rng.uniform(math.log(1e-6), math.log(10e-3), n))  # 4 decades


DISTRIBUTIONS = {"lognormal": lognormal, "bimodal": bimodal, "heavy_tailed_pareto": heavy_tailed,
                 "one_slow_sm": one_slow_sm, "wide_4_decades": wide_uniform_log}


# -- helpers ----------------------------------------------------------------------------------
def exact_quantile(values: np.ndarray, q: float) -> float:
    s = np.sort(values)
    return float(s[max(1, math.ceil(q * s.size)) - 1])


def prometheus_histogram_quantile(q: float, bounds: tuple[float, ...], values: np.ndarray) -> float:
    """Prometheus's histogram_quantile over classic buckets holding ``values`` exactly."""
    counts = np.bincount(np.searchsorted(np.asarray(bounds), values, side="left"), minlength=len(bounds) + 1)
    cumulative = np.cumsum(counts)
    total = cumulative[-1]
    rank = q * total
    b = int(np.searchsorted(cumulative, rank, side="left"))  # first bucket with cum >= rank
    if b == len(bounds):  # +Inf bucket: Prometheus answers the largest finite bound
        return float(bounds[-1])
    lower = 0.0 if b == 0 else bounds[b - 1]
    before = 0 if b == 0 else cumulative[b - 1]
    in_bucket = counts[b]
    return float(lower + (bounds[b] - lower) * (rank - before) / in_bucket)


def kv(key, value):
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def export_for(per_sm: dict[int, np.ndarray], t_s: float, gpu: int = 0) -> ExportMetricsServiceRequest:
    """One OTLP export with a delta exponential histogram point per SM (as the probe emits)."""
    req = ExportMetricsServiceRequest()
    metric = req.resource_metrics.add().scope_metrics.add().metrics.add()
    metric.name, metric.unit = sc.METRIC_CTA_DURATION, sc.METRIC_CTA_DURATION_UNIT
    metric.exponential_histogram.aggregation_temporality = 1
    for sm, values in per_sm.items():
        h = ExpHistogram()  # as instrumentation/sm_probe.py reduces CTAs (scale 8, 2,048 buckets)
        h.record(values)
        p = metric.exponential_histogram.data_points.add(
            start_time_unix_nano=int((t_s - 1) * 1e9), time_unix_nano=int(t_s * 1e9), count=h.count,
            sum=h.sum, scale=h.scale, zero_count=h.zero_count, min=h.min, max=h.max)
        p.attributes.extend([kv(sc.ATTR_GPU_ID, gpu), kv(sc.ATTR_SM_ID, sm), kv(sc.ATTR_KERNEL_NAME, KERNEL)])
        p.positive.offset = h.offset
        p.positive.bucket_counts.extend(int(c) for c in h.counts)
    return req


def feed(aggregator: Aggregator, per_sm: dict[int, np.ndarray], exports: int = 4) -> None:
    """Sends the samples as ``exports`` consecutive exports 5 s apart (several slots)."""
    parts = {sm: np.array_split(v, exports) for sm, v in per_sm.items()}
    for e in range(exports):
        aggregator.consume_metrics(export_for({sm: p[e] for sm, p in parts.items()}, T_S - 5 * (exports - e)))


@dataclass
class Row:
    distribution: str
    samples_per_sm: int
    sketch_max_rel_err: float
    sketch_median_rel_err: float
    sketch_bound: float
    prometheus_max_rel_err: float
    prometheus_median_rel_err: float
    replicas_max_rel_diff_vs_single: float
    replicas_max_rel_err_vs_exact: float
    hottest_sm_exact: int
    hottest_sm_sketch: int
    hottest_sm_prometheus: int
    bucket_bytes_per_sm: float


def run_distribution(name: str, fn, samples: int, seed: int) -> Row:
    rng = np.random.default_rng(seed)
    per_sm = {sm: fn(rng, sm, samples) for sm in range(N_SMS)}
    clock = lambda: T_S  # noqa: E731
    single = Aggregator(AggregationConfig(), clock=clock)
    feed(single, per_sm)
    windows = single.sm_windows("0", KERNEL, last_s=60)
    replicas = [Aggregator(AggregationConfig(), clock=clock) for _ in range(3)]
    owner = {sm: rng.integers(0, 3, samples) for sm in range(N_SMS)}
    for r, agg in enumerate(replicas):
        feed(agg, {sm: v[owner[sm] == r] for sm, v in per_sm.items()})
    replica_windows = [agg.sm_windows("0", KERNEL, last_s=60) for agg in replicas]
    sketch_err, prom_err, rep_diff, rep_err, bounds = [], [], [], [], []
    exact, sketch, prom = {}, {}, {}
    for sm, values in per_sm.items():
        exact[sm] = exact_quantile(values, 0.99)
        h = windows[str(sm)]
        assert h.count == samples
        sketch[sm] = h.quantile(0.99)
        bounds.append(relative_error(h.scale))
        prom[sm] = prometheus_histogram_quantile(0.99, sc.CTA_BUCKETS_S, values)
        sketch_err.append(abs(sketch[sm] - exact[sm]) / exact[sm])
        prom_err.append(abs(prom[sm] - exact[sm]) / exact[sm])
        merged = single.config.window.new_histogram()
        for w in replica_windows:
            merged.merge(w[str(sm)])
        assert merged.count == samples
        rep = merged.quantile(0.99)
        rep_diff.append(abs(rep - sketch[sm]) / sketch[sm])
        rep_err.append(abs(rep - exact[sm]) / exact[sm])
    return Row(name, samples, max(sketch_err), float(np.median(sketch_err)), max(bounds), max(prom_err),
               float(np.median(prom_err)), max(rep_diff), max(rep_err), max(exact, key=exact.get),
               max(sketch, key=sketch.get), max(prom, key=prom.get),
               single.memory_bytes() / N_SMS)


# -- ingest cost ------------------------------------------------------------------------------
def _span_mix(n_requests: int, seed: int = 11):
    """An engine-like export: per request 6 request-tree spans; one engine.step span per
    4 requests x 16 decode steps, linked to its requests; 1 in 10 steps with 20 kernel
    spans carrying CUPTI-like attributes."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1 import trace_pb2

    rng = np.random.default_rng(seed)
    req = ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    t0 = int(T_S * 1e9) - 5_000_000_000

    def span(name, tid, sid, parent=b"", attrs=(), links=(), dur=1_000_000):
        s = spans.add(name=name, trace_id=tid, span_id=sid, parent_span_id=parent,
                      start_time_unix_nano=t0, end_time_unix_nano=t0 + dur)
        s.attributes.extend([kv(k, v) for k, v in attrs])
        s.links.extend([trace_pb2.Span.Link(trace_id=t, span_id=i) for t, i in links])

    roots = []
    for r in range(n_requests):
        tid, sid = rng.bytes(16), rng.bytes(8)
        roots.append((tid, sid))
        span(sc.SPAN_HTTP_COMPLETIONS, tid, sid, attrs=[
            (sc.GEN_AI_REQUEST_MODEL, "llama"), (sc.REQUEST_PRIORITY, r % 3), (sc.HTTP_RESPONSE_STATUS_CODE, 200),
            (sc.GEN_AI_USAGE_INPUT_TOKENS, 128), (sc.GEN_AI_USAGE_OUTPUT_TOKENS, 16)], dur=200_000_000)
        for phase in sc.REQUEST_PHASE_SPANS:
            span(phase, tid, rng.bytes(8), parent=sid)
    for s in range(n_requests // 4 * 16):
        tid, sid = rng.bytes(16), rng.bytes(8)
        riders = roots[(s // 16) * 4:(s // 16) * 4 + 4]
        span(sc.SPAN_ENGINE_STEP, tid, sid, attrs=[(sc.STEP_ID, s), (sc.STEP_BATCH_SIZE, 4),
                                                   (sc.STEP_PREFILL_TOKENS, 0), (sc.STEP_DECODE_TOKENS, 4)],
             links=riders, dur=int(rng.integers(2, 9)) * 1_000_000)
        if s % 10 == 0:
            for k in range(20):
                span(sc.SPAN_KERNEL_PREFIX + f"kernel_{k}", tid, rng.bytes(8), parent=sid, attrs=[
                    (sc.CUDA_KERNEL_NAME, f"kernel_{k}"), (sc.HW_GPU_ID, 0), (sc.CUDA_DEVICE, 0),
                    (sc.CUDA_GRID, "132,1,1"), (sc.CUDA_BLOCK, "128,1,1"), (sc.CUDA_REGISTERS, 96),
                    (sc.CUDA_SHARED_MEMORY_BYTES, 49152), (sc.CUDA_STREAM, 7), (sc.CUDA_CORRELATION_ID, k),
                    (sc.KERNEL_SMS_USED, 132), (sc.KERNEL_WAVES, 1), (sc.KERNEL_SLOWEST_SM, k % 132)],
                     dur=int(rng.integers(5, 200)) * 1_000)
    return req


def measure_ingest(repeats: int = 5) -> dict:
    """CPU seconds (process time, best of ``repeats``) per span and per CTA point."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    body = _span_mix(200).SerializeToString()
    n_spans = len(ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans)
    out = {"spans_per_export": n_spans}
    from sightline.collector.trace_store import TraceStoreConfig

    # The default store (deferred indexing) gets the received encoding's size, as from the
    # OTLP protobuf receivers; the eager one indexes every span as it arrives.
    modes = {"with_trace_store": AggregationConfig(),
             "with_eager_trace_store": AggregationConfig(trace_store=TraceStoreConfig(mode="eager")),
             "without_trace_store": AggregationConfig(trace_store=TraceStoreConfig(mode="off"))}
    for mode, config in modes.items():
        best = math.inf
        for _ in range(repeats):
            agg = Aggregator(config, clock=lambda: T_S)
            t = time.process_time()
            for _ in range(5):
                agg.consume_traces(ExportTraceServiceRequest.FromString(body), len(body))
            best = min(best, (time.process_time() - t) / (5 * n_spans))
        out[f"spans_per_cpu_s_{mode}"] = 1.0 / best
    rng = np.random.default_rng(4)
    bodies = [export_for({sm: rng.lognormal(math.log(25e-6), 0.3, 64) for sm in range(N_SMS)}, T_S - 1)
              .SerializeToString() for _ in range(4)]
    best = math.inf
    for _ in range(repeats):
        agg = Aggregator(AggregationConfig(), clock=lambda: T_S)
        t = time.process_time()
        for b in bodies:
            agg.consume_metrics(ExportMetricsServiceRequest.FromString(b))
        best = min(best, (time.process_time() - t) / (len(bodies) * N_SMS))
    out["cta_points_per_cpu_s"] = 1.0 / best
    out["what"] = ("Aggregator.consume_* alone, protobuf parse included, one thread; "
                   f"mix per export: {n_spans} spans (request trees, linked steps, 10 % of steps with 20 kernel spans)")
    return out


# -- freshness --------------------------------------------------------------------------------
def measure_freshness(trials: int) -> dict:
    latencies = []
    with tempfile.TemporaryDirectory(prefix="sketch-freshness-") as folder, \
            CollectorProcess(Path(folder) / "collector.log", ready_timeout_s=60) as collector:
        query = collector.url("query")
        rng = np.random.default_rng(3)
        expected = 0
        for trial in range(trials):
            values = {sm: rng.lognormal(math.log(25e-6), 0.3, 50) for sm in range(N_SMS)}
            expected += 50 * N_SMS
            body = export_for(values, time.time()).SerializeToString()
            t0 = time.perf_counter()
            urllib.request.urlopen(urllib.request.Request(
                collector.url("http", "/v1/metrics"), data=body, method="POST",
                headers={"Content-Type": "application/x-protobuf"}), timeout=10).read()
            while True:
                url = f"{query}/api/v1/heatmap?gpu=0&kernel={KERNEL}&kind=time_sm"
                try:
                    with urllib.request.urlopen(url, timeout=10) as r:
                        got = sum(map(sum, json.loads(r.read())["counts"]))
                except urllib.error.HTTPError:
                    got = 0
                if got >= expected:
                    break
                if time.perf_counter() - t0 > 30:
                    raise TimeoutError(f"export {trial} not visible after 30 s")
            latencies.append(time.perf_counter() - t0)
    lat = np.asarray(latencies) * 1e3
    return {"trials": trials, "sms_per_export": N_SMS, "ctas_per_export": 50 * N_SMS,
            "p50_ms": float(np.percentile(lat, 50)), "p90_ms": float(np.percentile(lat, 90)),
            "max_ms": float(lat.max()),
            "what": "POST /v1/metrics (OTLP/HTTP protobuf) sent -> its CTAs counted in /api/v1/heatmap; "
                    "includes the heatmap computation (132 SMs)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000, help="CTAs per SM per distribution")
    parser.add_argument("--freshness", action="store_true", help="also measure export -> heatmap latency")
    parser.add_argument("--freshness-trials", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = [run_distribution(name, fn, args.samples, seed) for seed, (name, fn) in enumerate(DISTRIBUTIONS.items())]
    elapsed = time.perf_counter() - t0
    commit = git_commit(short=True)
    result = {
        "bench": "sketch_accuracy", "git_commit": commit, "date_utc": utc_now(),
        "machine": platform.platform(), "python": platform.python_version(), "sms": N_SMS,
        "quantile": 0.99, "window": {"slot_s": 10.0, "max_buckets": AggregationConfig().window.max_buckets},
        "prometheus_buckets_s": list(sc.CTA_BUCKETS_S), "seconds": elapsed,
        "rows": [r.__dict__ for r in rows],
        "goal_met": all(r.sketch_max_rel_err <= 0.01 and r.replicas_max_rel_err_vs_exact <= 0.01 for r in rows),
    }
    result["ingest"] = measure_ingest()
    if args.freshness:
        result["freshness"] = measure_freshness(args.freshness_trials)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sketch_accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Per-SM P99 accuracy (commit {commit}, {result['date_utc']})", "",
             f"{N_SMS} SMs x {args.samples} CTAs per distribution; P99 per SM through OTLP points -> "
             f"Aggregator window vs exact; Prometheus `histogram_quantile` over `CTA_BUCKETS_S` on the same "
             f"samples; 3 replicas merged. Command: `.venv/bin/python -m bench.sketch_accuracy"
             f"{' --freshness' if args.freshness else ''}`.", "",
             "| distribution | sketch max err | sketch median | bound | Prometheus max err | Prometheus median "
             "| replicas vs single | replicas vs exact | hottest SM exact/sketch/prom | bucket bytes/SM |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda v: f"{100 * v:.3f} %"  # noqa: E731
    for r in rows:
        lines.append(f"| {r.distribution} | {pct(r.sketch_max_rel_err)} | {pct(r.sketch_median_rel_err)} | "
                     f"{pct(r.sketch_bound)} | {pct(r.prometheus_max_rel_err)} | {pct(r.prometheus_median_rel_err)} | "
                     f"{pct(r.replicas_max_rel_diff_vs_single)} | {pct(r.replicas_max_rel_err_vs_exact)} | "
                     f"{r.hottest_sm_exact}/{r.hottest_sm_sketch}/{r.hottest_sm_prometheus} | "
                     f"{r.bucket_bytes_per_sm:.0f} |")
    lines += ["", "Hottest SM agrees only where one SM is really slower (`one_slow_sm`); elsewhere all SMs "
                  "draw from one distribution and the hottest is sampling noise. Replicas vs single is 0 "
                  "because exponential-histogram merges are exact at a common scale.",
              "", f"Goal (sketch and merged replicas within 1 % of exact on every SM): "
                  f"{'met' if result['goal_met'] else 'NOT met'}."]
    g = result["ingest"]
    lines += ["", f"Ingest cost ({g['what']}; CPU time, best of 5, on {platform.machine()} shared with other work): "
                  f"{g['spans_per_cpu_s_with_trace_store']:,.0f} spans/CPU-s with the trace store (default: "
                  f"keeps the received encoding, indexes on the first query), "
                  f"{g['spans_per_cpu_s_with_eager_trace_store']:,.0f} with it indexing at ingest "
                  f"(`--trace-store eager`), {g['spans_per_cpu_s_without_trace_store']:,.0f} without a store; "
                  f"{g['cta_points_per_cpu_s']:,.0f} per-SM points/CPU-s."]
    if "freshness" in result:
        f = result["freshness"]
        lines += ["", f"Freshness ({f['trials']} exports of {f['ctas_per_export']} CTAs over {f['sms_per_export']} SMs "
                      f"into a `sightline collector run` process): p50 {f['p50_ms']:.1f} ms, p90 {f['p90_ms']:.1f} ms, "
                      f"max {f['max_ms']:.1f} ms ({f['what']})."]
    (args.out / "sketch_accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
