"""Why a request was slow, as one cause class with the evidence that named it.

:func:`classify` reads a :class:`CauseEvidence`; first match wins. 1. ``compile``: compiles in its life took >=
``compile_share`` of e2e. 2. ``queueing``: waiting behind others (ahead, overtaking, or a full engine) took >=
``queue_share`` of e2e, more than the engine's slowness added (far beyond the usual load, its traced steps'). 3. The
engine was slow (steps >= ``engine_slow`` x the usual for their kind and tokens, or >= ``corroborated_slow`` x with
evidence of a cause outweighing others' prefill, or idle, far-too-long or (with such evidence) prefill-carrying steps
beyond their cost >= ``idle_share`` of e2e): ``host_stall`` when host evidence (idle, or host time (off the CPU where
recorded) stretching steps >= ``host_slow`` x, or ``host_slow_gpu_usual`` x beside a GPU under ``gpu_slow`` x) meets a
GPU known usual (< ``gpu_slow`` x: traced steps' GPU time, else or where they missed the slowness CTAs), clocked down
(CTAs slower too) or stretched less than the host stretched steps, with idle time or no SM scoring ``sm_score``; else
``sm_contention`` when SMs were flagged (``sm_score`` if the GPU was slower, and starved ones outweighing its CTAs');
``device_contention`` when the GPU was >= ``gpu_slow`` x; ``host_stall`` on host evidence; else ``unknown``. 4.
``prefill_interference`` when others' prefill cost its decode >= ``interference_share`` of e2e. GPU time, CTAs count
under ``FAR_BEYOND`` x the store's upper batch and KV quartiles; step time under ``UNPRICED_KV`` x the KV's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..instrumentation import check_range
from ..instrumentation import semconv as sc
from .engine_timeline import LONG_STEP, TRACED_REACH_S

__all__ = ["Cause", "CauseConfig", "CauseEvidence", "classify"]

# with no cause standing out, the batch is worth naming when the requests beyond the usual
# batch added this share of a usual step to its steps (not for one or two more on a GPU)
BUSIER = 0.1
# a load this many times the usual batch or KV lies beyond what the usual steps' own spread
# can price (a burst of long prompts: 30 requests holding thousands of blocks against one)
FAR_BEYOND = 4.0
# KV this many times the store's upper quartile of decode steps' KV lies beyond the contexts
# a block's cost was measured across: there neither the steps' durations nor their GPU time
# or CTAs (which grow with the context read) can be priced, only the host's time
UNPRICED_KV = 8.0


@dataclass(frozen=True)
class CauseConfig:
    """The rules' thresholds (module docstring); errors name the bad value."""

    engine_slow: float = 1.2
    # a smaller slowdown counts when other evidence names a cause (SMs flagged, host time
    # stretched, GPU work slower) and the engine's excess outweighs others' prefill tokens
    corroborated_slow: float = 1.1
    gpu_slow: float = 1.3
    host_slow: float = 1.5
    # with the GPU's work at its usual speed, a smaller stretch of host time is already a
    # stall: time off the CPU does not grow with the batch (the thread's CPU time does, and
    # is not counted where steps record it), and nothing else is left to slow the steps
    host_slow_gpu_usual: float = 1.2
    idle_share: float = 0.3
    compile_share: float = 0.2
    queue_share: float = 0.5
    interference_share: float = 0.3
    # SMs name the cause when their evidence is strong: a neighbour halves what an SM gets or
    # doubles its CTAs' time; weaker flags beside a slower whole GPU are the GPU's
    sm_score: float = 2.0

    def __post_init__(self) -> None:
        for name in ("engine_slow", "corroborated_slow", "gpu_slow", "host_slow", "host_slow_gpu_usual", "sm_score"):
            check_range(f"CauseConfig.{name}", getattr(self, name), 1.0, 100.0, lo_open=True)
        for name in ("idle_share", "compile_share", "queue_share", "interference_share"):
            check_range(f"CauseConfig.{name}", getattr(self, name), 0.0, 1.0, lo_open=True)


@dataclass
class CauseEvidence:
    """What the spans and per-SM data show about one request's lifetime (arrival to end)."""

    e2e_s: float
    queue_s: float
    decode_s: float
    priority: str
    queue: dict[str, int] | None = None  # at arrival: depth, ahead_more_urgent, overtaken_by
    steps: int = 0  # steps of its engine that ran while it lived
    engine_slowdown: float | None = None  # decode-only steps: mean duration over the usual (WindowSteps)
    idle_excess_s: float = 0.0  # time with no step running, beyond the usual gaps
    long_steps_s: float = 0.0   # time beyond their usual in steps LONG_STEP x it or more (WindowSteps)
    traced_steps: int = 0
    traced_near: int = 0  # under MIN_TRACED traced in its life: the traced steps close to it added
    gpu_slowdown: float | None = None  # traced steps: GPU time over the usual
    # traced steps: 1 + host time beyond its usual / the usual step (where steps record their
    # thread's CPU time, host time off the CPU only: WindowSteps)
    host_slowdown: float | None = None
    compiles: list[dict] = field(default_factory=list)  # steps that compiled kernels
    contended_sms: list[dict] = field(default_factory=list)  # gpu, kernel, sm, score, reasons
    sm_count: int = 0  # SMs with CTAs in its slots (0: not known)
    cta_slowdown: float | None = None  # the median SM's CTA P90 over its usual, attention kernels
    cta_spread: float | None = None  # the slowest SM's CTA P90 over the median SM's, then
    # its decode time, beyond decode-only, in steps with prefill tokens or in which one began
    # (an engine that schedules ahead launches the next step inside this one)
    interference_s: float = 0.0
    # and the time those steps ran beyond others' prefill at its usual cost: the engine's slowness
    prefill_slowed_s: float = 0.0
    usual: dict[str, float] = field(default_factory=dict)  # the usual step compared with
    batch: float | None = None  # its decode-only steps' mean batch (WindowSteps)
    kv_blocks: float | None = None  # and their mean KV blocks in use
    kv_load: float | None = None  # every step's in its life and the traced ones near it (WindowSteps)
    traced_slowdown: float | None = None  # its kernel-traced decode-only steps' own (WindowSteps)
    host_cpu_slowdown: float | None = None  # their engine thread's CPU time in host phases (WindowSteps)


@dataclass
class Cause:
    """The cause named, in a sentence, with the figures behind it and what they were compared with."""

    name: str  # one of semconv.CAUSES
    summary: str
    evidence: dict[str, Any]
    compared_with: str


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def classify(e: CauseEvidence, config: CauseConfig | None = None) -> Cause:
    """The cause of one slow request (module docstring)."""
    c = config or CauseConfig()
    e2e = max(e.e2e_s, 1e-12)
    usual = (f"the usual step of its engine in the collector's store (where most steps lie): decode-only "
             f"{e.usual.get('duration', 0.0) * 1e3:.2f} ms at a batch of {e.usual.get('batch', 0.0):.0f}, plus "
             f"{e.usual.get('duration_per_token', 0.0) * 1e6:.2f} us per prefill token and "
             f"{e.usual.get('per_request', 0.0) * 1e6:.2f} us per request beyond that batch and "
             f"{e.usual.get('per_kv_block', 0.0) * 1e6:.3f} us per KV block beyond "
             f"{e.usual.get('kv_blocks', 0.0):.0f}; a usual "
             f"second's mean decode step {e.usual.get('decode_mean', e.usual.get('duration', 0.0)) * 1e3:.2f} ms"
             + (f"; a kernel-timed decode step's GPU time {e.usual['gpu'] * 1e3:.2f} ms plus "
                f"{e.usual.get('gpu_per_token', 0.0) * 1e6:.2f} us per prefill token (from "
                f"{e.usual.get('gpu_token_steps', 0):.0f} kernel-timed steps with prefill tokens)"
                if e.usual.get("gpu") else ""))
    compile_s = sum(s["duration_s"] for s in e.compiles)
    if e.compiles and compile_s >= c.compile_share * e2e:
        n = sum(s["jit_compiles"] for s in e.compiles)
        return Cause(sc.CAUSE_COMPILE, f"{n} kernel compile(s) while serving: step(s) "
                     f"{', '.join(str(s['step_id']) for s in e.compiles)} took {compile_s * 1e3:.0f} ms "
                     f"of its {e2e * 1e3:.0f} ms", {"compile_steps": e.compiles, "compile_s": compile_s},
                     "its end-to-end latency")
    usual_batch, usual_kv = e.usual.get("batch", 0.0), e.usual.get("kv_blocks", 0.0)
    engine = {"engine_slowdown": e.engine_slowdown, "steps": e.steps, "idle_excess_s": e.idle_excess_s,
              "long_steps_s": e.long_steps_s, "batch": e.batch, "usual_batch": usual_batch,
              "kv_blocks": e.kv_blocks, "kv_load": e.kv_load, "usual_kv_blocks": usual_kv,
              "traced_slowdown": e.traced_slowdown,
              **({"host_cpu_slowdown": e.host_cpu_slowdown} if e.host_cpu_slowdown is not None else {}),
              **({"prefill_slowed_s": e.prefill_slowed_s} if e.prefill_slowed_s > 0 else {})}
    # beyond the contexts the store prices, the steps' durations (long steps included), GPU
    # time and CTAs say how heavy they were: only the host's time says how slow
    unpriced = _unpriced(e)
    steps_slowdown = min(e.engine_slowdown or 1.0, e.host_slowdown or 1.0) if unpriced else e.engine_slowdown
    # a slow engine stretches its wait too: of the wait, queue_s / slowdown is the queue's own;
    # the engine added (e2e - idle) x (1 - 1 / slowdown) plus the idle time
    slowdown = max(steps_slowdown or 1.0, 1.0)
    # the engine not stepping, or one step far too long
    stalled_s = e.idle_excess_s + (0.0 if unpriced else e.long_steps_s)
    engine_excess_s = stalled_s + max(e2e - stalled_s, 0.0) * (1.0 - 1.0 / slowdown) + e.prefill_slowed_s
    # far beyond the usual load (a burst's batch and KV) the usual steps' spread cannot price
    # a step: there the traced steps, which time the GPU's work and the host's, say how fast
    # the engine ran, and the steps' durations only how heavy they were
    heavier = not unpriced and _heavier_not_slower(e, c)
    wait_slowdown = min(slowdown, max(e.gpu_slowdown or 1.0, e.host_slowdown or 1.0, 1.0)) if heavier else slowdown
    wait_excess_s = stalled_s + max(e2e - stalled_s, 0.0) * (1.0 - 1.0 / wait_slowdown)
    # a wait is the queue's when others waited ahead, overtook it, or filled the engine; with
    # none of those the engine was not taking work (a long step, a stalled loop)
    q = e.queue or {}
    behind_others = e.queue is None or bool(q.get("depth") or q.get("overtaken_by") or q.get("engine_full"))
    if e.queue_s >= c.queue_share * e2e and e.queue_s / wait_slowdown > wait_excess_s and behind_others:
        heavy = (_unpriced_clause(e) if unpriced and slowdown < (e.engine_slowdown or 1.0) else
                 _heavier(e, usual_batch, usual_kv) if heavier and wait_slowdown < slowdown else "")
        return Cause(sc.CAUSE_QUEUEING,
                     f"waited {e.queue_s * 1e3:.0f} ms of {e2e * 1e3:.0f} ms in the queue (priority {e.priority}; "
                     f"{q.get('depth', '?')} waiting when it arrived, {q.get('ahead_more_urgent', '?')} more urgent; "
                     f"{q.get('overtaken_by', '?')} more urgent arrived later and went first){heavy}",
                     {"queue_s": e.queue_s, "priority": e.priority, **q, **engine,
                      **({"gpu_slowdown": e.gpu_slowdown, "host_slowdown": e.host_slowdown,
                          "traced_steps": e.traced_steps} if heavy else {})},
                     "its end-to-end latency; the requests in the collector's store")
    # the step's GPU time says whether the GPU's work slowed; CTA durations alone (no traced
    # step) are weaker: a GPU left idle by its host clocks down, and its CTAs then run longer.
    # Traced steps that missed the slowness (a hog that comes and goes between them) do not
    # speak for the GPU; the CTAs, timed in every probed step, then do, but only for steps slow
    # on their own: a CTA's time grows with the context it reads, which the steps' usual prices
    # and the CTAs' does not, so CTAs must not be what makes a request's steps count as slow
    missed = _missed(e) if e.cta_slowdown is not None and (e.engine_slowdown or 0.0) >= c.engine_slow else ""
    # GPU time and CTAs are read against the usual priced for their load, which costs measured
    # across the store's batches and contexts price only near them: ``FAR_BEYOND`` x the upper
    # quartile of both (a surge), they cannot say that the device was slower. SMs against each
    # other in the same slot, and the host's time, need no price and still speak
    surge = _surge(e)
    gpu_unpriced = unpriced or surge
    traced_gpu = None if gpu_unpriced else _within_steps(e, e.gpu_slowdown)
    gpu = None if gpu_unpriced else _within_steps(e, e.cta_slowdown) if e.gpu_slowdown is None or missed else traced_gpu
    host = e.host_slowdown or 0.0
    host_side = (e.idle_excess_s >= c.idle_share * e2e or host >= c.host_slow
                 or (gpu is not None and gpu < c.gpu_slow and host >= c.host_slow_gpu_usual))
    strong = [s for s in e.contended_sms if (s["score"] or 0.0) >= c.sm_score]
    named = bool(e.contended_sms) or host_side or (gpu is not None and gpu >= c.gpu_slow)
    slow = ((steps_slowdown or 0.0) >= c.engine_slow or stalled_s >= c.idle_share * e2e
            or ((steps_slowdown or 0.0) >= c.corroborated_slow and named and engine_excess_s >= e.interference_s)
            or (named and not unpriced and _carried_slow(e, c)))
    if slow:
        # with the GPU's work at its usual speed, the host's evidence wins over SM flags unless
        # one is strong and the GPU idle time that would show a stall is missing
        idle = e.idle_excess_s >= c.idle_share * e2e
        # a GPU its host left idle clocks down: then its CTAs, not only its steps, run slower,
        # and by about as much: a clock slows a step's kernels and their CTAs alike. GPU time
        # beyond the CTAs' slowdown at the margin is time the GPU ran other work (another
        # process time-slicing the GPU, memory traffic that slows CTAs less than it spaces them)
        cta = e.cta_slowdown or 0.0
        clocked_down = gpu is not None and gpu >= c.gpu_slow and cta >= c.gpu_slow and gpu <= cta * c.gpu_slow
        # host time stretched the steps more than GPU time did (the GPU's share of a step is
        # at most the whole step, so gpu - 1 bounds its excess from above in those units)
        host_more = gpu is not None and (e.host_slowdown or 0.0) >= max(gpu, c.host_slow)
        if host_side and gpu is not None and (gpu < c.gpu_slow or clocked_down or host_more) \
                and (idle or not strong):
            return _host_stall(e, c, engine, usual)
        if (strong or (e.contended_sms and not (gpu is not None and gpu >= c.gpu_slow))) \
                and not _beyond_flagged_sms(e, c, traced_gpu):
            sms = sorted({(s["gpu"], s["sm"]) for s in e.contended_sms}, key=lambda g: (g[0], int(g[1])
                                                                                     if g[1].isdigit() else 0))
            top = max(e.contended_sms, key=lambda s: s["score"] or 0.0)
            return Cause(sc.CAUSE_SM_CONTENTION,
                         f"{_steps(e, c)} while {len(sms)} SM(s) ran slow or starved "
                         f"against the kernel's other SMs (SM {top['sm']} of {top['kernel']}, score "
                         f"{(top['score'] or 0.0):.2f})",
                         {**engine, "contended_sms": e.contended_sms, "sms": [sm for _, sm in sms],
                          "gpu_slowdown": e.gpu_slowdown, "cta_slowdown": e.cta_slowdown, "sm_count": e.sm_count},
                         f"{usual}; each SM against the kernel's other SMs in the same slots")
        if gpu is not None and gpu >= c.gpu_slow:
            return Cause(sc.CAUSE_DEVICE_CONTENTION,
                         f"{_steps(e, c)} with GPU work slower on every SM "
                         f"(GPU time per step {_x(e.gpu_slowdown)}, median SM's CTA P90 {_x(e.cta_slowdown)}; "
                         f"per-SM spread {_x(e.cta_spread)}, {_flagged(e)}){_near(e)}"
                         + (f"{missed}, and the CTAs, timed in every probed step, speak for the GPU"
                            if missed else ""),
                         {**engine, "gpu_slowdown": e.gpu_slowdown, "cta_slowdown": e.cta_slowdown,
                          "cta_spread": e.cta_spread, "host_slowdown": e.host_slowdown,
                          "traced_steps": e.traced_steps, "traced_near": e.traced_near,
                          "flagged_sms": len(_distinct_flags(e)),
                          "sm_count": e.sm_count, **({"contended_sms": e.contended_sms} if e.contended_sms else {})},
                         f"{usual}; GPU time and CTA durations against where most of the store's and window's lie")
        if host_side:
            return _host_stall(e, c, engine, usual)
        # no traced step and no CTA figures (trace level below kernels, or no GPU): nothing to weigh
        blind = e.gpu_slowdown is None and e.host_slowdown is None and e.cta_slowdown is None
        why = ("no kernel-traced step or CTA timing covers its life, so its GPU and host time are not known"
               if blind else "neither the GPU's nor the host's evidence says why" + _missed(e)
               + (_surge_clause(e) if surge and not unpriced else _heavier(e, usual_batch, usual_kv) if heavier
                  else ""))
        return Cause(sc.CAUSE_UNKNOWN, f"the engine was slower ({_steps(e, c)}) but {why}",
                     {**engine, "queue_s": e.queue_s, "traced_steps": e.traced_steps, "traced_near": e.traced_near,
                      "gpu_slowdown": e.gpu_slowdown, "host_slowdown": e.host_slowdown,
                      "cta_slowdown": e.cta_slowdown}, usual)
    if e.interference_s >= c.interference_share * e2e:
        return Cause(sc.CAUSE_PREFILL_INTERFERENCE,
                     f"its decode steps carried or waited on other requests' prefill: {e.interference_s * 1e3:.0f} ms of "
                     f"its {e.decode_s * 1e3:.0f} ms of decode beyond what decode-only steps take",
                     {"interference_s": e.interference_s, "decode_s": e.decode_s, **engine}, usual)
    # what was weighed, so that a reader can see how close each rule came
    added_s = (e.usual.get("per_request", 0.0) * max(0.0, (e.batch or 0.0) - usual_batch)
               + e.usual.get("per_kv_block", 0.0) * max(0.0, (e.kv_blocks or 0.0) - usual_kv))
    busier = (f" for their load ({e.batch or 0.0:.0f} requests{_holding(e.kv_blocks)}, usually "
              f"{usual_batch:.0f}{_holding(usual_kv)}: the engine was busier, not slower)"
              if added_s > 0 and added_s >= BUSIER * e.usual.get("duration", 0.0) else "")
    steps = f"{_unpriced_clause(e)}," if unpriced else f": {_under_slow(e, c, host_side, gpu, busier)}"
    return Cause(sc.CAUSE_UNKNOWN, f"no cause stands out{steps} and it did not wait long",
                 {**engine, "queue_s": e.queue_s, "traced_steps": e.traced_steps, "traced_near": e.traced_near,
                  "gpu_slowdown": e.gpu_slowdown, "host_slowdown": e.host_slowdown, "cta_slowdown": e.cta_slowdown,
                  "flagged_sms": len(_distinct_flags(e)), "interference_s": e.interference_s}, usual)


def _under_slow(e: CauseEvidence, c: CauseConfig, host_side: bool, gpu: float | None, busier: str) -> str:
    """How its steps ran against their usual (``busier``: for their load, where that added
    much), and which bar they stayed under: ``engine_slow`` alone, ``corroborated_slow`` beside
    the evidence that names a cause (classify's: SMs flagged, ``host_side``, the GPU at
    ``gpu_slow``), or others' prefill outweighing them (three decimals: 1.096x is under 1.1x)."""
    s = e.engine_slowdown
    if s is None or s <= 1.0:
        return f"its steps took the usual time{busier}"
    ran = f"its steps ran {s:.3f}x the usual{busier}"
    found = ([f"{len(_distinct_flags(e))} SM(s) flagged"] if e.contended_sms else []) \
        + ([f"host time {_x(e.host_slowdown)}"] if host_side else []) \
        + ([f"GPU time {_x(gpu)}"] if gpu is not None and gpu >= c.gpu_slow else [])
    if not found:
        return f"{ran}, under the {c.engine_slow:g}x that counts as slow with nothing naming a cause"
    if s < c.corroborated_slow:
        return f"{ran}, under the {c.corroborated_slow:g}x that counts as slow beside evidence ({', '.join(found)})"
    return f"{ran}, less than others' prefill in its steps added"


def _within_steps(e: CauseEvidence, gpu: float | None) -> float | None:
    """A GPU slowdown (its traced steps', or its CTAs'), at most what its own steps' slowdown
    leaves room for: a step's GPU time is part of the step, so its excess per step cannot
    exceed the steps'. Traced steps are a sample (or, for a short life, steps near it), and
    one outlier among them (a step its own steps did not share) would otherwise speak for all
    of its steps; CTAs are every request's on the GPU then (others' long prompts among them)."""
    usual_gpu = e.usual.get("gpu", 0.0)
    if gpu is None or e.engine_slowdown is None or usual_gpu <= 0:
        return gpu
    step = e.usual.get("decode_mean", e.usual.get("duration", 0.0))
    return min(gpu, 1.0 + max(e.engine_slowdown - 1.0, 0.0) * step / usual_gpu)


def _heavier_not_slower(e: CauseEvidence, c: CauseConfig) -> bool:
    """Whether its decode steps carried ``FAR_BEYOND`` x the usual batch or KV or more while
    its traced steps' GPU time and host time stayed under their thresholds."""
    far = ((e.batch or 0.0) >= FAR_BEYOND * max(e.usual.get("batch", 0.0), 1.0)
           or (e.kv_blocks or 0.0) >= FAR_BEYOND * max(e.usual.get("kv_blocks", 0.0), 1.0))
    return (far and e.gpu_slowdown is not None and e.host_slowdown is not None
            and e.gpu_slowdown < c.gpu_slow and e.host_slowdown < c.host_slow)


def _unpriced(e: CauseEvidence) -> bool:
    """Whether its decode steps, or the steps in its life and the traced ones read for its GPU,
    held ``UNPRICED_KV`` x the store's upper quartile of KV or more (never where the usual
    does not say: a store before steps recorded their KV)."""
    return _beyond_priced(e, UNPRICED_KV)


def _surge(e: CauseEvidence) -> bool:
    """Whether its steps decoded ``FAR_BEYOND`` x the store's upper quartile of batch or more while
    holding as many times its upper quartile of KV: a load the usual step's costs do not price."""
    return _beyond_priced(e, FAR_BEYOND) and (e.batch or 0.0) >= FAR_BEYOND * max(
        e.usual.get("batch_upper", math.inf), 1.0)


def _beyond_priced(e: CauseEvidence, times: float) -> bool:
    """Whether its steps held ``times`` x the store's upper quartile of KV or more (_unpriced)."""
    upper = e.usual.get("kv_upper", 0.0)
    return upper > 0 and _kv(e) >= times * upper


def _kv(e: CauseEvidence) -> float:
    """The KV blocks its steps held: its decode-only steps', or its life's where more."""
    return max(e.kv_blocks or 0.0, e.kv_load or 0.0)


def _unpriced_clause(e: CauseEvidence) -> str:
    """The clause that says its steps' load lay beyond what the store prices."""
    return (f"; its steps held {_kv(e):.0f} KV blocks ({e.batch or 0.0:.0f} requests decoded), "
            f"{_kv(e) / e.usual['kv_upper']:.0f}x the upper quartile of the store's steps "
            f"({e.usual['kv_upper']:.0f}), beyond the contexts a block's cost was measured across: their "
            f"duration, GPU time ({_x(e.gpu_slowdown)}) and CTAs ({_x(e.cta_slowdown)}) say how heavy they "
            f"were, not how slow, and their host time {_x(e.host_slowdown)} its usual")


def _surge_clause(e: CauseEvidence) -> str:
    """The clause that says its steps' load lay too far beyond the store's for their GPU time to be priced."""
    return (f": its steps decoded {e.batch or 0.0:.0f} requests holding {_kv(e):.0f} KV blocks, "
            f"{(e.batch or 0.0) / max(e.usual['batch_upper'], 1.0):.1f}x and {_kv(e) / e.usual['kv_upper']:.1f}x "
            f"the upper quartiles of the store's steps ({e.usual['batch_upper']:.0f}, {e.usual['kv_upper']:.0f}), "
            f"beyond the load the usual was measured across: their GPU time ({_x(e.gpu_slowdown)}) and CTAs "
            f"({_x(e.cta_slowdown)}) say how heavy they were, not whether the device was slower, and their host "
            f"time was {_x(e.host_slowdown)} its usual")


def _heavier(e: CauseEvidence, usual_batch: float, usual_kv: float) -> str:
    """The clause that says its steps carried more, with their GPU and host figures."""
    figures = (f"GPU time per step {_x(e.gpu_slowdown)} and host time {_x(e.host_slowdown)}"
               if e.host_cpu_slowdown is None else
               f"GPU time per step {_x(e.gpu_slowdown)}, host time off the CPU {_x(e.host_slowdown)} and the "
               f"engine thread's CPU time per step {_x(e.host_cpu_slowdown)}")
    return (f"; its steps ran heavier, not slower: {e.batch or 0.0:.0f} requests{_holding(e.kv_blocks)} "
            f"(usually {usual_batch:.0f}{_holding(usual_kv)}), {figures} their usual")


def _holding(kv_blocks: float | None) -> str:
    return f" holding {kv_blocks:.0f} KV blocks" if kv_blocks else ""


def _carried_slow(e: CauseEvidence, c: CauseConfig) -> bool:
    """Whether steps that carried others' prefill ran beyond that prefill's usual cost for
    ``idle_share`` of its life or more: the engine's slowness the decode-only yardstick leaves out."""
    return e.prefill_slowed_s >= c.idle_share * max(e.e2e_s, 1e-12)


def _steps(e: CauseEvidence, c: CauseConfig) -> str:
    """How slow its steps were: their slowdown, the time in steps far beyond their usual, and
    (where it counts) the time steps with others' prefill ran beyond that prefill's cost."""
    long = (f" ({e.long_steps_s * 1e3:.0f} ms in steps {LONG_STEP:g}x their usual or more)"
            if e.long_steps_s > 0 else "")
    carried = (f", and {e.prefill_slowed_s * 1e3:.0f} ms beyond the usual cost of others' prefill in the steps "
               f"that carried it" if _carried_slow(e, c) else "")
    return f"steps {_x(e.engine_slowdown)} the usual{long}{carried}"


def _beyond_flagged_sms(e: CauseEvidence, c: CauseConfig, gpu: float | None) -> bool:
    """Whether the traced steps' GPU time (``gpu``: its slowdown, _within_steps) grew more than
    SMs flagged only as starved explain. The block scheduler gives a starved SM's share to the others: losing a fraction f of the
    SMs costs a kernel whose grid filled them in one wave ceil(1 / (1 - f)) waves (2 for any
    f up to a half), and one of many waves 1 / (1 - f). With the median SM's CTA slowdown
    known, the GPU's slowdown is that device-wide factor times the SMs' (at most the waves):
    the device's when its factor is the larger or the two cannot reach it; without it, the
    many-waves bound. (A slow SM's CTAs hold their kernel up by their own slowdown: no bound.)"""
    if gpu is None or gpu < c.gpu_slow or not e.sm_count:
        return False
    if any("slow" in (s.get("reasons") or ()) for s in e.contended_sms):
        return False
    flags = _distinct_flags(e)
    kernels = len({(g, kernel) for g, kernel, _ in flags}) or 1
    lost = min(len(flags) / kernels / e.sm_count, 0.99)  # the flagged share of one kernel's SMs
    if e.cta_slowdown is None:
        return gpu >= c.gpu_slow / (1.0 - lost)
    per_cta = max(e.cta_slowdown, 1.0)
    return per_cta * per_cta >= gpu or gpu >= c.gpu_slow * per_cta * math.ceil(1.0 / (1.0 - lost))


def _distinct_flags(e: CauseEvidence) -> set[tuple[str, str, str]]:
    """The (gpu, kernel, SM) flagged in any of its slots."""
    return {(s["gpu"], s["kernel"], s["sm"]) for s in e.contended_sms}


def _flagged(e: CauseEvidence) -> str:
    n = len(_distinct_flags(e))
    return "no SM flagged" if not n else (f"{n} SM(s) flagged starved of {e.sm_count}, explaining less of that "
                                          "slowdown than every SM's CTAs or too little of it")


def _missed(e: CauseEvidence) -> str:
    """Where its kernel-traced decode steps ran well under its steps' slowdown (under half of
    its excess), so that their GPU and host time could not say where the time went."""
    traced, slowdown = e.traced_slowdown, e.engine_slowdown or 1.0
    if traced is None or slowdown <= 1.0 or traced - 1.0 >= 0.5 * (slowdown - 1.0):
        return ""
    return (f": its kernel-traced decode steps ran {_x(traced)} the usual where its decode steps ran "
            f"{_x(slowdown)}, so the traced ones missed the slowness")


def _near(e: CauseEvidence) -> str:
    """Where the GPU and host figures came from when few steps of its life were traced."""
    return (f"; from its {e.traced_steps} traced step(s) and {e.traced_near} within "
            f"{TRACED_REACH_S:g} s of its life" if e.traced_near else "")


def _host_stall(e: CauseEvidence, c: CauseConfig, engine: dict, usual: str) -> Cause:
    """The ``host_stall`` cause, with the host's and the GPU's figures."""
    off = (f"its engine thread spent off the CPU (its own CPU time {_x(e.host_cpu_slowdown)} the usual) "
           if e.host_cpu_slowdown is not None else "")
    return Cause(sc.CAUSE_HOST_STALL,
                 f"{_steps(e, c)} while the GPU's work was not "
                 f"(GPU time per step {_x(e.gpu_slowdown)}, CTA P90 {_x(e.cta_slowdown)}); host time {off}beyond "
                 f"its usual stretched kernel-timed steps {_x(e.host_slowdown)}, {e.idle_excess_s * 1e3:.0f} ms "
                 f"with no step running beyond the usual gaps{_near(e)}",
                 {**engine, "gpu_slowdown": e.gpu_slowdown, "cta_slowdown": e.cta_slowdown,
                  "host_slowdown": e.host_slowdown, "traced_steps": e.traced_steps, "traced_near": e.traced_near},
                 f"{usual}; a kernel-timed decode step's host time {e.usual.get('host', 0.0) * 1e3:.2f} ms "
                 f"plus {e.usual.get('host_per_token', 0.0) * 1e6:.2f} us per prefill token"
                 + (f" ({e.usual['host_off'] * 1e3:.2f} ms of a step's off the CPU)" if "host_off" in e.usual else "")
                 + f", and gap {e.usual.get('gap', 0.0) * 1e3:.2f} ms")
