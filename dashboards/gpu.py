"""GPU: which SM, which kernel, and is the device leaking?

Per-SM views come from the SM probe (one record per FlashAttention-2 CTA), reduced by
the collector: ``sightline_sm_cta_p99_seconds`` (each SM's CTA-duration P99 over the
last window) drawn as a time x SM heatmap with one row per SM, and the per-SM CTA
duration buckets drawn as an SM x latency matrix (fraction of that SM's CTAs that
finished within each bound, so a slow SM is the row whose colors lag). Kernel views
come from CUPTI kernel spans, kernel compiles while serving and start-up phases from the
engine; memory and CUDA contexts from NVML. Tensor-parallel ranks: each rank's compute and
collective wait per step, and the rank the others waited for (the straggler: the collector's
verdict per step and per window slot).

One panel per GPU (Grafana repeats on ``$gpu``) so SM rows of different devices never
mix.
"""

from __future__ import annotations

from ..instrumentation import semconv as sc
from . import promql as q
from .panels import DashboardSpec, PanelSpec, Query, Row, Variable

__all__ = ["UID", "spec"]

UID = "sightline-gpu"
_GPU_KERNEL = (sc.LABEL_GPU, sc.LABEL_KERNEL)
_GPU = (sc.LABEL_GPU,)


def _step_quantiles(title: str, histogram: str, by: str, description: str, exemplar: bool) -> PanelSpec:
    return PanelSpec(
        title=title,
        unit="s",
        description=description,
        queries=tuple(
            Query(q.histogram_quantile(quantile, histogram, (by,)), f"P{round(quantile * 100)} {{{{{by}}}}}",
                  exemplar=exemplar)
            for quantile in (0.5, 0.99)
        ),
    )


def _per_step(counter: str) -> str:
    """A rank's seconds per tensor-parallel step: its counter's rate over the steps' rate."""
    per_rank = q.sum_by((sc.LABEL_INSTANCE_ID, sc.LABEL_RANK), q.rate(q.counter(counter)))
    steps = q.sum_by((sc.LABEL_INSTANCE_ID,), q.rate(q.counter(sc.COLLECTOR_TP_STEPS_TOTAL)))
    return f"{per_rank}\n/ ignoring({sc.LABEL_RANK}) group_left\n{steps}"


def _tp_panel(title: str, unit: str, expr: str, description: str,
              legend: str = "{{instance_id}} rank {{rank}}") -> PanelSpec:
    return PanelSpec(title=title, unit=unit, width=6, description=description,
                     queries=(Query(expr, legend),))


def spec() -> DashboardSpec:
    sm_p99 = q.selector(sc.COLLECTOR_SM_CTA_P99_SECONDS, regex=_GPU_KERNEL)
    # all SMs of a GPU together (per-SM buckets are opt-in; the full-resolution heatmap is the API's)
    cta_count = q.sum_by((sc.LABEL_KERNEL,), f"increase({q.selector(q.count(sc.COLLECTOR_GPU_CTA_DURATION_SECONDS), regex=_GPU_KERNEL)}[$__range])")
    cta_buckets = q.sum_by(
        (sc.LABEL_KERNEL, q.BUCKET_LABEL),
        f"increase({q.selector(q.bucket(sc.COLLECTOR_GPU_CTA_DURATION_SECONDS), regex=_GPU_KERNEL)}[$__range])",
    )
    per_sm = Row(
        "Per-SM CTA timing",
        (
            PanelSpec(
                title="Per-SM CTA P99, GPU $gpu",
                kind="rows_heatmap",
                unit="s",
                width=24,
                height=16,
                repeat=sc.LABEL_GPU,
                description="One row per SM; color = that SM's CTA-duration P99 over the collector's window "
                "(worst kernel among those selected). A hot row is a slow SM.",
                queries=(
                    Query(q.aggregate("max", (sc.LABEL_SM,), sm_p99), legend="{{sm}}"),
                ),
            ),
            PanelSpec(
                title="Kernel x CTA duration, all SMs, GPU $gpu",
                kind="matrix",
                unit="percentunit",
                width=24,
                height=16,
                repeat=sc.LABEL_GPU,
                matrix_rows=sc.LABEL_KERNEL,
                matrix_columns=q.BUCKET_LABEL,
                description="Rows: kernels; columns: CTA duration bound (le, seconds); cell: fraction of the kernel's "
                "CTAs on this GPU (all SMs) over the dashboard's time range that finished within the bound. "
                "Per SM at full resolution: the collector's /api/v1/heatmap.html.",
                queries=(Query(f"{cta_buckets} / ignoring({q.BUCKET_LABEL}) group_left {cta_count}",
                               fmt="table", instant=True),),
            ),
            PanelSpec(
                title="Contended SMs",
                unit="short",
                description="SMs the collector's contention tests flagged in the gauge window: slow (more CTAs "
                "above the other SMs' P90 than chance allows) or starved (fewer CTAs than their share).",
                queries=(
                    Query(q.sum_by(_GPU_KERNEL + (sc.LABEL_REASON,),
                                   q.selector(sc.COLLECTOR_SM_CONTENDED, regex=_GPU_KERNEL)),
                          "{{reason}} gpu{{gpu}} {{kernel}}"),
                ),
            ),
            PanelSpec(
                title="SM hotspot ratio",
                unit="short",
                description="Slowest SM's CTA P99 over the median SM's, per kernel (1 = balanced).",
                queries=(
                    Query(q.selector(sc.COLLECTOR_SM_HOTSPOT_RATIO, regex=_GPU_KERNEL),
                          "collector gpu{{gpu}} {{kernel}}"),
                    Query(q.selector(sc.RULE_SM_HOTSPOT, regex=_GPU_KERNEL), "rule gpu{{gpu}} {{kernel}}"),
                ),
            ),
            PanelSpec(
                title="CTA duration P99 across SMs",
                unit="s",
                description="Median, max and min over SMs of the per-SM CTA P99.",
                queries=(
                    Query(q.aggregate("quantile", _GPU_KERNEL, sm_p99, 0.5), "median SM gpu{{gpu}} {{kernel}}"),
                    Query(q.aggregate("max", _GPU_KERNEL, sm_p99), "slowest SM gpu{{gpu}} {{kernel}}"),
                    Query(q.aggregate("min", _GPU_KERNEL, sm_p99), "fastest SM gpu{{gpu}} {{kernel}}"),
                ),
            ),
        ),
    )
    kernels = Row(
        "Kernels",
        (
            PanelSpec(
                title="Kernel duration, $kernel",
                kind="heatmap",
                unit="s",
                width=8,
                height=9,
                repeat=sc.LABEL_KERNEL,
                description="Duration of traced kernel launches (CUPTI, GPU clock); exemplars open the step trace.",
                queries=(
                    Query(q.sum_by((q.BUCKET_LABEL,),
                                   q.rate(q.selector(q.bucket(sc.COLLECTOR_KERNEL_DURATION_SECONDS), regex=_GPU_KERNEL))),
                          legend="{{le}}", exemplar=True, fmt="heatmap"),
                ),
            ),
            PanelSpec(
                title="Kernel P99 vs a day earlier",
                unit="s",
                queries=(
                    Query(q.selector(sc.RULE_KERNEL_P99, regex=_GPU_KERNEL), "now gpu{{gpu}} {{kernel}}"),
                    Query(f"{q.selector(sc.RULE_KERNEL_P99, regex=_GPU_KERNEL)} offset 1d",
                          "1d ago gpu{{gpu}} {{kernel}}"),
                ),
            ),
            PanelSpec(
                title="Traced kernel launches",
                unit="ops",
                queries=(
                    Query(q.sum_by(_GPU_KERNEL, q.rate(q.selector(q.count(sc.COLLECTOR_KERNEL_DURATION_SECONDS),
                                                                    regex=_GPU_KERNEL))), "gpu{{gpu}} {{kernel}}"),
                ),
            ),
            _step_quantiles("Engine step duration (traces)", sc.COLLECTOR_STEP_DURATION_SECONDS, sc.LABEL_PHASE,
                            "Steps whose spans reached the collector; exemplars open the step.", exemplar=True),
            _step_quantiles("Engine step duration (engine)", sc.ENGINE_STEP_SECONDS, sc.LABEL_MODEL,
                            "Every step, from Sightline's engine's own histogram (vLLM has no such series).",
                            exemplar=False),
            PanelSpec(
                title="Kernel variants met while serving",
                unit="short",
                description=("Kernel variants compiled, loaded from the disk cache or autotuned after the "
                             "engine said ready: each one is a defect of the warm-up, and the step that met "
                             "it carries sightline.step.jit_compiles (explain names the cause). Should "
                             "stay empty."),
                queries=(Query(q.sum_by(("instance", sc.LABEL_KERNEL, sc.LABEL_COMPILE_KIND),
                                        f"increase({q.counter(sc.ENGINE_JIT_COMPILES_TOTAL)}[$__rate_interval])"),
                               "{{instance}} {{kernel}} {{kind}}"),),
            ),
            PanelSpec(
                title="Engine start-up by phase",
                unit="s",
                description=("Seconds of each start-up phase of the running engines (loading weights, the "
                             "KV cache, each warm-up family, graph capture), and process start to ready."),
                queries=(Query(q.sum_by(("instance", sc.LABEL_PHASE), q.selector(sc.ENGINE_STARTUP_SECONDS)),
                               "{{instance}} {{phase}}"),
                         Query(q.selector(sc.ENGINE_STARTUP_TOTAL_SECONDS), "{{instance}} total")),
            ),
        ),
    )
    ranks = Row("Tensor-parallel ranks", (
        _tp_panel("Collective wait per step, by rank", "s",
                  _per_step(sc.COLLECTOR_TP_COLLECTIVE_WAIT_SECONDS_TOTAL),
                  "Seconds each rank's forward pass spends inside all-reduces per step (after the "
                  "step's first). A rank that keeps the others waiting waits least: the lowest line."),
        _tp_panel("Compute per step, by rank", "s", _per_step(sc.COLLECTOR_TP_COMPUTE_SECONDS_TOTAL),
                  "Seconds each rank's forward pass spends outside collectives per step."),
        _tp_panel("Straggler share, by rank", "percentunit", q.selector(sc.RULE_TP_STRAGGLER_SHARE),
                  "Share of the tensor-parallel steps over 5 minutes that named each rank the "
                  "straggler (the rank the others waited for). The alert fires past half."),
        _tp_panel("Straggler of the last window slot", "short", q.selector(sc.COLLECTOR_TP_STRAGGLER_RANK),
                  "The rank the newest complete collector window slot with steps named (-1: the ranks "
                  "kept pace); per slot: the collector's /api/v1/stragglers.", legend="{{instance_id}}"),
    ))
    memory = Row(
        "Memory and contexts",
        (
            PanelSpec(
                title="GPU memory used",
                unit="bytes",
                width=8,
                queries=(Query(q.selector(sc.GPU_MEMORY_USED_BYTES, regex=_GPU), "gpu{{gpu}}"),),
            ),
            PanelSpec(
                title="GPU memory per process",
                unit="bytes",
                width=8,
                queries=(Query(q.selector(sc.GPU_PROCESS_MEMORY_BYTES, regex=_GPU), "gpu{{gpu}} pid {{pid}}"),),
            ),
            PanelSpec(
                title="CUDA contexts",
                unit="short",
                width=8,
                description="Processes holding a CUDA context on the GPU; steady growth is a context leak.",
                queries=(Query(q.selector(sc.GPU_CUDA_CONTEXTS, regex=_GPU), "gpu{{gpu}}"),),
            ),
        ),
    )
    return DashboardSpec(
        uid=UID,
        title="Sightline / GPU",
        description="Per-SM CTA timing heatmaps, kernel durations, SM hotspots, tensor-parallel "
        "stragglers, GPU memory and contexts.",
        variables=(
            Variable(sc.LABEL_GPU, sc.COLLECTOR_SM_CTA_P99_SECONDS, sc.LABEL_GPU,
                     also=(q.count(sc.COLLECTOR_KERNEL_DURATION_SECONDS), sc.GPU_MEMORY_USED_BYTES)),
            Variable(sc.LABEL_KERNEL, sc.COLLECTOR_SM_CTA_P99_SECONDS, sc.LABEL_KERNEL, depends=(sc.LABEL_GPU,),
                     also=(q.count(sc.COLLECTOR_KERNEL_DURATION_SECONDS),)),
        ),
        rows=(per_sm, kernels, ranks, memory),
    )
