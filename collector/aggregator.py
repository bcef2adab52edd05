"""Turns received OTLP traces and metrics into windowed distributions and indexes.

Inputs (one form: the receivers convert Zipkin to OTLP first): ``gpu.kernel.cta.duration``
exponential-histogram points go to the per-SM store (:mod:`.sm_store`: identity, fair
admission, cumulative streams; :mod:`.sm_blocks`: accuracy and memory). Spans, dispatched
on their name alone, feed request, step and kernel latency series
(:class:`~.span_series.SpanSeries`, which states their cost); every export request also
goes to the bounded :class:`~.trace_store.TraceStore` (indexed when first queried).

Guarantees: memory bounded whatever arrives (each store states its bound); timestamps
ahead of the collector's clock are clamped to it; per-SM points older than the
full-resolution window are refused (``reason="late"``). Thread-safety: the span series
under one lock per export request; the per-SM store and the trace store have their own
locks, so metrics, spans and scrapes do not wait on each other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..instrumentation import ExpHistogram
from .aggregation_config import AggregationConfig, WindowConfig
from .cause_counter import SlowRequestCauses
from .decoded_traces import as_decoded
from .engine_timeline import EngineTimeline
from .exposition import AggregatorCollector, ExpositionSnapshot
from .sm_exposition import SmPage
from .sm_store import SmKey, SmStore
from .span_series import SpanSeries
from .trace_store import TraceStore
from .windows import Exemplar

__all__ = ["AggregationConfig", "Aggregator", "ExpositionSnapshot", "SmKey", "WindowConfig"]

log = logging.getLogger(__name__)


class Aggregator:
    """See the module docstring. ``clock`` returns wall-clock seconds (tests pin it)."""

    def __init__(self, config: AggregationConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config or AggregationConfig()
        self.clock = clock
        self._lock = threading.Lock()
        wc = self.config.window
        self._wc = wc
        self.store = TraceStore(self.config.trace_store)
        self.overflow: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.evicted: dict[str, int] = {}
        self.spans_seen = 0
        # Span-derived series and per-SM series; both add to these overflow, dropped and evicted counters.
        self._spans = SpanSeries(self.config, self.overflow, self.dropped, self.evicted)
        self.sm = SmStore(self.config, self.overflow, self.dropped, clock, self.evicted)
        self.sm_page = SmPage(self.sm)  # the per-SM families of /metrics, kept between scrapes
        self.timeline = EngineTimeline()  # explain's step and queue facts (used under the store's lock)
        factor = self.config.slow_request_factor
        self.causes = SlowRequestCauses(factor) if factor is not None and self.config.store_traces else None

    @property
    def points_seen(self) -> int:
        return self.sm.points_seen

    @property
    def newest_data_s(self) -> float:
        """Newest data time taken (span end or CTA point time, clamped to the clock)."""
        return max(self.sm.newest_point_s, self._spans.newest_data_s)

    # -- public: ingest -------------------------------------------------------------
    def consume_traces(self, request, encoded_bytes: int | None = None) -> int:
        """Ingests a :data:`~.decoded_traces.DecodedTraceRequest` (the receivers' one parse;
        a stock ``ExportTraceServiceRequest``, as replay and tests hand in, is converted
        first); returns the number of spans taken.

        The series and the trace store both read ``request`` itself: nothing parses or
        encodes it again. ``encoded_bytes``: the size of the encoding it was decoded from,
        when the receiver knows it (the trace store's bound counts it; else the store asks
        the message). One lock hold per export request; per span one dict lookup on its name,
        and a handler only for request roots, steps and kernels."""
        request = as_decoded(request)
        with self._lock:
            n = self._spans.consume(request, self.clock())
            self.spans_seen += n
        if self.config.store_traces:
            self.store.add_request(request, encoded_bytes)  # O(1) when deferred; its own lock
        return n

    def consume_metrics(self, request) -> int:
        """Ingests an ``ExportMetricsServiceRequest``; returns the CTA points taken."""
        return self.sm.consume(request, self.clock())

    def prometheus_collector(self) -> AggregatorCollector:
        """A custom collector to register with a ``prometheus_client`` registry."""
        return AggregatorCollector(self)

    # -- public: queries (each takes the lock and returns copies) ------------------------
    def now(self) -> float:
        return self.clock()

    def kernels(self) -> list[dict]:
        """What per-(instance, gpu, kernel) per-SM data exists, plus span-derived kernels."""
        with self._lock:
            spans = [{"gpu": g, "kernel": k, "launches": s.classic.count, "source": "kernel_spans"}
                     for (g, k), s in self._spans.kernels.items()]
        return self.sm.gpus() + sorted(spans, key=lambda e: (e["gpu"], e["kernel"]))

    def sm_windows(self, gpu: str, kernel: str, now_s: float | None = None,
                   last_s: float | None = None, instance: str | None = None) -> dict[str, ExpHistogram]:
        """Per SM: one histogram merged over the last ``last_s`` seconds (full resolution)."""
        now_s = self.clock() if now_s is None else now_s
        last_s = self.config.gauge_window_s if last_s is None else last_s
        return self.sm.histograms(self.sm.resolve(gpu, kernel, instance), now_s, last_s)

    def sm_slots(self, gpu: str, kernel: str, now_s: float | None = None, last_s: float | None = None,
                 instance: str | None = None) -> dict[str, list[tuple[int, ExpHistogram, Exemplar | None]]]:
        """Per SM: ``(slot epoch, histogram, slowest exemplar)`` of each full-resolution slot."""
        now_s = self.clock() if now_s is None else now_s
        last_s = self.config.gauge_window_s if last_s is None else last_s
        return self.sm.slot_histograms(self.sm.resolve(gpu, kernel, instance), now_s, last_s)

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

    def stragglers(self, instance: str | None = None) -> dict:
        """Per producer with tensor-parallel steps: each window slot's straggler verdict."""
        with self._lock:
            return self._spans.stragglers.slots(instance)

    def slow_request_causes(self) -> dict[str, int] | None:
        """The slow requests explained so far, by cause (classifying those newly slow); None
        when the collector does not classify them."""
        return self.causes.refresh(self, self.clock()) if self.causes is not None else None

    def with_store(self, fn):
        """Runs ``fn(store)`` on the caught-up trace store under its lock (explanations)."""
        return self.store.read(fn)

    def exposition_snapshot(self) -> ExpositionSnapshot:
        """The span-derived series and counters for /metrics (the per-SM ones: ``sm.snapshot``)."""
        with self._lock:
            spans = dict(
                requests={k: {f: s.classic.copy() for f, s in v.items()} for k, v in self._spans.requests.items()},
                requests_total=dict(self._spans.requests_total),
                kernels={k: s.classic.copy() for k, s in self._spans.kernels.items()},
                steps={k: s.classic.copy() for k, s in self._spans.steps.items()},
                stragglers=self._spans.stragglers.snapshot(self.clock()))
        return ExpositionSnapshot(**spans, overflow=dict(self.overflow), dropped=dict(self.dropped),
                                  evicted=dict(self.evicted))

    def memory_bytes(self) -> int:
        """Bytes held by every histogram's bucket arrays (the part that grows with data)."""
        with self._lock:
            total = sum(s.window.nbytes() for s in self._spans.kernels.values())
            total += sum(s.window.nbytes() for s in self._spans.steps.values())
            total += sum(s.window.nbytes() for v in self._spans.requests.values() for s in v.values())
        return total + self.sm.nbytes()

    def series_counts(self) -> dict[str, int]:
        sm = self.sm.counts()
        with self._lock:
            return {"sm": sm["sm"], "gpus": sm["gpus"], "kernel": len(self._spans.kernels),
                    "request": len(self._spans.requests), "step": len(self._spans.steps),
                    "cumulative_streams": sm["cumulative_streams"]}
