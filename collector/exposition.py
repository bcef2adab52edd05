"""Prometheus exposition of the aggregator, sized for fleets: the /metrics page.

:func:`metrics_page` writes a registry (the collector's own metrics and
:class:`AggregatorCollector`) through ``prometheus_client``, then the per-SM families in bulk
(:mod:`.sm_exposition`), in the format the scraper's Accept header prefers, with one
OpenMetrics ``# EOF`` at the very end. :class:`AggregatorCollector`: span-derived series as
classic histograms (re-binned as :class:`~.windows.ClassicHistogram` states), requests seen,
overflow, eviction and refusal counters, slow requests by the cause explain named. Per-SM data, by default: one P99 gauge per (gpu, SM, kernel)
and per (gpu, kernel) a hotspot ratio, the hottest SM and a histogram over all SMs; per-SM
histograms are opt-in (``expose_sm_histograms``). Exemplars appear in OpenMetrics only.
A scrape reads a snapshot taken block by block (:meth:`.sm_store.SmStore.snapshot`), so
ingest goes on while it renders.
Cost of a scrape: per (instance, gpu, kernel) block written since the last scrape, one
vectorised P99 and one string per line (:class:`~.sm_exposition.SmPage`); bytes joined for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.samples import Exemplar as PromExemplar

from ..instrumentation import semconv
from .gzip_pieces import gzip_join
from .point_check import POINT_REFUSALS
from .windows import ClassicHistogram

if TYPE_CHECKING:
    from .aggregator import Aggregator

__all__ = ["AggregatorCollector", "ExpositionSnapshot", "metrics_page", "prometheus_buckets"]

_OPENMETRICS_EOF = b"# EOF\n"


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
    overflow: dict[str, int]
    dropped: dict[str, int]
    evicted: dict[str, int]
    stragglers: dict[str, dict] | None = None   # StragglerSeries.snapshot: per producer


def metrics_page(registry, aggregator: Aggregator | None, accept: str = "",
                 gzipped: bool = False) -> tuple[bytes, str]:
    """(body, content type) of /metrics: ``registry`` (anything with ``collect()``), then
    ``aggregator``'s per-SM families, in the format ``accept`` (an HTTP Accept header)
    prefers; OpenMetrics ends with one ``# EOF``. ``gzipped``: the body gzip-encoded, the
    per-SM blocks' pieces compressed once and kept (:mod:`.gzip_pieces`). Its cost grows
    with the per-SM series: call it off the event loop."""
    encode, content_type = choose_encoder(accept)
    openmetrics = content_type.startswith("application/openmetrics-text")
    pieces = [(encode(registry).removesuffix(_OPENMETRICS_EOF), None)]
    if aggregator is not None:
        pieces += aggregator.sm_page.pieces(aggregator.now(), openmetrics, deflate=gzipped)
    if openmetrics:
        pieces.append((_OPENMETRICS_EOF, None))
    if gzipped:
        return gzip_join(pieces), content_type
    return b"".join(text for text, _ in pieces), content_type


class AggregatorCollector:
    """A ``prometheus_client`` collector over an :class:`Aggregator`'s span-derived series and
    counters (register it once); :func:`metrics_page` adds the per-SM families."""

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
        overflow = CounterMetricFamily(L.COLLECTOR_SERIES_OVERFLOW_TOTAL,
                                       "Observations folded into an overflow series (cardinality limit).",
                                       labels=[L.LABEL_FAMILY])
        evicted = CounterMetricFamily(L.COLLECTOR_SERIES_EVICTED_TOTAL,
                                      "Series let go from a full table after idling past the window horizon.",
                                      labels=[L.LABEL_FAMILY])
        dropped = CounterMetricFamily(L.COLLECTOR_AGGREGATOR_DROPPED_TOTAL,
                                      "Data points or spans the aggregator refused, by reason.",
                                      labels=[L.LABEL_REASON])
        causes = CounterMetricFamily(L.COLLECTOR_SLOW_REQUESTS_EXPLAINED,
                                     "Slow requests the collector explained, by the cause it named.",
                                     labels=[L.LABEL_CAUSE])
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
            # Present at 0 from the start, so that rate() and increase() (alerts, the
            # pipeline dashboard) see the first overflow or refusal.
            for family, n in sorted({**dict.fromkeys(OVERFLOW_FAMILIES, 0), **snap.overflow}.items()):
                overflow.add_metric([family], n)
            for family, n in sorted({**dict.fromkeys(EVICTED_FAMILIES, 0), **snap.evicted}.items()):
                evicted.add_metric([family], n)
            for reason, n in sorted({**dict.fromkeys(DROP_REASONS, 0), **snap.dropped}.items()):
                dropped.add_metric([reason], n)
            counted = self._aggregator.slow_request_causes()
            for cause, n in (counted or {}).items():
                causes.add_metric([cause], n)
        yield from fams.values()
        yield from (requests_total, kernel, step, overflow, evicted, dropped)
        if snap is None or counted is not None:
            yield causes
        yield from _straggler_families(snap.stragglers if snap is not None else None)


def _straggler_families(producers: dict | None):
    """Tensor-parallel families: counters per (instance, rank), the newest complete slot's
    straggler (-1: none named) and share per instance."""
    L = semconv
    inst, rank = L.LABEL_INSTANCE_ID, L.LABEL_RANK
    steps = CounterMetricFamily(L.COLLECTOR_TP_STEPS_TOTAL,
                                "Tensor-parallel steps whose every rank reported its part.",
                                labels=[inst])
    named = CounterMetricFamily(L.COLLECTOR_TP_STRAGGLER_STEPS_TOTAL,
                                "Tensor-parallel steps that named this rank the straggler "
                                "(the rank the others waited for in collectives).",
                                labels=[inst, rank])
    compute = CounterMetricFamily(L.COLLECTOR_TP_COMPUTE_SECONDS_TOTAL,
                                  "Seconds each rank's forward passes spent outside collectives.",
                                  labels=[inst, rank])
    wait = CounterMetricFamily(L.COLLECTOR_TP_COLLECTIVE_WAIT_SECONDS_TOTAL,
                               "Seconds each rank's forward passes spent in collectives "
                               "(waiting for the other ranks, and the transfer).",
                               labels=[inst, rank])
    verdict = GaugeMetricFamily(L.COLLECTOR_TP_STRAGGLER_RANK,
                                "The rank named the straggler by the newest complete window slot "
                                "with tensor-parallel steps; -1: the ranks kept pace.", labels=[inst])
    share = GaugeMetricFamily(L.COLLECTOR_TP_STRAGGLER_SHARE,
                              "Share of that slot's steps that named its most named rank.",
                              labels=[inst])
    for name, p in sorted((producers or {}).items()):
        steps.add_metric([name], p["steps"])
        for r in sorted(p["compute_s"]):
            named.add_metric([name, str(r)], p["named"].get(r, 0))
            compute.add_metric([name, str(r)], p["compute_s"][r])
            wait.add_metric([name, str(r)], p["wait_s"][r])
        if p["last_slot"] is not None:
            who, fraction = p["last_slot"]
            verdict.add_metric([name], -1 if who is None else who)
            share.add_metric([name], fraction)
    yield from (steps, named, compute, wait, verdict, share)



OVERFLOW_FAMILIES = ("request", "step", "kernel", "sm_cta", "tp")
EVICTED_FAMILIES = ("request", "kernel", "sm_cta")
# Every reason the aggregator refuses a span or point for: each is on /metrics at 0 from the
# start (tests/collector/test_counting.py checks the list against every reason in the code).
DROP_REASONS = ("malformed_span", "span_out_of_range", "partial_tp_step", "malformed_point",
                "explicit_bucket_histogram", "unsupported_metric_type", "unknown_metric", "missing_attributes",
                "late", "sm_series_limit", "cumulative_streams_full", "cumulative_baseline",
                "wide_launches_unmatched", "dealt_unmatched") + POINT_REFUSALS
