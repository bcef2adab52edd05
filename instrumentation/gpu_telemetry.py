"""GPU telemetry for an engine's steps: kernel spans (CUPTI) and per-SM CTA histograms.

Contract (TEAM.md): ``GpuTelemetry.create(telemetry, device_index)`` -> instance or None;
``.probe`` goes to the attention ops (None = off); ``begin_step(step_trace)`` /
``end_step(step_trace)`` bracket each engine step on the engine thread; ``shutdown()``.

On the engine thread each step costs: one random draw, one device-side copy of the step's
probe records (24 bytes per CTA, stream-ordered) and a queue put; a traced step also
switches CUPTI's activity kinds on and off around its launches and pushes and pops its
external-correlation id. Everything else happens on one worker thread:

1. The steps' probe records are reduced ON THE GPU, ``probe_batch_steps`` steps at a time
   (``sm_histograms``: ~25 torch ops per batch on the worker's own stream, ordered after
   the steps by an event; no host sync; batched because per step those ops cost the worker
   ~3 ms of CPU, measured on the H200, against a ~30 ms step) into
   per-(gpu, SM, kernel) exponential histograms, always on, with an exemplar per key
   pointing at the step span whose CTA on that SM was slowest in the export interval.
   Records come to the host only for steps whose kernel spans are emitted.
2. Kernel spans come from CUPTI, switched on only for the steps they are kept for. The
   policy decides when a step BEGINS (on the engine thread, one random draw): a sampled
   fraction of steps (``kernel_sample_ratio``, 0.2 % by default), and the
   ``tail_follow_steps`` steps after any step slower than the ``tail_quantile`` (P99.9)
   of the recent ``tail_window_steps`` (the worker compares each untraced step's wall
   duration with that quantile when it takes the step; a slow step's cause — a long
   prefill chunk, a large batch — usually persists for the next steps). Left out of that
   rule: traced steps, and the steps that ran while a traced step's records were still
   being processed, which are marked ``sightline.step.kernel_trace_backlog`` (that work
   takes the GIL: on the H200 the step after a traced one took ~460 ms instead of ~40).
   A traced step's span carries ``sightline.step.kernel_trace_reason``.
   Why not record every step and keep the slow ones
   afterwards: measured on the H200 (llama-8b shape, 64 concurrent), CUPTI recording every
   kernel of every step cut output tokens/s to 0.10-0.14x, because cupti-python hands each
   record to Python (~1,500 records per step of an eager engine) on a thread that holds
   the GIL; a traced step costs 151-206 ms of CPU (bench/results/overhead.md).
   The worker joins the records to the traced steps by external id and emits the spans
   once a step's records went quiet (``settle_s``) or ``max_wait_s`` passed. Kernel spans
   are children of the step span, timestamped with the GPU's start/end, with grid, block,
   registers, shared memory, stream, device, and for probed kernels SMs used, waves,
   slowest SM, CTAs and CTA-duration spread.
3. Every ``export_interval_s`` the histograms go out as OTLP metric
   ``gpu.kernel.cta.duration`` (unit s, delta temporality) through the OTLP metric
   exporter of the telemetry's config, and into its capture file when one is set
   (the metric's OTLP form and destinations: ``cta_metrics.py``).

Failure model: every public method swallows and logs its own errors (telemetry errors
never reach a request); a full work queue drops the step's GPU data and counts it.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import semconv
from .cta_metrics import build_cta_metrics, metric_exporters_from, resource_of
from .cupti_tracer import CuptiTracer, KernelRecord
from .sm_probe import LaunchFacts, SmProbe, launch_facts

__all__ = ["GpuTelemetry", "GpuTelemetryConfig", "GpuTelemetryStats", "TailPolicy", "build_cta_metrics",
           "kernel_span_attributes", "kernel_span_name"]

logger = logging.getLogger(__name__)
_SPAN_NAME_MAX = 160
_FLUSH_AFTER_NS = 50_000_000   # a traced step's kernels have finished well within this


@dataclass(frozen=True)
class GpuTelemetryConfig:
    """Knobs of the GPU telemetry; ranges checked, errors name the bad value."""

    kernel_sample_ratio: float = 0.002  # fraction of steps whose kernels become spans
    tail_quantile: float = 0.999        # a step slower than this quantile arms tail tracing
    tail_window_steps: int = 1024       # recent steps the quantile is taken over
    tail_min_steps: int = 64            # no tail rule before this many steps
    tail_follow_steps: int = 1          # steps traced after a step slower than the quantile
    settle_s: float = 1.0               # quiet time after a traced step's last CUPTI record
    backlog_grace_s: float = 1.0        # steps this soon after a traced step's kernel spans
                                        # were emitted are still marked (their export runs)
    max_wait_s: float = 10.0            # give up waiting for a traced step's records
    cupti: bool = True                  # kernel spans (CUPTI)
    probe: bool = True                  # per-CTA SM probe in our Triton kernels
    probe_capacity_ctas: int = 1 << 20  # CTAs probed per step (24 B each on the device)
    probe_batch_steps: int = 32         # steps whose probe records are reduced together
    export_interval_s: float = 10.0
    max_pending_steps: int = 4096
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.kernel_sample_ratio <= 1.0:
            raise ValueError(f"kernel_sample_ratio={self.kernel_sample_ratio} not in [0, 1]")
        if not 0.5 <= self.tail_quantile <= 1.0:
            raise ValueError(f"tail_quantile={self.tail_quantile} not in [0.5, 1]")
        if not 8 <= self.tail_window_steps <= 1_000_000:
            raise ValueError(f"tail_window_steps={self.tail_window_steps} not in [8, 1e6]")
        if not 1 <= self.tail_min_steps <= self.tail_window_steps:
            raise ValueError(f"tail_min_steps={self.tail_min_steps} not in "
                             f"[1, tail_window_steps={self.tail_window_steps}]")
        if not 0 <= self.tail_follow_steps <= 1_000:
            raise ValueError(f"tail_follow_steps={self.tail_follow_steps} not in [0, 1000]")
        if not 0.0 <= self.settle_s <= 60.0:
            raise ValueError(f"settle_s={self.settle_s} not in [0, 60]")
        if not 0.0 <= self.backlog_grace_s <= 60.0:
            raise ValueError(f"backlog_grace_s={self.backlog_grace_s} not in [0, 60]")
        if not self.settle_s <= self.max_wait_s <= 600.0:
            raise ValueError(f"max_wait_s={self.max_wait_s} not in [settle_s={self.settle_s}, 600]")
        if not 1 <= self.probe_capacity_ctas <= 1 << 26:
            raise ValueError(f"probe_capacity_ctas={self.probe_capacity_ctas} not in [1, 2**26]")
        if not 0.01 <= self.export_interval_s <= 3600:
            raise ValueError(f"export_interval_s={self.export_interval_s} not in [0.01, 3600]")
        if not 1 <= self.probe_batch_steps <= 4096:
            raise ValueError(f"probe_batch_steps={self.probe_batch_steps} not in [1, 4096]")
        if not 1 <= self.max_pending_steps <= 1_000_000:
            raise ValueError(f"max_pending_steps={self.max_pending_steps} not in [1, 1e6]")


class TailPolicy:
    """Which steps get kernel spans. ``sample()`` (engine thread, when a step begins): True
    with probability ``ratio``. ``is_tail(duration_s)`` (worker, when a step ended): True if
    the step was slower than the ``quantile`` of the previous ``window`` steps (the current
    one excluded; no rule before ``min_steps``); O(window) per call."""

    def __init__(self, ratio: float, quantile: float, window: int, min_steps: int,
                 rng: random.Random, refresh_steps: int = 1) -> None:
        self.ratio, self.quantile, self.min_steps, self.rng = ratio, quantile, min_steps, rng
        self._recent: deque[float] = deque(maxlen=window)
        # the quantile is recomputed every ``refresh_steps`` steps (O(window) each time)
        self.refresh_steps = refresh_steps
        self._limit: float | None = None
        self._since_refresh = refresh_steps

    def threshold(self) -> float | None:
        if len(self._recent) < self.min_steps:
            return None
        return float(np.quantile(np.fromiter(self._recent, float), self.quantile,
                                 method="higher"))

    def is_tail(self, duration_s: float) -> bool:
        if self._since_refresh >= self.refresh_steps or self._limit is None:
            self._limit, self._since_refresh = self.threshold(), 0
        self._since_refresh += 1
        limit = self._limit
        self._recent.append(duration_s)
        return limit is not None and duration_s > limit

    def sample(self) -> bool:
        return self.ratio > 0.0 and self.rng.random() < self.ratio


@dataclass
class GpuTelemetryStats:
    steps: int = 0
    steps_dropped: int = 0          # work queue full: the step's GPU data was not kept
    steps_traced_sampled: int = 0
    steps_traced_tail: int = 0      # traced because a recent step was slower than the P99
    tail_steps: int = 0             # steps slower than the recent P99
    steps_backlog: int = 0          # steps that ran while traced steps' records were processed
    kernel_spans: int = 0
    kernels_seen: int = 0
    kernels_unmatched: int = 0      # CUPTI kernels with no known step (outside steps, late)
    kernels_skipped: int = 0        # kernels of steps the policy did not trace
    ctas_probed: int = 0            # grid CTAs of probed launches (idle ones included)
    probe_launches_dropped: int = 0
    metric_exports: int = 0
    export_failures: int = 0
    errors: int = 0
    engine_thread_s: float = 0.0    # time spent in begin_step/end_step (the request path)
    worker_probe_s: float = 0.0     # worker: enqueueing the on-GPU histogram reduction
    worker_match_s: float = 0.0     # worker: draining CUPTI and joining kernels to steps
    worker_settle_s: float = 0.0    # worker: policy decisions and kernel spans
    worker_cpu_s: float = 0.0       # worker thread's CPU time in all of the above and flushes
                                    # (wall times above include waits for the GIL; this not)


@dataclass
class _Step:
    ext_id: int
    step_id: int
    span_context: object
    start_ns: int
    end_ns: int
    pending: object | None                     # PendingCtas
    ctas: object | None = None                 # PendingCtas; to the host only if traced
    reason: str = ""                           # "sampled" | "after_tail" | "" (at begin_step)
    backlog: bool = False                      # ran while a traced step was being processed
    last_match_ns: int = 0                     # wall time a kernel was last joined to it
    flushed: bool = False                      # CUPTI was asked to deliver its records
    kernels: list[KernelRecord] = field(default_factory=list)


def kernel_span_name(kernel_name: str) -> str:
    """``kernel <name>``, cut to a length span stores accept (C++ names run to kilobytes)."""
    return (semconv.SPAN_KERNEL_PREFIX + kernel_name)[:_SPAN_NAME_MAX]


def kernel_span_attributes(kernel: KernelRecord, gpu_id: int,
                           facts: LaunchFacts | None = None) -> dict:
    """A kernel span's attributes. Only what the kernel adds: its step's id and why it was
    traced are on the parent step span, and CUPTI's device id is ``gpu_id``. Each
    attribute costs the span exporter ~8 µs of OTLP encoding (~50 µs a span without any),
    and a traced step has 730-1,551 of them on the H200 (``bench/tracing_overhead.py``)."""
    attrs = {
        semconv.CUDA_KERNEL_NAME: kernel.name,
        semconv.CUDA_GRID: f"{kernel.grid[0]},{kernel.grid[1]},{kernel.grid[2]}",
        semconv.CUDA_BLOCK: f"{kernel.block[0]},{kernel.block[1]},{kernel.block[2]}",
        semconv.CUDA_REGISTERS: kernel.registers_per_thread,
        semconv.CUDA_SHARED_MEMORY_BYTES: kernel.shared_memory_bytes,
        semconv.CUDA_STREAM: kernel.stream_id,
        semconv.CUDA_CORRELATION_ID: kernel.correlation_id,
        semconv.HW_GPU_ID: gpu_id,
    }
    if facts is not None:
        attrs.update({semconv.KERNEL_CTAS: facts.ctas, semconv.KERNEL_SMS_USED: facts.sms_used,
                      semconv.KERNEL_WAVES: facts.waves,
                      semconv.KERNEL_SLOWEST_SM: facts.slowest_sm,
                      semconv.KERNEL_CTA_SPREAD: round(facts.cta_spread, 4)})
    return attrs


class GpuTelemetry:
    """See the module docstring. Create with ``GpuTelemetry.create``."""

    def __init__(self, telemetry, device_index: int = 0,
                 config: GpuTelemetryConfig | None = None, metric_exporters=None) -> None:
        self.telemetry = telemetry
        self.device_index = device_index
        if config is None:
            ratio = getattr(getattr(telemetry, "config", None), "kernel_sample_ratio", 0.002)
            config = GpuTelemetryConfig(kernel_sample_ratio=ratio)
        self.config = config
        self.stats = GpuTelemetryStats()
        self.policy = TailPolicy(config.kernel_sample_ratio, config.tail_quantile,
                                 config.tail_window_steps, config.tail_min_steps,
                                 random.Random(config.seed), refresh_steps=16)
        self.tracer = CuptiTracer() if config.cupti else None
        if self.tracer is not None:
            if self.tracer.start():
                self.tracer.disable()       # idle until a traced step switches it on
            else:
                logger.warning("GPU telemetry continues without kernel spans: %s",
                               self.tracer.unavailable_reason)
        self.probe: SmProbe | None = None
        self.histograms = None
        self._side = None
        if config.probe:
            import torch

            from .sm_histograms import DeviceCtaHistograms
            device = torch.device(f"cuda:{device_index}")
            self.probe = SmProbe(device, config.probe_capacity_ctas, gpu_id=device_index)
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.histograms = DeviceCtaHistograms(device, device_index, num_sms)
            self._side = torch.cuda.Stream(device=device)
        self._exporters = (list(metric_exporters) if metric_exporters is not None
                           else metric_exporters_from(telemetry))
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_pending_steps)
        self._next_ext = 1
        self._open: tuple[int, str] | None = None  # the running step: (external id, reason)
        self._follow = 0          # steps still to trace after a slow one (worker sets it)
        # Kernel-trace backlog: a traced step's ~1,000 CUPTI records are processed on other
        # threads of this process, for 151-206 ms of CPU (H200), and they take the GIL from
        # the engine thread: in the H200 capture the step after a traced one took ~460 ms
        # instead of ~40. Steps that run meanwhile are marked and kept out of the tail rule
        # (else each would arm the next trace). Counters with one writer each, read
        # without a lock: traced steps handed to the worker (engine thread), settled (worker).
        self._traced_handed_over = 0
        self._traced_settled = 0
        self._backlog_until_ns = 0   # worker: last settle + backlog_grace_s
        self._probe_batch: list = []   # (PendingCtas, end_ns) of steps not yet reduced
        self._awaiting: dict[int, _Step] = {}     # traced steps waiting for CUPTI records
        self._skipped: deque[int] = deque()        # recent untraced steps' external ids
        self._skipped_set: set[int] = set()
        self._interval_start_ns = time.time_ns()
        self._last_export = time.monotonic()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name="sightline-gpu-telemetry",
                                        daemon=True)
        self._worker.start()

    @classmethod
    def create(cls, telemetry, device_index: int = 0, config: GpuTelemetryConfig | None = None,
               metric_exporters=None) -> GpuTelemetry | None:
        """An instance, or None (logged why) without CUDA or below the KERNELS level."""
        if telemetry is None or not getattr(telemetry, "kernels_on", False):
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
            return cls(telemetry, device_index, config, metric_exporters)
        except Exception:
            logger.exception("GPU telemetry could not start; continuing without it")
            return None

    @property
    def kernel_spans_available(self) -> bool:
        return self.tracer is not None and self.tracer.available

    # -- engine thread ----------------------------------------------------------------
    def begin_step(self, step_trace) -> None:
        """Decides whether the step gets kernel spans; if so, switches CUPTI on and tags the
        step's CUDA launches (external correlation)."""
        if step_trace is None:
            return
        t0 = time.perf_counter()
        try:
            ext = self._next_ext
            self._next_ext += 1
            reason = ""
            if self.tracer is not None and self.tracer.available:
                if self._follow > 0:
                    self._follow -= 1
                    reason = "after_tail"
                elif self.policy.sample():
                    reason = "sampled"
                if reason:
                    self.tracer.enable()
                    self.tracer.push(ext)
                    step_trace.set_attributes({semconv.STEP_TRACE_REASON: reason})
            self._open = (ext, reason)
        except Exception:
            self.stats.errors += 1
            logger.exception("GpuTelemetry.begin_step failed")
        self.stats.engine_thread_s += time.perf_counter() - t0

    def end_step(self, step_trace) -> None:
        """Closes the step's tag and hands its GPU data to the worker (no device sync).
        Called before the step span ends, it marks a step that ran during a kernel-trace
        backlog (``semconv.STEP_KERNEL_TRACE_BACKLOG``)."""
        if step_trace is None or self._open is None:
            return
        t0 = time.perf_counter()
        try:
            (ext, reason), self._open = self._open, None
            if reason:
                self.tracer.pop()
                self.tracer.disable()
            ctx = step_trace.span_context
            pending = None
            if self.probe is not None:
                pending = self.probe.end_step(ctx.trace_id, ctx.span_id)
            end_ns = step_trace.end_time_ns or time.time_ns()
            backlog = (self._traced_handed_over > self._traced_settled
                       or step_trace.start_time_ns < self._backlog_until_ns)
            if backlog:
                step_trace.set_attributes({semconv.STEP_KERNEL_TRACE_BACKLOG: True})
                self.stats.steps_backlog += 1
            step = _Step(ext, step_trace.step_id, ctx, step_trace.start_time_ns, end_ns, pending,
                         reason=reason, backlog=backlog)
            self.stats.steps += 1
            if reason:
                self._traced_handed_over += 1   # before the put: the worker may settle it at once
            try:
                self._queue.put_nowait(step)
            except queue.Full:
                self.stats.steps_dropped += 1
                if reason:
                    self._traced_handed_over -= 1
        except Exception:
            self.stats.errors += 1
            logger.exception("GpuTelemetry.end_step failed")
        self.stats.engine_thread_s += time.perf_counter() - t0

    def flush(self, timeout_s: float = 30.0, export: bool = True) -> bool:
        """Settles every step handed over so far (CUPTI flushed, spans emitted) and, with
        ``export``, exports the histograms now. Blocks; for tests, benchmarks, shutdown."""
        done = threading.Event()
        try:
            self._queue.put(("flush", export, done), timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def shutdown(self) -> None:
        try:
            self.flush(export=True)
        finally:
            self._stop.set()
            self._worker.join(timeout=10)
            if self.tracer is not None:
                self.tracer.stop()

    # -- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                item = None
            cpu0 = time.thread_time()
            try:
                t0 = time.perf_counter()
                if isinstance(item, _Step):
                    self._take_step(item)
                    self.stats.worker_probe_s += time.perf_counter() - t0
                    continue   # take every queued step before matching kernels
                if isinstance(item, tuple):
                    _, export, done = item
                    self._match(flush=True)
                    self._settle(force=True)
                    if export:
                        self._export()
                    done.set()
                    continue
                self._match(flush=False)
                t1 = time.perf_counter()
                self._settle(force=False)
                self.stats.worker_match_s += t1 - t0
                self.stats.worker_settle_s += time.perf_counter() - t1
                if time.monotonic() - self._last_export >= self.config.export_interval_s:
                    self._export()
            except Exception:
                self.stats.errors += 1
                logger.exception("GPU telemetry worker step failed")
            finally:
                self.stats.worker_cpu_s += time.thread_time() - cpu0

    def _take_step(self, step: _Step) -> None:
        pending, step.pending = step.pending, None
        if pending is not None and self.histograms is not None:
            self._probe_batch.append((pending, step.end_ns))
            if len(self._probe_batch) >= self.config.probe_batch_steps:
                self._reduce_probe_batch()
            self.stats.ctas_probed += sum(n for _, n in pending.launches)
            step.ctas = pending
        if self.probe is not None:
            self.stats.probe_launches_dropped = self.probe.dropped_launches
        # Traced steps and those run during their backlog are left out of the tail rule:
        # kernel tracing makes them slow (H200: ~10x), so each would arm the next trace,
        # which would slow the next step, which would arm the next, ...
        if (not step.reason and not step.backlog
                and self.policy.is_tail((step.end_ns - step.start_ns) * 1e-9)):
            self._follow = self.config.tail_follow_steps    # read by begin_step
            self.stats.tail_steps += 1
        if step.reason and self.tracer is not None and self.tracer.available:
            self._awaiting[step.ext_id] = step
        else:
            if step.reason:
                self._traced_settled += 1       # traced, but CUPTI is unavailable
            self._skipped.append(step.ext_id)
            self._skipped_set.add(step.ext_id)
            while len(self._skipped) > 4 * self.config.max_pending_steps:
                self._skipped_set.discard(self._skipped.popleft())

    def _reduce_probe_batch(self) -> None:
        """Enqueues the on-GPU histogram reduction of the batched steps' probe records (one
        set of torch ops for the whole batch) on the side stream, after their kernels."""
        batch, self._probe_batch = self._probe_batch, []
        if not batch:
            return
        import torch
        with torch.cuda.stream(self._side):
            last_event = batch[-1][0].event
            if last_event is not None:           # recorded after every earlier step's copy
                self._side.wait_event(last_event)
            for pending, _ in batch:
                pending.snapshot.record_stream(self._side)
            self.histograms.add_steps([(p.snapshot, p.launches, p.trace_id, p.span_id, end_ns)
                                       for p, end_ns in batch])

    def _match(self, flush: bool) -> None:
        if self.tracer is None or not self.tracer.available:
            return
        batch = self.tracer.drain(flush=flush)
        now = time.time_ns()
        for k in batch.kernels:
            self.stats.kernels_seen += 1
            step = self._awaiting.get(k.external_id) if k.external_id is not None else None
            if step is not None:
                step.kernels.append(k)
                step.last_match_ns = now
            elif k.external_id in self._skipped_set:
                self.stats.kernels_skipped += 1
            else:
                self.stats.kernels_unmatched += 1

    def _settle(self, force: bool) -> None:
        """Emits a traced step's kernel spans once its records went quiet for ``settle_s``
        (CUPTI may deliver them in several buffers, seconds late), or at ``max_wait_s``."""
        if not self._awaiting:
            return
        now = time.time_ns()
        # CUPTI is off between traced steps, so a traced step's records sit in a part-full
        # buffer: once its kernels have had time to finish, ask CUPTI to deliver them (one
        # forced flush for every step due; they are few, so this stays cheap).
        due = [st for st in self._awaiting.values()
               if not st.flushed and now - st.end_ns >= _FLUSH_AFTER_NS]
        if due and not force:
            self.tracer.flush()
            for st in due:
                st.flushed = True
            self._match(flush=False)
        quiet, limit = int(self.config.settle_s * 1e9), int(self.config.max_wait_s * 1e9)
        for ext in sorted(self._awaiting):
            step = self._awaiting[ext]
            waited = now - step.end_ns
            ready = force or waited >= limit or (
                step.kernels and waited >= quiet and now - step.last_match_ns >= quiet)
            if not ready:
                continue
            del self._awaiting[ext]
            reason = step.reason
            if reason and step.kernels:
                if reason == "after_tail":
                    self.stats.steps_traced_tail += 1
                else:
                    self.stats.steps_traced_sampled += 1
                self._emit_spans(step)
            # the grace covers the span export that follows, on the exporter's thread
            self._backlog_until_ns = time.time_ns() + int(self.config.backlog_grace_s * 1e9)
            self._traced_settled += 1

    def _emit_spans(self, step: _Step) -> None:
        spans = self.telemetry.finished_spans   # built finished: ~1,000 per traced step
        parent = step.span_context
        # pair the i-th probed launch of a kernel with its i-th CUPTI record (launch order)
        facts_by_name: dict[str, deque[LaunchFacts]] = {}
        for f in self._facts(step):
            facts_by_name.setdefault(f.kernel_name, deque()).append(f)
        for k in sorted(step.kernels, key=lambda r: r.correlation_id):
            queue_ = facts_by_name.get(k.name)
            attrs = kernel_span_attributes(k, self.device_index,
                                           queue_.popleft() if queue_ else None)
            spans.emit(kernel_span_name(k.name),
                       spans.child_context(parent), parent, k.start_ns, k.end_ns, attrs)
            self.stats.kernel_spans += 1

    def _facts(self, step: _Step) -> list[LaunchFacts]:
        if step.ctas is None:
            return []
        import torch
        with torch.cuda.stream(self._side):   # the side stream already waited for the step
            return launch_facts(step.ctas.wait())

    def _export(self) -> None:
        self._last_export = time.monotonic()
        if self.histograms is None:
            return
        self._reduce_probe_batch()
        import torch
        with torch.cuda.stream(self._side):
            hists, exemplars = self.histograms.take()
        now = time.time_ns()
        start, self._interval_start_ns = self._interval_start_ns, now
        if not hists or not self._exporters:
            return
        data = build_cta_metrics(hists, exemplars, start, now, resource_of(self.telemetry))
        for exporter in self._exporters:
            try:
                result = exporter.export(data)
                ok = getattr(result, "name", "SUCCESS") == "SUCCESS"
            except Exception:
                logger.exception("exporting %s failed", semconv.METRIC_CTA_DURATION)
                ok = False
            self.stats.metric_exports += 1
            if not ok:
                self.stats.export_failures += 1
