"""The engine's recent steps and queue, as facts decoded once from the trace store.

:class:`EngineTimeline` turns the store's ``engine.step`` spans (kind, tokens, compiles, and
for a traced step the GPU time of its kernels) and its request roots (arrival, time in the
queue, priority) into arrays that ``explain`` queries by time: which steps ran while a
request lived, how long they took against what a step of that kind and size (prefill tokens,
requests decoded and KV blocks held beyond the usual) usually takes on its engine in the store (where
most of its steps lie: the median of their densest half; for its decode-only steps, their
mean against a usual second's, so that a stall on a minority of them counts), the time
with no step running, and how many requests waited when one arrived.
Guarantee: only what the store holds is counted; a span is decoded once, again only when
its trace grew. Cost: one protobuf decode per new step, kernel and queue span per
:meth:`refresh` (under the store's lock), then O(steps) numpy per query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..instrumentation import semconv as sc

__all__ = ["KINDS", "EngineTimeline", "QueueEntry", "StepFacts", "WindowSteps", "step_facts", "usual_value"]

KINDS = ("decode", "prefill", "mixed")  # a step's tokens: decode only, prefill only, both
_KERNEL, _SUMMARY = sc.SPAN_KERNEL_PREFIX, sc.SPAN_KERNEL_SUMMARY_PREFIX
_MIN_PREFILL_FOR_COST = 16  # steps with fewer prefill tokens say little about a token's cost
# A window with few traced steps (a short request, 1 step in 50 traced) adds the GPU and
# host time of the traced steps this close to it: contention or a stall lasts seconds, and
# one or two steps may miss a stall that holds the host part of the time
TRACED_REACH_S = 1.0
MIN_TRACED = 3   # fewer traced steps in a window than this: those within reach join them
_MIN_SECOND_STEPS = 4   # a second with fewer clean decode steps says little about their mean
_MIN_SLOPE_STEPS = 20   # a quarter of the decode steps with fewer says little about a KV block's cost
_SLOPE_POINTS = 256   # a per-token slope from the newest steps with prefill: 32,640 pairs
_SLOPE_LENGTHS = 3   # fewer distinct prompt lengths do not make a line
# A step this many times its usual stalled the engine (a neighbour's launch, a wait on a
# lock): beyond any misfit of the per-token line (mixed steps with few prefill tokens run
# up to about twice it), and a mean over the request's other steps would hide it
LONG_STEP = 4.0


def usual_value(values: np.ndarray, default: float = float("nan")) -> float:
    """Where most of ``values`` lie: the median of their shortest half (the densest half of
    the sorted values). A slowdown in fewer than half of the steps leaves it where the
    others are, where a plain median would move toward the slow ones."""
    x = np.sort(values[np.isfinite(values)])
    if not x.size:
        return default
    half = (x.size + 1) // 2
    widths = x[half - 1:] - x[:x.size - half + 1]
    i = int(np.argmin(widths))
    return float(np.median(x[i:i + half]))


def _prefill_begun_inside(a: dict[str, np.ndarray]) -> np.ndarray:
    """Per step (``a`` sorted by start), the prefill tokens of its engine's steps that began
    inside its span: an engine that schedules ahead launches the next step before it
    completes this one, and a prefill's launches then stretch this step (others' prefill,
    not slowness). A step with none is undisturbed."""
    inside = np.zeros(len(a["start"]), dtype=np.int64)
    for instance in set(a["instance"].tolist()):
        mine = np.flatnonzero(a["instance"] == instance)
        # prefilled[j]: prefill tokens of the instance's first j steps
        prefilled = np.concatenate(([0], np.cumsum(np.maximum(a["prefill"][mine], 0))))
        # its steps i+1 .. k-1 began inside step i (k: the first to begin at or after its end)
        after = np.arange(len(mine)) + 1
        k = np.maximum(np.searchsorted(a["start"][mine], a["end"][mine], side="left"), after)
        inside[mine] = prefilled[k] - prefilled[after]
    return inside


def _usual_mean(a: dict[str, np.ndarray], durations: np.ndarray, default: float) -> float:
    """A usual second's mean decode step (undisturbed ones, see _prefill_begun_inside; ``durations``:
    each step's at the usual batch): where most of the per-second means lie. Step times are
    skewed (a few long ones in any second), so a request's mean step is held against this,
    not against the usual step."""
    clean = a["clean"]
    if not clean.any():
        return default
    _, inverse = np.unique(a["start"][clean] // 1_000_000_000, return_inverse=True)
    counts = np.bincount(inverse)
    means = np.bincount(inverse, weights=durations[clean]) / counts
    return usual_value(means[counts >= _MIN_SECOND_STEPS], default)


def _beyond(values, usual: float):
    """How far ``values`` (requests decoded, KV blocks held) lie beyond the usual (none at
    or under it)."""
    return np.maximum(0.0, np.asarray(values, dtype=np.float64) - usual)


def _load_s(u: dict[str, float], decode_tokens, kv_blocks):
    """What a step's load beyond the usual adds to it: its requests beyond the usual batch,
    and the KV blocks its decode reads beyond the usual (0 where the store had no spread)."""
    return (u["per_request"] * _beyond(decode_tokens, u["batch"])
            + u["per_kv_block"] * _beyond(kv_blocks, u["kv_blocks"]))


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    """How much ``y`` grows per unit of ``x``, robustly: the medians of ``y`` in the lowest
    and the highest quarter of ``x``, over their ``x`` medians (slow steps in under half of
    either quarter leave it); 0 with too few values or no spread in ``x``, never below 0."""
    if x.size < 4 * _MIN_SLOPE_STEPS:
        return 0.0
    q1, q3 = np.quantile(x, [0.25, 0.75])
    low, high = x <= q1, x >= q3
    rise = float(np.median(x[high]) - np.median(x[low]))
    if low.sum() < _MIN_SLOPE_STEPS or high.sum() < _MIN_SLOPE_STEPS or rise <= 0:
        return 0.0
    return max(0.0, float(np.median(y[high]) - np.median(y[low])) / rise)


def _per_unit(x: np.ndarray, y: np.ndarray) -> float:
    """How much ``y`` grows per unit of ``x``: the median of the slopes between every two
    points of distinct ``x`` (Theil-Sen: slow points in under about three in ten leave it).
    Cost: the square of the points."""
    finite = np.isfinite(y)
    x, y = x[finite], y[finite]
    i, j = np.triu_indices(x.size, k=1)
    apart = x[j] != x[i]
    i, j = i[apart], j[apart]
    return float(np.median((y[j] - y[i]) / (x[j] - x[i])))


def _number(value, default=0.0) -> float:
    try:
        return float(value) if value is not None else default
    except (TypeError, ValueError):
        return default


@dataclass(slots=True)
class StepFacts:
    """One ``engine.step`` span, decoded."""

    start_ns: int
    end_ns: int
    kind: int  # index into KINDS
    prefill_tokens: int
    decode_tokens: int
    kv_blocks: int  # KV blocks in use when it ran: what its decode attention reads (0: not known)
    jit_compiles: int
    gpu_s: float  # GPU time of its traced kernels (NaN: its kernels were not traced); see step_facts
    host_s: float  # host time of a traced step (NaN: not traced); see step_facts
    step_id: int | None
    instance: str
    # traced by the random draw at the usual ratio or as the first prefill step in an
    # interval (not after a slow step, not in a slow spell): what the usual GPU and host
    # time are taken from
    usual_sample: bool = True
    # the engine thread's CPU time in its host phases (NaN: not traced, or not recorded);
    # host time beyond it is time the thread was kept off the CPU
    host_cpu_s: float = float("nan")
    # where the host came to wait for its GPU only after the GPU had finished: from when it
    # finished (``late_from_ns``) to the wait (``wait_ns``); 0: not recorded, or not late
    late_from_ns: int = 0
    wait_ns: int = 0


@dataclass(slots=True)
class QueueEntry:
    """A stored request's wait: when it arrived, when the scheduler took it, its priority."""

    trace_id: bytes
    arrival_ns: int
    left_ns: int
    priority: float  # lower is more urgent (NaN: not known)
    instance: str


def step_facts(trace, step) -> StepFacts:
    """A step's facts. Its GPU time: for a CUDA graph replay, from its first kernel's start to
    its last one's end, so that work the GPU ran between them (another process's kernels,
    time-sliced in) counts as the GPU's and not the host's; an eager step's kernels wait on
    the host's launches, so there it is their summed time. Its host time: for a replay, from
    its last kernel's end to the step's end (how late the host saw the GPU finish; the wait
    before the first kernel is the GPU's queue, which another process fills); for an eager
    step, the step's time beyond its kernels' (the launches pace it). Where the kernel spans
    say when the launch calls returned, host time is until the last one returned, plus the
    step's end beyond the launches, the kernels and when the engine began waiting for it (a
    host that issued everything early, then waited on a GPU another process held, is not
    slow; nor one that launched the next step first; where it came to the wait after the GPU
    had finished, the timeline adds the time until the next step began: _late_s), and GPU
    time is its kernels' time before that return plus all of the time from it to the last
    kernel's end: once everything is issued, a gap between kernels is the GPU's (another
    process's work, time-sliced in), replay or eager."""
    record = step.record()
    a = record.attributes
    prefill, decode = int(_number(a.get(sc.STEP_PREFILL_TOKENS))), int(_number(a.get(sc.STEP_DECODE_TOKENS)))
    kind = 0 if prefill == 0 else (1 if decode == 0 else 2)
    busy, first, last = 0.0, None, None   # first is None: its kernels were not traced
    launched = 0   # when the step's last launch call returned (0: not recorded)
    kernels = []   # (start, end, busy seconds) per kernel or summary span
    own = bytes.fromhex(record.span_id)
    for span in trace.spans:
        name = span.name
        if not (name.startswith(_KERNEL) or name.startswith(_SUMMARY)) or span.parent_span_id != own:
            continue
        # a summary: many launches, their summed time, not the span's extent
        time_s = (_number(span.attributes.get(sc.KERNEL_TOTAL_DURATION_S), span.duration_s)
                  if name.startswith(_SUMMARY) else span.duration_s)
        busy += time_s
        launched = max(launched, int(_number(span.attributes.get(sc.KERNEL_LAUNCH_END_NS))))
        start, end = span.start_time_unix_nano, span.end_time_unix_nano
        kernels.append((start, end, time_s))
        first = start if first is None else min(first, start)
        last = end if last is None else max(last, end)
    duration = max(0, record.end_time_unix_nano - record.start_time_unix_nano) / 1e9
    graph = bool(a.get(sc.STEP_CUDA_GRAPH)) and first is not None and last > first
    late_from = wait = 0
    if first is None:
        gpu = host = float("nan")
    elif launched > record.start_time_unix_nano:
        gpu = _busy_before(kernels, launched) + max(0, last - launched) / 1e9
        waited = int(_number(a.get(sc.STEP_WAIT_START_NS)))   # 0: not recorded
        tail = max(0, record.end_time_unix_nano - max(last, launched, waited))
        host = (min(launched, record.end_time_unix_nano) - record.start_time_unix_nano + tail) / 1e9
        if min(waited, record.end_time_unix_nano) > max(last, launched):   # see _late_s
            late_from, wait = max(last, launched), min(waited, record.end_time_unix_nano)
    elif graph:
        gpu, host = (last - first) / 1e9, max(0, record.end_time_unix_nano - last) / 1e9
    else:
        gpu, host = busy, duration - busy
    step_id = a.get(sc.STEP_ID)
    reason = a.get(sc.STEP_TRACE_REASON)
    return StepFacts(record.start_time_unix_nano, record.end_time_unix_nano, kind, prefill, decode,
                     int(_number(a.get(sc.STEP_KV_BLOCKS_USED))), int(_number(a.get(sc.STEP_JIT_COMPILES))),
                     gpu, host,
                     int(_number(step_id)) if step_id is not None else None, step.instance,
                     reason in (None, sc.TRACE_REASON_SAMPLED, sc.TRACE_REASON_PREFILL),
                     _cpu_seconds(a.get(sc.STEP_HOST_CPU_S)) if first is not None else float("nan"),
                     late_from, wait)


def _late_s(a: dict[str, np.ndarray]) -> np.ndarray:
    """Per step (``a`` sorted by start), host time missing from step_facts': where the host
    came to wait for its GPU only after the GPU had finished, the time from the GPU's end to
    that wait or to the next step's start, whichever came first. Before the next step began,
    the loop held the GPU idle (a thread holding the GIL, a stalled output path); after, the
    next step's launches ran, which are that step's host time, not this one's."""
    late = np.zeros(len(a["start"]))
    for instance in set(a["instance"].tolist()):
        own = a["instance"] == instance
        mine = np.flatnonzero(own & (a["wait"] > 0))
        if not mine.size:
            continue
        starts = a["start"][own]
        # the first step of the instance to start after each one
        following = starts[np.minimum(np.searchsorted(starts, a["start"][mine], side="right"), starts.size - 1)]
        following = np.where(following > a["start"][mine], following, np.iinfo(np.int64).max)
        late[mine] = np.maximum(0, np.minimum(a["wait"][mine], following) - a["late_from"][mine]) / 1e9
    return late


def _cpu_seconds(value) -> float:
    """A step's recorded CPU time, NaN where absent or not a time (negative, not finite)."""
    seconds = _number(value, float("nan"))
    return seconds if math.isfinite(seconds) and seconds >= 0 else float("nan")


def _busy_before(kernels: list[tuple[int, int, float]], until_ns: int) -> float:
    """Seconds of kernel time before ``until_ns``: each span's busy time in the share of its
    extent that lies before it (a summary's launches taken as spread over its extent)."""
    total = 0.0
    for start, end, time_s in kernels:
        if end <= until_ns:
            total += time_s
        elif start < until_ns:
            total += time_s * (until_ns - start) / (end - start)
    return total


def _queue_entry(trace) -> QueueEntry:
    root = trace.request_root
    record = root.record()
    queue = next((s for s in trace.spans if s.name == sc.SPAN_QUEUE), None)
    if queue is not None:
        arrival, left = queue.start_time_unix_nano, queue.end_time_unix_nano
    else:
        arrival = record.start_time_unix_nano
        left = arrival + int(_number(record.attributes.get(sc.REQUEST_QUEUE_S)) * 1e9)
    priority = _number(record.attributes.get(sc.REQUEST_PRIORITY), float("nan"))
    return QueueEntry(trace.trace_id, arrival, left, priority, root.instance)


@dataclass
class WindowSteps:
    """The steps that overlapped a window, against the usual (see :meth:`EngineTimeline.window`)."""

    steps: int
    # its decode-only steps' mean duration, leaving out those in which a prefill began
    # (_prefill_begun_inside), over a usual second's (_usual_mean) plus what their requests beyond the
    # usual batch cost; where none is left, the median step's over the usual for its tokens.
    # A stall that stretches a third of the steps 4x doubles the request's time, and leaves
    # their median usual
    slowdown: float | None
    traced: int
    gpu_slowdown: float | None  # traced steps: summed GPU time over the usual summed
    # traced steps: 1 + their summed host time beyond its usual over their usual time summed,
    # how much the host stretched them (a graph replay's host time is tens of us: a ratio to
    # it says nothing)
    host_slowdown: float | None
    idle_excess_s: float  # time in the window with no step running, beyond the usual gaps
    compiles: list[dict]  # steps that compiled kernels: step_id, jit_compiles, duration_s
    traced_near: int = 0  # under MIN_TRACED traced in the window: those within TRACED_REACH_S added
    # time beyond their usual in undisturbed steps of any kind >= LONG_STEP x it, at most the
    # window's length: one such step is a stall that a mean over the others leaves out
    long_steps_s: float = 0.0
    batch: float | None = None  # its decode-only steps' mean batch (requests decoded)
    kv_blocks: float | None = None  # its decode-only steps' mean KV blocks in use
    # its kernel-traced decode-only steps' own mean duration on the yardstick of ``slowdown``:
    # far under it, the traced steps missed the slowness their GPU and host time would split
    traced_slowdown: float | None = None
    # traced steps recording it: their engine thread's CPU time in their host phases over its
    # usual in a decode step (the engine's own host work; a larger batch asks more of it)
    host_cpu_slowdown: float | None = None
    # the mean KV blocks in use of every step in the window and of the traced steps near it:
    # the load its GPU time and CTAs were read under (its own decode-only steps may be few)
    kv_load: float | None = None


class EngineTimeline:
    """See the module docstring. Not thread-safe: its owner calls it from one query at a time
    (``refresh`` inside ``TraceStore.read``)."""

    def __init__(self) -> None:
        self._steps: dict[bytes, tuple[int, list[StepFacts]]] = {}  # trace id -> (its spans, facts)
        self._queues: dict[bytes, tuple[int, QueueEntry]] = {}
        self._arrays: dict[str, np.ndarray] | None = None
        self._usual: dict[str | None, dict[str, float]] = {}  # per instance (None: all of them)

    # -- building -------------------------------------------------------------------------
    def refresh(self, store) -> None:
        """Decodes what the store gained since the last call and forgets what it evicted."""
        steps, queues, changed = {}, {}, False
        for trace in store.traces():
            n = len(trace.spans)
            if trace.step_spans:
                known = self._steps.get(trace.trace_id)
                if known is None or known[0] != n:
                    known = (n, [step_facts(trace, s) for s in trace.step_spans])
                    changed = True
                steps[trace.trace_id] = known
            if trace.request_root is not None:
                known = self._queues.get(trace.trace_id)
                if known is None or known[0] != n:
                    known = (n, _queue_entry(trace))
                queues[trace.trace_id] = known
        changed = changed or len(steps) != len(self._steps)
        self._steps, self._queues = steps, queues
        if changed or self._arrays is None:
            self._build()

    def _build(self) -> None:
        facts = sorted((f for _, fs in self._steps.values() for f in fs), key=lambda f: f.start_ns)
        a = {"start": np.array([f.start_ns for f in facts], dtype=np.int64),
             "end": np.array([f.end_ns for f in facts], dtype=np.int64),
             "kind": np.array([f.kind for f in facts], dtype=np.int64),
             "prefill": np.array([f.prefill_tokens for f in facts], dtype=np.float64),
             "decode": np.array([f.decode_tokens for f in facts], dtype=np.float64),
             "kv": np.array([f.kv_blocks for f in facts], dtype=np.float64),
             "gpu": np.array([f.gpu_s for f in facts], dtype=np.float64),
             "host": np.array([f.host_s for f in facts], dtype=np.float64),
             "host_cpu": np.array([f.host_cpu_s for f in facts], dtype=np.float64),
             "compiles": np.array([f.jit_compiles for f in facts], dtype=np.int64),
             "usual_sample": np.array([f.usual_sample for f in facts], dtype=bool),
             "step_id": np.array([-1 if f.step_id is None else f.step_id for f in facts], dtype=np.int64),
             "instance": np.array([f.instance for f in facts], dtype=object),
             "wait": np.array([f.wait_ns for f in facts], dtype=np.int64),
             "late_from": np.array([f.late_from_ns for f in facts], dtype=np.int64)}
        a["duration"] = np.maximum(0, a["end"] - a["start"]) / 1e9
        a["host"] = a["host"] + _late_s(a)
        a["host_off"] = np.maximum(0.0, a["host"] - a["host_cpu"])   # NaN where no CPU time was recorded
        a["prefill_inside"] = _prefill_begun_inside(a)
        a["undisturbed"] = a["prefill_inside"] == 0
        a["clean"] = a["undisturbed"] & (a["kind"] == 0)   # the decode steps a mean is taken over
        self._arrays = a
        # each engine against its own usual: engines of other models or devices share the store
        self._usual = {None: self._fit(a)}
        for instance in set(a["instance"].tolist()):
            mine = a["instance"] == instance
            self._usual[instance] = self._fit({k: v[mine] for k, v in a.items()})

    @staticmethod
    def _fit(a: dict[str, np.ndarray]) -> dict[str, float]:
        """The usual step: a decode-only step's duration at the usual batch and KV, plus a
        cost per prefill token, per request beyond that batch and per KV block beyond that KV;
        the same for GPU time and host time (see step_facts) of traced steps, and the gap
        between steps. Each is the median of the shortest half of the values
        (:func:`usual_value`); beside them the most requests a step decoded and the upper
        quartile of decode steps' KV blocks (``kv_upper``: how far the KV cost was measured).
        GPU and host time come from the steps the usual ratio sampled, of each kind where it
        has any: steps traced after a slow step or in a slow spell were chosen for running slow."""
        decode = a["kind"] == 0
        prefilled = a["prefill"] >= _MIN_PREFILL_FOR_COST
        traced = np.isfinite(a["gpu"])

        def sampled(rows: np.ndarray) -> np.ndarray:
            usual = rows & a["usual_sample"]
            return usual if usual.any() else rows

        def fit(values: np.ndarray, rows: np.ndarray) -> tuple[float, float, int]:
            """The usual decode step, the cost per prefill token and how many steps it rests on.
            The cost is the slope of the line through the steps with prefill (their own
            intercept: a prefill of 100 tokens can take less than a decode step's CUDA graph,
            and measured from the decode step most short prompts would cost nothing); with
            under ``_SLOPE_LENGTHS`` prompt lengths, each step's cost beyond the decode step."""
            anchors, costed = sampled(decode & rows), sampled(prefilled & rows)
            base = usual_value(values[anchors], 0.0)
            x, y = a["prefill"][costed][-_SLOPE_POINTS:], values[costed][-_SLOPE_POINTS:]
            if np.unique(x).size >= _SLOPE_LENGTHS:
                per_token = _per_unit(x, y)
            else:
                per_token = usual_value((values[costed] - base) / a["prefill"][costed], 0.0)
            return base, max(0.0, per_token), int(costed.sum())

        base, per_token, _ = fit(a["duration"], np.ones_like(decode))
        gpu_base, gpu_token, gpu_token_steps = fit(a["gpu"], traced)
        host_base, host_token, _ = fit(a["host"], traced)
        # the host time its thread spent off the CPU, and its CPU time (steps that record it)
        timed_cpu = traced & np.isfinite(a["host_cpu"])
        host_off = usual_value(a["host_off"][sampled(timed_cpu)], float("nan")) if timed_cpu.any() else float("nan")
        host_cpu = usual_value(a["host_cpu"][sampled(decode & timed_cpu)], float("nan")) \
            if (decode & timed_cpu).any() else float("nan")
        batch = usual_value(a["decode"][decode], 0.0)
        # a request decoded beyond the usual batch costs a step (its duration and GPU time
        # alike) what a prefill token costs the GPU (the same weights, one more row), else
        # the whole step: more load is not a slower engine. A smaller batch is not counted
        # faster (a decode step reads all of the weights whatever its batch).
        per_request = gpu_token if gpu_token > 0 else per_token
        at_usual_batch = a["duration"] - per_request * _beyond(a["decode"], batch)
        # a decode step reads every running request's KV: the usual load's own spread of
        # context lengths says what a block costs (its GPU time alike), so that long contexts
        # are a heavier load, not a slower engine
        kv_blocks = usual_value(a["kv"][decode], 0.0)
        per_kv_block = _slope(a["kv"][decode], at_usual_batch[decode])
        # the contexts that slope was measured across end about here; far beyond, a block's
        # cost is a guess (attention over long contexts need not scale as over short ones)
        kv_upper = float(np.quantile(a["kv"][decode], 0.75)) if decode.any() else 0.0
        batch_upper = float(np.quantile(a["decode"][decode], 0.75)) if decode.any() else 0.0
        at_usual = at_usual_batch - per_kv_block * _beyond(a["kv"], kv_blocks)
        return {"duration": base, "duration_per_token": per_token, "gpu": gpu_base, "gpu_per_token": gpu_token,
                "host": host_base, "host_per_token": host_token,
                # only where steps recorded their thread's CPU time (older captures did not)
                **({"host_off": host_off} if np.isfinite(host_off) else {}),
                **({"host_cpu": host_cpu} if np.isfinite(host_cpu) else {}),
                "gpu_token_steps": gpu_token_steps, "batch": batch,
                "per_request": per_request, "kv_blocks": kv_blocks, "per_kv_block": per_kv_block,
                "kv_upper": kv_upper, "batch_upper": batch_upper,
                "decode_mean": _usual_mean(a, at_usual, base),
                "most_decode": float(a["decode"].max()) if len(a["decode"]) else 0.0,
                "gap": usual_value(np.diff(a["start"]) / 1e9 - a["duration"][:-1], 0.0) if len(a["start"]) > 1 else 0.0}

    # -- queries ----------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return 0 if self._arrays is None else len(self._arrays["start"])

    def usual(self, instance: str | None = None) -> dict[str, float]:
        """The usual step of ``instance``'s engine (all steps when it has none): durations in
        seconds, per-token costs."""
        return dict(self._usual.get(instance) or self._usual.get(None) or {})

    def decode_only_s(self, decode_tokens: int, kv_blocks: int = 0, instance: str | None = None) -> float:
        """What a decode-only step of ``decode_tokens`` requests holding ``kv_blocks`` usually
        takes on ``instance``'s engine (0 while the store has no step)."""
        u = self.usual(instance)
        return u["duration"] + float(_load_s(u, decode_tokens, kv_blocks)) if u else 0.0

    def window(self, start_ns: int, end_ns: int, instance: str | None = None) -> WindowSteps:
        """The steps that overlapped ``[start_ns, end_ns]`` (of ``instance``, when it has steps)."""
        a = self._arrays
        if a is None or not len(a["start"]):
            return WindowSteps(0, None, 0, None, None, 0.0, [])
        mine = self._steps_of(instance)
        inside = mine & (a["start"] < end_ns) & (a["end"] > start_ns)
        u = self.usual(instance)
        idx = np.flatnonzero(inside)
        if not idx.size:
            return WindowSteps(0, None, 0, None, None, (end_ns - start_ns) / 1e9, [])
        prefill, load = a["prefill"][idx], _load_s(u, a["decode"][idx], a["kv"][idx])
        expected = u["duration"] + u["duration_per_token"] * prefill + load
        duration = a["duration"][idx]
        slowdown = traced_slowdown = None
        if (expected > 0).all():
            # decode-only steps are the yardstick: a mixed step's cost beyond the line of
            # its tokens is others' prefill (prefill_interference), not the engine's slowness
            plain = a["clean"][idx]
            if plain.any() and u["decode_mean"] > 0:
                usual_mean = u["decode_mean"] + float(load[plain].mean())
                slowdown = float(duration[plain].mean() / usual_mean)
                timed = plain & np.isfinite(a["gpu"][idx])
                if timed.any():
                    traced_slowdown = float(duration[timed].mean() / (u["decode_mean"] + float(load[timed].mean())))
            else:
                slowdown = float(np.median(duration / expected))
        decoded = a["kind"][idx] == 0
        batch = float(a["decode"][idx][decoded].mean()) if decoded.any() else None
        kv_blocks = float(a["kv"][idx][decoded].mean()) if decoded.any() else None
        long = a["undisturbed"][idx] & (duration >= LONG_STEP * expected)
        long_s = min(float((duration - expected)[long].sum()), (end_ns - start_ns) / 1e9)
        traced = idx[np.isfinite(a["gpu"][idx])]
        near = 0
        if traced.size < MIN_TRACED:
            reach_ns = int(TRACED_REACH_S * 1e9)
            around = mine & (a["start"] < end_ns + reach_ns) & (a["end"] > start_ns - reach_ns) & np.isfinite(a["gpu"])
            near = int(around.sum()) - int(traced.size)
            traced = np.flatnonzero(around)
        gpu, host, host_cpu = self._gpu_and_host(traced, u)
        kv_load = float(a["kv"][np.union1d(idx, traced)].mean())
        # time in the window with no step running, beyond a usual gap before each step
        lo, hi = np.maximum(a["start"][idx], start_ns), np.minimum(a["end"][idx], end_ns)
        covered, reach = 0, start_ns
        for s, e in zip(lo.tolist(), hi.tolist()):
            if e > reach:
                covered += e - max(s, reach)
                reach = e
        idle = (end_ns - start_ns - covered) / 1e9
        # steps of an engine that schedules ahead overlap: a negative usual gap counts as none
        usual_gap = max(0.0, u["gap"]) if np.isfinite(u["gap"]) else 0.0
        compiles = [{"step_id": int(a["step_id"][i]) if a["step_id"][i] >= 0 else None,
                     "jit_compiles": int(a["compiles"][i]), "duration_s": float(a["duration"][i])}
                    for i in idx[a["compiles"][idx] > 0].tolist()]
        return WindowSteps(int(idx.size), slowdown, int(traced.size) - near, gpu, host,
                           max(0.0, idle - usual_gap * idx.size), compiles, near, long_s, batch, kv_blocks,
                           traced_slowdown, host_cpu, kv_load)

    def _gpu_and_host(self, traced: np.ndarray, u: dict[str, float]) -> tuple[float | None, float | None,
                                                                              float | None]:
        """Traced steps ``traced`` (indices): their GPU time over the usual for their tokens;
        the stretch their host time beyond its usual gave them; and their engine thread's CPU
        time in those host phases over its usual, all ratios of sums (WindowSteps): a stall
        that lands on a minority of steps moves a sum, not a median. Where a step recorded
        its thread's CPU time, only host time off the CPU beyond its usual stretches it: CPU
        time that grows with the batch is the engine's own work, a heavier step, not a stall."""
        if not traced.size:
            return None, None, None
        a = self._arrays
        prefill, gpu_s, host_s, cpu_s, off_s = (a["prefill"][traced], a["gpu"][traced], a["host"][traced],
                                                a["host_cpu"][traced], a["host_off"][traced])
        load = _load_s(u, a["decode"][traced], a["kv"][traced])
        want_gpu = u["gpu"] + u["gpu_per_token"] * prefill + load
        want_host = u["host"] + u["host_per_token"] * prefill
        want_step = u["duration"] + u["duration_per_token"] * prefill + load
        gpu = float(gpu_s.sum() / want_gpu.sum()) if (want_gpu > 0).all() else None
        usual_off = u.get("host_off", float("nan"))
        split = np.isfinite(cpu_s) & np.isfinite(usual_off)
        excess = np.where(split, off_s - usual_off, host_s - want_host)
        host = float(1.0 + excess.sum() / want_step.sum()) if (want_step > 0).all() else None
        usual_cpu = u.get("host_cpu", float("nan"))
        timed = np.isfinite(cpu_s)
        cpu = (float(cpu_s[timed].sum() / (usual_cpu * timed.sum()))
               if timed.any() and np.isfinite(usual_cpu) and usual_cpu > 0 else None)
        return gpu, host, cpu

    def queue_at(self, trace_id: bytes, arrival_ns: int, left_ns: int, priority: float,
                 instance: str | None = None) -> dict:
        """When a request arrived: how many stored requests waited (``depth``), how many of
        them more urgent (``ahead_more_urgent``), how many more urgent ones arrived while it
        waited and left the queue before it (``overtaken_by``), and whether the engine ran
        full while it waited (``engine_full``: its steps then decoded, at the median, at
        least 0.9 of the most requests any stored step of that engine did)."""
        depth = ahead = overtaken = 0
        for tid, (_, q) in self._queues.items():
            if tid == trace_id or (instance is not None and q.instance != instance):
                continue
            urgent = q.priority < priority  # NaN compares False: unknown is not more urgent
            if q.arrival_ns <= arrival_ns < q.left_ns:
                depth += 1
                ahead += urgent
            elif arrival_ns < q.arrival_ns < left_ns and q.left_ns <= left_ns and urgent:
                overtaken += 1
        return {"depth": depth, "ahead_more_urgent": ahead, "overtaken_by": overtaken,
                "engine_full": self._full(arrival_ns, left_ns, instance)}

    def _full(self, start_ns: int, end_ns: int, instance: str | None) -> bool:
        a = self._arrays
        if a is None or not len(a["start"]):
            return False
        during = self._steps_of(instance) & (a["start"] < end_ns) & (a["end"] > start_ns)
        most = self.usual(instance)["most_decode"]
        return bool(during.any() and most > 0 and np.median(a["decode"][during]) >= 0.9 * most)

    def prefill_begun_inside(self, start_ns: int, instance: str | None = None) -> int:
        """The prefill tokens of the steps that began inside the stored step that began at
        ``start_ns`` (of ``instance``, when it has steps), of its engine: what stretched it
        (0: nothing did; see _prefill_begun_inside)."""
        a = self._arrays
        if a is None:
            return 0
        any_instance = instance is None or instance not in self._usual
        i = int(np.searchsorted(a["start"], start_ns, side="left"))
        while i < len(a["start"]) and a["start"][i] == start_ns:
            if any_instance or a["instance"][i] == instance:
                return int(a["prefill_inside"][i])
            i += 1
        return 0

    def _steps_of(self, instance: str | None) -> np.ndarray:
        """Which stored steps are ``instance``'s (all of them when it has none)."""
        a = self._arrays
        if instance is not None and (a["instance"] == instance).any():
            return a["instance"] == instance
        return np.ones(len(a["start"]), dtype=bool)
