"""``promtool test rules`` unit tests for every Sightline alert, firing and not firing.

The cases are data (input series in promtool's expanding notation, evaluation times,
the exact labels each alert must carry); series names come from ``semconv`` and the
expected annotations from the rules themselves, so a rename cannot leave the tests
behind. Written to ``deploy/prometheus/tests/*.yml`` by
``python -m sightline.deploy.prometheus_rule_tests`` and run by
``tests/deploy/test_rules.py``. Every alert has at least one case where it fires and
one where it stays silent; :func:`coverage` says which.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ..dashboards import promql as q
from ..instrumentation import semconv as sc
from . import prometheus_rules as rules

__all__ = ["AlertCheck", "ExprCheck", "Case", "TEST_DIR", "case_files", "render_test_files", "coverage", "write_all"]

TEST_DIR = rules.RULES_PATH.parent / "tests"

ENGINE = {"job": rules.JOB_ENGINE, "instance": "engine-0:8000"}
COLLECTOR = {"job": rules.JOB_COLLECTOR, "instance": "collector-0:8889"}
MODEL = {sc.LABEL_MODEL: "llama-tiny"}
ADAPTED = {sc.LABEL_SOURCE: sc.SOURCE_SIGHTLINE}  # the adapter's label on llm: copies


def series(metric: str, labels: dict[str, str]) -> str:
    body = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return f"{metric}{{{body}}}"


@dataclasses.dataclass(frozen=True)
class AlertCheck:
    """At ``eval_time``, alert ``alertname`` is firing exactly for ``firing`` label sets
    (the expression's output labels; the rule's own labels are added automatically)."""

    eval_time: str
    alertname: str
    firing: tuple[dict[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class ExprCheck:
    """At ``eval_time``, ``expr`` returns exactly ``samples``: (series in promtool's
    ``name{labels}`` notation, value) pairs."""

    eval_time: str
    expr: str
    samples: tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    input_series: tuple[tuple[str, str], ...]
    checks: tuple[AlertCheck, ...]
    interval: str = "1m"
    exprs: tuple[ExprCheck, ...] = ()


def _alerts_by_name() -> dict[str, rules.AlertRule]:
    return {
        rule.alert: rule
        for group in rules.rule_groups()
        for rule in group.rules
        if isinstance(rule, rules.AlertRule)
    }


def _expected(check: AlertCheck) -> dict:
    rule = _alerts_by_name()[check.alertname]
    expected = []
    for labels in check.firing:
        full = {**labels, "severity": rule.severity, **dict(rule.labels)}
        annotations = {
            key: rules.render_annotation(value, full) for key, value in rule.annotations().items()
        }
        expected.append({"exp_labels": full, "exp_annotations": annotations})
    return {"eval_time": check.eval_time, "alertname": check.alertname, "exp_alerts": expected}


# ---------------------------------------------------------------------------------
# SLO burn rates
# ---------------------------------------------------------------------------------
def _ttft(good: str, total: str) -> tuple[tuple[str, str], ...]:
    le = q.le_value(rules.SloConfig().ttft_threshold_s)
    labels = {**ENGINE, **MODEL}
    return (
        (series(q.bucket(sc.ENGINE_TTFT_SECONDS), {**labels, q.BUCKET_LABEL: le}), good),
        (series(q.count(sc.ENGINE_TTFT_SECONDS), labels), total),
    )


def _errors(errors: str, finished: str, code: str = "500") -> tuple[tuple[str, str], ...]:
    return (
        (series(q.counter(sc.ENGINE_REQUEST_ERRORS_TOTAL), {**ENGINE, **MODEL, sc.LABEL_CODE: code}), errors),
        (series(q.counter(sc.ENGINE_REQUESTS_TOTAL), {**ENGINE, **MODEL, sc.LABEL_FINISH_REASON: "stop"}), finished),
    )


def slo_cases() -> list[Case]:
    return [
        Case(
            "ttft: half the requests over the threshold pages (and also tickets)",
            _ttft(good="0+30x120", total="0+60x120"),
            (
                AlertCheck("70m", "SightlineTTFTBudgetBurnFast", (MODEL,)),
                AlertCheck("70m", "SightlineTTFTBudgetBurnSlow", (MODEL,)),
            ),
        ),
        Case(
            "ttft: 0.5% over the threshold is within the 1% budget",
            _ttft(good="0+199x240", total="0+200x240"),
            (
                AlertCheck("70m", "SightlineTTFTBudgetBurnFast"),
                AlertCheck("230m", "SightlineTTFTBudgetBurnSlow"),
            ),
        ),
        Case(
            "ttft: a burn that stopped 30m ago does not page (short windows are clean)",
            _ttft(good="0+30x60 1800+60x30", total="0+60x90"),
            (AlertCheck("90m", "SightlineTTFTBudgetBurnFast"),),
        ),
        Case(
            "ttft: a slow 5% burn tickets but does not page",
            _ttft(good="0+190x240", total="0+200x240"),
            (
                AlertCheck("180m", "SightlineTTFTBudgetBurnFast"),
                AlertCheck("180m", "SightlineTTFTBudgetBurnSlow", (MODEL,)),
            ),
        ),
        Case(
            "errors: 9% server errors page",
            _errors(errors="0+10x120", finished="0+100x120"),
            (AlertCheck("70m", "SightlineErrorsBudgetBurnFast", (MODEL,)),),
        ),
        Case(
            "errors: client errors (400) never burn the budget",
            _errors(errors="0+50x120", finished="0+100x120", code="400"),
            (
                AlertCheck("70m", "SightlineErrorsBudgetBurnFast"),
                AlertCheck("110m", "SightlineErrorsBudgetBurnSlow"),
            ),
        ),
        Case(
            "errors: a 0.5% error ratio (5x budget) tickets but does not page",
            _errors(errors="0+1x240", finished="0+199x240", code="429"),
            (
                AlertCheck("180m", "SightlineErrorsBudgetBurnFast"),
                AlertCheck("180m", "SightlineErrorsBudgetBurnSlow", (MODEL,)),
            ),
        ),
    ]


# ---------------------------------------------------------------------------------
# Engine saturation and targets
# ---------------------------------------------------------------------------------
def engine_cases() -> list[Case]:
    kv = series(sc.ENGINE_KV_USAGE, {**ENGINE, **MODEL})
    waiting = series(sc.ENGINE_WAITING, {**ENGINE, **MODEL})
    up_engine = series("up", ENGINE)
    up_other = series("up", {"job": "node", "instance": "host:9100"})
    compiles = series(q.counter(sc.ENGINE_JIT_COMPILES_TOTAL),
                      {**ENGINE, **MODEL, sc.LABEL_KERNEL: "sightline_paged_decode",
                       sc.LABEL_COMPILE_KIND: "compiled"})
    return [
        Case(
            "kv cache at 97% for 20 minutes",
            ((kv, "0.97x20"),),
            (AlertCheck("15m", "SightlineKVCacheNearFull", ({**ENGINE, **MODEL, **ADAPTED},)),),
        ),
        Case(
            "kv cache: a 5-minute spike, then 50%; a steady 90%",
            ((kv, "0.97x5 0.5x15"), (series(sc.ENGINE_KV_USAGE, {**ENGINE, sc.LABEL_MODEL: "other"}), "0.9x20")),
            (AlertCheck("15m", "SightlineKVCacheNearFull"),),
        ),
        Case(
            "waiting queue growing by one request a minute",
            ((waiting, "0+1x45"),),
            (AlertCheck("40m", "SightlineWaitingQueueGrowing", ({**ENGINE, **MODEL, **ADAPTED},)),),
        ),
        Case(
            "waiting queue long but stable",
            ((waiting, "50x45"),),
            (AlertCheck("40m", "SightlineWaitingQueueGrowing"),),
        ),
        Case(
            "engine target down; another job's target down is not ours",
            ((up_engine, "0x10"), (up_other, "0x10")),
            (AlertCheck("8m", "SightlineTargetDown", (ENGINE,)),),
        ),
        Case(
            "engine target up",
            ((up_engine, "1x10"),),
            (AlertCheck("8m", "SightlineTargetDown"),),
        ),
        Case(
            "a kernel variant compiled while serving, ten minutes ago",
            ((compiles, "0x10 1x20"),),
            (AlertCheck("20m", "SightlineKernelCompiledWhileServing",
                        ({**ENGINE, sc.LABEL_KERNEL: "sightline_paged_decode",
                          sc.LABEL_COMPILE_KIND: "compiled"},)),),
        ),
        Case(
            "compiles counted long ago only",
            ((compiles, "1x40"),),
            (AlertCheck("30m", "SightlineKernelCompiledWhileServing"),),
        ),
    ]


# ---------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------
GPU_KERNEL = {sc.LABEL_GPU: "0", sc.LABEL_KERNEL: "fa2_decode"}


def _contended(values_per_sm: dict[int, str], gpu: str = "0") -> tuple[tuple[str, str], ...]:
    """Contention-score series of flagged SMs (``_`` where an SM is not flagged: no sample)."""
    return tuple(
        (series(sc.COLLECTOR_SM_CONTENTION_SCORE, {**COLLECTOR, **GPU_KERNEL, sc.LABEL_GPU: gpu, sc.LABEL_SM: str(sm)}),
         values)
        for sm, values in values_per_sm.items()
    )


def _causes(per_minute: dict[str, int], minutes: int = 30) -> tuple[tuple[str, str], ...]:
    """Slow requests explained, per cause, growing by ``per_minute[cause]`` a minute."""
    return tuple((series(q.counter(sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED), {**COLLECTOR, sc.LABEL_CAUSE: cause}),
                  f"0+{n}x{minutes}") for cause, n in per_minute.items())


def _kernel_hist(le_1ms: str, le_10ms: str, total: str) -> tuple[tuple[str, str], ...]:
    name = sc.COLLECTOR_KERNEL_DURATION_SECONDS
    labels = {**COLLECTOR, **GPU_KERNEL}
    return (
        (series(q.bucket(name), {**labels, q.BUCKET_LABEL: q.le_value(0.001)}), le_1ms),
        (series(q.bucket(name), {**labels, q.BUCKET_LABEL: q.le_value(0.01)}), le_10ms),
        (series(q.bucket(name), {**labels, q.BUCKET_LABEL: "+Inf"}), total),
        (series(q.count(name), labels), total),
    )


def gpu_cases() -> list[Case]:
    memory = series(sc.GPU_MEMORY_USED_BYTES, {**ENGINE, sc.LABEL_GPU: "0"})
    contexts = series(sc.GPU_CUDA_CONTEXTS, {**ENGINE, sc.LABEL_GPU: "0"})
    gib, mib = 1 << 30, 1 << 20
    return [
        Case(
            "two SMs flagged contended for 20 minutes, one of them on and off",
            _contended({3: "4x25", 7: "9.5x5 _x2 9.5x18"}),
            (AlertCheck("20m", rules.SM_CONTENTION_ALERT, (GPU_KERNEL,)),),
        ),
        Case(
            "an SM flagged for 10 minutes; another GPU never",
            _contended({3: "4x10 _x15"}) + _contended({5: "_x25"}, gpu="1"),
            (AlertCheck("20m", rules.SM_CONTENTION_ALERT),),
        ),
        Case(
            "slow requests mostly explained by device contention, then by a host stall",
            _causes({sc.CAUSE_DEVICE_CONTENTION: 2, sc.CAUSE_UNKNOWN: 1}, 20)
            + _causes({sc.CAUSE_HOST_STALL: 0}, 20),
            (AlertCheck("18m", "SightlineDeviceContention", ({"job": rules.JOB_COLLECTOR},)),
             AlertCheck("18m", "SightlineHostStall")),
        ),
        Case(
            "a host stall explains most slow requests",
            _causes({sc.CAUSE_HOST_STALL: 3, sc.CAUSE_QUEUEING: 1, sc.CAUSE_DEVICE_CONTENTION: 0}, 20),
            (AlertCheck("18m", "SightlineHostStall", ({"job": rules.JOB_COLLECTOR},)),
             AlertCheck("18m", "SightlineDeviceContention")),
        ),
        Case(
            "a host stall the only cause named; more slow requests left unknown do not outvote it",
            _causes({sc.CAUSE_HOST_STALL: 2, sc.CAUSE_UNKNOWN: 5, sc.CAUSE_DEVICE_CONTENTION: 0}, 20),
            (AlertCheck("18m", "SightlineHostStall", ({"job": rules.JOB_COLLECTOR},)),
             AlertCheck("18m", "SightlineDeviceContention")),
        ),
        Case(
            "device contention a minority of the causes; a host stall too rare to count",
            _causes({sc.CAUSE_DEVICE_CONTENTION: 1, sc.CAUSE_QUEUEING: 3}, 20)
            + ((series(q.counter(sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED), {**COLLECTOR, sc.LABEL_CAUSE: sc.CAUSE_HOST_STALL}),
                "0x15 1x5"),),
            (AlertCheck("18m", "SightlineDeviceContention"), AlertCheck("18m", "SightlineHostStall")),
        ),
        Case(
            "GPU memory growing 100 MiB a minute",
            ((memory, f"{10 * gib}+{100 * mib}x120"),),
            (AlertCheck("100m", "SightlineGPUMemoryGrowing", ({**ENGINE, sc.LABEL_GPU: "0"},)),),
        ),
        Case(
            "GPU memory flat; creeping 1 MiB a minute on 40 GiB",
            ((memory, f"{40 * gib}x120"),
             (memory.replace('gpu="0"', 'gpu="1"'), f"{40 * gib}+{mib}x120")),
            (AlertCheck("100m", "SightlineGPUMemoryGrowing"),),
        ),
        Case(
            "a new CUDA context every 10 minutes",
            ((contexts, " ".join(f"{n}+0x9" for n in range(1, 10))),),
            (AlertCheck("85m", "SightlineCUDAContextsGrowing", ({**ENGINE, sc.LABEL_GPU: "0"},)),),
        ),
        Case(
            "contexts stable; one restart adds a single context",
            ((contexts, "3x90"), (contexts.replace('gpu="0"', 'gpu="1"'), "3x40 4x50")),
            (AlertCheck("85m", "SightlineCUDAContextsGrowing"),),
        ),
    ]


def _tp(instance: str, steps: str, named: str, rank: str = "1") -> tuple[tuple[str, str], ...]:
    """A collector's tensor-parallel counters for one producer: its steps, and the steps
    that named ``rank`` (rank 0 never named)."""
    producer = {**COLLECTOR, sc.LABEL_INSTANCE_ID: instance}
    return (
        (series(q.counter(sc.COLLECTOR_TP_STEPS_TOTAL), producer), steps),
        (series(q.counter(sc.COLLECTOR_TP_STRAGGLER_STEPS_TOTAL), {**producer, sc.LABEL_RANK: rank}), named),
        (series(q.counter(sc.COLLECTOR_TP_STRAGGLER_STEPS_TOTAL), {**producer, sc.LABEL_RANK: "0"}), "0+0x30"),
    )


def tp_cases() -> list[Case]:
    straggler = {sc.LABEL_INSTANCE_ID: "engine-a", sc.LABEL_RANK: "1"}
    share = sc.RULE_TP_STRAGGLER_SHARE
    return [
        Case(
            "rank 1 named in 80% of the steps for 30 minutes",
            _tp("engine-a", "0+6000x30", "0+4800x30"),
            (AlertCheck("25m", "SightlineTensorParallelStraggler", (straggler,)),),
            exprs=(ExprCheck("25m", share, (
                (series(share, {sc.LABEL_INSTANCE_ID: "engine-a", sc.LABEL_RANK: "0"}), 0.0),
                (series(share, straggler), 0.8))),),
        ),
        Case(
            "rank 1 named in 30% of the steps; elsewhere in 80% for 10 minutes only",
            _tp("engine-a", "0+6000x30", "0+1800x30")
            + _tp("engine-b", "0+6000x30", "0+4800x10 48000+0x20"),
            (AlertCheck("25m", "SightlineTensorParallelStraggler"),),
        ),
    ]


def kernel_cases() -> list[Case]:
    """Day-over-day comparisons need a day of samples: evaluated every 10 minutes to
    keep promtool fast (the alert's ``for`` of 30m still spans three evaluations)."""
    day = 24 * 60
    return [
        Case(
            "kernel P99 10x slower than the same time yesterday",
            _kernel_hist(le_1ms=f"0+100x{day} {100 * day}x60", le_10ms=f"0+100x{day + 60}",
                         total=f"0+100x{day + 60}"),
            (AlertCheck(f"{day + 50}m", "SightlineKernelP99Regression", (GPU_KERNEL,)),),
        ),
        Case(
            "kernel P99 same as yesterday; no yesterday at all",
            _kernel_hist(le_1ms=f"0+100x{day + 60}", le_10ms=f"0+100x{day + 60}", total=f"0+100x{day + 60}"),
            (
                AlertCheck(f"{day + 50}m", "SightlineKernelP99Regression"),
                AlertCheck("50m", "SightlineKernelP99Regression"),
            ),
        ),
    ]


# ---------------------------------------------------------------------------------
# Telemetry pipeline
# ---------------------------------------------------------------------------------
def pipeline_cases() -> list[Case]:
    rejected_labels = {**COLLECTOR, sc.LABEL_RECEIVER: sc.RECEIVER_OTLP_HTTP, sc.LABEL_REASON: "too_large"}
    rejected = series(q.counter(sc.COLLECTOR_REJECTED_TOTAL), rejected_labels)
    dropped = series(q.counter(sc.COLLECTOR_DROPPED_TOTAL), {**COLLECTOR, sc.LABEL_REASON: "queue_full"})
    agg_dropped = series(q.counter(sc.COLLECTOR_AGGREGATOR_DROPPED_TOTAL),
                         {**COLLECTOR, sc.LABEL_REASON: "series_limit"})
    failures = series(q.counter(sc.TELEMETRY_EXPORT_FAILURES_TOTAL), {**ENGINE, sc.LABEL_SIGNAL: "traces"})
    spans_dropped = series(q.counter(sc.TELEMETRY_SPANS_DROPPED_TOTAL), ENGINE)
    job_only = {"job": rules.JOB_COLLECTOR}
    records_dropped = series(q.counter(sc.TELEMETRY_EVENTS_DROPPED_TOTAL),
                             {**ENGINE, sc.LABEL_REASON: "process_down"})
    return [
        Case(
            "engine dropping telemetry records while its telemetry process is down",
            ((records_dropped, "0+50x30"),),
            (AlertCheck("20m", "SightlineTelemetryRecordsDropped",
                        ({**ENGINE, sc.LABEL_REASON: "process_down"},)),),
        ),
        Case(
            "engine telemetry records all handed over",
            ((records_dropped, "7x30"),),
            (AlertCheck("20m", "SightlineTelemetryRecordsDropped"),),
        ),
        Case(
            "collector rejecting oversized OTLP/HTTP bodies",
            ((rejected, "0+5x30"),),
            (AlertCheck("20m", "SightlineCollectorRejecting",
                        ({"job": rules.JOB_COLLECTOR, sc.LABEL_RECEIVER: sc.RECEIVER_OTLP_HTTP,
                          sc.LABEL_REASON: "too_large"},)),),
        ),
        Case(
            "collector rejected some data an hour ago, none now",
            ((rejected, "7x30"),),
            (AlertCheck("20m", "SightlineCollectorRejecting"),),
        ),
        Case(
            "collector dropping in the pipeline queue and in the aggregator",
            ((dropped, "0+3x20"), (agg_dropped, "0+1x20")),
            (AlertCheck("15m", "SightlineCollectorDropping",
                        ({**job_only, sc.LABEL_REASON: "queue_full"},
                         {**job_only, sc.LABEL_REASON: "series_limit"})),),
        ),
        Case(
            "collector drop counters flat",
            ((dropped, "12x20"), (agg_dropped, "0x20")),
            (AlertCheck("15m", "SightlineCollectorDropping"),),
        ),
        Case(
            "engine exporter failing once a minute; spans dropped",
            ((failures, "0+1x30"), (spans_dropped, "0+100x30")),
            (
                AlertCheck("20m", "SightlineTelemetryExportFailing", (ENGINE,)),
                AlertCheck("20m", "SightlineTelemetrySpansDropped", (ENGINE,)),
            ),
        ),
        Case(
            "engine exporter healthy",
            ((failures, "4x30"), (spans_dropped, "0x30")),
            (
                AlertCheck("20m", "SightlineTelemetryExportFailing"),
                AlertCheck("20m", "SightlineTelemetrySpansDropped"),
            ),
        ),
    ]


# ---------------------------------------------------------------------------------
# vLLM's series through the adapter: the same alerts fire on them
# ---------------------------------------------------------------------------------
VLLM = {"job": "vllm", "instance": "vllm-0:8000", "engine": "0", sc.VLLM_LABEL_MODEL: "llama-tiny"}
VLLM_TARGET = {"job": "vllm", "instance": "vllm-0:8000"}


def vllm_cases() -> list[Case]:
    le = q.le_value(rules.SloConfig().ttft_threshold_s)
    ttft = (
        (series(q.bucket(sc.VLLM_TTFT_SECONDS), {**VLLM, q.BUCKET_LABEL: le}), "0+30x120"),
        (series(q.count(sc.VLLM_TTFT_SECONDS), VLLM), "0+60x120"),
    )
    success = series(q.counter(sc.VLLM_REQUEST_SUCCESS_TOTAL), {**VLLM, sc.VLLM_LABEL_FINISHED_REASON: "stop"})
    running = series(sc.VLLM_RUNNING, VLLM)

    def http(status: str, handler: str = "/v1/chat/completions") -> str:
        return series(q.counter(sc.VLLM_HTTP_REQUESTS_TOTAL), {**VLLM_TARGET, sc.VLLM_LABEL_HANDLER: handler,
                                                               "method": "POST", sc.VLLM_LABEL_STATUS: status})

    adapted = {**VLLM, sc.LABEL_MODEL: "llama-tiny", sc.LABEL_SOURCE: sc.SOURCE_VLLM}
    kv = series(sc.VLLM_KV_USAGE, VLLM)
    return [
        Case(
            "vllm: half the requests over the TTFT threshold pages",
            ttft,
            (AlertCheck("70m", "SightlineTTFTBudgetBurnFast", (MODEL,)),),
        ),
        Case(
            "vllm: 9% 5xx responses on /v1 page; 4xx and /metrics errors do not count",
            ((http("5xx"), "0+10x120"), (http("4xx"), "0+50x120"), (http("5xx", "/metrics"), "0+99x120"),
             (http("2xx"), "0+100x120"), (success, "0+100x120"), (running, "3x120")),
            (AlertCheck("70m", "SightlineErrorsBudgetBurnFast", (MODEL,)),),
            exprs=(ExprCheck("10m", q.counter(sc.LLM_REQUEST_ERRORS_TOTAL), tuple(
                (series(q.counter(sc.LLM_REQUEST_ERRORS_TOTAL),
                        {**VLLM_TARGET, sc.LABEL_MODEL: "llama-tiny", sc.LABEL_CODE: code, sc.VLLM_LABEL_STATUS: code,
                         sc.LABEL_SOURCE: sc.SOURCE_VLLM,
                         sc.VLLM_LABEL_HANDLER: "/v1/chat/completions", "method": "POST"}), value)
                for code, value in (("4xx", 500.0), ("5xx", 100.0)))),),
        ),
        Case(
            "vllm: series land in the llm: set under model and finish_reason",
            ((success, "0+100x20"), (running, "3x20"), (kv, "0.97x20")),
            (AlertCheck("15m", "SightlineKVCacheNearFull", (adapted,)),),
            exprs=(
                ExprCheck("10m", q.counter(sc.LLM_REQUESTS_TOTAL), (
                    (series(q.counter(sc.LLM_REQUESTS_TOTAL),
                            {**adapted, sc.LABEL_FINISH_REASON: "stop", sc.VLLM_LABEL_FINISHED_REASON: "stop"}),
                     1000.0),)),
                ExprCheck("10m", sc.LLM_RUNNING, ((series(sc.LLM_RUNNING, adapted), 3.0),)),
            ),
        ),
        Case(
            "vllm: waiting queue growing; KV cache at 50%",
            ((series(sc.VLLM_WAITING, VLLM), "0+1x45"), (kv, "0.5x45")),
            (AlertCheck("40m", "SightlineWaitingQueueGrowing", (adapted,)),
             AlertCheck("40m", "SightlineKVCacheNearFull")),
        ),
    ]


def case_files() -> dict[str, tuple[str, list[Case]]]:
    """``{file name: (evaluation interval, cases)}``: one file per alert family."""
    return {
        "slo.yml": ("5m", slo_cases()),
        "engine.yml": ("1m", engine_cases()),
        "gpu.yml": ("1m", gpu_cases()),
        "tensor_parallel.yml": ("1m", tp_cases()),
        "kernels.yml": ("10m", kernel_cases()),
        "pipeline.yml": ("1m", pipeline_cases()),
        "vllm.yml": ("1m", vllm_cases()),
    }


def _document(evaluation_interval: str, cases: list[Case]) -> dict:
    return {
        "rule_files": [f"../{rules.RULES_PATH.name}"],
        "evaluation_interval": evaluation_interval,
        # Recording groups before the alert groups that read them: promtool's default
        # order is a map's (random), which makes a rule read its input one interval late.
        "group_eval_order": [group.name for group in rules.rule_groups()],
        "tests": [
            {
                "name": case.name,
                "interval": case.interval,
                "input_series": [{"series": s, "values": v} for s, v in case.input_series],
                "alert_rule_test": [_expected(check) for check in case.checks],
                **({"promql_expr_test": [
                    {"expr": c.expr, "eval_time": c.eval_time,
                     "exp_samples": [{"labels": labels, "value": value} for labels, value in c.samples]}
                    for c in case.exprs]} if case.exprs else {}),
            }
            for case in cases
        ],
    }


def render_test_files() -> dict[str, str]:
    header = "# Generated by `python -m sightline.deploy.prometheus_rule_tests`; do not edit.\n"
    return {
        name: header + yaml.safe_dump(_document(interval, cases), sort_keys=False, width=10_000)
        for name, (interval, cases) in case_files().items()
    }


def coverage() -> dict[str, tuple[bool, bool]]:
    """``{alertname: (has a firing check, has a silent check)}`` for every alert rule."""
    result = {name: (False, False) for name in _alerts_by_name()}
    for _, cases in case_files().values():
        for case in cases:
            for check in case.checks:
                fires, silent = result[check.alertname]
                result[check.alertname] = (fires or bool(check.firing), silent or not check.firing)
    return result


def write_all() -> list[Path]:
    TEST_DIR.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_test_files().items():
        path = TEST_DIR / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_all():
        print(written)
