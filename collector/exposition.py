"""Prometheus exposition of the aggregator: classic histograms, P99 gauges, hotspots.

:class:`ClassicHistogram` keeps cumulative counts over fixed bucket bounds (the ones in
``semconv``), what Prometheus's ``histogram_quantile`` reads. Values recorded one by one
land in exactly their bucket; a received exponential histogram is re-binned bucket by
bucket at each bucket's representative point, so a count is misplaced only when its
value lies within the source histogram's relative error (0.54 % at scale 6) of a
classic bound. Memory: one int per bound and one exemplar slot per bound.

:class:`AggregatorCollector` is a ``prometheus_client`` custom collector. It builds every
family from a snapshot taken under the aggregator's lock, so a scrape never sees a
half-applied export. Exemplars (trace and span ids) are attached per bucket, the latest
(or, for per-SM data, the slowest) one seen; they appear in the OpenMetrics format only.
Cost of a scrape: one window merge per per-SM series for the P99 gauge, and 19 lines
per per-SM classic histogram: 8 GPUs x 132 SMs x 4 kernels made an ~84,000-line, ~3 s
scrape on this project's shared 2-core machine (``expose_sm_histograms=False`` leaves the
gauges and drops those lines).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Exemplar as PromExemplar

from sightline.collector.windows import Exemplar
from sightline.instrumentation import semconv
from sightline.instrumentation.exphist import ExpHistogram

if TYPE_CHECKING:
    from sightline.collector.aggregator import Aggregator

__all__ = ["AggregatorCollector", "ClassicHistogram", "ExpositionSnapshot"]


class ClassicHistogram:
    """Cumulative counts over fixed upper bounds (plus +Inf), with per-bucket exemplars."""

    __slots__ = ("bounds", "counts", "sum", "count", "exemplars")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # not cumulative; the last is (max bound, +Inf)
        self.sum = 0.0
        self.count = 0
        self.exemplars: list[Exemplar | None] = [None] * (len(bounds) + 1)

    def record(self, value: float, exemplar: Exemplar | None = None) -> None:
        i = bisect.bisect_left(self.bounds, value)  # Prometheus buckets are "<= le"
        self.counts[i] += 1
        self.sum += value
        self.count += 1
        if exemplar is not None:
            self.exemplars[i] = exemplar

    def add_exp(self, hist: ExpHistogram, exemplar: Exemplar | None = None) -> None:
        """Re-bins an exponential histogram (see the module docstring for the error)."""
        self.count += hist.count
        self.sum += hist.sum
        self.counts[0] += hist.zero_count
        n = hist.counts.size
        if n:
            # Bucket i goes to classic bucket #{bounds < its point}: with the first bucket
            # index past each bound (cached per scale), one cumsum and a walk over the bounds
            # (plain ints: cheaper than numpy's per-call overhead for ~16 bounds).
            cumulative = np.cumsum(hist.counts).tolist()
            offset, counts, before = hist.offset, self.counts, 0
            for j, first in enumerate(_first_bucket_above(self.bounds, hist.scale)):
                k = min(max(first - offset, 0), n)
                upto = cumulative[k - 1] if k else 0
                counts[j] += upto - before
                before = upto
            counts[-1] += cumulative[-1] - before
        if exemplar is not None:
            self.exemplars[bisect.bisect_left(self.bounds, exemplar.value)] = exemplar

    def copy(self) -> ClassicHistogram:
        other = ClassicHistogram(self.bounds)
        other.counts = list(self.counts)
        other.sum, other.count = self.sum, self.count
        other.exemplars = list(self.exemplars)
        return other

    def prometheus_buckets(self) -> list[tuple]:
        out: list[tuple] = []
        cumulative = 0
        les = [_le(b) for b in self.bounds] + ["+Inf"]
        for le, n, ex in zip(les, self.counts, self.exemplars):
            cumulative += n
            if ex is not None:
                out.append((le, cumulative, PromExemplar(
                    {semconv.EXEMPLAR_TRACE_ID_LABEL: ex.trace_id.hex(), "span_id": ex.span_id.hex()}, ex.value,
                    ex.time_unix_nano / 1e9 if ex.time_unix_nano else None)))
            else:
                out.append((le, cumulative))
        return out


@functools.lru_cache(maxsize=256)
def _first_bucket_above(bounds: tuple[float, ...], scale: int) -> tuple[int, ...]:
    """Per bound ``b``: the smallest bucket index at ``scale`` whose point (the value a
    quantile answers for it, ``2 * upper / (base + 1)``) is above ``b``."""
    base = 2.0 ** (2.0 ** -scale)

    def point(i: int) -> float:
        return 2.0 * 2.0 ** ((i + 1) * 2.0 ** -scale) / (base + 1.0)

    out = []
    for b in bounds:
        i = math.floor(math.log2(b * (base + 1.0) / 2.0) * 2.0 ** scale) - 2
        while point(i) <= b:  # settle float rounding with the very formula used for points
            i += 1
        while point(i - 1) > b:
            i -= 1
        out.append(i)
    return tuple(out)


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass
class ExpositionSnapshot:
    """Copies of everything the Prometheus collector writes (taken under the lock)."""

    requests: dict[tuple[str, str], dict[str, ClassicHistogram]]
    requests_total: dict[tuple[str, str, str], int]
    kernels: dict[tuple[str, str], ClassicHistogram]
    steps: dict[str, ClassicHistogram]
    kernel_trace_backlog_steps: int
    sm_classic: dict[tuple[str, str, str], ClassicHistogram]  # (gpu, sm, kernel)
    sm_p99: dict[tuple[str, str], dict[str, float]]
    overflow: dict[str, int]
    dropped: dict[str, int]


class AggregatorCollector:
    """A ``prometheus_client`` collector over an :class:`Aggregator` (register it once)."""

    def __init__(self, aggregator: Aggregator) -> None:
        self._aggregator = aggregator

    def describe(self):
        # Names only, without taking the lock: lets the registry check duplicates cheaply.
        return list(self._families(None))

    def collect(self):
        return list(self._families(self._aggregator.exposition_snapshot()))

    def _families(self, snap):
        L = semconv
        req_labels = [L.LABEL_MODEL, L.LABEL_PRIORITY]
        fams = {
            "ttft": HistogramMetricFamily(L.COLLECTOR_REQUEST_TTFT_SECONDS,
                                          "Time to first token per request (from request spans).",
                                          labels=req_labels),
            "tpot": HistogramMetricFamily(L.COLLECTOR_REQUEST_TPOT_SECONDS,
                                          "Time per output token after the first (from request spans).",
                                          labels=req_labels),
            "e2e": HistogramMetricFamily(L.COLLECTOR_REQUEST_E2E_SECONDS,
                                         "End-to-end request latency (from request spans).",
                                         labels=req_labels),
            "queue": HistogramMetricFamily(L.COLLECTOR_REQUEST_QUEUE_SECONDS,
                                           "Time a request waited in the scheduler queue.",
                                           labels=req_labels),
        }
        requests_total = CounterMetricFamily(L.COLLECTOR_REQUESTS_TOTAL, "Requests seen in spans.",
                                             labels=[L.LABEL_MODEL, L.LABEL_PRIORITY, L.LABEL_FINISH_REASON])
        kernel = HistogramMetricFamily(L.COLLECTOR_KERNEL_DURATION_SECONDS,
                                       "CUDA kernel durations (from sampled kernel spans).",
                                       labels=[L.LABEL_GPU, L.LABEL_KERNEL])
        step = HistogramMetricFamily(L.COLLECTOR_STEP_DURATION_SECONDS,
                                     "Engine step durations (from engine.step spans).",
                                     labels=[L.LABEL_PHASE])
        backlog = CounterMetricFamily(L.COLLECTOR_STEPS_KERNEL_TRACE_BACKLOG_TOTAL,
                                      "Engine steps run while the engine's telemetry processed a "
                                      "kernel-traced step (that CPU may have slowed them).",
                                      labels=[])
        sm_hist = HistogramMetricFamily(L.COLLECTOR_SM_CTA_DURATION_SECONDS,
                                        "Duration of each attention CTA by the SM that ran it.",
                                        labels=[L.LABEL_GPU, L.LABEL_SM, L.LABEL_KERNEL])
        sm_p99 = GaugeMetricFamily(L.COLLECTOR_SM_CTA_P99_SECONDS,
                                   "P99 CTA duration per SM over the last gauge window.",
                                   labels=[L.LABEL_GPU, L.LABEL_SM, L.LABEL_KERNEL])
        hotspot = GaugeMetricFamily(L.COLLECTOR_SM_HOTSPOT_RATIO,
                                    "Slowest SM's P99 CTA duration over the median SM's P99.",
                                    labels=[L.LABEL_GPU, L.LABEL_KERNEL])
        overflow = CounterMetricFamily(L.COLLECTOR_SERIES_OVERFLOW_TOTAL,
                                       "Observations folded into an overflow series (cardinality limit).",
                                       labels=[L.LABEL_FAMILY])
        dropped = CounterMetricFamily(L.COLLECTOR_AGGREGATOR_DROPPED_TOTAL,
                                      "Data points or spans the aggregator refused, by reason.",
                                      labels=[L.LABEL_REASON])
        if snap is not None:
            for (model, priority), series in snap.requests.items():
                for key in ("ttft", "tpot", "e2e", "queue"):
                    h = series[key]
                    if h.count:
                        fams[key].add_metric([model, priority], h.prometheus_buckets(), h.sum)
            for (model, priority, reason), n in snap.requests_total.items():
                requests_total.add_metric([model, priority, reason], n)
            for (gpu, name), h in snap.kernels.items():
                kernel.add_metric([gpu, name], h.prometheus_buckets(), h.sum)
            for phase, h in snap.steps.items():
                step.add_metric([phase], h.prometheus_buckets(), h.sum)
            backlog.add_metric([], snap.kernel_trace_backlog_steps)  # at 0 from the start
            for (gpu, sm, name), h in snap.sm_classic.items():
                sm_hist.add_metric([gpu, sm, name], h.prometheus_buckets(), h.sum)
            for (gpu, name), per_sm in snap.sm_p99.items():
                for sm, p99 in per_sm.items():
                    sm_p99.add_metric([gpu, sm, name], p99)
                ratio = hotspot_ratio(list(per_sm.values()))
                if not math.isnan(ratio):
                    hotspot.add_metric([gpu, name], ratio)
            # Present at 0 from the start, so that rate() and increase() (alerts, the
            # pipeline dashboard) see the first overflow or refusal.
            for family, n in sorted({**dict.fromkeys(OVERFLOW_FAMILIES, 0), **snap.overflow}.items()):
                overflow.add_metric([family], n)
            for reason, n in sorted({**dict.fromkeys(DROP_REASONS, 0), **snap.dropped}.items()):
                dropped.add_metric([reason], n)
        yield from fams.values()
        yield from (requests_total, kernel, step, backlog, sm_hist, sm_p99, hotspot, overflow, dropped)


OVERFLOW_FAMILIES = ("request", "step", "kernel", "sm_cta")
DROP_REASONS = ("malformed_span", "malformed_point", "explicit_bucket_histogram",
                "unsupported_metric_type", "missing_attributes", "bad_scale", "too_many_buckets",
                "inconsistent_count", "out_of_range", "late")


def hotspot_ratio(p99s: list[float]) -> float:
    """max / median of per-SM P99s (NaN with no SM or a zero median)."""
    values = [v for v in p99s if not math.isnan(v)]
    if not values:
        return math.nan
    median = float(np.median(values))
    return max(values) / median if median > 0 else math.nan
