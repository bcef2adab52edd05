"""The engine core: schedule, launch, complete, and one ``OutputBatch`` per step. No text.

``EngineCore`` owns the scheduler and KV block manager (plain Python), the model runner
(device, CUDA graphs) and the GPU telemetry; built, it is warm (``engine/warmup.py``). A
step turns the scheduler's plan into device work and the sampled tokens into an
``OutputBatch`` (new tokens, or final figures on eos, max_tokens, abort, failure); text and
stop strings belong to the caller (``finish_stop``). Overlapped scheduling
(``async_scheduling``, on with CUDA) plans and launches the next step before the one on the
device is waited for. Telemetry: Queued and Step events for the keys in ``AddRequest``, O(1)
appends per step (a null recorder when off); a kernel variant a launch meets after start-up
is counted (``CoreMetrics``) and set on its step span. ``add_request`` and ``abort`` may be
called from any thread; stepping and ``finish_stop`` from one. The scheduler's lock is
never held around the model. Tensor parallelism: the core is rank 0 (``tp_workers``); a
worker's death or a failed step fails the group for good (``failed``): live requests end
with that error, new ones are refused, the caller stops the core.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from ..instrumentation import OpenStep, Queued, Step, TelemetryPipeline
from ..instrumentation import semconv as sc
from .compile_cache import resolve_compile_cache
from .compile_watch import compile_watch, step_compile_attributes
from .config import EngineConfig, resolve_model_config
from .core_records import (ERROR_ENGINE, AddRequest, FinalOutput, OutputBatch, Ready,
                           StepStats)
from .kv_cache import KVCacheConfig, KVCacheManager
from .metrics import CoreMetrics
from .request import FinishReason, Request
from .scheduler import QueueFullError, Scheduler, StepPlan
from .startup import StartupProgress
from .tokenizer import load_tokenizer

if TYPE_CHECKING:   # torch comes with the engine, not with this module
    from ..instrumentation import LifecycleRecorder
    from .model_runner import LaunchedStep, ModelRunner, StepExecution

__all__ = ["EngineCore", "EngineStoppedError", "QueueFullError"]

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine is draining or stopped: no new requests (the server answers 503)."""


class _NullRecorder:
    """The recorder when tracing is off: every call does nothing (no checks in the step)."""

    def record(self, event) -> None:
        pass

    def record_later(self, build, *args) -> None:
        pass


class _NoGpuTelemetry:
    """GPU telemetry when kernel tracing is off: the step's wall time goes nowhere."""

    def observe_step(self, step, duration_s: float, prefill: bool = False) -> None:
        pass


_NULL_RECORDER = _NullRecorder()
_NO_GPU = _NoGpuTelemetry()


@dataclasses.dataclass
class _Launched:
    """A step on the device, applied to the scheduler with stand-ins for its tokens."""

    plan: StepPlan
    step: OpenStep                  # its telemetry record
    run: LaunchedStep
    finished: list[Request]         # requests it ends on max_tokens (outputs still to make)
    t0: float                       # perf_counter at launch
    launch_cpu_ns: int | None       # a traced step's thread CPU time in its launch (STEP_HOST_CPU_S)


class _Outputs:
    """One step's outputs while they are made: the two columns and the ended requests."""

    __slots__ = ("ids", "tokens", "finished")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.tokens: list[int] = []
        self.finished: list[FinalOutput] = []

    def __bool__(self) -> bool:
        return bool(self.ids or self.finished)


def _without_ended(plan: StepPlan) -> StepPlan | None:
    """The plan without the requests that ended after it was made (None if none is left)."""
    kept = [e for e in plan.scheduled if not e.request.is_finished]
    if len(kept) == len(plan.scheduled):
        return plan
    if not kept:
        return None
    prefill = sum(e.num_new_tokens for e in kept if e.is_prefill)
    return dataclasses.replace(plan, scheduled=kept, num_prefill_tokens=prefill,
                               num_decode_tokens=sum(e.num_new_tokens for e in kept) - prefill)


def _traced(step: OpenStep | None) -> bool:
    """Whether the GPU telemetry traced the step's kernels (it set a trace reason at launch)."""
    return bool(step is not None and step.attributes and sc.STEP_TRACE_REASON in step.attributes)


def _step_event(recorder: LifecycleRecorder, plan: StepPlan, step: OpenStep, end_ns: int,
                prefill_done: list, execution: StepExecution | None, runner: ModelRunner,
                error_type: str | None) -> Step:
    """The Step event of a closed step, built on the telemetry's thread (the plan, its
    requests' keys and the step's attributes no longer change once it is closed); the step
    span's ids are drawn here unless the GPU telemetry drew them. How the step ran
    (``execution``) is shown where the engine has a static decode path."""
    if runner.graphs is None:
        execution = None
    scheduled = plan.scheduled
    recorder.name_step(step)
    # a request's key, None when it is not traced (the assembler skips those)
    keys = tuple([e.request.telemetry for e in scheduled])
    preempted = tuple([r.telemetry for r in plan.preempted]) if plan.preempted else ()
    attributes = step.attributes
    if execution is not None:
        attributes = {**(attributes or {}), **execution.attributes()}
    num_decode = plan.num_decode_tokens      # one token per decode
    return Step(step.step_id, step.start_ns, end_ns, step.trace_id, step.span_id, keys,
                len(scheduled), preempted, tuple([k for k in prefill_done if k is not None]),
                plan.num_prefill_tokens, num_decode, len(scheduled) - num_decode, num_decode,
                plan.kv_blocks_used, plan.kv_blocks_total, error_type, attributes,
                plan.num_cached_prefill_tokens if plan.prefix_caching else None)


class EngineCore:
    """One model, one device; stepped by one thread (``step`` / ``step_overlapped``)."""

    def __init__(self, config: EngineConfig, telemetry: TelemetryPipeline | None = None,
                 startup: StartupProgress | None = None) -> None:
        """Loads the model, sizes the KV cache and warms up (``engine/warmup.py``): once
        constructed, the core is ready. ``startup``: where the phases are reported (its
        ``on_phase`` tells the API servers)."""
        from .model_runner import ModelRunner  # torch, loaded with the engine
        from .warmup import warm_up

        self.config = config
        self.startup = startup if startup is not None else StartupProgress()
        # before the first kernel module is imported (ModelRunner): Triton reads it then
        self.compile_cache = self.startup.use_cache(resolve_compile_cache(config.compile_cache_dir))
        self._compiles = compile_watch()
        self.model_config = resolve_model_config(config.model)
        self.model_name = config.model_name
        self.series = CoreMetrics(self.model_name)
        self.telemetry = telemetry
        self.recorder = telemetry.recorder if telemetry is not None else _NULL_RECORDER
        self._gpu = _NO_GPU
        self.gpu_telemetry = self._start_gpu_telemetry()
        self.tp = None        # TpWorkers: ranks 1..N-1, with tensor parallelism
        if config.tensor_parallel_size > 1:
            from .tp_workers import TpWorkers
            self.tp = TpWorkers.start(config, self._record_all if telemetry is not None else None)
        # kernel tracing (CUPTI) starts in the warm-up, after the eager variants and graphs
        try:
            self.runner = ModelRunner(config, self.model_config, self.gpu_telemetry,
                                      None if self.tp is None else self.tp.group, self.startup)
        except BaseException:
            self.close()
            raise
        eos = self.model_config.eos_token_id
        if eos is None:   # the tokenizer's, when the model's config names none
            eos = load_tokenizer(self.model_config.path, self.model_config.bos_token_id,
                                 None).eos_token_id
        self.eos_token_id = eos
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(KVCacheConfig(
            config.block_size, self.runner.num_blocks, config.prefix_caching_on(self.runner.device.type)))
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self._lock = threading.Lock()   # guards the scheduler and the inbox of aborts
        self._aborts: list[str] = []
        self._live: dict[str, Request] = {}   # added, final output not made yet
        self._accepting = True
        self._last_plan_nonempty = False
        self._preempted = 0               # preemptions not reported in a batch yet
        self._prefix_counts = [0, 0, 0]   # prefix cache queries, hits, evictions not reported yet
        self._completed: tuple[StepPlan, float, int] | None = None   # (plan, s, tokens sampled)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        if self.tp is not None:
            self.runner.async_ids = self.async_scheduling
            # each rank's part of each step, timed on the host (the CPU: gloo returns when the
            # sum is done); on CUDA the kernel records of traced steps tell it
            if telemetry is not None and telemetry.steps_on and self.runner.device.type == "cpu":
                self.runner.record_rank = self.recorder.record
        self._in_flight: _Launched | None = None   # the step launched, not completed (overlapped)
        self._last_step_done = 0.0
        self.step_durations_s: deque[float] = deque(maxlen=1 << 16)   # recent steps' wall times
        # beside each: its prefill and decode tokens (what made a slow step slow)
        self.step_tokens: deque[tuple[int, int]] = deque(maxlen=1 << 16)
        self.step_traced: deque[bool] = deque(maxlen=1 << 16)   # ... and whether its kernels were traced
        # the loop's time in all, and the part of it spent recording telemetry (GpuTelemetry's
        # begin/end_step count theirs in gpu_telemetry.stats.engine_thread_s)
        self.loop_s = 0.0
        self.telemetry_thread_s = 0.0
        self.startup_report = warm_up(self.runner, config, self.startup,
                                      telemetry.recorder if telemetry is not None else None,
                                      self.compile_cache)
        self.series.record_startup(self.startup_report)

    def _record_all(self, items: list) -> None:
        """A tensor-parallel worker's records, into this core's telemetry (its watch thread)."""
        record = self.recorder.record
        for item in items:
            record(item)

    @property
    def failed(self) -> str | None:
        """Why the tensor-parallel group failed (None: it stands, or there is none)."""
        return self.tp.failed if self.tp is not None else None

    def close(self) -> None:
        """Stops the tensor-parallel workers (nothing without them). Idempotent; the
        stepping thread calls it once it stopped stepping."""
        if self.tp is not None:
            self.tp.stop()

    @property
    def gpu_telemetry(self):
        """The GpuTelemetry (kernel spans, per-SM histograms), or None."""
        return self._gpu if self._gpu is not _NO_GPU else None

    @gpu_telemetry.setter
    def gpu_telemetry(self, gpu) -> None:
        self._gpu = gpu if gpu is not None else _NO_GPU

    def _start_gpu_telemetry(self):
        """Kernel spans and per-SM histograms only at level kernels on CUDA; None otherwise."""
        if self.telemetry is None or not self.telemetry.kernels_on:
            return None
        try:
            import torch
            if not torch.cuda.is_available() or self.config.device == "cpu":
                log.info("trace level kernels: no CUDA device, kernel tracing is off")
                return None
            from ..instrumentation import GpuTelemetry
            gpu = GpuTelemetry.create(self.telemetry.recorder, torch.cuda.current_device())
            if gpu is not None:
                self.telemetry.attach_gpu(gpu)   # the pipeline shuts it down
            return gpu
        except Exception:  # telemetry trouble never stops the engine
            log.exception("kernel telemetry unavailable; continuing without it")
            return None

    def ready(self, core_pid: int, telemetry_endpoint: str | None = None) -> Ready:
        """The handshake an API server waits for."""
        runner, report = self.runner, self.startup_report
        return Ready(self.model_name, self.max_model_len, self.model_config.vocab_size,
                     self.eos_token_id, runner.num_blocks, self.config.block_size,
                     self.config.scheduler.max_waiting, self.config.scheduler.max_num_seqs,
                     str(runner.device), str(runner.dtype).removeprefix("torch."),
                     self.async_scheduling, core_pid, telemetry_endpoint,
                     round(report.total_s, 3), report.trace_id,
                     self.tp.pids if self.tp is not None else [])

    # ---- requests (any thread) -----------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def has_work(self) -> bool:
        """Requests queued or running, aborts to apply, or a step still on the device."""
        return self.scheduler.has_work or self._in_flight is not None or bool(self._aborts)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def add_request(self, add: AddRequest) -> Request:
        """Queues a request. Raises EngineStoppedError (draining), QueueFullError (queue full)
        or ValueError (prompt + max_tokens past ``max_model_len``, a duplicate id). O(1)
        plus the scheduler's add."""
        sampling = add.sampling
        needed = len(add.prompt_token_ids) + sampling.max_tokens
        if needed > self.max_model_len:
            raise ValueError(f"prompt ({len(add.prompt_token_ids)} tokens) + max_tokens "
                             f"({sampling.max_tokens}) = {needed} exceeds the context length "
                             f"{self.max_model_len}")
        key = add.trace.key if add.trace is not None else None
        request = Request(add.request_id, add.prompt_token_ids, sampling, priority=add.priority,
                          eos_token_id=self.eos_token_id, telemetry=key, cache_salt=add.cache_salt)
        if key is not None:
            self.recorder.record(Queued(key, time.time_ns()))
        with self._lock:
            if not self._accepting:
                raise EngineStoppedError("the engine is shutting down")
            if self.failed is not None:
                raise EngineStoppedError(self.failed)
            if add.request_id in self._live:
                raise ValueError(f"request id {add.request_id!r} is still in flight")
            self.scheduler.add(request)  # QueueFullError / ValueError propagate
            self._live[add.request_id] = request
        return request

    def abort(self, request_id: str) -> None:
        """Drops the request before the next step (its blocks freed, reason abort). Safe for
        finished or unknown ids."""
        with self._lock:
            self._aborts.append(request_id)

    def stop_accepting(self) -> None:
        """Draining: later add_request calls raise EngineStoppedError; live requests go on."""
        with self._lock:
            self._accepting = False

    def abort_all(self) -> None:
        with self._lock:
            self._aborts.extend(self._live)

    # ---- stepping (one thread) -----------------------------------------------------------------
    def finish_stop(self, request_id: str, stop_at: int) -> FinalOutput | None:
        """Ends a request on a stop string found after ``stop_at`` of its output tokens: reason
        stop, later tokens dropped, its blocks freed. Its final output, or None when it was
        already reported (or is unknown)."""
        request = self._live.get(request_id)
        if request is None:
            return None
        with self._lock:
            self.scheduler.finish(request_id, FinishReason.STOP)   # None: ended in flight
        request.finish_reason = FinishReason.STOP
        del request.output_token_ids[stop_at:]
        return self._final(request_id, [])

    def step(self) -> OutputBatch:
        """One iteration on the caller's thread, waited for."""
        out, plan = self._schedule()
        if plan is not None:
            launched = self._launch(plan, None, out)
            if launched is not None:
                self._complete(launched, out)
        return self._batch(out)

    def step_overlapped(self) -> OutputBatch:
        """One iteration of overlapped scheduling: plans and launches the next step while the
        one in flight runs on the device, then completes that one (its outputs are returned)
        and leaves the new one in flight. A plan with penalized sampling needs the host's
        tokens, so it waits for the step in flight first."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self.failed is not None:
            previous = None   # its ids may never come: its requests end with the group's error
        out, plan = self._schedule()
        if plan is not None and previous is not None and any(
                e.request.sampling.penalized for e in plan.scheduled):
            self._complete(previous, out)
            previous = None
            plan = _without_ended(plan)   # the wait may have ended some (eos)
        launched = self._launch(plan, previous, out) if plan is not None else None
        if previous is not None:
            self._complete(previous, out)
        self._in_flight = launched
        return self._batch(out)

    @property
    def last_plan_nonempty(self) -> bool:
        return self._last_plan_nonempty

    @property
    def step_in_flight(self) -> bool:
        """A step is launched and not completed (overlapped scheduling)."""
        return self._in_flight is not None

    def _batch(self, out: _Outputs) -> OutputBatch:
        """The iteration's batch: the step it completed (if any) and the queue as it is now."""
        stats = self.queue_stats()
        completed, self._completed = self._completed, None
        if completed is not None:
            plan, stats.duration_s, stats.num_generated = completed
            stats.step_id, stats.num_seqs = plan.step_id, len(plan.scheduled)
            stats.num_prefill_tokens, stats.num_decode_tokens = (plan.num_prefill_tokens,
                                                                 plan.num_decode_tokens)
        return OutputBatch(out.ids, out.tokens, out.finished, stats)

    def queue_stats(self) -> StepStats:
        """The queue and the cache now, and the preemptions not reported yet (no step)."""
        preempted, self._preempted = self._preempted, 0
        (queries, hits, evictions), self._prefix_counts = self._prefix_counts, [0, 0, 0]
        scheduler, kv = self.scheduler, self.kv_cache
        return StepStats(None, None, 0, 0, 0, 0, preempted, scheduler.num_running,
                         scheduler.num_waiting, kv.num_used_blocks, kv.num_blocks, queries, hits,
                         evictions, kv.prefix_cache_stats().cached_blocks)

    def _schedule(self) -> tuple[_Outputs, StepPlan | None]:
        """Applies aborts and plans the next step (None when there is nothing to run)."""
        out = _Outputs()
        failed = self.failed
        with self._lock:
            aborts, self._aborts = self._aborts, []
            if failed is not None:   # the group cannot step again: every live request ends
                aborts += self._live
            for request_id in aborts:
                if self.scheduler.abort(request_id) is not None:
                    out.finished.append(self._final(request_id, [], failed))
            if failed is not None:
                self._last_plan_nonempty = False
                return out, None
            plan = self.scheduler.schedule()
        self._last_plan_nonempty = not plan.is_empty
        if plan.is_empty:
            return out, None
        self._preempted += len(plan.preempted)
        self._prefix_counts[0] += plan.prefix_cache_queries
        self._prefix_counts[1] += plan.num_cached_prefill_tokens
        self._prefix_counts[2] += plan.prefix_cache_evictions
        return out, plan

    def _launch(self, plan: StepPlan, previous: _Launched | None, out: _Outputs) -> _Launched | None:
        """Enqueues the plan on the device and applies it to the scheduler with stand-ins for
        its tokens; on failure, fails its requests (into ``out``) and returns None."""
        t0, cpu0 = time.perf_counter(), time.thread_time_ns()
        step = OpenStep(plan.step_id, 0, 0, time.time_ns())   # ids drawn off this thread
        self.telemetry_thread_s += time.perf_counter() - t0
        self.runner.copy_blocks(self.kv_cache.take_pending_copies())
        compiles = self._compiles.thread_count()
        try:
            run = self.runner.launch(plan, step, previous.run.tokens if previous else None)
            if self._compiles.thread_count() != compiles:
                self._served_compiles(plan, step, compiles)
        except Exception as exc:
            log.exception("model step %d failed", plan.step_id)
            self._close_step(plan, step, None, [], type(exc).__name__)
            self._fail_plan(plan, self._step_failure(plan, exc), out)
            return None
        launch_cpu_ns = time.thread_time_ns() - cpu0 if _traced(step) else None
        with self._lock:
            finished = self.scheduler.update_pending(
                plan, {request_id: row for row, request_id in enumerate(run.request_ids)})
        return _Launched(plan, step, run, finished, t0, launch_cpu_ns)

    def _served_compiles(self, plan: StepPlan, step: OpenStep, since: int) -> None:
        """Kernel variants this step met for the first time: counted (a defect of the
        warm-up), logged, and on its span for explain's ``compile`` cause."""
        events = self._compiles.since(since)
        self.series.jit_compiled(events)
        log.warning("step %d met %d kernel variants for the first time while serving: %s",
                    plan.step_id, len(events), ", ".join(f"{e} ({e.source})" for e in events))
        for key, value in step_compile_attributes(events).items():
            step.set_attribute(key, value)

    def _complete(self, launched: _Launched, out: _Outputs) -> None:
        """Waits for a launched step's tokens, puts them in place and turns them into outputs
        (the step's figures for its batch's stats in ``_completed``)."""
        plan, step = launched.plan, launched.step
        traced = launched.launch_cpu_ns is not None
        if traced:
            step.set_attribute(sc.STEP_WAIT_START_NS, time.time_ns())   # its kernels become spans
        try:
            sampled = launched.run.wait()
        except Exception as exc:
            log.exception("model step %d failed", plan.step_id)
            self._close_step(plan, step, launched.run.execution, [], type(exc).__name__)
            self._fail_plan(plan, self._step_failure(plan, exc), out, launched.finished)
            return
        cpu0 = time.thread_time_ns() if traced else 0
        with self._lock:
            finished = launched.finished + self.scheduler.resolve(plan, sampled)
        prefill_done: list = []
        done = {r.request_id for r in finished}
        live = self._live
        for entry in plan.scheduled:
            request_id = entry.request.request_id
            token = sampled.get(request_id)
            if token is None or request_id not in live:
                continue
            if entry.is_prefill:  # this chunk finished the (re)computed prompt
                prefill_done.append(entry.request.telemetry)
            if request_id in done:
                out.finished.append(self._final(request_id, [token]))
            else:
                out.ids.append(request_id)
                out.tokens.append(token)
        # the step's share of the loop: from its launch, or from the previous step's end when
        # it was launched while that one ran (overlapped steps would otherwise count twice)
        done_s = time.perf_counter()
        duration = done_s - max(launched.t0, self._last_step_done)
        self._last_step_done = done_s
        if traced:
            step.set_attribute(sc.STEP_HOST_CPU_S, (launched.launch_cpu_ns + time.thread_time_ns() - cpu0) / 1e9)
        self._close_step(plan, step, launched.run.execution, prefill_done, None, duration, done_s)
        self.step_durations_s.append(duration)
        self.step_tokens.append((plan.num_prefill_tokens, plan.num_decode_tokens))
        self.step_traced.append(traced)
        self.loop_s += duration
        self._completed = (plan, duration, len(sampled))

    def _close_step(self, plan: StepPlan, step: OpenStep, execution: StepExecution | None,
                    prefill_done: list, error_type: str | None,
                    duration_s: float | None = None, c0: float | None = None) -> None:
        """One Step event (the batch, the preempted requests, the finished prompts); with the
        step's ``duration_s`` (it completed), the GPU telemetry's tail rule and plan for the
        next step. ``c0``: the caller's ``perf_counter()`` just before, counted from."""
        if c0 is None:
            c0 = time.perf_counter()
        # prefill_done is the step's own list, not changed after: built into the event later
        self.recorder.record_later(_step_event, self.recorder, plan, step, time.time_ns(),
                                   prefill_done, execution, self.runner, error_type)
        if duration_s is not None:
            self._gpu.observe_step(step, duration_s, plan.num_prefill_tokens > 0)
        self.telemetry_thread_s += time.perf_counter() - c0

    def _final(self, request_id: str, tokens: list[int], error: str | None = None) -> FinalOutput:
        """The final output of a request the scheduler finished, with its timing figures."""
        request = self._live.pop(request_id)
        reason = request.finish_reason.value if request.finish_reason else FinishReason.ABORT.value
        arrival, end = request.arrival_time_s, request.finish_time_s or time.monotonic()
        first_token, scheduled = request.first_token_time_s, request.first_scheduled_time_s
        out = FinalOutput(request_id, tokens, reason, error, ERROR_ENGINE if error else None,
                          request.num_prompt_tokens, request.num_output_tokens_read,
                          e2e_s=end - arrival, num_preemptions=request.num_preemptions,
                          num_cached_tokens=request.num_cached_tokens)
        if scheduled is not None:
            out.queue_s = scheduled - arrival
        if first_token is not None:
            out.ttft_s = first_token - arrival
            out.decode_s = end - first_token
            if request.num_output_tokens > 1:
                out.tpot_s = (end - first_token) / (request.num_output_tokens - 1)
            if scheduled is not None:
                out.prefill_s = first_token - scheduled
        self.runner.release(request_id)
        return out

    def _step_failure(self, plan: StepPlan, exc: Exception) -> str:
        """What the failed step's requests are told. Under tensor parallelism the ranks are
        out of step for good: the group fails, and a rank that died is named."""
        if self.tp is None:
            return f"engine step failed: {type(exc).__name__}: {exc}"
        return self.tp.fail_step(plan.step_id, exc)

    def _fail_plan(self, plan: StepPlan, message: str, out: _Outputs,
                   finished: list[Request] | tuple = ()) -> None:
        """Ends the plan's requests with ``message``, and those it had ``finished`` (on
        max_tokens, their last token never read)."""
        with self._lock:
            for entry in plan.scheduled:
                if self.scheduler.finish(entry.request.request_id, FinishReason.ABORT) is not None:
                    out.finished.append(self._final(entry.request.request_id, [], message))
            for request in finished:
                if request.request_id in self._live:
                    request.finish_reason = FinishReason.ABORT
                    del request.output_token_ids[-1:]
                    out.finished.append(self._final(request.request_id, [], message))

    # ---- reading ---------------------------------------------------------------------------
    def debug_steps(self) -> dict:
        """The wall times of recent steps, oldest first, with their [prefill, decode] tokens and
        whether their kernels were traced, and the loop's total time beside the part of it
        spent recording telemetry (GPU telemetry's figures when it runs)."""
        gpu = self.gpu_telemetry
        stats = gpu.stats if gpu is not None else None
        return {
            "durations_s": list(self.step_durations_s), "tokens": [list(t) for t in self.step_tokens],
            "traced": [int(t) for t in self.step_traced],
            "loop_s": self.loop_s,
            "telemetry_engine_thread_s": self.telemetry_thread_s
            + (stats.engine_thread_s if stats is not None else 0.0),
            # the traced steps' part of it, and how many steps were traced
            "telemetry_traced_steps_s": stats.engine_thread_traced_s if stats is not None else 0.0,
            "steps_traced": (stats.steps_traced_sampled + stats.steps_traced_spell + stats.steps_traced_tail
                             + stats.steps_traced_prefill if stats is not None else 0),
            # of them, steps with prefill tokens traced once none was for an interval
            "steps_traced_prefill": stats.steps_traced_prefill if stats is not None else 0,
            # slow spells begun, and the steps traced in them (of steps_traced)
            "slow_spells": stats.slow_spells if stats is not None else 0,
            "steps_traced_spell": stats.steps_traced_spell if stats is not None else 0,
            # the spell rule's learned rate of slow decode steps per step, and its limit now
            **(gpu.spell_rule_state() if gpu is not None else {}),
            # untraced steps whose probe records were read: their part, and every probed step
            "telemetry_probed_steps_s": stats.engine_thread_probed_s if stats is not None else 0.0,
            "steps_probed": stats.steps_probed if stats is not None else 0,
            "ctas_probed": stats.ctas_probed if stats is not None else 0,   # fed the histograms
            "gpu_telemetry_worker_cpu_s": stats.worker_cpu_s if stats is not None else 0.0,
            "gpu_telemetry_worker_phases_cpu_s":
                stats.worker_phases_cpu_s() if stats is not None else {},
            # the worker's wall time closing traced steps, by call (summed)
            "gpu_telemetry_worker_close_wall_s": stats.worker_close_wall_s() if stats is not None else {}}

    def utility(self, method: str, argument: str = "") -> dict:
        """A ``UtilityCall``'s answer: ``debug_steps``, ``kv_blocks``, ``startup_report`` or
        ``core_metrics`` (this process's series: start-up, compiles while serving and its
        telemetry's, in the format the Accept header ``argument`` asks for)."""
        if method == "debug_steps":
            return self.debug_steps()
        if method == "kv_blocks":
            return self.kv_blocks()
        if method == "startup_report":
            return self.startup_report.to_dict()
        if method == "core_metrics":
            from prometheus_client.exposition import choose_encoder
            encode = choose_encoder(argument)[0]
            registry = getattr(self.telemetry, "registry", None)
            parts = [encode(r).decode() for r in (self.series.registry, registry) if r is not None]
            # one body: an OpenMetrics "# EOF" only at its end (the API server's exposition
            # keeps one, at the end of the page)
            return {"body": "".join(p.removesuffix("# EOF\n") for p in parts[:-1]) + parts[-1]}
        raise ValueError(f"unknown utility method {method!r}")

    def kv_blocks(self) -> dict:
        """Blocks in use and in all, and the requests the core holds."""
        return {"used": self.kv_cache.num_used_blocks, "total": self.kv_cache.num_blocks,
                "live": len(self._live), "running": self.scheduler.num_running,
                "waiting": self.scheduler.num_waiting}
