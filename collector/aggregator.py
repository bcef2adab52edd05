"""Turns received OTLP traces and metrics into windowed distributions and indexes.

Inputs (one form: the receivers convert Zipkin to OTLP first):

* ``gpu.kernel.cta.duration`` exponential-histogram points (attributes ``gpu.id``,
  ``gpu.sm.id``, ``cuda.kernel.name``) become per-(gpu, SM, kernel) sliding windows
  (:mod:`.windows`) plus cumulative classic histograms, keeping the slowest exemplar of
  each slot. DELTA points are merged as they are; CUMULATIVE points are turned into
  deltas against the previous point of the same stream (resource + attributes + start
  time). Explicit-bucket histograms of that metric cannot be merged into exponential
  sketches without losing the error bound, so they are refused and counted
  (``reason="explicit_bucket_histogram"``); each point is checked by :mod:`.otlp_points`.
* Spans, dispatched on their name alone, feed request, step and kernel latency series
  (:class:`~.span_series.SpanSeries`, which states their cost). Every export request also
  goes to the :class:`~.trace_store.TraceStore` (bounded; indexed when first queried).

Guarantees: per-SM quantiles within ``relative_error(scale)`` of the exact rank (0.54 %
at scale 6, see :mod:`.windows`); memory bounded whatever arrives: at most
``max_sm_series + 1`` per-SM windows (the extra one is the overflow series that absorbs
every new key past the limit, counted in ``overflow``), likewise for kernels, requests
and steps; per-window memory as stated in :mod:`.windows`. Timestamps ahead of the
collector's clock (producer clock skew) are clamped to it, so they are visible at once;
per-SM points older than the window horizon can never be queried and are refused
(``reason="late"``); late spans still count in the cumulative Prometheus histograms.

Thread-safety: one lock around each export request and each query snapshot (the trace
store has its own). Span cost: see :mod:`.span_series` (measured in-process on
bench/sketch_accuracy.py's engine-like mix, 46 % kernel spans: ~2.9 us per span with the lean
re-parse against ~4.3 us reading the full form). The trace store costs O(1) per export
request at ingest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from sightline.collector.aggregation_config import AggregationConfig, WindowConfig
from sightline.collector.exposition import AggregatorCollector, ClassicHistogram, ExpositionSnapshot
from sightline.collector.otlp_points import (PointRefused, clamped_time_s, cta_point_histogram, label as _label,
                                             points_in)
from sightline.collector.span_series import SpanSeries
from sightline.collector.trace_store import TraceStore
from sightline.collector.windows import Exemplar, SlidingHistogram, merge_all, subtract_cumulative
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.exphist import ExpHistogram

__all__ = ["AggregationConfig", "Aggregator", "ExpositionSnapshot", "SmKey", "WindowConfig"]

log = logging.getLogger(__name__)
OVERFLOW = sc.OVERFLOW_LABEL_VALUE
SmKey = tuple[str, str, str]  # (gpu, sm, kernel)
_CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


class _SmSeries:
    __slots__ = ("window", "classic")

    def __init__(self, config: WindowConfig) -> None:
        self.window = SlidingHistogram(config)
        self.classic = ClassicHistogram(sc.CTA_BUCKETS_S)



class Aggregator:
    """See the module docstring. ``clock`` returns wall-clock seconds (tests pin it)."""

    def __init__(self, config: AggregationConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config or AggregationConfig()
        self.clock = clock
        self._lock = threading.Lock()
        wc = self.config.window
        self._wc = wc
        self._sm: dict[SmKey, _SmSeries] = {}
        self._cumulative: OrderedDict[tuple, tuple[int, ExpHistogram]] = OrderedDict()
        self.store = TraceStore(self.config.trace_store)
        self.overflow: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.spans_seen = 0
        self.points_seen = 0
        self._newest_point_s = 0.0
        # Span-derived series; it adds to this object's overflow and dropped counters.
        self._spans = SpanSeries(self.config, self.overflow, self.dropped)

    @property
    def newest_data_s(self) -> float:
        """Newest data time taken (span end or CTA point time, clamped to the clock)."""
        return max(self._newest_point_s, self._spans.newest_data_s)

    # -- public: ingest -------------------------------------------------------------
    def consume_traces(self, request, encoded: bytes | None = None) -> int:
        """Ingests an ``ExportTraceServiceRequest``; returns the number of spans taken.

        ``encoded``: the request's protobuf encoding when the caller has it (the OTLP
        protobuf receivers pass the body they parsed), so the trace store keeps it without
        encoding the request again. The spans are read from that encoding parsed again in
        lean form (:class:`~.otlp_points.LeanTraceRequest`, ~0.4 us per span): reading
        attributes of the full form costs several times that. One lock hold per export
        request; per span one dict lookup on its name, and a handler only for request roots,
        steps and kernels."""
        if encoded is None and self.config.store_traces and self.config.trace_store.defer_index:
            encoded = request.SerializeToString()  # the trace store would encode it anyway
        source, lean = self._spans.source(request, encoded)
        with self._lock:
            n = self._spans.consume(source, lean, self.clock())
            self.spans_seen += n
        if self.config.store_traces:
            self.store.add_request(request, encoded)  # O(1) when deferred; its own lock
        return n

    def consume_metrics(self, request) -> int:
        """Ingests an ``ExportMetricsServiceRequest``; returns the CTA points taken."""
        taken = 0
        with self._lock:
            now = self.clock()
            for rm in request.resource_metrics:
                resource_key = rm.resource.SerializeToString(deterministic=True)
                for sm_scope in rm.scope_metrics:
                    for metric in sm_scope.metrics:
                        if metric.name != sc.METRIC_CTA_DURATION:
                            self._drop("unknown_metric", points_in(metric))
                            continue
                        kind = metric.WhichOneof("data")
                        if kind == "exponential_histogram":
                            data = metric.exponential_histogram
                            cumulative = data.aggregation_temporality == _CUMULATIVE
                            for point in data.data_points:
                                try:
                                    taken += self._on_cta_point(point, cumulative, resource_key, now)
                                except Exception:  # keep the batch's other points
                                    self._drop("malformed_point")
                                    log.debug("CTA point refused", exc_info=True)
                        elif kind == "histogram":
                            self._drop("explicit_bucket_histogram", len(metric.histogram.data_points))
                        else:
                            self._drop("unsupported_metric_type", points_in(metric))
            self.points_seen += taken
        return taken

    def prometheus_collector(self) -> AggregatorCollector:
        """A custom collector to register with a ``prometheus_client`` registry."""
        return AggregatorCollector(self)

    # -- public: queries (each takes the lock and returns copies) ------------------------
    def now(self) -> float:
        return self.clock()

    def kernels(self) -> list[dict]:
        """What per-SM data exists: one entry per (gpu, kernel), plus span-derived kernels."""
        with self._lock:
            per: dict[tuple[str, str], dict] = {}
            for (gpu, sm, kernel), series in self._sm.items():
                entry = per.setdefault((gpu, kernel), {"gpu": gpu, "kernel": kernel, "sms": 0,
                                                       "ctas": 0, "source": "sm_probe"})
                entry["sms"] += 1
                entry["ctas"] += series.classic.count
            spans = [{"gpu": g, "kernel": k, "launches": s.classic.count, "source": "kernel_spans"}
                     for (g, k), s in self._spans.kernels.items()]
        return sorted(per.values(), key=lambda e: (e["gpu"], e["kernel"])) + \
            sorted(spans, key=lambda e: (e["gpu"], e["kernel"]))

    def sm_slots(self, gpu: str, kernel: str, now_s: float | None = None,
                 last_s: float | None = None) -> dict[str, list[tuple[int, ExpHistogram, Exemplar | None]]]:
        """Per SM: ``(slot epoch, histogram copy, slowest exemplar)`` over the last ``last_s``."""
        now_s = self.clock() if now_s is None else now_s
        last_s = self._wc.horizon_s if last_s is None else last_s
        with self._lock:
            out = {}
            for (g, sm, k), series in self._sm.items():
                if g == gpu and k == kernel:
                    out[sm] = [(e, h.copy(), ex) for e, h, ex in series.window.slots(now_s, last_s)]
        return out

    def sm_windows(self, gpu: str, kernel: str, now_s: float | None = None,
                   last_s: float | None = None) -> dict[str, ExpHistogram]:
        """Per SM: one histogram merged over the last ``last_s`` seconds."""
        now_s = self.clock() if now_s is None else now_s
        last_s = self.config.gauge_window_s if last_s is None else last_s
        with self._lock:
            return {sm: s.window.window(now_s, last_s) for (g, sm, k), s in self._sm.items()
                    if g == gpu and k == kernel}

    def sm_windows_between(self, start_s: float, end_s: float) -> dict[tuple[str, str], dict[str, ExpHistogram]]:
        """Per (gpu, kernel), per SM: the slots overlapping ``[start_s, end_s]``, merged."""
        wc = self._wc
        first = wc.epoch(start_s)
        last_s = max(end_s - start_s, 0.0) + wc.slot_s
        out: dict[tuple[str, str], dict[str, ExpHistogram]] = {}
        with self._lock:
            for (gpu, sm, kernel), series in self._sm.items():
                hists = [h for e, h, _ in series.window.slots(end_s, last_s) if e >= first]
                if hists:
                    out.setdefault((gpu, kernel), {})[sm] = merge_all(hists, wc)
        return out

    def sm_exemplar_for_spans(self, span_ids: set[bytes]) -> tuple[str, str, str, Exemplar] | None:
        """The slowest per-SM exemplar (still in a window) that points at one of ``span_ids``."""
        best = None
        with self._lock:
            for (gpu, sm, kernel), series in self._sm.items():
                for ex in series.window.exemplars():
                    if ex.span_id in span_ids and (best is None or ex.value > best[3].value):
                        best = (gpu, sm, kernel, ex)
        return best

    def latency_window(self, family: str, key, last_s: float | None = None) -> ExpHistogram:
        """A span-derived distribution over the window: ``family`` is ttft|tpot|e2e|queue
        (key (model, priority)), kernel (key (gpu, kernel)) or step (key phase)."""
        now_s = self.clock()
        last_s = self._wc.horizon_s if last_s is None else last_s
        with self._lock:
            if family == "kernel":
                series = self._spans.kernels.get(key)
            elif family == "step":
                series = self._spans.steps.get(key)
            else:
                series = self._spans.requests.get(key, {}).get(family)
            return series.window.window(now_s, last_s) if series else ExpHistogram()

    def with_store(self, fn):
        """Runs ``fn(store)`` on the caught-up trace store under its lock (explanations)."""
        return self.store.read(fn)

    def exposition_snapshot(self) -> ExpositionSnapshot:
        now_s = self.clock()
        with self._lock:
            sm_p99: dict[tuple[str, str], dict[str, float]] = {}
            for (gpu, sm, kernel), s in self._sm.items():
                hist = s.window.window(now_s, self.config.gauge_window_s)
                if hist.count:
                    sm_p99.setdefault((gpu, kernel), {})[sm] = hist.quantile(0.99)
            return ExpositionSnapshot(
                requests={k: {f: s.classic.copy() for f, s in v.items()} for k, v in self._spans.requests.items()},
                requests_total=dict(self._spans.requests_total),
                kernels={k: s.classic.copy() for k, s in self._spans.kernels.items()},
                steps={k: s.classic.copy() for k, s in self._spans.steps.items()},
                kernel_trace_backlog_steps=self._spans.kernel_trace_backlog_steps,
                sm_classic=({k: s.classic.copy() for k, s in self._sm.items()}
                            if self.config.expose_sm_histograms else {}),
                sm_p99=sm_p99, overflow=dict(self.overflow), dropped=dict(self.dropped))

    def memory_bytes(self) -> int:
        """Bytes held by every histogram's bucket arrays (the part that grows with data)."""
        with self._lock:
            total = sum(s.window.nbytes() for s in self._sm.values())
            total += sum(s.window.nbytes() for s in self._spans.kernels.values())
            total += sum(s.window.nbytes() for s in self._spans.steps.values())
            total += sum(s.window.nbytes() for v in self._spans.requests.values() for s in v.values())
            total += sum(h.counts.nbytes for _, h in self._cumulative.values())
        return total

    def series_counts(self) -> dict[str, int]:
        with self._lock:
            return {"sm": len(self._sm), "kernel": len(self._spans.kernels),
                    "request": len(self._spans.requests), "step": len(self._spans.steps),
                    "cumulative_streams": len(self._cumulative)}

    # -- per-SM metric points ---------------------------------------------------------------
    def _time(self, unix_nano: int, now: float) -> float:
        t = clamped_time_s(unix_nano, now)
        if t > self._newest_point_s:
            self._newest_point_s = t
        return t

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def _on_cta_point(self, point, cumulative: bool, resource_key: bytes, now: float) -> int:
        gpu = sm = kernel = None
        for kv in point.attributes:
            key = kv.key
            if key == sc.ATTR_SM_ID:
                sm = _label(kv.value)
            elif key == sc.ATTR_GPU_ID:
                gpu = _label(kv.value)
            elif key == sc.ATTR_KERNEL_NAME:
                kernel = _label(kv.value)
        if sm is None or kernel is None:
            self._drop("missing_attributes")
            return 0
        gpu = gpu or "0"
        try:
            hist = cta_point_histogram(point, self._wc.max_buckets)
        except PointRefused as refused:
            self._drop(refused.reason)
            return 0
        if cumulative:
            stream = (resource_key, gpu, sm, kernel)
            prev = self._cumulative.get(stream)
            self._cumulative[stream] = (point.start_time_unix_nano, hist)
            self._cumulative.move_to_end(stream)
            while len(self._cumulative) > 2 * self.config.max_sm_series:
                self._cumulative.popitem(last=False)
            if prev is not None and prev[0] == point.start_time_unix_nano:
                delta = subtract_cumulative(hist, prev[1])
                if delta is None:  # a reset without a new start time: take it whole
                    delta = hist
                hist = delta
            if hist.count == 0:
                return 1
        t = self._time(point.time_unix_nano, now)
        if t <= now - self._wc.horizon_s:
            self._drop("late")
            return 0
        key = (gpu, sm, kernel)
        series = self._sm.get(key)
        if series is None:
            if len(self._sm) >= self.config.max_sm_series:
                key = (OVERFLOW, OVERFLOW, OVERFLOW)
                self.overflow["sm_cta"] = self.overflow.get("sm_cta", 0) + 1
                series = self._sm.get(key)
            if series is None:
                series = self._sm[key] = _SmSeries(self._wc)
        exemplar = None
        for e in point.exemplars:
            value = e.as_double if e.WhichOneof("value") == "as_double" else float(e.as_int)
            if exemplar is None or value > exemplar.value:
                exemplar = Exemplar(value, e.trace_id, e.span_id, e.time_unix_nano)
        if not series.window.add_histogram(hist, t, exemplar):
            self._drop("late")
            return 0
        series.classic.add_exp(hist, exemplar)
        return 1
