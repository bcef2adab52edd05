"""Sightline's Prometheus recording and alerting rules, composed from ``semconv`` names.

``deploy/prometheus/sightline-rules.yml`` and the Kubernetes ``PrometheusRule`` are both
rendered from :func:`rule_groups`, so they cannot drift from each other or from the metric
names; the tests fail when a committed file is stale. Regenerate with
``python -m sightline.deploy.prometheus_rules``. :func:`alert_rules` lists the alerts: SLO
burn rates, saturation, GPU and pipeline health. The first groups are the adapter
(:mod:`.prometheus_adapter`): every rule after them reads only the engine-agnostic ``llm:``
series, so the alerts serve vLLM as well as Sightline.

Guarantees: every alert has a ``severity`` label (``page`` | ``ticket``) and ``summary``,
``description`` and ``runbook_url`` annotations; annotations use only ``$labels`` (no
``$value``), so that unit tests can state them exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Literal

import yaml

from ..dashboards import promql as q
from ..instrumentation import semconv as sc
from .prometheus_adapter import SOURCE_LABELS, adapter_rules
from ..instrumentation import check_range

__all__ = [
    "SloConfig",
    "RecordingRule",
    "AlertRule",
    "RuleGroup",
    "RUNBOOK_BASE_URL",
    "RULES_PATH",
    "PROMETHEUS_RULE_PATH",
    "JOB_ENGINE",
    "JOB_COLLECTOR",
    "SM_CONTENTION_ALERT",
    "rule_groups",
    "alert_rules",
    "render_rules_yaml",
    "render_prometheus_rule",
    "render_annotation",
    "write_all",
]

_DEPLOY = Path(__file__).resolve().parent
RULES_PATH = _DEPLOY / "prometheus" / "sightline-rules.yml"
PROMETHEUS_RULE_PATH = _DEPLOY / "kubernetes" / "prometheusrule.yaml"
RUNBOOK_DIR = _DEPLOY / "runbooks"
# Where operators read the runbooks; point it at your fork's rendered docs.
RUNBOOK_BASE_URL = "https://github.com/sightline/sightline/blob/main/deploy/runbooks"

# Scrape job names (deploy/prometheus_config uses the same): the services' own names.
JOB_ENGINE = sc.SERVICE_NAME_ENGINE
JOB_COLLECTOR = sc.SERVICE_NAME_COLLECTOR

Severity = Literal["page", "ticket"]
# (long window, short window, burn-rate factor, severity) after the SRE workbook, ch. 5.
BURN_WINDOWS: tuple[tuple[str, str, float, Severity], ...] = (
    ("1h", "5m", 14.4, "page"),
    ("6h", "30m", 6.0, "page"),
    ("1d", "2h", 3.0, "ticket"),
    ("3d", "6h", 1.0, "ticket"),
)
RATIO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
# Server-side failures count against the error budget; client errors (4xx) do not,
# except 429: the request was refused for lack of capacity.
BUDGET_ERROR_CODES = "5..|429"


@dataclasses.dataclass(frozen=True)
class SloConfig:
    """Objectives and thresholds. Ranges are checked; errors name the bad value."""

    ttft_threshold_s: float = 1.0
    ttft_objective: float = 0.99  # fraction of requests with TTFT <= threshold
    availability_objective: float = 0.999  # fraction of requests without a server error
    kv_usage_threshold: float = 0.95
    waiting_threshold: int = 16
    # slow requests explained by one cause (collector/causes.py) over cause_window: at least
    # this many, and at least this share of all explained then, for its alert
    cause_min_requests: int = 3
    cause_min_share: float = 0.5
    cause_window: str = "10m"
    kernel_regression_factor: float = 1.5
    memory_growth_factor: float = 1.5  # predicted in 6h over now
    context_growth: int = 2  # contexts above the last hour's minimum
    tp_straggler_share: float = 0.5  # of a producer's tensor-parallel steps naming one rank

    def __post_init__(self) -> None:
        if self.ttft_threshold_s not in sc.TTFT_BUCKETS_S:
            raise ValueError(
                f"ttft_threshold_s={self.ttft_threshold_s} is not a TTFT histogram bucket bound; "
                f"allowed: {sc.TTFT_BUCKETS_S}"
            )
        for name in ("ttft_objective", "availability_objective"):
            check_range(name, getattr(self, name), 0.5, 1, hi_open=True)
        check_range("kv_usage_threshold", self.kv_usage_threshold, 0, 1, lo_open=True)
        check_range("waiting_threshold", self.waiting_threshold, 1, 1_000_000, integer=True)
        check_range("cause_min_requests", self.cause_min_requests, 1, 1_000_000, integer=True)
        check_range("cause_min_share", self.cause_min_share, 0, 1, lo_open=True)
        if not re.fullmatch(r"\d+[smh]", self.cause_window):
            raise ValueError(f"cause_window={self.cause_window!r} is not a Prometheus duration such as 10m")
        for name in ("kernel_regression_factor", "memory_growth_factor"):
            check_range(name, getattr(self, name), 1, 100, lo_open=True)
        check_range("context_growth", self.context_growth, 1, 1000, integer=True)
        check_range("tp_straggler_share", self.tp_straggler_share, 0, 1, lo_open=True)


@dataclasses.dataclass(frozen=True)
class RecordingRule:
    record: str
    expr: str
    labels: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict:
        rule = {"record": self.record, "expr": self.expr}
        if self.labels:
            rule["labels"] = dict(self.labels)
        return rule


@dataclasses.dataclass(frozen=True)
class AlertRule:
    """An alert; ``runbook`` is the stem of a file in ``deploy/runbooks/``."""

    alert: str
    expr: str
    for_: str
    severity: Severity
    summary: str
    description: str
    runbook: str
    labels: tuple[tuple[str, str], ...] = ()

    def annotations(self, runbook_base_url: str = RUNBOOK_BASE_URL) -> dict[str, str]:
        return {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": f"{runbook_base_url}/{self.runbook}.md",
        }

    def to_dict(self, runbook_base_url: str = RUNBOOK_BASE_URL) -> dict:
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity, **dict(self.labels)},
            "annotations": self.annotations(runbook_base_url),
        }


@dataclasses.dataclass(frozen=True)
class RuleGroup:
    name: str
    rules: tuple[RecordingRule | AlertRule, ...]
    interval: str | None = None

    def to_dict(self, runbook_base_url: str = RUNBOOK_BASE_URL) -> dict:
        group: dict = {"name": self.name}
        if self.interval:
            group["interval"] = self.interval
        group["rules"] = [
            rule.to_dict(runbook_base_url) if isinstance(rule, AlertRule) else rule.to_dict() for rule in self.rules
        ]
        return group


def _g(value: float) -> str:
    return f"{value:g}"


# ---------------------------------------------------------------------------------
# Recording rules
# ---------------------------------------------------------------------------------
def _ttft_bad_ratio(window: str, slo: SloConfig) -> str:
    by = (sc.LABEL_MODEL,)
    le = {q.BUCKET_LABEL: q.le_value(slo.ttft_threshold_s)}
    good = q.sum_by(by, q.rate(q.selector(q.bucket(sc.LLM_TTFT_SECONDS), le), window))
    total = q.sum_by(by, q.rate(q.count(sc.LLM_TTFT_SECONDS), window))
    return f"1 - ({good} / {total})"


def _error_ratio(window: str) -> str:
    by = (sc.LABEL_MODEL,)
    errors = f'{q.counter(sc.LLM_REQUEST_ERRORS_TOTAL)}{{{sc.LABEL_CODE}=~"{BUDGET_ERROR_CODES}"}}'
    finished_rate = q.sum_by(by, q.rate(q.counter(sc.LLM_REQUESTS_TOTAL), window))
    # A model without a single budget error has no error series: count it as 0 (not
    # absent), so the ratio reads 0 rather than "no data".
    errors_rate = f"({q.sum_by(by, q.rate(errors, window))} or 0 * {finished_rate})"
    # Errored requests never reach a finish reason, so all requests = finished + errors.
    return f"{errors_rate} / ({finished_rate} + {errors_rate})"


def _tp_straggler_share(window: str) -> str:
    """Per (producer, rank): the share of its tensor-parallel steps that named the rank the
    straggler over ``window`` (the collector's counters)."""
    producer = (sc.LABEL_INSTANCE_ID,)
    named = q.sum_by((*producer, sc.LABEL_RANK),
                     q.rate(q.counter(sc.COLLECTOR_TP_STRAGGLER_STEPS_TOTAL), window))
    steps = q.sum_by(producer, q.rate(q.counter(sc.COLLECTOR_TP_STEPS_TOTAL), window))
    return f"{named}\n/ ignoring({sc.LABEL_RANK}) group_left\n{steps}"


def adapter_groups() -> list[RuleGroup]:
    """Sightline's and vLLM's series copied into the engine-agnostic ``llm:`` set."""
    return [RuleGroup(name, tuple(RecordingRule(record, expr, tuple(SOURCE_LABELS[name].items()))
                                  for record, expr in rules))
            for name, rules in adapter_rules().items()]


def recording_groups(slo: SloConfig) -> list[RuleGroup]:
    sm_p99 = sc.COLLECTOR_SM_CTA_P99_SECONDS
    gpu_kernel = (sc.LABEL_GPU, sc.LABEL_KERNEL)
    latency = RuleGroup(
        "sightline-recording",
        (
            RecordingRule(sc.RULE_TTFT_P99,
                          q.histogram_quantile(0.99, sc.LLM_TTFT_SECONDS, (sc.LABEL_MODEL,), window="5m")),
            RecordingRule(sc.RULE_KERNEL_P99,
                          q.histogram_quantile(0.99, sc.COLLECTOR_KERNEL_DURATION_SECONDS, gpu_kernel, window="5m")),
            RecordingRule(sc.RULE_SM_HOTSPOT,
                          f"{q.aggregate('max', gpu_kernel, sm_p99)} / {q.aggregate('quantile', gpu_kernel, sm_p99, 0.5)}"),
            RecordingRule(sc.RULE_TP_STRAGGLER_SHARE, _tp_straggler_share("5m")),
        ),
    )
    slo_ratios = RuleGroup(
        "sightline-slo-ratios",
        tuple(
            RecordingRule(f"{sc.RULE_TTFT_SLO_BAD_RATIO_PREFIX}{window}", _ttft_bad_ratio(window, slo))
            for window in RATIO_WINDOWS
        )
        + tuple(RecordingRule(f"{sc.RULE_ERROR_RATIO_PREFIX}{window}", _error_ratio(window)) for window in RATIO_WINDOWS),
    )
    return [*adapter_groups(), latency, slo_ratios]


# ---------------------------------------------------------------------------------
# Alerts
# ---------------------------------------------------------------------------------
def _burn_alerts(slo_name: str, prefix: str, budget: float, what: str, runbook: str) -> list[AlertRule]:
    alerts = []
    for severity in ("page", "ticket"):
        clauses = [
            f"({prefix}{long} > {_g(factor * budget)} and {prefix}{short} > {_g(factor * budget)})"
            for long, short, factor, sev in BURN_WINDOWS
            if sev == severity
        ]
        windows = " or ".join(f"{long}/{short} at {_g(factor)}x" for long, short, factor, sev in BURN_WINDOWS
                              if sev == severity)
        alerts.append(
            AlertRule(
                alert=f"Sightline{slo_name}BudgetBurn{'Fast' if severity == 'page' else 'Slow'}",
                expr="\n or\n".join(clauses),
                for_="2m" if severity == "page" else "15m",
                severity=severity,  # type: ignore[arg-type]
                summary=f"{what} error budget burning {'fast' if severity == 'page' else 'steadily'} "
                "for model {{ $labels.model }}",
                description=f"{what}: the error budget ({_g(budget * 100)}% of requests) is being spent "
                f"faster than the SLO allows (windows {windows}). At this rate it is gone "
                f"{'within days' if severity == 'page' else 'before the 30-day period ends'}.",
                runbook=runbook,
                labels=(("slo", slo_name.lower()),),
            )
        )
    return alerts


SM_CONTENTION_ALERT = "SightlineSMContention"


def _cause_alert(slo: SloConfig, alert: str, cause: str, what: str, why: str, runbook: str) -> AlertRule:
    """Fires when ``cause`` explained at least ``cause_min_requests`` slow requests, and at
    least ``cause_min_share`` of those given a cause, over ``cause_window``. Requests left
    ``unknown`` do not count against it: no evidence is not evidence of another cause."""
    counter = q.counter(sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED)
    window = slo.cause_window
    named = f'sum by (job) (increase({counter}{{{sc.LABEL_CAUSE}="{cause}"}}[{window}]))'
    every = f'sum by (job) (increase({counter}{{{sc.LABEL_CAUSE}!="{sc.CAUSE_UNKNOWN}"}}[{window}]))'
    return AlertRule(
        alert=alert,
        expr=f"{named} >= {slo.cause_min_requests}\n and\n{named} / {every} >= {_g(slo.cause_min_share)}",
        for_="5m",
        severity="ticket",
        summary=f"{what[0].upper()}{what[1:]}",
        description=f"Over {window}, at least {slo.cause_min_requests} slow requests and at least "
        f"{_g(slo.cause_min_share * 100)}% of those the collector gave a cause were named {cause}. {why} "
        "`sightline explain` shows each request's evidence.",
        runbook=runbook,
    )


def alert_rules(slo: SloConfig) -> list[RuleGroup]:
    """The alerts.

    - SLO burn rates (SRE workbook, multiwindow multi-burn-rate): a *page* when the error
      budget burns 14.4x over 1h (confirmed over 5m) or 6x over 6h (confirmed over 30m), a
      *ticket* at 3x over 1d (2h) or 1x over 3d (6h). Two SLOs: TTFT (the fraction of
      requests whose TTFT exceeded the threshold, read from the histogram bucket whose
      ``le`` is the threshold, so the threshold must be a bucket bound) and server errors
      (5xx and 429 over all requests).
    - Saturation: KV cache near full; waiting queue long and growing. A kernel variant met
      while serving (a warm-up defect: a request waited on a compile).
    - GPU: SMs flagged slow or starved by the contention tests (sustained); slow requests
      explained by device contention or a host stall; a kernel's P99 up against the same hour
      a day earlier; device memory or CUDA contexts growing (leak); one tensor-parallel rank
      named the straggler of most steps (sustained).
    - Pipeline: collector rejecting or dropping data; engine exporters failing or dropping
      spans; a scrape target down.
    """
    ttft_budget = 1.0 - slo.ttft_objective
    error_budget = 1.0 - slo.availability_objective
    slo_alerts = RuleGroup(
        "sightline-slo-alerts",
        tuple(
            _burn_alerts("TTFT", sc.RULE_TTFT_SLO_BAD_RATIO_PREFIX, ttft_budget,
                         f"TTFT SLO ({_g(slo.ttft_objective * 100)}% of requests within {_g(slo.ttft_threshold_s)}s)",
                         "ttft-slo-burn")
            + _burn_alerts("Errors", sc.RULE_ERROR_RATIO_PREFIX, error_budget,
                           f"Availability SLO ({_g(slo.availability_objective * 100)}% of requests without a "
                           "server error)", "error-budget-burn")
        ),
    )
    waiting = sc.LLM_WAITING
    engine = RuleGroup(
        "sightline-engine-alerts",
        (
            AlertRule(
                alert="SightlineKVCacheNearFull",
                expr=f"{sc.LLM_KV_USAGE} > {_g(slo.kv_usage_threshold)}",
                for_="10m",
                severity="ticket",
                summary="KV cache of {{ $labels.instance }} above "
                f"{_g(slo.kv_usage_threshold * 100)}% for 10 minutes",
                description="New requests wait for blocks and running ones get preempted (recomputed). "
                "Check preemptions and queue time on the Overview dashboard.",
                runbook="kv-cache-near-full",
            ),
            AlertRule(
                alert="SightlineWaitingQueueGrowing",
                expr=f"{waiting} > {slo.waiting_threshold} and deriv({waiting}[15m]) > 0",
                for_="15m",
                severity="ticket",
                summary="Waiting queue of {{ $labels.instance }} long and still growing",
                description=f"More than {slo.waiting_threshold} requests wait and the queue has grown over the "
                "last 15 minutes: arrivals exceed what the engine serves. Queue time (and TTFT) will keep rising.",
                runbook="waiting-queue-growing",
            ),
            AlertRule(
                alert="SightlineKernelCompiledWhileServing",
                expr=f"sum by (job, instance, {sc.LABEL_KERNEL}, {sc.LABEL_COMPILE_KIND}) "
                f"(increase({q.counter(sc.ENGINE_JIT_COMPILES_TOTAL)}[15m])) > 0",
                for_="0m",
                severity="ticket",
                summary="Engine {{ $labels.instance }} met kernel variants of {{ $labels.kernel }} "
                "while serving ({{ $labels.kind }})",
                description="A request's step compiled (or loaded, or autotuned) a kernel variant the "
                "warm-up did not run, so it waited for it: seconds on a GPU. The step span carries "
                "sightline.step.jit_compiles; explain names the requests it held up.",
                runbook="kernel-compiled-while-serving",
            ),
            AlertRule(
                alert="SightlineTargetDown",
                expr=f'up{{job=~"{JOB_ENGINE}|{JOB_COLLECTOR}"}} == 0',
                for_="5m",
                severity="page",
                summary="{{ $labels.job }} at {{ $labels.instance }} is not answering scrapes",
                description="Prometheus could not scrape the target for 5 minutes: the process is down, "
                "hung or unreachable. Every other Sightline alert about it is blind meanwhile.",
                runbook="target-down",
            ),
        ),
    )
    contended = f"count by ({sc.LABEL_GPU}, {sc.LABEL_KERNEL}) ({sc.COLLECTOR_SM_CONTENTION_SCORE}) > 0"
    memory = sc.GPU_MEMORY_USED_BYTES
    contexts = sc.GPU_CUDA_CONTEXTS
    gpu = RuleGroup(
        "sightline-gpu-alerts",
        (
            AlertRule(
                alert=SM_CONTENTION_ALERT,
                expr=contended,
                for_="15m",
                severity="ticket",
                summary="GPU {{ $labels.gpu }}: SMs running slow or starved against the kernel's other SMs "
                "({{ $labels.kernel }})",
                description="For 15 minutes the collector's contention tests have flagged SMs of this kernel: "
                "more of their CTAs above the other SMs' P90, or fewer CTAs than their share, than chance "
                "allows. Another tenant on those SMs is the usual cause. See the per-SM heatmap.",
                runbook="sm-contention",
            ),
            _cause_alert(slo, "SightlineDeviceContention", sc.CAUSE_DEVICE_CONTENTION,
                         "slow requests explained by every SM running slower alike",
                         "GPU work took longer on every SM, with no SM standing out: memory-bandwidth "
                         "contention from another process, clocks or power.", "device-contention"),
            _cause_alert(slo, "SightlineHostStall", sc.CAUSE_HOST_STALL,
                         "slow requests explained by the engine's host side stalling",
                         "Engine steps took longer than usual (or none ran) while the GPU's work did not: "
                         "CPU contention on the engine's cores, a thread holding the GIL, paging.", "host-stall"),
            AlertRule(
                alert="SightlineKernelP99Regression",
                expr=f"{sc.RULE_KERNEL_P99} > {_g(slo.kernel_regression_factor)} * ({sc.RULE_KERNEL_P99} offset 1d)",
                for_="30m",
                severity="ticket",
                summary="Kernel {{ $labels.kernel }} on GPU {{ $labels.gpu }} slower than a day ago",
                description=f"The kernel's duration P99 has been above {_g(slo.kernel_regression_factor)}x its "
                "value at the same time yesterday for 30 minutes (deploy, driver, clocks, input shapes?).",
                runbook="kernel-p99-regression",
            ),
            AlertRule(
                alert="SightlineTensorParallelStraggler",
                expr=f"{sc.RULE_TP_STRAGGLER_SHARE} > {_g(slo.tp_straggler_share)}",
                for_="15m",
                severity="ticket",
                summary="Tensor-parallel rank {{ $labels.rank }} of {{ $labels.instance_id }} holds "
                "up the other ranks",
                description=f"For 15 minutes more than {_g(slo.tp_straggler_share * 100)}% of the engine's "
                "tensor-parallel steps named this rank the straggler: the others waited for it in "
                "their all-reduces, so every step (and request) runs at its pace.",
                runbook="tp-straggler",
            ),
            AlertRule(
                alert="SightlineGPUMemoryGrowing",
                expr=f"deriv({memory}[1h]) > 0 and predict_linear({memory}[1h], 6 * 3600) > "
                f"{_g(slo.memory_growth_factor)} * {memory}",
                for_="30m",
                severity="ticket",
                summary="GPU {{ $labels.gpu }} memory growing steadily (leak?)",
                description=f"Used memory has grown over the last hour and, at that rate, will reach "
                f"{_g(slo.memory_growth_factor)}x today's level within 6 hours.",
                runbook="gpu-memory-leak",
            ),
            AlertRule(
                alert="SightlineCUDAContextsGrowing",
                expr=f"{contexts} - min_over_time({contexts}[1h]) >= {slo.context_growth} "
                f"and deriv({contexts}[1h]) > 0",
                for_="30m",
                severity="ticket",
                summary="GPU {{ $labels.gpu }}: CUDA contexts keep growing",
                description=f"At least {slo.context_growth} more processes hold a CUDA context than an hour "
                "ago, and the count is rising: workers that exit without releasing the device, or a leak.",
                runbook="gpu-memory-leak",
            ),
        ),
    )

    def rate_above_zero(name: str, by: tuple[str, ...]) -> str:
        return f"{q.sum_by(by, q.rate(q.counter(name), '5m'))} > 0"

    pipeline = RuleGroup(
        "sightline-pipeline-alerts",
        (
            AlertRule(
                alert="SightlineCollectorRejecting",
                expr=rate_above_zero(sc.COLLECTOR_REJECTED_TOTAL, ("job", sc.LABEL_RECEIVER, sc.LABEL_REASON)),
                for_="10m",
                severity="ticket",
                summary="Collector refusing telemetry on {{ $labels.receiver }} ({{ $labels.reason }})",
                description="Senders get errors (400/413/429/401) and their telemetry is lost unless they retry. "
                "The reason label says which limit or check refuses it.",
                runbook="collector-losing-data",
            ),
            AlertRule(
                alert="SightlineCollectorDropping",
                expr=f"{rate_above_zero(sc.COLLECTOR_DROPPED_TOTAL, ('job', sc.LABEL_REASON))}\n or\n"
                f"{rate_above_zero(sc.COLLECTOR_AGGREGATOR_DROPPED_TOTAL, ('job', sc.LABEL_REASON))}",
                for_="5m",
                severity="ticket",
                summary="Collector dropping accepted telemetry ({{ $labels.reason }})",
                description="Data the collector acknowledged is being discarded, so heatmaps and percentiles "
                "undercount. See the Pipeline health dashboard.",
                runbook="collector-losing-data",
            ),
            AlertRule(
                alert="SightlineTelemetryExportFailing",
                expr=rate_above_zero(sc.TELEMETRY_EXPORT_FAILURES_TOTAL, ("job", "instance")),
                for_="10m",
                severity="ticket",
                summary="Engine {{ $labels.instance }} failing to export telemetry",
                description="The engine's OTLP exporters keep failing (sidecar or collector unreachable, "
                "refusing, or timing out). Traces and per-SM histograms from this engine are missing.",
                runbook="telemetry-export-failing",
            ),
            AlertRule(
                alert="SightlineTelemetryRecordsDropped",
                expr=rate_above_zero(sc.TELEMETRY_EVENTS_DROPPED_TOTAL, ("job", "instance", sc.LABEL_REASON)),
                for_="15m",
                severity="ticket",
                summary="Engine {{ $labels.instance }} dropping telemetry records ({{ $labels.reason }})",
                description="The engine could not hand lifecycle events or GPU records to its telemetry "
                "process (buffer or queue full, or the process down and being restarted). Requests are "
                "unaffected; their traces, kernel spans or per-SM data are incomplete.",
                runbook="telemetry-records-dropped",
            ),
            AlertRule(
                alert="SightlineTelemetrySpansDropped",
                expr=rate_above_zero(sc.TELEMETRY_SPANS_DROPPED_TOTAL, ("job", "instance")),
                for_="15m",
                severity="ticket",
                summary="Engine {{ $labels.instance }} dropping spans before export",
                description="The engine's span queue is full: spans are produced faster than exported. "
                "Requests are unaffected; their traces are incomplete.",
                runbook="telemetry-export-failing",
            ),
        ),
    )
    return [slo_alerts, engine, gpu, pipeline]


def rule_groups(slo: SloConfig | None = None) -> list[RuleGroup]:
    """All groups: recording rules first (alerts read them)."""
    slo = slo or SloConfig()
    return recording_groups(slo) + alert_rules(slo)


# ---------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------
class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

_HEADER = "# Generated by `python -m sightline.deploy.prometheus_rules` from semconv names; do not edit.\n"


def _dump(document: dict) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=10_000, allow_unicode=True)


def rules_document(slo: SloConfig | None = None, runbook_base_url: str = RUNBOOK_BASE_URL) -> dict:
    return {"groups": [group.to_dict(runbook_base_url) for group in rule_groups(slo)]}


def render_rules_yaml(slo: SloConfig | None = None, runbook_base_url: str = RUNBOOK_BASE_URL) -> str:
    """The Prometheus rule file (``rule_files:`` entry) as YAML text."""
    return _HEADER + _dump(rules_document(slo, runbook_base_url))


def render_prometheus_rule(
    slo: SloConfig | None = None,
    runbook_base_url: str = RUNBOOK_BASE_URL,
    namespace: str = "sightline",
) -> str:
    """The same groups as a Prometheus Operator ``PrometheusRule`` custom resource."""
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "sightline-rules",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "sightline", "release": "prometheus"},
        },
        "spec": rules_document(slo, runbook_base_url),
    }
    return _HEADER + _dump(manifest)


_LABEL_REF = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def render_annotation(template: str, labels: dict[str, str]) -> str:
    """``template`` with ``{{ $labels.x }}`` replaced as Prometheus does (missing -> "")."""
    return _LABEL_REF.sub(lambda match: labels.get(match.group(1), ""), template)


def write_all() -> list[Path]:
    """Writes the rule file and the PrometheusRule manifest; returns their paths."""
    RULES_PATH.parent.mkdir(parents=True, exist_ok=True)
    PROMETHEUS_RULE_PATH.parent.mkdir(parents=True, exist_ok=True)
    RULES_PATH.write_text(render_rules_yaml(), encoding="utf-8")
    PROMETHEUS_RULE_PATH.write_text(render_prometheus_rule(), encoding="utf-8")
    return [RULES_PATH, PROMETHEUS_RULE_PATH]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write Sightline's Prometheus rules (YAML and PrometheusRule).")
    parser.parse_args(argv)
    for path in write_all():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
