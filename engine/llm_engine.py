"""The engine in one process: the core, the front end's output processing, and a loop thread.

``LLMEngine`` composes an ``EngineCore`` (scheduler, KV cache, model runner: token ids only)
and an ``OutputProcessor`` (text, stop strings, request metrics) on the same thread, so
that a stop string ends its request before the next step is planned. It serves the
benchmarks and tests offline (``generate``, ``step``) and, with its loop thread
(``start``), an in-process API server: ``add_request`` (a full queue raises
``QueueFullError`` at once, for HTTP 429) returns a ``RequestStream`` fed with ONE
``call_soon_threadsafe`` per step and event loop. ``engine serve`` runs the core in its own
process instead (``core_process``). Telemetry: the core records Queued and Step events,
the processor Detokenized; O(1) appends each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

from ..instrumentation import TelemetryPipeline, cancel_stop_at_exit, stop_at_exit
from .config import EngineConfig
from .core_records import AddRequest, OutputBatch, StepStats, TraceContext
from .engine_core import EngineCore, EngineStoppedError
from .metrics import EngineMetrics
from .output_processor import LiveRequest, OutputProcessor
from .request import FinishReason, Request, SamplingParams
from .request_output import RequestOutput, RequestStream, deliver
from .scheduler import QueueFullError
from .startup import StartupProgress
from .tokenizer import load_tokenizer

__all__ = ["LLMEngine", "RequestOutput", "RequestStream", "EngineStoppedError", "QueueFullError",
           "trace_context"]

log = logging.getLogger(__name__)


def trace_context(trace) -> TraceContext | None:
    """What crosses the boundary of a request's trace: its key and its server span's ids."""
    if trace is None:
        return None
    return TraceContext(trace.key, format(trace.trace_id, "032x"), format(trace.span_id, "016x"))


class LLMEngine:
    """One model, one device, one loop thread (or ``step()`` driven by the caller, offline)."""

    def __init__(self, config: EngineConfig, telemetry: TelemetryPipeline | None = None,
                 metrics: EngineMetrics | None = None,
                 startup: StartupProgress | None = None) -> None:
        """Builds the core, which warms up before it returns (``startup``: where the
        phases are reported); once constructed, the engine is ready."""
        self.core = core = EngineCore(config, telemetry, startup)
        self.config = config
        self.model_config = core.model_config
        self.model_name = core.model_name
        self.telemetry = telemetry
        self.tokenizer = load_tokenizer(self.model_config.path, self.model_config.bos_token_id,
                                        self.model_config.eos_token_id)
        self.metrics = metrics if metrics is not None else EngineMetrics(self.model_name)
        self.processor = OutputProcessor(
            self.tokenizer, self.metrics, core.finish_stop,
            telemetry.recorder if telemetry is not None else None)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._next_id = 0
        self.last_step: StepStats | None = None   # the step the last iteration completed

    # ---- the core's parts (tests and benchmarks read them) ------------------------------------
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    kv_cache = property(lambda self: self.core.kv_cache)
    max_model_len = property(lambda self: self.core.max_model_len)
    _in_flight = property(lambda self: self.core._in_flight)
    step_durations_s = property(lambda self: self.core.step_durations_s)
    startup_report = property(lambda self: self.core.startup_report)
    compile_cache = property(lambda self: self.core.compile_cache)

    @property
    def eos_token_id(self) -> int | None:
        return self.core.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.core.eos_token_id = value

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:   # benchmarks switch it between runs
        self.core.async_scheduling = on

    @property
    def gpu_telemetry(self):
        return self.core.gpu_telemetry

    @gpu_telemetry.setter
    def gpu_telemetry(self, gpu) -> None:
        self.core.gpu_telemetry = gpu

    # ---- server-side API (any thread) ---------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self.processor.live)

    @property
    def has_work(self) -> bool:
        """Requests queued or running, or a step still on the device."""
        return self.core.has_work

    @property
    def accepting(self) -> bool:
        return self.core.accepting

    def new_request_id(self, prefix: str = "req") -> str:
        with self._wake:
            self._next_id += 1
            return f"{prefix}-{self._next_id}"

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    *, priority: int = 0, trace=None, loop: asyncio.AbstractEventLoop | None = None,
                    cache_salt: str | None = None) -> RequestStream | None:
        """Queues a request. Returns its output stream (None when ``loop`` is None: offline).

        Raises EngineStoppedError (draining), QueueFullError (queue full) or ValueError (a prompt
        with max_tokens past ``max_model_len`` or the KV cache). O(1) plus the scheduler's add.
        """
        stream = RequestStream(request_id, loop) if loop is not None else None
        self._add(request_id, prompt_token_ids, sampling, priority, trace, stream, cache_salt)
        return stream

    def _add(self, request_id, prompt_token_ids, sampling, priority, trace, stream,
             cache_salt: str | None = None) -> Request:
        prompt = list(prompt_token_ids)
        self.processor.add(request_id, len(prompt), sampling, stream, trace)
        try:
            request = self.core.add_request(AddRequest(request_id, prompt, sampling, priority,
                                                       trace=trace_context(trace), cache_salt=cache_salt))
        except BaseException:
            self.processor.live.pop(request_id, None)
            raise
        with self._wake:
            self._wake.notify()
        return request

    def abort(self, request_id: str) -> None:
        """Asks the loop to drop the request (client gone); its blocks are freed before the next
        step. Safe to call for finished or unknown ids."""
        self.core.abort(request_id)
        with self._wake:
            self._wake.notify()

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the loop thread (daemon; ``shutdown`` joins it)."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="sightline-engine", daemon=True)
        self._thread.start()
        stop_at_exit(self, "shutdown")   # its steps call torch

    def stop_accepting(self) -> None:
        """Draining: later add_request calls raise EngineStoppedError; live requests go on."""
        self.core.stop_accepting()

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until no request is live (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.processor.live and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.processor.live

    def shutdown(self) -> None:
        """Aborts whatever is still live, stops and joins the loop thread. Idempotent."""
        self.stop_accepting()
        self.core.abort_all()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        cancel_stop_at_exit(self)
        self.core.close()

    # ---- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while True:
            with self._wake:
                while not (self._stopping or core.has_work):
                    self._wake.wait()
                if self._stopping and not core.has_work:
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
        outputs = self.step_overlapped() if self.core.async_scheduling else self.step()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for live, output in outputs:
            if live.stream is not None:
                batches.setdefault(live.stream.loop, []).append((live.stream, output))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(deliver, batch)
            except RuntimeError:  # the server's loop closed under us (shutdown)
                pass
        return bool(outputs) or self.core.last_plan_nonempty or self.core.step_in_flight

    def step(self) -> list[tuple[LiveRequest, RequestOutput]]:
        """One iteration on the caller's thread, waited for. Returns the outputs it produced."""
        return self._process(self.core.step())

    def step_overlapped(self) -> list[tuple[LiveRequest, RequestOutput]]:
        """One iteration of overlapped scheduling (``EngineCore.step_overlapped``)."""
        return self._process(self.core.step_overlapped())

    def _process(self, batch: OutputBatch) -> list[tuple[LiveRequest, RequestOutput]]:
        stats = batch.stats
        self.last_step = stats if stats.duration_s is not None else None
        return self.processor.process(batch)

    # ---- offline use (benchmarks, tests) -------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 priorities: Sequence[int] | None = None) -> list[Request]:
        """Runs prompts to completion on the caller's thread (the loop thread must not run).
        Returns the finished Requests in prompt order."""
        if self._thread is not None:
            raise RuntimeError("generate() is for an engine whose loop thread is not started")
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        requests = {}
        for i, prompt in enumerate(prompts):
            request_id = self.new_request_id("offline")
            requests[request_id] = self._add(request_id, prompt, params[i],
                                             priorities[i] if priorities else 0, None, None)
        run = self.step_overlapped if self.core.async_scheduling else self.step
        while self.has_work:
            for _, output in run():
                if output.finished and output.finish_reason == FinishReason.STOP.value:
                    requests[output.request_id].finish_reason = FinishReason.STOP   # a stop string
        return list(requests.values())
