"""Adapter recording rules: Sightline's and vLLM's series -> one engine-agnostic ``llm:`` set.

Dashboards and SLO alerts read only the ``llm:`` series (``semconv.LLM_*``), so they work
unchanged on a Prometheus that scrapes Sightline's engine and collector, vLLM, or both.
Each rule copies one source series under its ``llm:`` name, renaming vLLM's labels
(``model_name`` -> ``model``, ``finished_reason`` -> ``finish_reason``); counters and
histogram buckets stay raw counters, so ``rate()`` and ``histogram_quantile()`` work on
the copies as on the originals; prefix cache blocks, evictions and TTFT by hit / miss
have no vLLM source. vLLM has no per-request error counter: its HTTP middleware's
``http_requests_total{status="5xx"}`` on ``/v1/*`` handlers becomes
``llm:request_errors_total{code="5xx"}``, given the model of the same target.

Cost: one stored series per source series (the copy), evaluated at the rule interval.
Bucket bounds are the source's: vLLM's TTFT bounds start with Sightline's, so an SLO
threshold that is a Sightline bucket bound is one of vLLM's too.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ..dashboards import promql as q
from ..instrumentation import semconv as sc

__all__ = ["Mapping", "SERVING", "SAMPLED", "GROUP_SIGHTLINE", "GROUP_VLLM", "SOURCE_LABELS", "adapter_rules"]

GROUP_SIGHTLINE = "llm-adapter-sightline"
GROUP_VLLM = "llm-adapter-vllm"
SOURCE_LABELS = {GROUP_SIGHTLINE: {sc.LABEL_SOURCE: sc.SOURCE_SIGHTLINE}, GROUP_VLLM: {sc.LABEL_SOURCE: sc.SOURCE_VLLM}}
Kind = Literal["histogram", "counter", "gauge"]


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One ``llm:`` series and where it comes from (None: that source has no such series)."""

    target: str
    kind: Kind
    sightline: str | None
    vllm: str | None


# What the engine measured about every request it served.
SERVING: tuple[Mapping, ...] = (
    Mapping(sc.LLM_TTFT_SECONDS, "histogram", sc.ENGINE_TTFT_SECONDS, sc.VLLM_TTFT_SECONDS),
    Mapping(sc.LLM_ITL_SECONDS, "histogram", sc.ENGINE_ITL_SECONDS, sc.VLLM_ITL_SECONDS),
    Mapping(sc.LLM_TPOT_SECONDS, "histogram", sc.ENGINE_TPOT_SECONDS, sc.VLLM_TPOT_SECONDS),
    Mapping(sc.LLM_E2E_SECONDS, "histogram", sc.ENGINE_E2E_SECONDS, sc.VLLM_E2E_SECONDS),
    Mapping(sc.LLM_QUEUE_SECONDS, "histogram", sc.ENGINE_QUEUE_SECONDS, sc.VLLM_QUEUE_SECONDS),
    Mapping(sc.LLM_PREFILL_SECONDS, "histogram", sc.ENGINE_PREFILL_SECONDS, sc.VLLM_PREFILL_SECONDS),
    Mapping(sc.LLM_DECODE_SECONDS, "histogram", sc.ENGINE_DECODE_SECONDS, sc.VLLM_DECODE_SECONDS),
    Mapping(sc.LLM_REQUEST_PROMPT_TOKENS, "histogram", sc.ENGINE_REQUEST_PROMPT_TOKENS,
            sc.VLLM_REQUEST_PROMPT_TOKENS),
    Mapping(sc.LLM_REQUEST_GENERATION_TOKENS, "histogram", sc.ENGINE_REQUEST_GENERATION_TOKENS,
            sc.VLLM_REQUEST_GENERATION_TOKENS),
    Mapping(sc.LLM_ITERATION_TOKENS, "histogram", sc.ENGINE_STEP_TOKENS, sc.VLLM_ITERATION_TOKENS),
    Mapping(sc.LLM_REQUESTS_TOTAL, "counter", sc.ENGINE_REQUESTS_TOTAL, sc.VLLM_REQUEST_SUCCESS_TOTAL),
    Mapping(sc.LLM_PROMPT_TOKENS_TOTAL, "counter", sc.ENGINE_PROMPT_TOKENS_TOTAL, sc.VLLM_PROMPT_TOKENS_TOTAL),
    Mapping(sc.LLM_GENERATION_TOKENS_TOTAL, "counter", sc.ENGINE_GENERATION_TOKENS_TOTAL,
            sc.VLLM_GENERATION_TOKENS_TOTAL),
    Mapping(sc.LLM_PREEMPTIONS_TOTAL, "counter", sc.ENGINE_PREEMPTIONS_TOTAL, sc.VLLM_PREEMPTIONS_TOTAL),
    Mapping(sc.LLM_REQUEST_ERRORS_TOTAL, "counter", sc.ENGINE_REQUEST_ERRORS_TOTAL, None),  # vLLM: below
    Mapping(sc.LLM_RUNNING, "gauge", sc.ENGINE_RUNNING, sc.VLLM_RUNNING),
    Mapping(sc.LLM_WAITING, "gauge", sc.ENGINE_WAITING, sc.VLLM_WAITING),
    Mapping(sc.LLM_KV_USAGE, "gauge", sc.ENGINE_KV_USAGE, sc.VLLM_KV_USAGE),
    Mapping(sc.LLM_PREFIX_CACHE_QUERIES_TOTAL, "counter", sc.ENGINE_PREFIX_CACHE_QUERIES_TOTAL,
            sc.VLLM_PREFIX_CACHE_QUERIES_TOTAL),
    Mapping(sc.LLM_PREFIX_CACHE_HITS_TOTAL, "counter", sc.ENGINE_PREFIX_CACHE_HITS_TOTAL,
            sc.VLLM_PREFIX_CACHE_HITS_TOTAL),
    Mapping(sc.LLM_PREFIX_CACHE_BLOCKS, "gauge", sc.ENGINE_PREFIX_CACHE_BLOCKS, None),
    Mapping(sc.LLM_PREFIX_CACHE_EVICTIONS_TOTAL, "counter", sc.ENGINE_PREFIX_CACHE_EVICTIONS_TOTAL, None),
    Mapping(sc.LLM_PREFIX_CACHE_TTFT_SECONDS, "histogram", sc.ENGINE_PREFIX_CACHE_TTFT_SECONDS, None),
)

# Per-request latencies labelled by priority: from Sightline's request traces (the
# collector's span-derived series: sampled requests only), from vLLM's own histograms.
SAMPLED: tuple[Mapping, ...] = (
    Mapping(sc.LLM_SAMPLED_TTFT_SECONDS, "histogram", sc.COLLECTOR_REQUEST_TTFT_SECONDS, sc.VLLM_TTFT_SECONDS),
    Mapping(sc.LLM_SAMPLED_TPOT_SECONDS, "histogram", sc.COLLECTOR_REQUEST_TPOT_SECONDS, sc.VLLM_TPOT_SECONDS),
    Mapping(sc.LLM_SAMPLED_E2E_SECONDS, "histogram", sc.COLLECTOR_REQUEST_E2E_SECONDS, sc.VLLM_E2E_SECONDS),
    Mapping(sc.LLM_SAMPLED_QUEUE_SECONDS, "histogram", sc.COLLECTOR_REQUEST_QUEUE_SECONDS,
            sc.VLLM_QUEUE_SECONDS),
    Mapping(sc.LLM_SAMPLED_REQUESTS_TOTAL, "counter", sc.COLLECTOR_REQUESTS_TOTAL, sc.VLLM_REQUEST_SUCCESS_TOTAL),
)


def _series(base: str, kind: Kind) -> tuple[tuple[str, str], ...]:
    """(suffix, exposed name) pairs of one metric: a histogram's three, a counter's _total."""
    if kind == "histogram":
        return (("_bucket", q.bucket(base)), ("_sum", q.total_sum(base)), ("_count", q.count(base)))
    if kind == "counter":
        return (("_total", q.counter(base)),)
    return (("", base),)


def _rename(expr: str, to: str, source: str) -> str:
    return f'label_replace({expr}, "{to}", "$1", "{source}", "(.+)")'


def _from_vllm(series: str) -> str:
    expr = _rename(series, sc.LABEL_MODEL, sc.VLLM_LABEL_MODEL)
    if series.startswith(sc.VLLM_REQUEST_SUCCESS_TOTAL):
        expr = _rename(expr, sc.LABEL_FINISH_REASON, sc.VLLM_LABEL_FINISHED_REASON)
    return expr


def _vllm_errors() -> str:
    """vLLM's failed ``/v1/*`` responses (4xx, 5xx) as ``code``, with the target's model."""
    http = (f'{q.counter(sc.VLLM_HTTP_REQUESTS_TOTAL)}{{{sc.VLLM_LABEL_HANDLER}=~"/v1/.*",'
            f'{sc.VLLM_LABEL_STATUS}=~"[45]xx"}}')
    model_of_target = f"group by (job, instance, {sc.LABEL_MODEL}) ({_from_vllm(sc.VLLM_RUNNING)})"
    return f"{_rename(http, sc.LABEL_CODE, sc.VLLM_LABEL_STATUS)}\n  * on (job, instance) group_left ({sc.LABEL_MODEL})\n  {model_of_target}"


def adapter_rules() -> dict[str, list[tuple[str, str]]]:
    """``{group name: [(record, expr), ...]}``: one group per source. Every rule of a group
    adds the label ``source`` (:data:`SOURCE_LABELS`), so copies of different engines'
    series never collide, even on one target."""
    sightline: list[tuple[str, str]] = []
    vllm: list[tuple[str, str]] = []
    for mapping in SERVING + SAMPLED:
        for suffix, name in _series(mapping.target, mapping.kind):
            if mapping.sightline is not None:
                source = dict(_series(mapping.sightline, mapping.kind))[suffix]
                sightline.append((name, source))
            if mapping.vllm is not None:
                source = dict(_series(mapping.vllm, mapping.kind))[suffix]
                vllm.append((name, _from_vllm(source)))
    vllm.append((q.counter(sc.LLM_REQUEST_ERRORS_TOTAL), _vllm_errors()))
    return {GROUP_SIGHTLINE: sightline, GROUP_VLLM: vllm}
