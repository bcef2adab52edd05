"""The engine loop: schedule -> run -> update, in its own thread, streaming tokens to asyncio.

``LLMEngine`` composes the scheduler and KV block manager (plain Python), the model runner
(device), the tokenizer, the Prometheus series and the tracer. The server thread calls
``add_request`` (synchronous: a full queue raises ``QueueFullError`` at once, for HTTP 429)
and ``abort``; everything else happens on the loop thread:

1. apply pending aborts (their KV blocks go back to the free list), then ``schedule()``;
2. open the step span (linked to its requests) and the requests' phase spans;
3. run the model (the only device work), then ``update()`` with the sampled tokens;
4. detokenize incrementally, finish requests on stop strings (``scheduler.finish``), and hand
   every request's new text to its asyncio queue with ONE ``call_soon_threadsafe`` per step.

The scheduler is guarded by one lock held only around ``add``/``schedule``/``update``/
``finish`` (never around the model), so admission never waits for a step. Request phases:
``queue`` from add to first schedule, ``prefill`` from there to the first token, ``decode``
to the end, ``detokenize`` around the final flush; a preempted request is re-queued and its
recompute opens new ``queue``/``prefill`` spans. Telemetry off costs one branch per use.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sightline.engine.config import EngineConfig, resolve_model_config
from sightline.engine.kv_cache import KVCacheConfig, KVCacheManager
from sightline.engine.metrics import EngineMetrics, trace_exemplar
from sightline.engine.request import FinishReason, Request, SamplingParams
from sightline.engine.scheduler import QueueFullError, Scheduler, StepPlan
from sightline.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from sightline.instrumentation import semconv as sc

__all__ = ["LLMEngine", "RequestOutput", "RequestStream", "StepStats", "EngineStoppedError",
           "QueueFullError"]

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine is draining or stopped: no new requests (the server answers 503)."""


@dataclass
class RequestOutput:
    """What one step produced for one request; the last one has ``finished=True``."""

    request_id: str
    text: str  # new text since the previous output (stop strings never included)
    token_ids: list[int]  # new tokens since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # set when the engine failed this request
    ttft_s: float | None = None  # the timing fields are set on the final output
    tpot_s: float | None = None
    queue_s: float | None = None
    e2e_s: float | None = None
    num_preemptions: int = 0


class RequestStream:
    """Async iterator over one request's outputs; created and consumed on the server's loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self.queue.get()
        self.finished = output.finished
        return output


@dataclass(eq=False)
class _Live:
    """Engine-thread state of one live request."""

    request: Request
    stream: RequestStream | None
    detok: IncrementalDetokenizer
    trace: object | None  # RequestTrace
    phase: str = sc.SPAN_QUEUE
    text: str = ""  # generated text after stop-string truncation
    emitted: int = 0  # chars of text already handed out
    checked: int = 0  # chars of text already searched for stop strings
    new_tokens: list[int] | None = None
    hold: int = 0  # chars kept back while they could start a stop string
    stopped: bool = False  # a stop string ended it
    exemplar: dict[str, str] | None = None  # points the request's latency observations at its trace
    last_token_s: float = 0.0  # monotonic time of its latest token (inter-token latency)


@dataclass(frozen=True)
class StepStats:
    """What the last ``step()`` did (for benchmarks and logs)."""

    step_id: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    duration_s: float  # schedule + model + sampling + update + detokenize


def _deliver(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in batch:
        stream.queue.put_nowait(output)


class LLMEngine:
    """One model, one device, one loop thread (or ``step()`` driven by the caller, offline)."""

    def __init__(self, config: EngineConfig, telemetry=None) -> None:
        from sightline.engine.model_runner import ModelRunner  # torch, loaded with the engine
        from sightline.instrumentation.tracing import Telemetry

        self.config = config
        self.model_config = resolve_model_config(config.model)
        self.model_name = config.model_name
        self.telemetry = telemetry if telemetry is not None else Telemetry.disabled()
        self.gpu_telemetry = self._gpu_telemetry()
        self.runner = ModelRunner(config, self.model_config, self.gpu_telemetry)
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
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._next_id = 0
        self._last_plan_nonempty = False
        self.last_step: StepStats | None = None

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
        """Kernel tracing (E3's GpuTelemetry) only at level kernels on CUDA; None otherwise."""
        if not self.telemetry.kernels_on:
            return None
        try:
            import torch
            if not torch.cuda.is_available() or self.config.device == "cpu":
                log.info("trace level kernels: no CUDA device, kernel tracing is off")
                return None
            from sightline.instrumentation.gpu_telemetry import GpuTelemetry
            return GpuTelemetry.create(self.telemetry, torch.cuda.current_device())
        except Exception:  # telemetry trouble never stops the engine
            log.exception("kernel telemetry unavailable; continuing without it")
            return None

    # ---- server-side API (any thread) ---------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._live)

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
        request = Request(request_id, list(prompt_token_ids), sampling, priority=priority,
                          eos_token_id=self.eos_token_id, telemetry=trace)
        stream = RequestStream(request_id, loop) if loop is not None else None
        live = _Live(request, stream, IncrementalDetokenizer(self.tokenizer), trace,
                     hold=max((len(s) for s in sampling.stop), default=1) - 1, exemplar=trace_exemplar(trace))
        if trace is not None:
            trace.start_phase(sc.SPAN_QUEUE)
        with self._wake:
            if not self._accepting:
                raise EngineStoppedError("the engine is shutting down")
            self.scheduler.add(request)  # QueueFullError / ValueError propagate
            self._live[request_id] = live
            self.metrics.c_waiting.set(self.scheduler.num_waiting)
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
        if self.gpu_telemetry is not None:
            try:
                self.gpu_telemetry.shutdown()
            except Exception:
                log.exception("kernel telemetry shutdown failed")

    # ---- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._aborts or self.scheduler.has_work):
                    self._wake.wait()
                if self._stopping and not self._aborts:
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
        outputs = self.step()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for live, output in outputs:
            if live.stream is not None:
                batches.setdefault(live.stream.loop, []).append((live.stream, output))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the server's loop closed under us (shutdown)
                pass
        return bool(outputs) or self._last_plan_nonempty

    def step(self) -> list[tuple[_Live, RequestOutput]]:
        """One iteration on the caller's thread. Returns the outputs it produced."""
        t0 = time.perf_counter()
        outputs: list[tuple[_Live, RequestOutput]] = []
        with self._lock:
            aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                if self.scheduler.abort(request_id) is not None:
                    outputs.append(self._finish_output(request_id))
            plan = self.scheduler.schedule()
        self._last_plan_nonempty = not plan.is_empty
        if plan.is_empty:
            self._record_gauges()
            return outputs
        step_trace = self._open_step(plan)
        self.runner.copy_blocks(self.kv_cache.take_pending_copies())
        try:
            sampled = self.runner.execute(plan, step_trace)
        except Exception as exc:
            log.exception("model step %d failed", plan.step_id)
            outputs += self._fail_plan(plan, f"engine step failed: {type(exc).__name__}: {exc}")
            if step_trace is not None:
                step_trace.end({sc.ERROR_TYPE: type(exc).__name__})
            return outputs
        with self._lock:
            finished = self.scheduler.update(plan, sampled)
        if step_trace is not None:
            step_trace.end()
        outputs += self._process_tokens(plan, sampled, finished)
        m = self.metrics
        duration = time.perf_counter() - t0
        self.last_step = StepStats(plan.step_id, plan.num_prefill_tokens, plan.num_decode_tokens,
                                   len(plan.scheduled), duration)
        m.c_step.observe(duration)
        m.c_step_tokens.observe(plan.num_scheduled_tokens)
        m.c_generation_tokens.inc(len(sampled))
        self._record_gauges()
        return outputs

    def _record_gauges(self) -> None:
        m = self.metrics
        m.c_running.set(self.scheduler.num_running)
        m.c_waiting.set(self.scheduler.num_waiting)
        m.c_kv_usage.set(self.kv_cache.usage)

    def _open_step(self, plan: StepPlan):
        """Phase transitions of the scheduled requests, and the step span when steps_on."""
        for request in plan.preempted:
            live = self._live.get(request.request_id)
            self.metrics.c_preemptions.inc()
            if live is not None:
                live.phase = sc.SPAN_QUEUE
                if live.trace is not None:
                    live.trace.preempted()
                    live.trace.start_phase(sc.SPAN_QUEUE)
        for entry in plan.scheduled:
            live = self._live.get(entry.request.request_id)
            if live is not None and live.phase == sc.SPAN_QUEUE:
                live.phase = sc.SPAN_PREFILL
                if live.trace is not None:
                    live.trace.end_phase(sc.SPAN_QUEUE)
                    live.trace.start_phase(sc.SPAN_PREFILL)
        if not self.telemetry.steps_on:
            return None
        traces = [e.request.telemetry for e in plan.scheduled]
        num_decode = sum(1 for e in plan.scheduled if not e.is_prefill)
        step_trace = self.telemetry.start_step(plan.step_id, requests=traces, attributes={
            sc.STEP_PREFILL_TOKENS: plan.num_prefill_tokens,
            sc.STEP_DECODE_TOKENS: plan.num_decode_tokens,
            sc.STEP_NUM_PREFILL_SEQS: len(plan.scheduled) - num_decode,
            sc.STEP_NUM_DECODE_SEQS: num_decode,
            sc.STEP_KV_BLOCKS_USED: plan.kv_blocks_used,
            sc.STEP_KV_BLOCKS_TOTAL: plan.kv_blocks_total,
        })
        if step_trace is not None:
            for trace in traces:
                if trace is not None:
                    trace.link_step(step_trace)
        return step_trace

    def _process_tokens(self, plan: StepPlan, sampled: dict[str, int],
                        finished: list[Request]) -> list[tuple[_Live, RequestOutput]]:
        outputs = []
        done = {r.request_id for r in finished}
        now = time.monotonic()
        for entry in plan.scheduled:
            request_id = entry.request.request_id
            token = sampled.get(request_id)
            live = self._live.get(request_id)
            if token is None or live is None:
                continue
            if live.phase == sc.SPAN_PREFILL:  # this chunk finished the (re)computed prompt
                live.phase = sc.SPAN_DECODE
                if entry.request.num_output_tokens == 1:
                    self.metrics.c_prompt_tokens.inc(entry.request.num_prompt_tokens)
                if live.trace is not None:
                    live.trace.end_phase(sc.SPAN_PREFILL)
                    live.trace.first_token()
                    live.trace.start_phase(sc.SPAN_DECODE)
            if entry.request.num_output_tokens > 1:
                self.metrics.c_itl.observe(now - live.last_token_s, live.exemplar)
            live.last_token_s = now
            live.new_tokens = (live.new_tokens or []) + [token]
            live.text += live.detok.push(token)
            if self._hit_stop(live):
                if request_id in done:  # it also hit eos/max_tokens: the stop string came first
                    entry.request.finish_reason = FinishReason.STOP
                else:
                    with self._lock:
                        if self.scheduler.finish(request_id, FinishReason.STOP) is not None:
                            done.add(request_id)
            if request_id in done:
                outputs.append(self._finish_output(request_id))
            else:
                outputs.append((live, self._delta(live, final=False)))
        return outputs

    def _hit_stop(self, live: _Live) -> bool:
        """Truncates ``live.text`` at the first stop string; True when one appeared."""
        stops = live.request.sampling.stop
        if not stops:
            return False
        start = max(0, live.checked - live.hold)
        cut = -1
        for stop in stops:
            index = live.text.find(stop, start)
            if index >= 0 and (cut < 0 or index < cut):
                cut = index
        live.checked = len(live.text)
        if cut >= 0:
            live.text = live.text[:cut]
            live.checked = cut
            live.stopped = True
            return True
        return False

    def _delta(self, live: _Live, final: bool) -> RequestOutput:
        end = len(live.text) if final else max(live.emitted, len(live.text) - live.hold)
        text = live.text[live.emitted:end]
        live.emitted = end
        tokens, live.new_tokens = live.new_tokens or [], None
        request = live.request
        return RequestOutput(request.request_id, text, tokens,
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens)

    def _finish_output(self, request_id: str, error: str | None = None) -> tuple[_Live, RequestOutput]:
        """Final output of a request the scheduler finished; records its metrics and spans."""
        live = self._live.pop(request_id)
        request = live.request
        reason = request.finish_reason.value if request.finish_reason else FinishReason.ABORT.value
        trace = live.trace
        if trace is not None:
            for phase in (sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE):
                trace.end_phase(phase)
            trace.start_phase(sc.SPAN_DETOKENIZE)
        if not live.stopped and reason != FinishReason.ABORT.value:
            # Bytes held back as an incomplete character are final now (U+FFFD if still bad).
            live.text += live.detok.flush()
            self._hit_stop(live)
        output = self._delta(live, final=True)
        if trace is not None:
            trace.end_phase(sc.SPAN_DETOKENIZE)
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

    def _fail_plan(self, plan: StepPlan, message: str) -> list[tuple[_Live, RequestOutput]]:
        outputs = []
        with self._lock:
            for entry in plan.scheduled:
                if self.scheduler.finish(entry.request.request_id, FinishReason.ABORT) is not None:
                    outputs.append(self._finish_output(entry.request.request_id, error=message))
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
        while self.scheduler.has_work:
            self.step()
        return requests
