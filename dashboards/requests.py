"""Requests: where did the slow requests spend their time?

Built from the adapter's sampled ``llm:sampled_*`` series: the collector's span-derived
histograms (labels model and priority) where Sightline's traces arrive, so it shows what
the traces saw, or vLLM's own histograms (no priority). Latency heatmaps per priority
(one panel per priority value, with exemplars linking a cell to a trace in Tempo) and
the phase breakdown queue / prefill / decode; slow requests by the cause the collector named. Trace-derived counts cover sampled
requests only (a ``traceparent`` with flags ``-00`` is counted by the engine, not here):
the Overview's rates, from the engine's own counters, count every request.

Phase arithmetic: the collector exposes queue, TTFT and end-to-end histograms of the
same requests, so the *mean* prefill time is exactly mean(TTFT) - mean(queue) and the
mean decode time mean(e2e) - mean(TTFT). Percentiles do not subtract that way: the
P99 panel shows each phase's own P99 side by side, not a decomposition of the P99
request.
"""

from __future__ import annotations

from ..instrumentation import semconv as sc
from . import promql as q
from .panels import DashboardSpec, PanelSpec, Query, Row, Variable

__all__ = ["UID", "spec"]

UID = "sightline-requests"
_FILTER = (sc.LABEL_MODEL, sc.LABEL_PRIORITY)
_BY_PRIORITY = (sc.LABEL_PRIORITY,)
_SAMPLED = ("Sampled traffic only where the series come from traces (Sightline's collector): a request "
            "whose trace is not sampled is missing here; the Overview's request rate counts every request.")


# The collector's span-derived histogram behind each sampled llm: copy: its exemplars
# (trace ids) are what the panels show, since recording rules cannot copy them.
_SOURCE = {sc.LLM_SAMPLED_TTFT_SECONDS: sc.COLLECTOR_REQUEST_TTFT_SECONDS,
           sc.LLM_SAMPLED_E2E_SECONDS: sc.COLLECTOR_REQUEST_E2E_SECONDS,
           sc.LLM_SAMPLED_QUEUE_SECONDS: sc.COLLECTOR_REQUEST_QUEUE_SECONDS,
           sc.LLM_SAMPLED_TPOT_SECONDS: sc.COLLECTOR_REQUEST_TPOT_SECONDS}


def _p(quantile: float, histogram: str) -> str:
    return q.with_exemplars_of(q.histogram_quantile(quantile, histogram, _BY_PRIORITY, regex=_FILTER),
                               _SOURCE[histogram], regex=_FILTER)


def _heatmap(title: str, histogram: str, description: str) -> PanelSpec:
    return PanelSpec(
        title=title,
        kind="heatmap",
        unit="s",
        width=8,
        height=9,
        repeat=sc.LABEL_PRIORITY,
        description=description,
        queries=(
            Query(
                q.with_exemplars_of(q.sum_by((q.BUCKET_LABEL,), q.rate(q.selector(q.bucket(histogram), regex=_FILTER))),
                                    _SOURCE[histogram], regex=_FILTER),
                legend="{{le}}",
                exemplar=True,
                fmt="heatmap",
            ),
        ),
    )


def _mean(histogram: str) -> str:
    return q.mean(histogram, _BY_PRIORITY, regex=_FILTER)


def spec() -> DashboardSpec:
    heatmaps = Row(
        "Latency heatmaps by priority",
        (
            _heatmap("TTFT, priority $priority", sc.LLM_SAMPLED_TTFT_SECONDS,
                     "Time to first token of the requests of one priority; exemplars open the trace."),
            _heatmap("End-to-end latency, priority $priority", sc.LLM_SAMPLED_E2E_SECONDS,
                     "Arrival to last token of the requests of one priority."),
            _heatmap("Queue time, priority $priority", sc.LLM_SAMPLED_QUEUE_SECONDS,
                     "Time in the scheduler's waiting queue, per priority."),
        ),
    )
    phases = Row(
        "Phase breakdown",
        (
            PanelSpec(
                title="Mean time per phase",
                unit="s",
                stacked=True,
                description="Stacked: queue, prefill (TTFT - queue), decode (e2e - TTFT); exact for means.",
                queries=(
                    Query(_mean(sc.LLM_SAMPLED_QUEUE_SECONDS), "queue p{{priority}}"),
                    Query(f"({_mean(sc.LLM_SAMPLED_TTFT_SECONDS)}) - ({_mean(sc.LLM_SAMPLED_QUEUE_SECONDS)})",
                          "prefill p{{priority}}"),
                    Query(f"({_mean(sc.LLM_SAMPLED_E2E_SECONDS)}) - ({_mean(sc.LLM_SAMPLED_TTFT_SECONDS)})",
                          "decode p{{priority}}"),
                ),
            ),
            PanelSpec(
                title="P99 per phase",
                unit="s",
                description="Each phase's own P99 (queue, TTFT, end-to-end); exemplars open the slow traces.",
                queries=(
                    Query(_p(0.99, sc.LLM_SAMPLED_QUEUE_SECONDS),
                          "queue p{{priority}}", exemplar=True),
                    Query(_p(0.99, sc.LLM_SAMPLED_TTFT_SECONDS),
                          "TTFT p{{priority}}", exemplar=True),
                    Query(_p(0.99, sc.LLM_SAMPLED_E2E_SECONDS),
                          "e2e p{{priority}}", exemplar=True),
                ),
            ),
            PanelSpec(
                title="Time per output token P50 / P99",
                unit="s",
                queries=tuple(
                    Query(_p(quantile, sc.LLM_SAMPLED_TPOT_SECONDS),
                          f"P{round(quantile * 100)} p{{{{priority}}}}", exemplar=True)
                    for quantile in (0.5, 0.99)
                ),
            ),
            PanelSpec(
                title="Share of queue time in TTFT",
                unit="percentunit",
                description="Mean queue time over mean TTFT: near 1 means requests wait for capacity, not compute.",
                queries=(
                    Query(f"({_mean(sc.LLM_SAMPLED_QUEUE_SECONDS)}) / ({_mean(sc.LLM_SAMPLED_TTFT_SECONDS)})",
                          "p{{priority}}"),
                ),
            ),
        ),
    )
    volume = Row(
        "Volume",
        (
            PanelSpec(
                title="Sampled requests by priority",
                unit="reqps",
                description=_SAMPLED,
                stacked=True,
                queries=(Query(q.sum_by(_BY_PRIORITY, q.rate(q.selector(q.counter(sc.LLM_SAMPLED_REQUESTS_TOTAL),
                                                                         regex=_FILTER))), "p{{priority}}"),),
            ),
            PanelSpec(
                title="Sampled requests by finish reason",
                unit="reqps",
                description=_SAMPLED,
                stacked=True,
                queries=(Query(q.sum_by((sc.LABEL_FINISH_REASON,),
                                        q.rate(q.selector(q.counter(sc.LLM_SAMPLED_REQUESTS_TOTAL), regex=_FILTER))),
                               "{{finish_reason}}"),),
            ),
        ),
    )
    causes = Row(
        "Why slow requests were slow",
        (
            PanelSpec(
                title="Slow requests by cause",
                unit="short",
                width=24,
                stacked=True,
                description="Slow requests (e2e at or above the collector's quantile of the stored requests') "
                "explained in each 5 minutes, by the cause the collector named (sightline explain shows each "
                "one's evidence).",
                queries=(Query(q.sum_by((sc.LABEL_CAUSE,),
                                        f"increase({q.counter(sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED)}[5m])"),
                               "{{cause}}"),),
            ),
        ),
    )
    series = q.counter(sc.LLM_SAMPLED_REQUESTS_TOTAL)
    return DashboardSpec(
        uid=UID,
        title="Sightline / Requests",
        description="Latency heatmaps per priority and the queue / prefill / decode breakdown, from request "
                    "traces (sampled requests only) or, for vLLM, its own histograms.",
        variables=(
            Variable(sc.LABEL_MODEL, series, sc.LABEL_MODEL),
            Variable(sc.LABEL_PRIORITY, series, sc.LABEL_PRIORITY, depends=(sc.LABEL_MODEL,)),
        ),
        rows=(heatmaps, phases, causes, volume),
    )
