"""Prometheus exposition of the aggregator, sized for fleets.

:class:`AggregatorCollector` is a ``prometheus_client`` custom collector. Span-derived
series are classic histograms (re-binned as :class:`~.windows.ClassicHistogram` states).
Per-SM data, by default: one P99 gauge per (gpu, SM, kernel) over the gauge window, and
per (gpu, kernel) the hotspot ratio, the hottest SM and a CTA-duration histogram over all
SMs; per-SM histograms (19 lines per series) are opt-in (``expose_sm_histograms``). The
``gpu`` label is the GPU's identity (UUID, else ``instance:index``; ``sightline_gpu`` maps it
to its instance and index); a long kernel name is shortened (``sightline_sm_kernel`` maps it). The full-resolution heatmap is the query API's.
A scrape reads a snapshot taken block by block (:meth:`.sm_store.SmStore.snapshot`), so
ingest goes on while it renders. Exemplars appear in the OpenMetrics format only.
Cost of a scrape: one vectorised P99 per (instance, gpu, kernel) block, one line per series.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Exemplar as PromExemplar

from ..instrumentation import semconv
from .hotspot import hotspots
from .sm_store import BlockSnapshot, gpu_label, kernel_label
from .windows import ClassicHistogram

if TYPE_CHECKING:
    from .aggregator import Aggregator

__all__ = ["AggregatorCollector", "ExpositionSnapshot", "prometheus_buckets"]


def prometheus_buckets(h: ClassicHistogram) -> list[tuple]:
    """``h``'s cumulative buckets, each with its exemplar, as ``HistogramMetricFamily`` takes them."""
    out: list[tuple] = []
    cumulative = 0
    les = [repr(float(b)) for b in h.bounds] + ["+Inf"]
    for le, n, ex in zip(les, h.counts, h.exemplars):
        cumulative += n
        if ex is not None:
            out.append((le, cumulative, PromExemplar(
                {semconv.EXEMPLAR_TRACE_ID_LABEL: ex.trace_id.hex(), "span_id": ex.span_id.hex()}, ex.value,
                ex.time_unix_nano / 1e9 if ex.time_unix_nano else None)))
        else:
            out.append((le, cumulative))
    return out


@dataclass
class ExpositionSnapshot:
    """Copies of everything the Prometheus collector writes (taken under the lock)."""

    requests: dict[tuple[str, str], dict[str, ClassicHistogram]]
    requests_total: dict[tuple[str, str, str], int]
    kernels: dict[tuple[str, str], ClassicHistogram]
    steps: dict[str, ClassicHistogram]
    sm_blocks: list[BlockSnapshot]
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
        per_sm = [L.LABEL_GPU, L.LABEL_SM, L.LABEL_KERNEL]
        per_gpu = [L.LABEL_GPU, L.LABEL_KERNEL]
        sm_hist = HistogramMetricFamily(L.COLLECTOR_SM_CTA_DURATION_SECONDS,
                                        "Duration of each attention CTA by the SM that ran it (opt-in).",
                                        labels=per_sm)
        sm_p99 = GaugeMetricFamily(L.COLLECTOR_SM_CTA_P99_SECONDS,
                                   "P99 CTA duration per SM over the last gauge window.", labels=per_sm)
        hotspot = GaugeMetricFamily(L.COLLECTOR_SM_HOTSPOT_RATIO,
                                    "Slowest SM's P99 CTA duration over the median SM's P99.", labels=per_gpu)
        hottest = GaugeMetricFamily(L.COLLECTOR_SM_HOTTEST,
                                    "The SM with the largest P99 CTA duration (its number).", labels=per_gpu)
        gpu_hist = HistogramMetricFamily(L.COLLECTOR_GPU_CTA_DURATION_SECONDS,
                                         "Duration of each attention CTA, all SMs of a GPU together.",
                                         labels=per_gpu)
        gpu_info = GaugeMetricFamily(L.COLLECTOR_GPU_INFO, "1 per GPU with per-SM data: its instance and gpu.id.",
                                     labels=[L.LABEL_GPU, L.LABEL_INSTANCE_ID, L.LABEL_GPU_INDEX])
        kernel_info = GaugeMetricFamily(L.COLLECTOR_SM_KERNEL_INFO, "1 per kernel with per-SM data: its whole name.",
                                        labels=[L.LABEL_KERNEL, L.LABEL_KERNEL_NAME])
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
                        fams[key].add_metric([model, priority], prometheus_buckets(h), h.sum)
            for (model, priority, reason), n in snap.requests_total.items():
                requests_total.add_metric([model, priority, reason], n)
            for (gpu, name), h in snap.kernels.items():
                kernel.add_metric([gpu, name], prometheus_buckets(h), h.sum)
            for phase, h in snap.steps.items():
                step.add_metric([phase], prometheus_buckets(h), h.sum)
            gpus, kernels = set(), {}
            for block in snap.sm_blocks:
                instance, gpu, name = block.key
                gpu = gpu_label(instance, gpu, block.gpu_index)
                if gpu not in gpus:
                    gpus.add(gpu)
                    gpu_info.add_metric([gpu, instance, block.gpu_index], 1)
                short = kernels.get(name)
                if short is None:
                    short = kernels[name] = kernel_label(name)
                    kernel_info.add_metric([short, name], 1)
                gpu_hist.add_metric([gpu, short], prometheus_buckets(block.classic), block.classic.sum)
                p99 = {}
                for sm, value in zip(block.sms, block.p99_s.tolist()):
                    if not math.isnan(value):
                        p99[sm] = value
                        # 6 digits: the sketch's own error is 0.5 %, more would be noise (and bytes)
                        sm_p99.add_metric([gpu, sm, short], float(f"{value:.6g}"))
                summary = hotspots(p99)
                if summary.ratio is not None:
                    hotspot.add_metric([gpu, short], summary.ratio)
                    if summary.hottest_sm.isdigit():
                        hottest.add_metric([gpu, short], int(summary.hottest_sm))
                for sm, h in zip(block.sms, block.classic_sm or ()):
                    sm_hist.add_metric([gpu, sm, short], prometheus_buckets(h), h.sum)
            # Present at 0 from the start, so that rate() and increase() (alerts, the
            # pipeline dashboard) see the first overflow or refusal.
            for family, n in sorted({**dict.fromkeys(OVERFLOW_FAMILIES, 0), **snap.overflow}.items()):
                overflow.add_metric([family], n)
            for reason, n in sorted({**dict.fromkeys(DROP_REASONS, 0), **snap.dropped}.items()):
                dropped.add_metric([reason], n)
        yield from fams.values()
        yield from (requests_total, kernel, step, sm_p99, hotspot, hottest, gpu_hist, gpu_info, kernel_info)
        if snap is None or any(b.classic_sm is not None for b in snap.sm_blocks):
            yield sm_hist
        yield from (overflow, dropped)


OVERFLOW_FAMILIES = ("request", "step", "kernel", "sm_cta")
DROP_REASONS = ("malformed_span", "malformed_point", "explicit_bucket_histogram",
                "unsupported_metric_type", "missing_attributes", "bad_scale", "too_many_buckets",
                "inconsistent_count", "out_of_range", "late", "sm_series_limit", "cumulative_streams_full",
                "cumulative_baseline")
