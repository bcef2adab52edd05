"""Why was a request slow: its cause, phase breakdown, the steps it rode, kernels and SMs.

``explain_trace(sources, trace_id)`` explains one request (say, a Prometheus exemplar's
trace id); ``explain_slowest(sources, quantile, limit)`` explains every request at or above
the exact ``quantile`` of the end-to-end latencies in the trace store, slowest first.
``sources``: a trace store, per-SM data and an engine timeline (:class:`~.query.Sources`).
An explanation holds the request's phases, how much of its prompt the engine's prefix cache
served and how long computing the rest took, the ``engine.step`` spans it rode (span links in
both directions) with their slowest kernel spans and, under tensor parallelism, per-rank
waits and straggler (:mod:`.stragglers`), its slowest SM, and the cause class
:mod:`.causes` names from the evidence of its lifetime (:func:`evidence_sm`, the timeline).
Guarantee: explanations only cover what the bounded store still holds: a step evicted
(or never received, e.g. kernel spans that were not sampled) is absent, never invented.
Cost: O(spans of the selected requests and their steps) plus one pass over the
requests for the threshold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..instrumentation import check_range
from ..instrumentation import semconv as sc
from .aggregation_config import StragglerConfig
from .causes import Cause, CauseEvidence, classify
from .contention import hotspots
from .otlp_points import MAX_LABEL_CHARS
from .query import SmQuery, Sources
from .sm_store import SmKey
from .stragglers import straggler
from .trace_store import StoredSpan, TraceStore

__all__ = ["Explanation", "KernelSummary", "Phases", "PromptCache", "RequestExplanation", "StepSummary",
           "evidence_sm", "explain_slowest", "explain_trace", "trace_spans"]


@dataclass
class KernelSummary:
    name: str
    gpu: str
    instance: str
    duration_s: float
    trace_id: str
    span_id: str
    slowest_sm: str | None
    cta_spread: float | None


@dataclass
class StepSummary:
    trace_id: str
    span_id: str
    step_id: int | None
    duration_s: float
    batch_size: int | None
    prefill_tokens: int | None
    decode_tokens: int | None
    kernels: list[KernelSummary] = field(default_factory=list)
    kernel_trace_reason: str | None = None  # its kernels were traced: "sampled" | "after_tail" | "slow_spell"
    prefill_cached_tokens: int | None = None  # prompt tokens it took from the prefix cache
    # tensor parallelism: per rank (index = rank), seconds computing and waiting in
    # collectives, and the rank the others waited for (None: they kept pace)
    rank_compute_s: list[float] | None = None
    rank_collective_wait_s: list[float] | None = None
    straggler_rank: int | None = None


@dataclass
class PromptCache:
    """The request's prompt and the engine's prefix cache: tokens served from the cache, the
    rest computed by its prefill phase(s) in ``prefill_s`` (for a miss, the whole prompt)."""

    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    cached_ratio: float | None  # None for an empty prompt
    hit: bool                   # some prompt tokens were served from the cache
    prefill_s: float


@dataclass
class Phases:
    queue_s: float
    prefill_s: float
    decode_s: float
    other_s: float


@dataclass
class SlowestSm:
    instance: str
    gpu: str
    sm: str
    kernel: str
    source: str  # "kernel_span" | "sm_exemplar" | "sm_window"
    value_s: float | None  # its P99 CTA duration (sm_window) or slowest CTA (sm_exemplar)
    score: float | None = None  # sm_window: its P99 / the median SM's P99 over the request


@dataclass
class RequestExplanation:
    trace_id: str
    span_id: str
    name: str
    start_time_unix_nano: int
    end_time_unix_nano: int
    model: str
    priority: str
    e2e_s: float
    ttft_s: float | None
    tpot_s: float | None
    finish_reason: str | None
    phases: Phases
    prompt_cache: PromptCache | None  # None: the engine reported no prefix cache figures
    steps_total: int
    steps: list[StepSummary]
    slowest_kernel: KernelSummary | None
    slowest_sm: SlowestSm | None
    cause: Cause | None = None
    instance: str = "unknown"
    # tensor parallelism: the rank named by the most of its steps that named one, and how
    # many of its steps did (0 and None without tensor parallelism)
    straggler_rank: int | None = None
    straggler_steps: int = 0


@dataclass
class Explanation:
    quantile: float
    threshold_s: float | None
    requests_considered: int
    requests: list[RequestExplanation]

    def to_dict(self) -> dict:
        return asdict(self)


def _f(value) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _i(value) -> int | None:
    f = _f(value)
    return int(f) if f is not None and math.isfinite(f) else None


def e2e_of(root: StoredSpan) -> float:
    """The request's e2e latency: its ``sightline.request.e2e_s`` (else the span's)."""
    return root.e2e_s


def trace_spans(sources: Sources, trace_id: str) -> dict | None:
    """Every stored span of one trace (start order) and the traces linked to it."""
    def read(store: TraceStore):
        trace = store.get(trace_id)
        if trace is None:
            return None
        spans = sorted(trace.spans, key=lambda s: (s.start_time_unix_nano, s.span_id))
        return {"trace_id": trace.trace_id.hex(), "dropped_spans": trace.dropped_spans,
                "spans": [s.record().to_dict() for s in spans],
                "linked_traces": [t.trace_id.hex() for t in store.linked(trace.trace_id)]}
    return sources.store.read(read)


def explain_trace(sources: Sources, trace_id: str, max_steps: int = 5,
                  max_kernels: int = 3) -> RequestExplanation | None:
    """One request explained by its trace id (e.g. from a Prometheus exemplar); None when
    the store holds no request root for it (never received, evicted, or not a request)."""
    def read(store: TraceStore):
        trace = store.get(trace_id)
        if trace is None or trace.request_root is None:
            return None
        sources.timeline.refresh(store)
        return _explain_one(store, trace.request_root, max_steps, max_kernels, sources.timeline,
                            _stragglers(sources))

    found = sources.store.read(read)
    if found is None:
        return None
    req, step_ids, evidence = found
    if req.slowest_sm is None:
        req.slowest_sm = _slowest_sm_from_sm_data(sources.sm, req, step_ids)
    _name_cause(sources.sm, req, evidence, {})
    return req


def explain_slowest(sources: Sources, quantile: float = 0.99, limit: int = 10,
                    max_steps: int = 5, max_kernels: int = 3,
                    within_s: tuple[float, float] | None = None) -> Explanation:
    """The requests at or above ``quantile`` of e2e latency, explained, slowest first: the
    threshold is the exact value at rank ``ceil(quantile * n)`` of the request root spans'
    latencies (the store holds every one of them, no sketch). ``within_s``: only the
    requests whose life (root span) overlaps ``[start, end]`` (Unix seconds) count."""
    check_range("quantile", quantile, 0.0, 1.0)
    check_range("limit", limit, 1, 1000, integer=True)
    if within_s is not None and not within_s[0] < within_s[1]:
        raise ValueError(f"within_s={within_s}: the start must come before the end")

    def read(store: TraceStore):
        roots = store.request_roots()
        if within_s is not None:
            lo, hi = int(within_s[0] * 1e9), int(within_s[1] * 1e9)
            roots = [r for r in roots if r.start_time_unix_nano < hi and r.end_time_unix_nano > lo]
        if not roots:
            return Explanation(quantile, None, 0, []), []
        ranked = sorted(roots, key=e2e_of)
        threshold = e2e_of(ranked[max(1, math.ceil(quantile * len(ranked))) - 1])
        chosen = [r for r in reversed(ranked) if e2e_of(r) >= threshold][:limit]
        sources.timeline.refresh(store)
        config = _stragglers(sources)
        out = [_explain_one(store, root, max_steps, max_kernels, sources.timeline, config)
               for root in chosen]
        return Explanation(quantile, threshold, len(roots), [r for r, _, _ in out]), out

    explanation, requests = sources.store.read(read)
    slots: dict = {}  # per-SM tests per kernel, shared by the requests
    for req, step_ids, evidence in requests:  # per-SM data is read outside the store lock
        if req.slowest_sm is None:
            req.slowest_sm = _slowest_sm_from_sm_data(sources.sm, req, step_ids)
        _name_cause(sources.sm, req, evidence, slots)
    return explanation


def _stragglers(sources) -> StragglerConfig:
    config = getattr(sources, "config", None)
    return getattr(config, "stragglers", None) or StragglerConfig()


def _rank_figures(attrs: dict, config: StragglerConfig) -> tuple[list | None, list | None, int | None]:
    """A step span's per-rank compute and collective-wait seconds and its straggler."""
    compute, wait = attrs.get(sc.STEP_RANK_COMPUTE_S), attrs.get(sc.STEP_RANK_COLLECTIVE_WAIT_S)
    if not isinstance(wait, list) or not isinstance(compute, list) or len(wait) != len(compute):
        return None, None, None
    compute, wait = [float(c) for c in compute], [float(w) for w in wait]
    rank = straggler(wait, [c + w for c, w in zip(compute, wait)], config)

    def known(values: list[float]) -> list:   # a rank that never reported: None, not NaN
        return [v if math.isfinite(v) else None for v in values]

    return known(compute), known(wait), rank


def explain_requests(sources: Sources, roots_of, max_steps: int = 5,
                     max_kernels: int = 3) -> list[RequestExplanation]:
    """Explains the request roots ``roots_of(store)`` picks (called under the store's lock)."""
    def read(store: TraceStore):
        chosen = roots_of(store)
        if not chosen:
            return []
        sources.timeline.refresh(store)
        config = _stragglers(sources)
        return [_explain_one(store, root, max_steps, max_kernels, sources.timeline, config) for root in chosen]

    slots: dict = {}
    out = []
    for req, step_ids, evidence in sources.store.read(read):
        if req.slowest_sm is None:
            req.slowest_sm = _slowest_sm_from_sm_data(sources.sm, req, step_ids)
        _name_cause(sources.sm, req, evidence, slots)
        out.append(req)
    return out


def _explain_one(store: TraceStore, root: StoredSpan, max_steps: int, max_kernels: int,
                 timeline, stragglers: StragglerConfig) -> tuple[RequestExplanation, set[bytes], CauseEvidence]:
    trace = store.get(root.trace_id)
    spans = trace.spans if trace else [root]
    totals = {sc.SPAN_QUEUE: 0.0, sc.SPAN_PREFILL: 0.0, sc.SPAN_DECODE: 0.0}
    seen_phase = set()
    for s in spans:  # a chunked prefill has several prefill spans: summed
        if s.name in totals:
            totals[s.name] += s.duration_s
            seen_phase.add(s.name)
    attrs = root.attributes
    if sc.SPAN_QUEUE not in seen_phase and _f(attrs.get(sc.REQUEST_QUEUE_S)) is not None:
        totals[sc.SPAN_QUEUE] = _f(attrs.get(sc.REQUEST_QUEUE_S))
    e2e = e2e_of(root)
    phases = Phases(totals[sc.SPAN_QUEUE], totals[sc.SPAN_PREFILL], totals[sc.SPAN_DECODE],
                    max(0.0, e2e - sum(totals.values())))
    steps = _steps_of(store, root.trace_id, spans)
    summaries = []
    for step in steps:
        step_trace = store.get(step.trace_id)
        kernels = []
        if step_trace is not None:
            step_id = step.span_id  # spans decode on access: read each id once
            for k in step_trace.spans:
                if k.name.startswith(sc.SPAN_KERNEL_PREFIX) and k.parent_span_id == step_id:
                    kernels.append(_kernel_summary(k))
        kernels.sort(key=lambda k: -k.duration_s)
        a = step.attributes
        summaries.append(StepSummary(step.trace_id.hex(), step.span_id.hex(), _i(a.get(sc.STEP_ID)),
                                     step.duration_s,
                                     _i(a.get(sc.STEP_BATCH_SIZE)), _i(a.get(sc.STEP_PREFILL_TOKENS)),
                                     _i(a.get(sc.STEP_DECODE_TOKENS)), kernels,
                                     a.get(sc.STEP_TRACE_REASON), _i(a.get(sc.STEP_PREFILL_CACHED_TOKENS)),
                                     *_rank_figures(a, stragglers)))
    named: dict[int, int] = {}
    for summary in summaries:
        if summary.straggler_rank is not None:
            named[summary.straggler_rank] = named.get(summary.straggler_rank, 0) + 1
    request_straggler = min(named, key=lambda r: (-named[r], r)) if named else None
    all_kernels = sorted((k for s in summaries for k in s.kernels), key=lambda k: -k.duration_s)
    slowest_kernel = all_kernels[0] if all_kernels else None
    slowest_sm = None
    for k in all_kernels:
        if k.slowest_sm is not None:
            slowest_sm = SlowestSm(k.instance, k.gpu, k.slowest_sm, k.name, "kernel_span", None)
            break
    # The slowest max_steps steps are shown. Slowest SM, from the first source that knows:
    # the slowest kernel span's slowest_sm attribute here, else (_slowest_sm_from_sm_data)
    # a per-SM exemplar pointing at one of the request's step spans, else the SM whose P99
    # stood out most.
    summaries.sort(key=lambda s: -s.duration_s)
    shown = summaries[:max_steps]
    if not any(s.kernels for s in shown):
        # kernel spans exist for a sampled few steps: when none of the slowest has them,
        # the slowest step that has them is shown too, so the kernels are never hidden
        traced = next((s for s in summaries[max_steps:] if s.kernels), None)
        if traced is not None:
            shown.append(traced)
    for s in shown:
        del s.kernels[max_kernels:]
    reasons = attrs.get(sc.GEN_AI_RESPONSE_FINISH_REASONS)
    if isinstance(reasons, list):
        reasons = reasons[0] if reasons else None
    model = attrs.get(sc.GEN_AI_REQUEST_MODEL, attrs.get(sc.GEN_AI_RESPONSE_MODEL, "unknown"))
    evidence = _evidence(root, spans, steps, phases, e2e, str(attrs.get(sc.REQUEST_PRIORITY, "unknown")), timeline)
    return RequestExplanation(
        trace_id=root.trace_id.hex(), span_id=root.span_id.hex(), name=root.name,
        start_time_unix_nano=root.start_time_unix_nano, end_time_unix_nano=root.end_time_unix_nano,
        model=str(model),
        priority=str(attrs.get(sc.REQUEST_PRIORITY, "unknown")), e2e_s=e2e,
        ttft_s=_f(attrs.get(sc.REQUEST_TTFT_S)), tpot_s=_f(attrs.get(sc.REQUEST_TPOT_S)),
        finish_reason=None if reasons is None else str(reasons), phases=phases,
        prompt_cache=_prompt_cache(attrs, phases.prefill_s), steps_total=len(summaries), steps=shown,
        slowest_kernel=slowest_kernel,
        slowest_sm=slowest_sm, instance=root.instance, straggler_rank=request_straggler,
        straggler_steps=named.get(request_straggler, 0)), {step.span_id for step in steps}, evidence


def _evidence(root: StoredSpan, spans: list[StoredSpan], steps: list[StoredSpan], phases: Phases, e2e: float,
              priority: str, timeline) -> CauseEvidence:
    """What the store shows of the request's lifetime (the per-SM part is added later)."""
    queue = min((s for s in spans if s.name == sc.SPAN_QUEUE), key=lambda s: s.start_time_unix_nano, default=None)
    start, end = root.start_time_unix_nano, root.end_time_unix_nano
    arrival = queue.start_time_unix_nano if queue is not None else start
    left = queue.end_time_unix_nano if queue is not None else arrival + int(phases.queue_s * 1e9)
    decode = [s.start_time_unix_nano for s in spans if s.name == sc.SPAN_DECODE]
    decode_from = min(decode) if decode else None
    usual = timeline.usual(root.instance)
    interference_ns, slowed_ns, counted_to = 0.0, 0.0, 0
    per_token = usual.get("duration_per_token", 0.0)
    if decode_from is not None:
        # its decode steps that carried prefill tokens, or in which a prefill began. An engine
        # that schedules ahead begins a step inside the last, so their spans overlap: each
        # step's excess is the end of its span, and time already counted is not counted again.
        # Others' prefill at its usual cost is interference; a step beyond that ran slow
        for step in sorted(steps, key=lambda s: s.start_time_unix_nano):
            record = step.record()
            prefill = _i(record.attributes.get(sc.STEP_PREFILL_TOKENS)) or 0
            step_start, step_end = record.start_time_unix_nano, record.end_time_unix_nano
            if step_start < decode_from:
                continue
            tokens = prefill + timeline.prefill_begun_inside(step_start, root.instance)
            if tokens > 0:
                batch = _i(record.attributes.get(sc.STEP_DECODE_TOKENS)) or 0
                kv_blocks = _i(record.attributes.get(sc.STEP_KV_BLOCKS_USED)) or 0
                excess = max(0.0, step.duration_s - timeline.decode_only_s(batch, kv_blocks, root.instance))
                new_ns = max(0, step_end - max(step_end - int(excess * 1e9), counted_to))
                priced = min(excess, per_token * tokens) if per_token > 0 else excess
                share = priced / excess if excess > 0 else 1.0
                interference_ns += new_ns * share
                slowed_ns += new_ns * (1.0 - share)
                counted_to = max(counted_to, step_end)
    interference = interference_ns / 1e9
    window = timeline.window(arrival, end, root.instance)
    try:
        rank = float(priority)
    except ValueError:
        rank = math.nan
    return CauseEvidence(
        e2e_s=e2e, queue_s=phases.queue_s, decode_s=phases.decode_s, priority=priority,
        queue=timeline.queue_at(root.trace_id, arrival, left, rank, root.instance), steps=window.steps,
        engine_slowdown=window.slowdown, idle_excess_s=window.idle_excess_s, long_steps_s=window.long_steps_s,
        traced_steps=window.traced,
        traced_near=window.traced_near,
        gpu_slowdown=window.gpu_slowdown, host_slowdown=window.host_slowdown, compiles=window.compiles,
        interference_s=interference, prefill_slowed_s=slowed_ns / 1e9, usual=usual, batch=window.batch,
        kv_blocks=window.kv_blocks, kv_load=window.kv_load,
        traced_slowdown=window.traced_slowdown, host_cpu_slowdown=window.host_cpu_slowdown)


def evidence_sm(sm: SmQuery, start_s: float, end_s: float, instance: str | None,
                cache: dict) -> tuple[list[dict], float | None, float | None, int]:
    """Per-SM evidence of ``[start_s, end_s]``: the SMs the contention tests flagged in the
    slots overlapping it (attention kernels of ``instance``, when it has any), the median
    unflagged SM's CTA P90 then over its median across the window's slots (median over
    kernels), the slowest SM's P90 over that median SM's then, and the most SMs a slot had
    CTAs on.
    ``cache`` keeps each kernel's tests."""
    slot_s = sm.window.slot_s
    keys = [e for e in sm.gpus() if e["instance"] == instance] or sm.gpus()
    flagged, slowdowns, spreads, sm_count = [], [], [], 0
    for e in keys:
        key = (e["instance"], e["gpu"], e["kernel"])
        if key not in cache:
            cache[key] = sm.contention(SmKey(*key), sm.now(), sm.window.horizon_s)
        levels, mine = [], []
        for epoch, slot in cache[key]:
            finite = np.isfinite(slot.p90_s)
            p90 = slot.p90_s[finite]
            if not p90.size:
                continue
            # every SM alike is read on the SMs no test flagged: with a neighbour on half of
            # them, the median SM may be a held one, whose CTAs share it
            unflagged = finite & ~slot.flagged
            level = float(np.median(slot.p90_s[unflagged] if unflagged.any() else p90))
            levels.append(level)
            if epoch * slot_s < end_s and (epoch + 1) * slot_s > start_s:
                mine.append(level)
                sm_count = max(sm_count, len(slot.sms))
                if level > 0:
                    spreads.append(float(p90.max()) / level)
                for i in np.flatnonzero(slot.flagged).tolist():
                    score = float(slot.score[i])
                    flagged.append({"gpu": e["gpu"], "kernel": e["kernel"], "sm": slot.sms[i],
                                    "score": score if math.isfinite(score) else None,
                                    "reasons": slot.reasons(i), "slot_start_unix_s": epoch * slot_s})
        usual = float(np.median(levels)) if levels else 0.0
        if mine and usual > 0:
            slowdowns.append(float(np.median(mine)) / usual)
    return (flagged, float(np.median(slowdowns)) if slowdowns else None,
            float(np.median(spreads)) if spreads else None, sm_count)


def _name_cause(sm: SmQuery, req: RequestExplanation, evidence: CauseEvidence, cache: dict) -> None:
    start_s, end_s = req.start_time_unix_nano / 1e9, req.end_time_unix_nano / 1e9
    evidence.contended_sms, evidence.cta_slowdown, evidence.cta_spread, evidence.sm_count = evidence_sm(
        sm, start_s, end_s, req.instance, cache)
    req.cause = classify(evidence)
    # the contention tests read closed slots only: what of its life lies in the open one
    # has no SM evidence yet, and a cause other than the SMs' may change when it closes
    now_s = sm.now()
    open_from = sm.window.slot_start(now_s)
    untested_s = end_s - max(start_s, open_from)
    if untested_s > 0 and req.cause.name not in (sc.CAUSE_SM_CONTENTION, sc.CAUSE_QUEUEING, sc.CAUSE_COMPILE):
        req.cause.summary += (f"; its last {untested_s:.1f} s lie in a slot still open, whose SMs are tested "
                              f"when it closes (in {open_from + sm.window.slot_s - now_s:.0f} s)")
        req.cause.evidence["sms_untested_s"] = untested_s


def _prompt_cache(attrs, prefill_s: float) -> PromptCache | None:
    """From the server span's input and cache-read token counts; None without both."""
    prompt, cached = _i(attrs.get(sc.GEN_AI_USAGE_INPUT_TOKENS)), _i(attrs.get(sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS))
    if prompt is None or cached is None:
        return None
    return PromptCache(prompt, cached, prompt - cached, cached / prompt if prompt else None, cached > 0,
                       prefill_s)


def _steps_of(store: TraceStore, trace_id: bytes, spans: list[StoredSpan]) -> list[StoredSpan]:
    """The step spans linked from this trace's spans, or linking to them (deduplicated)."""
    found: dict[bytes, StoredSpan] = {}
    for s in spans:
        for linked_trace, linked_span in s.links:
            other = store.get(linked_trace)
            if other is None:
                continue
            for step in other.step_spans:
                step_id = step.span_id
                if step_id == linked_span:
                    found[step_id] = step
    own = {s.span_id for s in spans}
    for other in store.linked(trace_id):
        for step in other.step_spans:
            if any(t == trace_id and sid in own for t, sid in step.links):
                found[step.span_id] = step
    return list(found.values())


def _kernel_summary(span: StoredSpan) -> KernelSummary:
    a = span.attributes
    name = a.get(sc.CUDA_KERNEL_NAME) or span.name[len(sc.SPAN_KERNEL_PREFIX):]
    gpu = a.get(sc.HW_GPU_ID, a.get(sc.CUDA_DEVICE, "unknown"))
    slowest = a.get(sc.KERNEL_SLOWEST_SM)
    if isinstance(slowest, float) and slowest.is_integer():
        slowest = int(slowest)
    return KernelSummary(str(name), str(gpu if not isinstance(gpu, float) else int(gpu)), span.instance,
                         span.duration_s, span.trace_id.hex(), span.span_id.hex(),
                         None if slowest is None else str(slowest), _f(a.get(sc.KERNEL_CTA_SPREAD)))


def _slowest_sm_from_sm_data(sm: SmQuery, req: RequestExplanation,
                             step_ids: set[bytes]) -> SlowestSm | None:
    if step_ids:
        hit = sm.exemplar_for_spans(step_ids)
        if hit is not None:
            key, sm_name, ex = hit
            return SlowestSm(key.instance, key.gpu, sm_name, key.kernel, "sm_exemplar", ex.value)
    # The SM that stood out most (P99 over the median SM's) while the request ran, in the
    # slowest kernel seen if any, else in any kernel with per-SM data then.
    only = None
    if req.slowest_kernel is not None:
        k = req.slowest_kernel
        try:
            only = sm.resolve(k.gpu, k.name[:MAX_LABEL_CHARS], k.instance)  # series keep this much of a name
        except ValueError:
            only = None
    per_key = sm.histograms_between(req.start_time_unix_nano / 1e9, req.end_time_unix_nano / 1e9)
    best = None
    for key, per_sm in per_key.items():
        if only is not None and key != only:
            continue
        summary = hotspots({s: h.quantile(0.99) for s, h in per_sm.items() if h.count})
        for s, value in summary.p99_s.items():
            score = summary.scores[s] if summary.ratio is not None else None
            rank = (score or 0.0, value)
            if best is None or rank > best[0]:
                best = (rank, SlowestSm(key.instance, key.gpu, s, key.kernel, "sm_window", value, score))
    return best[1] if best else None
