"""Overview: is the engine serving well right now?

Request rate, errors and finish reasons; TTFT, inter-token latency, time per output
token, end-to-end and queue latency at P50 and P99 (with exemplars that open the slow
request's trace in Tempo); running and waiting requests, KV-cache usage, preemptions and
token throughput; the prefix cache's hit rate, cached and evicted blocks and TTFT by hit /
miss (blocks, evictions and TTFT by outcome are Sightline's only: empty on vLLM). Reads the engine-agnostic ``llm:`` series that the adapter rules copy
from the engine's own ``/metrics`` (Sightline's or vLLM's: the SLI source, independent
of the telemetry pipeline's health), plus the SLO recording rules.
"""

from __future__ import annotations

from ..instrumentation import semconv as sc
from . import promql as q
from .panels import DashboardSpec, PanelSpec, Query, Row, Variable

__all__ = ["UID", "spec"]

UID = "sightline-overview"
_MODEL = (sc.LABEL_MODEL,)


def _counter_rate(name: str, by: tuple[str, ...]) -> str:
    return q.sum_by(by, q.rate(q.selector(q.counter(name), regex=_MODEL)))


def _quantiles(title: str, histogram: str, description: str, exemplars_of: str | None = None) -> PanelSpec:
    """P50 and P99 of an ``llm:`` histogram; ``exemplars_of``: Sightline's source histogram,
    whose trace-id exemplars the panel shows."""
    def expr(quantile: float) -> str:
        quantiles = q.histogram_quantile(quantile, histogram, _MODEL, regex=_MODEL)
        return q.with_exemplars_of(quantiles, exemplars_of, regex=_MODEL) if exemplars_of else quantiles

    return PanelSpec(
        title=title,
        description=description,
        unit="s",
        width=12,
        queries=tuple(
            Query(expr(quantile), legend=f"P{round(quantile * 100)} {{{{{sc.LABEL_MODEL}}}}}",
                  exemplar=exemplars_of is not None)
            for quantile in (0.5, 0.99)
        ),
    )


def spec() -> DashboardSpec:
    traffic = Row(
        "Traffic",
        (
            PanelSpec(
                title="Request rate",
                kind="stat",
                unit="reqps",
                width=6,
                height=6,
                queries=(Query(_counter_rate(sc.LLM_REQUESTS_TOTAL, ())),),
            ),
            PanelSpec(
                title="Error ratio (5m)",
                kind="stat",
                unit="percentunit",
                width=6,
                height=6,
                description="Requests answered with a server-side error (5xx, 429) over all requests; the SLO's error budget.",
                queries=(Query(f'{sc.RULE_ERROR_RATIO_PREFIX}5m{{{sc.LABEL_MODEL}=~"$model"}}', "{{model}}"),),
            ),
            PanelSpec(
                title="TTFT P99 (5m)",
                kind="stat",
                unit="s",
                width=6,
                height=6,
                queries=(Query(f'{sc.RULE_TTFT_P99}{{{sc.LABEL_MODEL}=~"$model"}}', "{{model}}"),),
            ),
            PanelSpec(
                title="KV cache usage",
                kind="stat",
                unit="percentunit",
                width=6,
                height=6,
                queries=(Query(f'max({q.selector(sc.LLM_KV_USAGE, regex=_MODEL)})'),),
            ),
            PanelSpec(
                title="Requests by finish reason",
                unit="reqps",
                stacked=True,
                queries=(Query(_counter_rate(sc.LLM_REQUESTS_TOTAL, (sc.LABEL_FINISH_REASON,)),
                               "{{finish_reason}}"),),
            ),
            PanelSpec(
                title="Errors by status code",
                unit="reqps",
                stacked=True,
                queries=(Query(_counter_rate(sc.LLM_REQUEST_ERRORS_TOTAL, (sc.LABEL_CODE,)), "{{code}}"),),
            ),
        ),
    )
    latency = Row(
        "Latency",
        (
            _quantiles("Time to first token", sc.LLM_TTFT_SECONDS,
                       "Arrival to first generated token. Exemplars link to the request's trace.",
                       sc.ENGINE_TTFT_SECONDS),
            _quantiles("Inter-token latency", sc.LLM_ITL_SECONDS,
                       "Gap between consecutive tokens of a request: one observation per token.",
                       sc.ENGINE_ITL_SECONDS),
            _quantiles("Time per output token", sc.LLM_TPOT_SECONDS,
                       "Mean gap between generated tokens after the first, per request."),
            _quantiles("End-to-end latency", sc.LLM_E2E_SECONDS, "Arrival to last token.", sc.ENGINE_E2E_SECONDS),
            _quantiles("Queue time", sc.LLM_QUEUE_SECONDS,
                       "Arrival to first scheduling: the scheduler's waiting queue."),
        ),
    )
    scheduler = Row(
        "Scheduler and KV cache",
        (
            PanelSpec(
                title="Running and waiting requests",
                queries=(
                    Query(q.sum_by(_MODEL, q.selector(sc.LLM_RUNNING, regex=_MODEL)), "running {{model}}"),
                    Query(q.sum_by(_MODEL, q.selector(sc.LLM_WAITING, regex=_MODEL)), "waiting {{model}}"),
                ),
            ),
            PanelSpec(
                title="KV cache usage",
                unit="percentunit",
                queries=(Query(q.selector(sc.LLM_KV_USAGE, regex=_MODEL), "{{instance}} {{model}}"),),
            ),
            PanelSpec(
                title="Preemptions",
                unit="ops",
                description="Requests evicted from the KV cache and recomputed later.",
                queries=(Query(_counter_rate(sc.LLM_PREEMPTIONS_TOTAL, _MODEL), "{{model}}"),),
            ),
            PanelSpec(
                title="Token throughput",
                unit="short",
                queries=(
                    Query(_counter_rate(sc.LLM_PROMPT_TOKENS_TOTAL, _MODEL), "prompt {{model}}"),
                    Query(_counter_rate(sc.LLM_GENERATION_TOKENS_TOTAL, _MODEL), "generated {{model}}"),
                ),
            ),
            PanelSpec(
                title="Tokens per step",
                unit="short",
                queries=(Query(q.mean(sc.LLM_ITERATION_TOKENS, regex=_MODEL), "mean"),),
            ),
        ),
    )
    return DashboardSpec(
        uid=UID,
        title="Sightline / Overview",
        description="Request rate, latency percentiles, queue and KV cache of the engine (Sightline's or vLLM's).",
        variables=(Variable(sc.LABEL_MODEL, q.counter(sc.LLM_REQUESTS_TOTAL), sc.LABEL_MODEL),),
        rows=(traffic, latency, scheduler, _prefix_cache()),
    )


def _prefix_cache() -> Row:
    by_outcome = (sc.LABEL_PREFIX_CACHE,)

    def ttft(quantile: float) -> Query:
        expr = q.histogram_quantile(quantile, sc.LLM_PREFIX_CACHE_TTFT_SECONDS, by_outcome, regex=_MODEL)
        return Query(q.with_exemplars_of(expr, sc.ENGINE_PREFIX_CACHE_TTFT_SECONDS, regex=_MODEL),
                     legend=f"P{round(quantile * 100)} {{{{{sc.LABEL_PREFIX_CACHE}}}}}", exemplar=True)

    return Row(
        "Prefix cache",
        (
            PanelSpec(
                title="Prefix cache hit rate",
                unit="percentunit",
                width=6,
                description="Prompt tokens whose KV the prefix cache held, over the prompt tokens looked "
                            "up when their requests were admitted.",
                queries=(Query(f"{_counter_rate(sc.LLM_PREFIX_CACHE_HITS_TOTAL, _MODEL)}\n  / "
                               f"{_counter_rate(sc.LLM_PREFIX_CACHE_QUERIES_TOTAL, _MODEL)}", "{{model}}"),),
            ),
            PanelSpec(
                title="Prefix cache blocks",
                width=6,
                description="KV blocks cached (held by requests or evictable), and cached blocks evicted "
                            "per second because an allocation found no never-cached free block.",
                queries=(
                    Query(q.sum_by(_MODEL, q.selector(sc.LLM_PREFIX_CACHE_BLOCKS, regex=_MODEL)), "cached {{model}}"),
                    Query(_counter_rate(sc.LLM_PREFIX_CACHE_EVICTIONS_TOTAL, _MODEL), "evicted/s {{model}}"),
                ),
            ),
            PanelSpec(
                title="TTFT by prefix cache hit / miss",
                unit="s",
                description="Time to first token of requests with some prompt tokens served from the "
                            "prefix cache (hit) and of the others (miss). Exemplars link to the trace.",
                queries=(ttft(0.5), ttft(0.99)),
            ),
        ),
    )
