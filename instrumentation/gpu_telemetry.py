"""The engine process's side of GPU telemetry: it records raw GPU facts, nothing more.

``GpuTelemetry.create(recorder, device_index)`` -> instance or None; ``probe`` goes to the
attention ops; ``begin_step`` / ``end_step`` bracket each step's launches (engine thread),
``observe_step`` runs once the step is done: the tail rule, the slow spell, the next step's
draw and probe turn (1 in ``probe_every_steps``; a prefill step out of turn when none was
probed for ``probe_prefill_interval_s``, and traced when none was for
``prefill_trace_interval_s``). A step planned plain calls nothing else. Probed
and traced steps leave a stream-ordered copy of their probe records to the worker (it
polls). A traced step switches CUPTI on and pushes/pops its external id (``step_id + 1``),
unwaited: the worker waits for its kernels, flushes CUPTI and switches it off; steps
launched meanwhile are recorded under ``UNTRACED_EXTERNAL_ID``, their sample owed to the
next (``cupti_detach``: the engine waits and detaches CUPTI itself, ms per traced step).
The worker reduces probe records on the GPU into per-(gpu, SM, kernel) histograms, exported
every ``export_interval_s``; CUPTI buffers go over raw. All leaves through the recorder."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from . import semconv
from .config import TelemetryConfig
from .config_checks import check_range
from .cupti_tracer import CuptiTracer
from .exit_guard import cancel_stop_at_exit, stop_at_exit
from .gpu_records import (UNTRACED_EXTERNAL_ID, CtaHistograms, GpuIdentity, KernelActivity,
                          KernelNames, StepLaunchFacts)
from .slow_spells import SlowSpellRule
from .sm_probe import SmProbe, launch_facts_of_records

__all__ = ["GpuTelemetry", "GpuTelemetryConfig", "GpuTelemetryStats", "TailPolicy"]

logger = logging.getLogger(__name__)

_NEVER = 1 << 62   # steps until the next sampled (probed) one at ratio 0 (without a probe)
_NEITHER = (False, False)   # the usual step's plan: neither sampled nor probed


# the knobs a user sets are TelemetryConfig's settings: their defaults are declared there once
_USER_DEFAULTS = {f.name: f.default for f in fields(TelemetryConfig)}


@dataclass(frozen=True)
class GpuTelemetryConfig:
    """Knobs of the GPU telemetry; ranges checked, errors name the bad value."""

    kernel_sample_ratio: float = _USER_DEFAULTS["kernel_sample_ratio"]   # steps whose kernels become spans
    # a slow spell: for ``slow_spell_s`` after ``slow_steps`` decode-only steps within
    # ``slow_within_steps`` steps each ran ``slow_step_factor`` x the tail window's median,
    # more than the engine's own rate of such steps gives by chance (slow_spells.py), steps
    # are sampled at ``slow_sample_ratio`` (when higher). A stall that lands on a
    # minority of steps moves their sum, not their median, and a few traced steps a second
    # often miss it: the spell traces enough of them to say where it went. A few slow steps
    # alone (the first after an idle spell, a collection, a burst's turn) begin none: a tenth
    # of a window's decode steps must be slow, and more than the engine's load makes slow,
    # which keeps the GIL and HBM hogs' intervals in a spell and little of the usual load
    # (bench.slow_spells on the H200 captures)
    slow_sample_ratio: float = _USER_DEFAULTS["kernel_sample_ratio_slow"]
    slow_step_factor: float = 1.5
    slow_spell_s: float = 1.0
    slow_steps: int = 6
    slow_within_steps: int = 64
    tail_quantile: float = 0.999        # a step slower than this quantile arms tail tracing
    tail_window_steps: int = 1024       # recent steps the quantile is taken over
    tail_min_steps: int = 64            # no tail rule before this many steps
    tail_follow_steps: int = 1          # steps traced after a step slower than the quantile
    cupti: bool = True                  # kernel spans (CUPTI)
    # CUPTI between traced steps: detached (untraced steps' CUDA calls pay nothing, each
    # traced step pays an attach of ms on the engine thread) or attached with its kinds off
    # (every CUDA call pays a few µs). Paired runs put the two within noise of each other in
    # throughput; attached keeps traced steps short (bench/results/overhead_http.md).
    cupti_detach: bool = _USER_DEFAULTS["cupti_detach"]
    probe: bool = _USER_DEFAULTS["sm_probe"]   # per-CTA SM probe in our Triton kernels
    probe_capacity_ctas: int = 1 << 20  # CTAs probed per step (24 B each on the device)
    probe_every_steps: int = _USER_DEFAULTS["sm_probe_every"]   # every Nth step's CTAs feed the histograms
    # and a step with prefill tokens when none was probed for this long (0: only its turn):
    # at a few requests a second 1 step in N rarely carries a prefill, and the prefill
    # kernel's per-SM histograms would stay empty for whole slots
    probe_prefill_interval_s: float = 1.0
    # and a step with prefill tokens gets kernel spans when none did for this long (0: only
    # its draw): the collector's usual GPU cost per prefill token rests on traced prefill
    # steps, and the usual ratio alone leaves a short capture only a handful of them
    prefill_trace_interval_s: float = 2.0
    probe_batch_steps: int = 32         # steps whose probe records are reduced together
    export_interval_s: float = _USER_DEFAULTS["metric_export_interval_s"]
    probe_poll_s: float = 0.05          # the worker's wake-ups for probed steps' records
    max_pending_steps: int = 4096
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = (("kernel_sample_ratio", 0.0, 1.0), ("slow_sample_ratio", 0.0, 1.0),
                  ("slow_step_factor", 1.0, 100.0), ("slow_spell_s", 0.0, 3600.0),
                  ("slow_steps", 1, 1_000), ("slow_within_steps", 1, 1_000_000),
                  ("tail_quantile", 0.5, 1.0),
                  ("tail_window_steps", 8, 1_000_000), ("tail_follow_steps", 0, 1_000),
                  ("probe_capacity_ctas", 1, 1 << 26), ("probe_every_steps", 1, 1_000_000),
                  ("probe_batch_steps", 1, 4096), ("export_interval_s", 0.01, 3600),
                  ("probe_prefill_interval_s", 0.0, 3600.0), ("prefill_trace_interval_s", 0.0, 3600.0),
                  ("probe_poll_s", 0.001, 10.0),
                  ("max_pending_steps", 1, 1_000_000))
        for name, low, high in checks:
            check_range(name, getattr(self, name), low, high,
                        integer=isinstance(low, int) and isinstance(high, int))
        check_range("tail_min_steps", self.tail_min_steps, 1, self.tail_window_steps, integer=True,
                    hint="(at most tail_window_steps)")


class TailPolicy:
    """Which steps get kernel spans. ``next_sample_gap()``: steps until the next sampled
    one, so that each step is sampled with probability ``ratio``. ``is_tail(duration_s)``
    (when a step ended): True if the step was slower than ``limit``, the ``quantile`` of the
    window of recent steps (``math.inf`` before ``min_steps``). ``slow_limit``: ``slow_factor``
    x the window's median. Steps join the window in batches of ``refresh_steps``; the
    quantile, O(window), is recomputed then only if the batch can have moved it, the median
    (a sort) once half a window of steps has joined since the last (when ``slow_factor`` is
    finite): the usual step costs a list append and a comparison."""

    # fixed slots: read on every step, right after the model's work, with cold caches
    __slots__ = ("ratio", "quantile", "min_steps", "rng", "limit", "_recent", "_batch",
                 "refresh_steps", "slow_factor", "slow_limit", "_since_median")

    def __init__(self, ratio: float, quantile: float, window: int, min_steps: int,
                 rng: random.Random, refresh_steps: int = 1, slow_factor: float = math.inf) -> None:
        self.ratio, self.quantile, self.min_steps, self.rng = ratio, quantile, min_steps, rng
        self.limit = math.inf
        self.slow_factor, self.slow_limit = slow_factor, math.inf
        self._since_median = 0   # steps joined since the median was taken
        self._recent: deque[float] = deque(maxlen=window)
        self._batch: list[float] = []     # steps since the last refresh, not yet in the window
        self.refresh_steps = refresh_steps

    def threshold(self) -> float | None:
        """``np.quantile(window, quantile, method="higher")``, i.e. the sorted value at rank
        ceil(quantile * (n - 1)), as the k-th largest: numpy would let the GIL go."""
        n = len(self._recent)
        if n < self.min_steps:
            return None
        k = n - math.ceil(self.quantile * (n - 1))
        return heapq.nlargest(k, self._recent)[-1]

    def room(self) -> int:
        """Steps that can still join ``batch`` before the next refresh is due."""
        return self.refresh_steps - 1 - len(self._batch)

    @property
    def batch(self) -> list[float]:
        """The steps not yet in the window. A step known to be no slower than ``limit`` may
        be appended while ``room()`` > 0: that is all ``is_tail`` would do with it."""
        return self._batch

    def is_tail(self, duration_s: float) -> bool:
        tail = duration_s > self.limit   # the limit of the steps before this one
        batch = self._batch
        batch.append(duration_s)
        if len(batch) >= self.refresh_steps:
            self._refresh()
        return tail

    def _refresh(self) -> None:
        """Moves the batch into the window; recomputes ``limit`` if it can have moved."""
        batch, recent = self._batch, self._recent
        self._batch = []
        leaving = list(itertools.islice(recent, max(len(recent) + len(batch) - recent.maxlen, 0)))
        moved = self._may_move(batch, leaving)
        recent.extend(batch)
        if moved:
            threshold = self.threshold()
            self.limit = math.inf if threshold is None else threshold
        if self.slow_factor != math.inf and len(recent) >= self.min_steps:
            # a sort of the window is tens of µs: every step's share of it stays under 0.1 µs
            self._since_median += len(batch)
            if self.slow_limit == math.inf or 2 * self._since_median >= recent.maxlen:
                self.slow_limit = self.slow_factor * sorted(recent)[len(recent) // 2]
                self._since_median = 0

    def _may_move(self, entering: list[float], leaving: list[float]) -> bool:
        """False only when the quantile stays where it is: the window was and stays full
        (its rank is then fixed), no entering value is above it, and no leaving value is at
        or above it (values equal to it entering leave it in place)."""
        limit, recent = self.limit, self._recent
        return (limit == math.inf or len(recent) < recent.maxlen
                or max(entering) > limit or (bool(leaving) and max(leaving) >= limit))

    def next_sample_gap(self, ratio: float | None = None) -> int:
        """1 + a geometric draw: every step is sampled independently with probability
        ``ratio`` (the policy's when None), at the cost of one draw per sampled step instead
        of one per step."""
        ratio = self.ratio if ratio is None else ratio
        if ratio <= 0.0:
            return _NEVER
        if ratio >= 1.0:
            return 1
        return 1 + int(math.log(1.0 - self.rng.random()) / math.log1p(-ratio))


@dataclass
class GpuTelemetryStats:
    steps_probed: int = 0           # steps whose probe records were read (1 in N, and traced)
    prefill_probes: int = 0         # ... of them, steps with prefill tokens probed out of turn
    steps_dropped: int = 0          # work queue full: the step's GPU data was not kept
    steps_traced_sampled: int = 0
    steps_traced_spell: int = 0     # sampled at the slow spell's ratio
    steps_traced_tail: int = 0      # traced because a recent step was slower than the P99.9
    steps_traced_prefill: int = 0   # the first step with prefill tokens in prefill_trace_interval_s
    steps_recorded_untraced: int = 0  # launched while CUPTI closed a traced step
    tail_steps: int = 0             # steps slower than the recent P99.9
    slow_spells: int = 0            # slow spells begun (sampling at slow_sample_ratio)
    ctas_probed: int = 0            # grid CTAs of probed launches (idle ones included)
    probe_launches_dropped: int = 0
    probe_snapshots_dropped: int = 0  # probed steps whose records found the snapshot ring full
    cupti_buffers: int = 0
    histogram_exports: int = 0
    errors: int = 0
    engine_thread_s: float = 0.0    # time spent in begin_step/end_step (not observe_step)
    engine_thread_traced_s: float = 0.0  # the part of it spent on traced steps
    engine_thread_probed_s: float = 0.0  # ... and on untraced steps whose probe records are read
    worker_cpu_s: float = 0.0       # the worker thread's CPU time, of which:
    worker_close_cpu_s: float = 0.0   # closing traced steps (CUPTI flush, kinds off)
    worker_reduce_cpu_s: float = 0.0  # enqueuing the probe records' histogram reductions
    worker_step_ctas_cpu_s: float = 0.0  # reading traced steps' probe records to the host
    # wall time of a traced step's close on the worker, by call: CUPTI's forced flush, the
    # kinds switched off, and its launch facts read back. Each may hold up the engine's next
    # launch (bench.overhead_http's after_traced shows whether one did)
    worker_flush_wall_s: float = 0.0
    worker_kinds_off_wall_s: float = 0.0
    worker_step_ctas_wall_s: float = 0.0

    def worker_phases_cpu_s(self) -> dict[str, float]:
        """The worker's CPU seconds by phase (a part of ``worker_cpu_s``)."""
        return {"close": self.worker_close_cpu_s, "reduce": self.worker_reduce_cpu_s,
                "step_ctas": self.worker_step_ctas_cpu_s}

    def worker_close_wall_s(self) -> dict[str, float]:
        """The worker's wall seconds in a traced step's close, by call."""
        return {"flush": self.worker_flush_wall_s, "kinds_off": self.worker_kinds_off_wall_s,
                "step_ctas": self.worker_step_ctas_wall_s}


class GpuTelemetry:
    """See the module docstring. Create with ``GpuTelemetry.create``."""

    def __init__(self, recorder, device_index: int = 0,
                 config: GpuTelemetryConfig | None = None) -> None:
        self.recorder = recorder
        self.device_index = device_index
        if config is None:
            telemetry_config = getattr(recorder, "config", None)
            default = GpuTelemetryConfig()   # where the recorder has no telemetry config
            config = GpuTelemetryConfig(
                kernel_sample_ratio=getattr(telemetry_config, "kernel_sample_ratio",
                                            default.kernel_sample_ratio),
                slow_sample_ratio=getattr(telemetry_config, "kernel_sample_ratio_slow",
                                          default.slow_sample_ratio),
                probe=getattr(telemetry_config, "sm_probe", default.probe),
                cupti_detach=getattr(telemetry_config, "cupti_detach", default.cupti_detach),
                probe_every_steps=getattr(telemetry_config, "sm_probe_every",
                                          default.probe_every_steps),
                export_interval_s=getattr(telemetry_config, "metric_export_interval_s",
                                          default.export_interval_s))
        self.config = config
        self.stats = GpuTelemetryStats()
        # slow spells only where they sample more than the usual ratio
        spells = config.slow_sample_ratio > config.kernel_sample_ratio and config.slow_spell_s > 0
        self.policy = TailPolicy(config.kernel_sample_ratio, config.tail_quantile,
                                 config.tail_window_steps, config.tail_min_steps,
                                 random.Random(config.seed), refresh_steps=64,
                                 slow_factor=config.slow_step_factor if spells else math.inf)
        self._spell_until = -math.inf   # monotonic time the slow spell ends
        self._spell_rule = SlowSpellRule(config.slow_steps, config.slow_within_steps)
        # the trace reason of the sample the countdown leads to, and of the last one drawn
        self._gap_for = self._drawn_for = semconv.TRACE_REASON_SAMPLED
        # CUPTI starts in ``start_kernel_tracing``, once the engine has captured its CUDA graphs
        self.tracer = CuptiTracer(self._on_buffer) if config.cupti else None
        self.probe: SmProbe | None = None
        self.histograms = None
        self._side = None
        if config.probe:
            import torch

            from .dispatch_order import learn_dispatch_deal
            from .sm_histograms import DeviceCtaHistograms
            device = torch.device(f"cuda:{device_index}")
            self.probe = SmProbe(device, config.probe_capacity_ctas, gpu_id=device_index)
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.histograms = DeviceCtaHistograms(device, device_index, num_sms)
            # on the GPU as start-up leaves it: idle, so the scheduler's own deal shows
            self.histograms.set_dispatch_deal(learn_dispatch_deal(device, num_sms))
            self.histograms.rotating = self.probe.rotating   # one set: kernels add themselves
            self._side = torch.cuda.Stream(device=device)
            self._engine_stream = torch.cuda.current_stream(device)   # the steps' stream
            self.probe.snapshots.stream_handle = self._engine_stream.cuda_stream
        recorder.record(GpuIdentity(device_index, _gpu_uuid(device_index)))
        # the worker's work, in the engine's order: appended without waking it (a wake-up is
        # a few µs here, and the worker then takes the GIL when the engine next lets it go),
        # except for a traced step, whose CUPTI close is due as soon as its kernels are done
        self._work_items: deque = deque()
        self._wake = threading.Event()
        # held by the worker around its CUDA calls and by the engine thread while CUPTI
        # attaches or detaches: cuptiFinalize must not race another thread's CUDA call
        self._cuda_lock = threading.Lock()
        self._open: str = ""       # the running step's trace reason ("" = not traced)
        self._probing = False      # the running step's probe records are read
        self._last_prefill_probe = -math.inf   # monotonic time of the last probed prefill step
        self._last_prefill_trace = -math.inf   # ... and of the last traced one
        # the next launch's (sampled, probed), drawn when the last step ended; and whether
        # that launch needs nothing of begin_step / end_step (read by the engine, no call)
        self._planned: tuple[bool, bool] | None = None
        self.next_step_plain = False
        # Quiet steps: plain steps ahead that need nothing but joining the tail window,
        # granted by a plan when neither countdown nor the window's refresh can come due
        # sooner (``_quiet_granted`` settles the countdowns for those taken). A step is quiet
        # while ``quiet_steps`` > 0 if it is no slower than ``quiet_limit`` and not
        # recorded by CUPTI; ``observe_step`` then only counts it down and appends its
        # duration to ``quiet_durations``, at its first branch.
        self.quiet_steps = 0
        self._quiet_granted = 0
        self.quiet_limit = math.inf
        self.quiet_durations: list[float] = []
        self._to_sample = self.policy.next_sample_gap()   # steps to the next sampled one
        self._to_probe = 1 if self.probe is not None else _NEVER   # ... to the next probed one
        self._untraced_push = False  # the running step pushed UNTRACED_EXTERNAL_ID
        self._follow = 0           # steps still to trace after a slow one
        self._owed = 0             # samples drawn while a traced step was being closed
        # True from a traced step's end until the worker has flushed CUPTI and switched it
        # off (set by the engine thread, cleared by the worker after the switch)
        self._closing = False
        self._done_marker = _cuda_event if config.cupti else (lambda: None)
        self._probe_batch: list = []
        self._probe_batch_words = 0
        self._retiring: deque = deque()   # (event after a batch's reduction, its newest step)
        self._interval_start_ns = time.time_ns()
        self._last_export = time.monotonic()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name="sightline-gpu-telemetry",
                                        daemon=True)
        self._worker.start()
        stop_at_exit(self, "_stop_worker")   # its exports call torch

    @classmethod
    def create(cls, recorder, device_index: int = 0,
               config: GpuTelemetryConfig | None = None) -> GpuTelemetry | None:
        """An instance, or None (logged why) without CUDA or below the KERNELS level."""
        if recorder is None or not getattr(recorder, "kernels_on", False):
            logger.info("GPU telemetry off: the trace level is below 'kernels'")
            return None
        try:
            import torch
            if not torch.cuda.is_available():
                logger.info("GPU telemetry off: no CUDA device")
                return None
        except ImportError:
            logger.info("GPU telemetry off: torch is not installed")
            return None
        try:
            return cls(recorder, device_index, config)
        except Exception:
            logger.exception("GPU telemetry could not start; continuing without it")
            return None

    def start_kernel_tracing(self) -> bool:
        """Subscribes to CUPTI, idle until a traced step. The engine calls it after capturing
        its CUDA graphs, so that they are instantiated without CUPTI; they are traced all the
        same (tests/engine/test_cuda_graphs.py)."""
        if self.tracer is None or self.tracer.available:
            return self.kernel_spans_available
        if self.tracer.start():
            self._idle_tracer()
        else:
            logger.warning("GPU telemetry continues without kernel spans: %s",
                           self.tracer.unavailable_reason)
        return self.tracer.available

    def warm_up_tracing(self, run) -> bool:
        """Runs ``run`` (a step's work) once with CUPTI recording, as a traced step would,
        then flushes CUPTI and idles it: the first traced step while serving then pays no
        first-use cost. Its kernels are recorded outside any step (``UNTRACED_EXTERNAL_ID``:
        counted as untraced, no span). Before serving only. False without CUPTI."""
        tracer = self.tracer
        if tracer is None or not tracer.available:
            return False
        import torch
        with self._cuda_lock:
            tracer.enable()
        tracer.push(UNTRACED_EXTERNAL_ID)
        try:
            run()
            torch.cuda.synchronize(self.device_index)
        finally:
            tracer.pop()
            tracer.flush()
            self._idle_tracer()
        return True

    @property
    def kernel_spans_available(self) -> bool:
        return self.tracer is not None and self.tracer.available

    @property
    def tracing(self) -> bool:
        """The running step (between ``begin_step`` and ``end_step``) gets kernel spans."""
        return bool(self._open)

    @property
    def probing(self) -> bool:
        """The running step's probe records are read (traced, or its turn to feed the
        per-SM histograms)."""
        return self._probing

    def follow_plan(self, sampled: bool, probed: bool) -> None:
        """Another process decided the next step (a tensor-parallel rank follows rank 0's
        draws: the same steps get kernel spans and probe records on every GPU); the draws
        and the tail rule here go unused."""
        self._planned = (sampled and self.kernel_spans_available, probed and self.probe is not None)
        self._follow = self._owed = 0
        self.next_step_plain = not (any(self._planned) or self._closing)

    @property
    def waits_for_traced_steps(self) -> bool:
        """The engine must wait for a traced step's tokens before ``end_step``: detaching
        CUPTI needs the step's records delivered first."""
        return self.config.cupti_detach

    @property
    def closing(self) -> bool:
        """A traced step has ended and CUPTI is not yet flushed and switched off."""
        return self._closing

    def resolve_names(self, pointers) -> None:
        """Answers the telemetry process's question: the names behind kernel pointers."""
        self.recorder.record(KernelNames(CuptiTracer.resolve_names(pointers)))

    # -- engine thread ----------------------------------------------------------------
    def prefill_probe_due(self) -> bool:
        """A step with prefill tokens beginning now is probed whatever its turn (none was
        for ``probe_prefill_interval_s``): the engine calls ``begin_step`` for it even when
        planned plain."""
        interval = self.config.probe_prefill_interval_s
        return (self.probe is not None and interval > 0
                and time.monotonic() - self._last_prefill_probe >= interval)

    def _prefill_trace_due(self) -> bool:
        """Whether no step with prefill tokens got kernel spans for ``prefill_trace_interval_s``."""
        interval = self.config.prefill_trace_interval_s
        return (interval > 0 and self.kernel_spans_available
                and time.monotonic() - self._last_prefill_trace >= interval)

    def prefill_due(self) -> bool:
        """Whether a step with prefill tokens beginning now is due for the probe or for kernel
        spans out of turn: the engine calls ``begin_step`` for it even when planned plain."""
        return self.prefill_probe_due() or self._prefill_trace_due()

    def begin_step(self, step, prefill: bool = False) -> None:
        """Decides whether the step gets kernel spans; if so, switches CUPTI on and tags the
        step's CUDA launches (external correlation ``step_id + 1``). Not needed on a step
        planned plain (``next_step_plain``): the engine may skip it and ``end_step`` then.
        ``prefill``: the step carries prefill tokens (probed if ``prefill_probe_due``, traced
        if none was for ``prefill_trace_interval_s``)."""
        t0 = time.perf_counter()
        drew, self._probing = self._take_plan()
        if prefill and (self._probing or self.prefill_probe_due()):
            self.stats.prefill_probes += not self._probing   # out of turn
            self._probing = True
            self._last_prefill_probe = time.monotonic()
        tracer = self.tracer
        try:
            reason = ""
            if tracer is not None and tracer.available:
                if self._closing:
                    # CUPTI still records the last traced step: this one's kernels are
                    # recorded too but kept out of it, and a sample drawn now is owed
                    self._owed += drew
                    tracer.push(UNTRACED_EXTERNAL_ID)
                    self._untraced_push = True
                    step.cupti_recorded = True
                    self.stats.steps_recorded_untraced += 1
                elif self._follow > 0:
                    self._follow -= 1
                    reason = semconv.TRACE_REASON_AFTER_TAIL
                elif drew or self._owed:   # every step draws once: the ratio holds
                    # an owed sample takes the latest draw's reason (its own, unless a
                    # later draw was traced first): one drawn in a slow spell is no usual
                    # sample for the collector
                    self._owed -= not drew
                    reason = self._drawn_for
                elif prefill and self._prefill_trace_due():
                    # in a slow spell it is a spell's sample: the collector leaves those out
                    # of the usual step
                    reason = (semconv.TRACE_REASON_PREFILL if self._spell_ratio() is None
                              else semconv.TRACE_REASON_SLOW_SPELL)
                if reason and prefill:
                    self._last_prefill_trace = time.monotonic()
                if reason:
                    if tracer.attached:
                        tracer.enable()
                    else:
                        with self._cuda_lock:
                            tracer.enable()
                    tracer.push(step.step_id + 1)
                    step.set_attribute(semconv.STEP_TRACE_REASON, reason)
                    step.cupti_recorded = True
            self._open = reason
        except Exception:
            self.stats.errors += 1
            logger.exception("GpuTelemetry.begin_step failed")
        spent = time.perf_counter() - t0
        self.stats.engine_thread_s += spent
        if self._open:
            self.stats.engine_thread_traced_s += spent
        elif self._probing:
            self.stats.engine_thread_probed_s += spent

    def _take_plan(self) -> tuple[bool, bool]:
        """``(sampled, probed)`` for the step beginning: as planned by the last
        ``observe_step``, or drawn now when none was (the first step, or a second launch
        before the first one's end)."""
        planned, self._planned = self._planned, None
        self.next_step_plain = False
        self._settle_quiet()
        return planned if planned is not None else self._plan()

    def _settle_quiet(self) -> None:
        """Counts the quiet steps taken since the last plan as the turns they were."""
        taken = self._quiet_granted - self.quiet_steps
        self._to_sample -= taken
        self._to_probe -= taken
        self.quiet_steps = self._quiet_granted = 0

    def _plan(self) -> tuple[bool, bool]:
        """One step's turn (each step takes exactly one): sampled, probed. Two countdowns,
        so that the usual step touches nothing else."""
        self._to_sample -= 1
        self._to_probe -= 1
        if self._to_sample and self._to_probe:
            return _NEITHER
        sampled, probed = not self._to_sample, not self._to_probe
        if sampled:
            ratio = self._spell_ratio()
            # the reason of the sample now due, and of the next (spell samples: more of them
            # where steps run slow, so the collector leaves them out of the usual step)
            self._drawn_for = self._gap_for
            self._gap_for = semconv.TRACE_REASON_SAMPLED if ratio is None else semconv.TRACE_REASON_SLOW_SPELL
            self._to_sample = self.policy.next_sample_gap(ratio)
        if probed:
            self._to_probe = self.config.probe_every_steps
        sampled = sampled and self.kernel_spans_available
        return (sampled, probed) if sampled or probed else _NEITHER

    def _spell_ratio(self) -> float | None:
        """The sample ratio during a slow spell (None: the usual one)."""
        if time.monotonic() < self._spell_until:   # never set without spells (slow_limit inf)
            return self.config.slow_sample_ratio
        return None

    def spell_rule_state(self) -> dict:
        """The spell rule's rate of slow decode steps per step (None until known) and the
        slow steps within ``slow_within_steps`` that begin a spell now."""
        return {"slow_step_rate": self._spell_rule.rate, "slow_spell_limit": self._spell_rule.limit()}

    def _slow_step(self, step_id: int) -> None:
        """A decode step well over the recent median: when the spell rule (``SlowSpellRule``)
        says so, the spell begins (the countdown drawn anew at its ratio: draws are
        memoryless) or lasts ``slow_spell_s`` longer."""
        now = time.monotonic()
        if not self._spell_rule.observe(step_id, now < self._spell_until):
            return
        if now >= self._spell_until:
            self.stats.slow_spells += 1
            gap = self.policy.next_sample_gap(self.config.slow_sample_ratio)
            if gap < self._to_sample:
                self._to_sample, self._gap_for = gap, semconv.TRACE_REASON_SLOW_SPELL
        self._spell_until = now + self.config.slow_spell_s

    def end_step(self, step, done=None, graph=None) -> None:
        """Closes the step's tag and hands its probe records to the worker (no device sync)
        if the step is traced or the 1-in-``probe_every_steps`` one; else forgets them.
        ``done``: a CUDA event after the step's kernels (e.g. its token copy), if one exists;
        ``graph``: ``(graphs, bucket)`` when the step replayed a captured graph (its probed
        launches are then snapshotted as the step's)."""
        t0 = time.perf_counter()
        probe = self.probe
        if not (self._open or self._untraced_push or self._probing):
            if probe is not None:   # an eager step's reservations, never read
                probe.discard()
            self.stats.engine_thread_s += time.perf_counter() - t0
            return
        reason, probed = "", False
        try:
            reason, self._open = self._open, ""
            if self._untraced_push:
                self._untraced_push = False
                self.tracer.pop()
            if reason:
                self.tracer.pop()
                if self.waits_for_traced_steps:
                    # The step's tokens are on the host, so its kernels are done: deliver
                    # their records while the kinds are still on (a CUDA graph's kernel
                    # records flushed after the kinds went off carried the flush time as
                    # their end).
                    self.tracer.flush()
                    self._idle_tracer()
                else:   # the worker does both once the step's kernels are done
                    done = done if done is not None else self._done_marker()
                    self._closing = True
                if reason == semconv.TRACE_REASON_SAMPLED:
                    self.stats.steps_traced_sampled += 1
                elif reason == semconv.TRACE_REASON_PREFILL:
                    self.stats.steps_traced_prefill += 1
                elif reason == semconv.TRACE_REASON_SLOW_SPELL:
                    self.stats.steps_traced_spell += 1
                else:
                    self.stats.steps_traced_tail += 1
            pending = None
            if probe is not None:
                if reason or self._probing:
                    self.recorder.name_step(step)   # its records name the step span
                    if graph is not None and graph[0].probe is probe:
                        pending = probe.end_replay(graph[0].launches(graph[1]), step.trace_id,
                                                   step.span_id)
                    else:
                        pending = probe.end_step(step.trace_id, step.span_id)
                    self.stats.steps_probed += pending is not None
                else:
                    probe.discard()
            probed, self._probing = self._probing, False
            if pending is not None or reason:
                if len(self._work_items) < self.config.max_pending_steps:
                    self._work_items.append((step.step_id, pending, time.time_ns(), bool(reason),
                                             done))
                    if reason:
                        self._wake.set()
                else:
                    self.stats.steps_dropped += 1
                    if pending is not None:
                        probe.snapshots.release_newest()
                    if done is not None or self._closing:
                        self._close_traced(None)   # never leave CUPTI recording
        except Exception:
            self.stats.errors += 1
            logger.exception("GpuTelemetry.end_step failed")
        spent = time.perf_counter() - t0
        self.stats.engine_thread_s += spent
        if reason:
            self.stats.engine_thread_traced_s += spent
        elif probed:
            self.stats.engine_thread_probed_s += spent

    def _idle_tracer(self) -> None:
        """Between traced steps: CUPTI detached (``cupti_detach``) or its kinds off."""
        if self.config.cupti_detach:
            with self._cuda_lock:
                self.tracer.detach()
        else:
            self.tracer.disable()

    def observe_step(self, step, duration_s: float, prefill: bool = False) -> None:
        """The tail rule, once the step's wall time is known: a step slower than the recent
        P99.9 arms kernel tracing of the next ``tail_follow_steps`` steps; a step without
        prefill tokens (``prefill`` False) over ``slow_step_factor`` x the recent median
        counts toward a slow spell (``_slow_step``; traced steps stay out of both rules:
        their CUPTI cost would arm the next one). Then plans the next launch: its sample
        draw and probe turn, and ``next_step_plain`` when it needs neither (nor anything
        pending), so that the engine skips ``begin_step`` and ``end_step`` on the usual
        step. The plan holds until a step begins or the next
        ``observe_step``. (The engine counts this call's time as its telemetry time.)

        The usual step is quiet: a plain plan granted it (no countdown and no window refresh
        due before it), it was not recorded and is not slower than either limit. It only joins
        the tail window: its turn is the plain one it was granted, settled at the next plan.
        (The engine takes quiet steps itself, without this call: see ``quiet_steps``.)"""
        if self.quiet_steps and duration_s <= self.quiet_limit and not step.cupti_recorded:
            self.quiet_steps -= 1
            self.quiet_durations.append(duration_s)   # what is_tail does with it
            return
        self._settle_quiet()
        if not step.cupti_recorded:
            slow = not prefill and duration_s > self.policy.slow_limit   # the limit before this step
            if self.policy.is_tail(duration_s):
                self.stats.tail_steps += 1
                if self.kernel_spans_available:   # else nothing would ever take the follow-up
                    self._follow = self.config.tail_follow_steps
            if slow and self.kernel_spans_available:
                self._slow_step(step.step_id)
        # a plan not taken (the last launch was plain) was that launch's: draw anew
        self._planned = plan = self._plan()
        self.next_step_plain = plain = plan is _NEITHER and not (self._closing or self._follow
                                                                 or self._owed)
        if plain:   # both countdowns are >= 1 here
            policy = self.policy
            self.quiet_steps = self._quiet_granted = max(
                min(self._to_sample, self._to_probe, policy.room() + 1) - 1, 0)
            # the limits change only at the next refresh, which no quiet step reaches; a
            # step over either needs the rules above
            self.quiet_limit = min(policy.limit, policy.slow_limit)
            self.quiet_durations = policy.batch

    def flush(self, timeout_s: float = 30.0, export: bool = True) -> bool:
        """Hands over every step so far (CUPTI flushed) and, with ``export``, the
        histograms now. Blocks; for tests, benchmarks and shutdown."""
        done = threading.Event()
        self._work_items.append(("flush", export, done))
        self._wake.set()
        return done.wait(timeout_s)

    def shutdown(self) -> None:
        try:
            self.flush(export=True)
        finally:
            self._stop_worker()
            if self.tracer is not None:
                self.tracer.stop()

    def _stop_worker(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._worker.join(timeout=timeout_s)
        cancel_stop_at_exit(self)

    # -- CUPTI's thread -------------------------------------------------------------------
    def _on_buffer(self, buffer: bytes) -> None:
        self.stats.cupti_buffers += 1
        self.recorder.record(KernelActivity(buffer))

    # -- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            # asleep until a traced step, a flush, the next export or the next poll for
            # probed steps: each wake-up takes the engine's GIL
            wait_s = self._last_export + self.config.export_interval_s - time.monotonic()
            self._wake.wait(min(max(wait_s, 0.001), self.config.probe_poll_s))
            self._wake.clear()   # before taking the items: a later set() wakes the next wait
            if self._stop.is_set():
                break
            cpu0 = time.thread_time()
            try:
                with self._cuda_lock:
                    self._work()
            except Exception:
                self.stats.errors += 1
                logger.exception("GPU telemetry worker step failed")
            finally:
                self.stats.worker_cpu_s += time.thread_time() - cpu0

    def _work(self) -> None:
        self._retire_snapshots()
        items = self._work_items
        while items:
            item = items.popleft()
            if item[0] == "flush":
                _, export, done = item
                self._reduce_probe_batch()
                if self.tracer is not None:
                    self.tracer.flush()
                if export:
                    self._export()
                done.set()
            else:
                self._take_step(*item)
        if time.monotonic() - self._last_export >= self.config.export_interval_s:
            self._export()

    def _close_traced(self, done) -> None:
        """After a traced step's kernels (``done``: an event recorded after them, or None):
        its records delivered while the kinds are still on, then CUPTI switched off."""
        if done is not None:
            done.synchronize()       # lets the GIL go while it waits
        cpu0, t0 = time.thread_time(), time.perf_counter()
        self.tracer.flush()
        t1 = time.perf_counter()
        self._idle_tracer()
        self._closing = False
        self.stats.worker_flush_wall_s += t1 - t0
        self.stats.worker_kinds_off_wall_s += time.perf_counter() - t1
        self.stats.worker_close_cpu_s += time.thread_time() - cpu0

    def _take_step(self, step_id: int, pending, end_ns: int, traced: bool, done=None) -> None:
        if traced and self._closing:
            self._close_traced(done)
        if pending is not None and self.histograms is not None:
            self._probe_batch.append((pending, end_ns))
            self._probe_batch_words += pending.words
            self.stats.ctas_probed += sum(n for _, n in pending.launches)
            if traced:   # this step's launch facts, reduced where its CTAs lie (the ring range stays live)
                cpu0, t0 = time.thread_time(), time.perf_counter()
                import torch
                with torch.cuda.stream(self._side):
                    self._side.wait_stream(self._engine_stream)
                    facts = launch_facts_of_records(pending.snapshot, list(pending.launches))
                self.recorder.record(StepLaunchFacts(step_id, facts))
                self.stats.worker_step_ctas_wall_s += time.perf_counter() - t0
                self.stats.worker_step_ctas_cpu_s += time.thread_time() - cpu0
            if (len(self._probe_batch) >= self.config.probe_batch_steps
                    or self._probe_batch_words >= self.probe.snapshots.words // 2):
                self._reduce_probe_batch()   # the ring's ranges come back only after it
        if self.probe is not None:
            self.stats.probe_launches_dropped = self.probe.dropped_launches
            self.stats.probe_snapshots_dropped = self.probe.dropped_snapshots

    def _reduce_probe_batch(self) -> None:
        """Enqueues the on-GPU histogram reduction of the batched steps' probe records (one
        set of torch ops for the whole batch) on the side stream, after their kernels."""
        batch, self._probe_batch = self._probe_batch, []
        self._probe_batch_words = 0
        if not batch:
            return
        cpu0 = time.thread_time()
        import torch
        with torch.cuda.stream(self._side):
            # after every snapshot copy in the batch: each was enqueued before its queue item
            # (an event per snapshot would cost the engine thread a GIL hand-off per step)
            self._side.wait_stream(self._engine_stream)
            self.histograms.add_steps([(p.snapshot, p.launches, p.trace_id, p.span_id, end_ns)
                                       for p, end_ns in batch])
            done = torch.cuda.Event()
            done.record(self._side)
        self._retiring.append((done, batch[-1][0]))   # its ranges come back once done
        self.stats.worker_reduce_cpu_s += time.thread_time() - cpu0

    def _retire_snapshots(self) -> None:
        """Gives the ring back the ranges of batches whose reductions the GPU finished."""
        while self._retiring and self._retiring[0][0].query():
            self._retiring.popleft()[1].retire()

    def _export(self) -> None:
        self._last_export = time.monotonic()
        if self.histograms is None:
            return
        self._reduce_probe_batch()
        import torch
        with torch.cuda.stream(self._side):
            hists, exemplars = self.histograms.take()
            dealt = self.histograms.take_dealt()
            mix = self.histograms.take_launch_mix()
        now = time.time_ns()
        start, self._interval_start_ns = self._interval_start_ns, now
        if hists:
            self.recorder.record(CtaHistograms(hists, exemplars, start, now, launch_mix=mix,
                                               num_sms=self.histograms.num_sms, dealt=dealt))
            self.stats.histogram_exports += 1


def _cuda_event():
    """An event recorded on the current stream: done when the work enqueued so far is."""
    import torch
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _gpu_uuid(device_index: int) -> str | None:
    """The GPU's NVML UUID (stable across processes and hosts), or None."""
    try:
        import pynvml
        pynvml.nvmlInit()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(device_index))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except Exception:
        return None
