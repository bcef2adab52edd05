"""The engine loop: schedule -> run -> update, in its own thread, streaming tokens to asyncio.

``LLMEngine`` composes the scheduler and KV block manager (plain Python), the model runner
(device), the tokenizer and the Prometheus series. The server thread calls ``add_request``
(a full queue raises ``QueueFullError`` at once, for HTTP 429) and ``abort``; everything
else happens on the loop thread: apply aborts, ``schedule()``, run the model (the only
device work), ``update()``, detokenize, finish requests on stop strings, and hand every
request's new text to its asyncio queue with ONE ``call_soon_threadsafe`` per step.
With overlapped scheduling (``EngineConfig.async_scheduling``, on with CUDA) the next step is
planned and launched before the one on the device is waited for (stand-in tokens,
``Scheduler.update_pending`` then ``resolve``); a request ending on eos or a stop string has
computed one token too many, which is dropped. The scheduler's lock is never held around
the model. Telemetry: the loop only records lifecycle events, O(1) appends per step and per
request event; spans are made elsewhere (``instrumentation.telemetry_pipeline``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..instrumentation import Detokenized, OpenStep, Queued, Step, TelemetryPipeline
from .compile_cache import resolve_compile_cache
from .compile_watch import compile_watch, step_compile_attributes
from .config import EngineConfig, resolve_model_config
from .kv_cache import KVCacheConfig, KVCacheManager
from .metrics import EngineMetrics, trace_exemplar
from .request import FinishReason, Request, SamplingParams
from .scheduler import QueueFullError, Scheduler, StepPlan
from .request_output import LiveRequest, RequestOutput, RequestStream, deliver
from .startup import StartupProgress
from .tokenizer import IncrementalDetokenizer, load_tokenizer

if TYPE_CHECKING:   # torch comes with the engine, not with this module
    from ..instrumentation import LifecycleRecorder
    from .model_runner import LaunchedStep, ModelRunner, StepExecution

__all__ = ["LLMEngine", "RequestOutput", "RequestStream", "StepStats", "EngineStoppedError",
           "QueueFullError"]

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine is draining or stopped: no new requests (the server answers 503)."""


@dataclass(frozen=True)
class StepStats:
    """What the last ``step()`` did (for benchmarks and logs)."""

    step_id: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    duration_s: float  # schedule + model + sampling + update + detokenize


@dataclass
class _Launched:
    """A step on the device, applied to the scheduler with stand-ins for its tokens."""

    plan: StepPlan
    step: OpenStep | None           # its telemetry record; None when tracing is off
    run: LaunchedStep
    finished: list[Request]         # requests it ends on max_tokens (outputs still to make)
    t0: float                       # perf_counter at launch


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


def _step_event(recorder: LifecycleRecorder, plan: StepPlan, step: OpenStep, end_ns: int,
                prefill_done: list[int], execution: StepExecution | None, runner: ModelRunner,
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
                len(scheduled), preempted, tuple(prefill_done), plan.num_prefill_tokens,
                num_decode, len(scheduled) - num_decode, num_decode, plan.kv_blocks_used,
                plan.kv_blocks_total, error_type, attributes)


class LLMEngine:
    """One model, one device, one loop thread (or ``step()`` driven by the caller, offline)."""

    def __init__(self, config: EngineConfig, telemetry: TelemetryPipeline | None = None,
                 startup: StartupProgress | None = None) -> None:
        """Loads the model, sizes the KV cache and warms up (``engine/warmup.py``): once
        constructed, the engine is ready. ``startup``: where the phases are reported."""
        from .model_runner import ModelRunner  # torch, loaded with the engine
        from .warmup import warm_up

        self.config = config
        self.startup = startup if startup is not None else StartupProgress()
        self.compile_cache = self.startup.use_cache(resolve_compile_cache(config.compile_cache_dir))
        self._compiles = compile_watch()
        self.model_config = resolve_model_config(config.model)
        self.model_name = config.model_name
        self.telemetry = telemetry
        self._recorder = telemetry.recorder if telemetry is not None else None
        self.gpu_telemetry = self._gpu_telemetry()
        self.runner = ModelRunner(config, self.model_config, self.gpu_telemetry, self.startup)
        self.tokenizer = load_tokenizer(self.model_config.path, self.model_config.bos_token_id,
                                        self.model_config.eos_token_id)
        self.eos_token_id = self.model_config.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = self.tokenizer.eos_token_id
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(KVCacheConfig(config.block_size, self.runner.num_blocks))
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.metrics = EngineMetrics(self.model_name)
        self._watch_gpu_health()
        self._lock = threading.Lock()  # guards the scheduler and the inboxes
        self._wake = threading.Condition(self._lock)
        self._aborts: list[str] = []
        self._live: dict[str, LiveRequest] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._next_id = 0
        self._last_plan_nonempty = False
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self._in_flight: _Launched | None = None   # the step launched, not completed (overlapped)
        self._last_step_done = 0.0
        self.last_step: StepStats | None = None
        self.step_durations_s: deque[float] = deque(maxlen=1 << 16)   # recent steps' wall times
        # the engine loop's time in all, and the part of it spent recording telemetry
        # (GpuTelemetry's begin/end_step count theirs in gpu_telemetry.stats.engine_thread_s)
        self.loop_s = 0.0
        self.telemetry_thread_s = 0.0
        # the CUDA graphs and kernel tracing (CUPTI) start here, after the eager variants
        self.startup_report = warm_up(self.runner, config, self.startup, self._recorder,
                                      self.compile_cache)
        self.metrics.record_startup(self.startup_report)

    def _watch_gpu_health(self) -> None:
        """GPU memory and contexts on /metrics whenever the model runs on CUDA, whatever
        the trace level: a leak must raise an alert even with tracing off."""
        if self.runner.device.type != "cuda":
            return
        try:
            reason = self.metrics.watch_gpu(self.runner.device.index or 0)
        except Exception as exc:  # NVML trouble never stops the engine
            reason = str(exc)
        if reason:
            log.warning("GPU memory/context metrics unavailable: %s", reason)

    def _gpu_telemetry(self):
        """Kernel spans and per-SM histograms only at level kernels on CUDA; None otherwise."""
        if self.telemetry is None or not self.telemetry.kernels_on:
            return None
        try:
            import torch
            if not torch.cuda.is_available() or self.config.device == "cpu":
                log.info("trace level kernels: no CUDA device, kernel tracing is off")
                return None
            from ..instrumentation import GpuTelemetry
            gpu = GpuTelemetry.create(self._recorder, torch.cuda.current_device())
            if gpu is not None:
                self.telemetry.attach_gpu(gpu)   # the pipeline shuts it down
            return gpu
        except Exception:  # telemetry trouble never stops the engine
            log.exception("kernel telemetry unavailable; continuing without it")
            return None

    # ---- server-side API (any thread) ---------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def has_work(self) -> bool:
        """Requests queued or running, or a step still on the device."""
        return self.scheduler.has_work or self._in_flight is not None

    @property
    def accepting(self) -> bool:
        return self._accepting

    def new_request_id(self, prefix: str = "req") -> str:
        with self._lock:
            self._next_id += 1
            return f"{prefix}-{self._next_id}"

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    *, priority: int = 0, trace=None,
                    loop: asyncio.AbstractEventLoop | None = None) -> RequestStream | None:
        """Queues a request. Returns its output stream (None when ``loop`` is None: offline).

        Raises EngineStoppedError (draining), QueueFullError (queue full) or ValueError (a prompt
        with max_tokens past ``max_model_len`` or the KV cache). O(1) plus the scheduler's add.
        """
        needed = len(prompt_token_ids) + sampling.max_tokens
        if needed > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                             f"({sampling.max_tokens}) = {needed} exceeds the context length "
                             f"{self.max_model_len}")
        key = trace.key if trace is not None else None
        request = Request(request_id, list(prompt_token_ids), sampling, priority=priority,
                          eos_token_id=self.eos_token_id, telemetry=key)
        stream = RequestStream(request_id, loop) if loop is not None else None
        live = LiveRequest(request, stream, IncrementalDetokenizer(self.tokenizer), key,
                     hold=max((len(s) for s in sampling.stop), default=1) - 1, exemplar=trace_exemplar(trace))
        if key is not None:
            self._recorder.record(Queued(key, time.time_ns()))
        with self._wake:
            if not self._accepting:
                raise EngineStoppedError("the engine is shutting down")
            self.scheduler.add(request)  # QueueFullError / ValueError propagate
            self._live[request_id] = live
            self.metrics.waiting.set(self.scheduler.num_waiting)
            self._wake.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Asks the loop to drop the request (client gone); its blocks are freed before the next
        step. Safe to call for finished or unknown ids."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the loop thread (daemon; ``shutdown`` joins it)."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="sightline-engine", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """Draining: later add_request calls raise EngineStoppedError; live requests go on."""
        with self._lock:
            self._accepting = False

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until no request is live (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self._live and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._live

    def shutdown(self) -> None:
        """Aborts whatever is still live, stops and joins the loop thread. Idempotent."""
        self.stop_accepting()
        with self._wake:
            self._aborts.extend(list(self._live))
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._aborts or self.scheduler.has_work
                           or self._in_flight is not None):
                    self._wake.wait()
                if self._stopping and not self._aborts and self._in_flight is None:
                    return
            try:
                did_work = self.step_and_deliver()
            except Exception:  # never let the loop die (a failed model step fails its requests)
                log.exception("engine step failed")
                did_work = True
            if not did_work:
                # Work exists but nothing fits yet (e.g. all blocks held): don't spin.
                with self._wake:
                    self._wake.wait(timeout=0.005)

    def step_and_deliver(self) -> bool:
        outputs = self.step_overlapped() if self.async_scheduling else self.step()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for live, output in outputs:
            if live.stream is not None:
                batches.setdefault(live.stream.loop, []).append((live.stream, output))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(deliver, batch)
            except RuntimeError:  # the server's loop closed under us (shutdown)
                pass
        return bool(outputs) or self._last_plan_nonempty or self._in_flight is not None

    def step(self) -> list[tuple[LiveRequest, RequestOutput]]:
        """One iteration on the caller's thread, waited for. Returns the outputs it produced."""
        outputs, plan = self._schedule()
        if plan is not None:
            launched = self._launch(plan, None, outputs)
            if launched is not None:
                outputs += self._complete(launched)
        return outputs

    def step_overlapped(self) -> list[tuple[LiveRequest, RequestOutput]]:
        """One iteration of overlapped scheduling: plans and launches the next step while the
        one in flight runs on the device, then completes that one (its outputs are returned)
        and leaves the new one in flight. A plan with penalized sampling needs the host's
        tokens, so it waits for the step in flight first."""
        previous, self._in_flight = self._in_flight, None
        outputs, plan = self._schedule()
        if plan is not None and previous is not None and any(
                e.request.sampling.penalized for e in plan.scheduled):
            outputs += self._complete(previous)
            previous = None
            plan = _without_ended(plan)   # the wait may have ended some (eos, stop string)
        launched = self._launch(plan, previous, outputs) if plan is not None else None
        if previous is not None:
            outputs += self._complete(previous)
        self._in_flight = launched
        return outputs

    def _schedule(self) -> tuple[list[tuple[LiveRequest, RequestOutput]], StepPlan | None]:
        """Applies aborts and plans the next step (None when there is nothing to run)."""
        outputs: list[tuple[LiveRequest, RequestOutput]] = []
        with self._lock:
            aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                if self.scheduler.abort(request_id) is not None:
                    outputs.append(self._finish_output(request_id))
            plan = self.scheduler.schedule()
        self._last_plan_nonempty = not plan.is_empty
        if plan.is_empty:
            self._record_gauges()
            return outputs, None
        for _ in plan.preempted:
            self.metrics.preemptions.inc()
        return outputs, plan

    def _launch(self, plan: StepPlan, previous: _Launched | None,
                outputs: list[tuple[LiveRequest, RequestOutput]]) -> _Launched | None:
        """Enqueues the plan on the device and applies it to the scheduler with stand-ins for
        its tokens; on failure, fails its requests (into ``outputs``) and returns None."""
        t0 = time.perf_counter()
        step = self._open_step(plan, t0) if self._recorder is not None else None
        self.runner.copy_blocks(self.kv_cache.take_pending_copies())
        compiles = self._compiles.thread_count()
        try:
            run = self.runner.launch(plan, step, previous.run.tokens if previous else None)
            if self._compiles.thread_count() != compiles:
                self._served_compiles(plan, step, compiles)
        except Exception as exc:
            log.exception("model step %d failed", plan.step_id)
            if step is not None:
                self._close_step(plan, step, None, (), [], type(exc).__name__)
            outputs += self._fail_plan(plan, f"engine step failed: {type(exc).__name__}: {exc}")
            return None
        with self._lock:
            finished = self.scheduler.update_pending(
                plan, {request_id: row for row, request_id in enumerate(run.request_ids)})
        return _Launched(plan, step, run, finished, t0)

    def _served_compiles(self, plan: StepPlan, step: OpenStep | None, since: int) -> None:
        """Kernel variants this step met for the first time: counted (a defect of the
        warm-up), logged, and on its span for explain."""
        events = self._compiles.since(since)
        self.metrics.jit_compiled(events)
        log.warning("step %d met %d kernel variants for the first time while serving: %s",
                    plan.step_id, len(events), ", ".join(f"{e} ({e.source})" for e in events))
        if step is not None:
            for key, value in step_compile_attributes(events).items():
                step.set_attribute(key, value)

    def _complete(self, launched: _Launched) -> list[tuple[LiveRequest, RequestOutput]]:
        """Waits for a launched step's tokens, puts them in place and turns them into outputs."""
        plan, step = launched.plan, launched.step
        try:
            sampled = launched.run.wait()
        except Exception as exc:
            log.exception("model step %d failed", plan.step_id)
            if step is not None:
                self._close_step(plan, step, launched.run.execution, (), [], type(exc).__name__)
            return self._fail_plan(plan, f"engine step failed: {type(exc).__name__}: {exc}",
                                   launched.finished)
        with self._lock:
            finished = launched.finished + self.scheduler.resolve(plan, sampled)
        prefill_done: list[int] = []
        events: list = []   # finished requests' events: recorded after their step's
        outputs = self._process_tokens(plan, sampled, finished, prefill_done, events)
        m = self.metrics
        # the step's share of the loop: from its launch, or from the previous step's end when
        # it was launched while that one ran (overlapped steps would otherwise count twice)
        done = time.perf_counter()
        duration = done - max(launched.t0, self._last_step_done)
        self._last_step_done = done
        if step is not None:
            self._close_step(plan, step, launched.run.execution, prefill_done, events, None, duration,
                             done)
        self.last_step = StepStats(plan.step_id, plan.num_prefill_tokens, plan.num_decode_tokens,
                                   len(plan.scheduled), duration)
        m.step.observe(duration)
        self.step_durations_s.append(duration)
        self.loop_s += duration
        m.step_tokens.observe(plan.num_scheduled_tokens)
        m.generation_tokens.inc(len(sampled))
        self._record_gauges()
        return outputs

    def _record_gauges(self) -> None:
        m = self.metrics
        m.running.set(self.scheduler.num_running)
        m.waiting.set(self.scheduler.num_waiting)
        m.kv_usage.set(self.kv_cache.usage)

    def _open_step(self, plan: StepPlan, c0: float) -> OpenStep:
        """The step's telemetry record; its time counted from the caller's ``c0``."""
        step = OpenStep(plan.step_id, 0, 0, time.time_ns())   # ids drawn off this thread
        self.telemetry_thread_s += time.perf_counter() - c0
        return step

    def _close_step(self, plan: StepPlan, step: OpenStep, execution: StepExecution | None,
                    prefill_done: list[int], events: list, error_type: str | None,
                    duration_s: float | None = None, c0: float | None = None) -> None:
        """One Step event (the batch, the preempted requests, the finished prompts), then the
        events of the requests it finished; with the step's ``duration_s`` (it completed),
        the GPU telemetry's tail rule and plan for the next step. ``c0``: the caller's
        ``perf_counter()`` just before, counted from (one clock read fewer)."""
        if c0 is None:
            c0 = time.perf_counter()
        # prefill_done is the step's own list, not changed after: built into the event later
        recorder = self._recorder
        recorder.record_later(_step_event, recorder, plan, step, time.time_ns(), prefill_done,
                              execution, self.runner, error_type)
        for event in events:
            recorder.record(event)
        gpu = self.gpu_telemetry
        if duration_s is not None and gpu is not None:
            # the usual step is quiet (GpuTelemetry.quiet_steps): taken here without a call,
            # since right after the model's work each call is mostly cache misses
            if gpu.quiet_steps and duration_s <= gpu.quiet_limit and not step.cupti_recorded:
                gpu.quiet_steps -= 1
                gpu.quiet_durations.append(duration_s)
            else:
                gpu.observe_step(step, duration_s)
        self.telemetry_thread_s += time.perf_counter() - c0

    def _process_tokens(self, plan: StepPlan, sampled: dict[str, int], finished: list[Request],
                        prefill_done: list[int], events: list) -> list[tuple[LiveRequest, RequestOutput]]:
        outputs = []
        done = {r.request_id for r in finished}
        now = time.monotonic()
        for entry in plan.scheduled:
            request_id = entry.request.request_id
            token = sampled.get(request_id)
            live = self._live.get(request_id)
            if token is None or live is None:
                continue
            # the token at position entry.end: later ones may be stand-ins already
            first_token = entry.end == entry.request.num_prompt_tokens
            if entry.is_prefill:  # this chunk finished the (re)computed prompt
                if first_token:
                    self.metrics.prompt_tokens.inc(entry.request.num_prompt_tokens)
                if live.key is not None:
                    prefill_done.append(live.key)
            if not first_token:
                itl_s = now - live.last_token_s
                self.metrics.itl.observe(itl_s, live.itl_exemplar(itl_s))
            live.last_token_s = now
            live.new_tokens = (live.new_tokens or []) + [token]
            live.text += live.detok.push(token)
            if live.hit_stop():
                request = entry.request
                if request_id in done:  # it also hit eos/max_tokens: the stop string came first
                    request.finish_reason = FinishReason.STOP
                else:
                    with self._lock:
                        if self.scheduler.finish(request_id, FinishReason.STOP) is not None:
                            done.add(request_id)
                        elif request.is_finished:  # on max_tokens by the step in flight
                            request.finish_reason = FinishReason.STOP
                            del request.output_token_ids[entry.end - request.num_prompt_tokens + 1:]
                            done.add(request_id)
            if request_id in done:
                outputs.append(self._finish_output(request_id, events=events))
            else:
                outputs.append((live, live.delta(final=False)))
        return outputs

    def _finish_output(self, request_id: str, error: str | None = None,
                       events: list | None = None) -> tuple[LiveRequest, RequestOutput]:
        """Final output of a request the scheduler finished; records its metrics and its
        ``Detokenized`` event (into ``events`` when given, else at once)."""
        live = self._live.pop(request_id)
        request = live.request
        reason = request.finish_reason.value if request.finish_reason else FinishReason.ABORT.value
        detok_start = time.time_ns() if live.key is not None else 0
        if not live.stopped and reason != FinishReason.ABORT.value:
            # Bytes held back as an incomplete character are final now (U+FFFD if still bad).
            live.text += live.detok.flush()
            live.hit_stop()
        output = live.delta(final=True)
        if live.key is not None:
            event = Detokenized(live.key, detok_start, time.time_ns())
            if events is not None:
                events.append(event)
            else:
                self._recorder.record(event)
        output.finished, output.finish_reason, output.error = True, reason, error
        output.num_preemptions = request.num_preemptions
        arrival, end = request.arrival_time_s, request.finish_time_s or time.monotonic()
        output.e2e_s = end - arrival
        if request.first_scheduled_time_s is not None:
            output.queue_s = request.first_scheduled_time_s - arrival
        if request.first_token_time_s is not None:
            output.ttft_s = request.first_token_time_s - arrival
            if request.num_output_tokens > 1:
                output.tpot_s = (end - request.first_token_time_s) / (request.num_output_tokens - 1)
        first_token, scheduled = request.first_token_time_s, request.first_scheduled_time_s
        self.metrics.request_finished(
            reason, e2e_s=output.e2e_s, queue_s=output.queue_s, ttft_s=output.ttft_s, tpot_s=output.tpot_s,
            prefill_s=first_token - scheduled if first_token is not None and scheduled is not None else None,
            decode_s=end - first_token if first_token is not None else None,
            prompt_tokens=request.num_prompt_tokens, generation_tokens=request.num_output_tokens,
            exemplar=live.exemplar)
        self.runner.release(request_id)
        return live, output

    def _fail_plan(self, plan: StepPlan, message: str,
                   finished: Sequence[Request] = ()) -> list[tuple[LiveRequest, RequestOutput]]:
        """Ends the plan's requests with ``message``, and those it had ``finished`` (on
        max_tokens, their last token never read)."""
        outputs = []
        with self._lock:
            for entry in plan.scheduled:
                if self.scheduler.finish(entry.request.request_id, FinishReason.ABORT) is not None:
                    outputs.append(self._finish_output(entry.request.request_id, error=message))
            for request in finished:
                if request.request_id in self._live:
                    request.finish_reason = FinishReason.ABORT
                    del request.output_token_ids[-1:]
                    outputs.append(self._finish_output(request.request_id, error=message))
        self._record_gauges()
        return outputs

    # ---- offline use (benchmarks, tests) -------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 priorities: Sequence[int] | None = None) -> list[Request]:
        """Runs prompts to completion on the caller's thread (the loop thread must not run).
        Returns the finished Requests in prompt order."""
        if self._thread is not None:
            raise RuntimeError("generate() is for an engine whose loop thread is not started")
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        requests = []
        for i, prompt in enumerate(prompts):
            request_id = self.new_request_id("offline")
            self.add_request(request_id, prompt, params[i], priority=priorities[i] if priorities else 0)
            requests.append(self._live[request_id].request)
        run = self.step_overlapped if self.async_scheduling else self.step
        while self.has_work:
            run()
        return requests
