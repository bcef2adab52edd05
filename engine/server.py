"""The OpenAI-compatible HTTP server (aiohttp) in front of one ``LLMEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models[/{id}]``,
``/health``, ``/live``, ``/ping``, ``/version``, ``/debug/{steps,startup}``, ``/metrics``
(OpenMetrics with trace-id exemplars when asked). HTTP is served from the start: ``/live``
is 200 at once, ``/health`` 503 naming the start-up phase until the engine is warm, the API
routes 503 (``/metrics`` has the telemetry's series). Streams as vLLM does: one SSE chunk
per generated token even when empty, the chat role on the first token's chunk, usage at the
end (``include_usage``) or on every chunk (``continuous_usage_stats``); ``X-Request-Id`` echoed.

Errors come in OpenAI's shape: 400 (bad parameters, JSON, context), 404, 429 with
``Retry-After`` (queue full), 503 (starting, shutting down), 500 (engine failure); the
process serves on. A client that disconnects has its request aborted, its KV blocks freed
before the next step. SIGTERM/SIGINT: new requests get 503, in-flight ones get
``shutdown_timeout_s`` (a second signal cuts it short), the rest are aborted, telemetry flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from ..instrumentation import TelemetryPipeline
from ..instrumentation import semconv as sc
from .config import EngineConfig
from .llm_engine import EngineStoppedError, LLMEngine, QueueFullError, RequestOutput
from .metrics import exposition
from .openai_protocol import (
    SSE_DONE, ChatCompletionRequest, CompletionRequest, ProtocolError, chat_chunk, chat_response,
    completion_chunk, completion_response, error_body, now_s, parse_chat_request,
    parse_completion_request, parse_json, sse, usage, usage_chunk)
from .request import SamplingParams
from .startup import StartupProgress
from .tokenizer import apply_chat_template

__all__ = ["EngineServer", "RunningServer", "serve", "serve_in_thread"]

log = logging.getLogger(__name__)

_CLIENT_GONE = "client_disconnected"
# The caller's request id (generated when absent): echoed, and the span attribute
# sightline.request.id; the response id is "<cmpl|chatcmpl>-<it>".
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII, as an HTTP header value can carry
# Seconds a client refused for a full queue is told to wait: about one batch's worth of work.
RETRY_AFTER_S = 1


def _json_response(payload: dict, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(payload).encode(), status=status, content_type="application/json")


class EngineServer:
    """Routes bound to one engine; ``app`` is the aiohttp application."""

    def __init__(self, engine: LLMEngine | None, telemetry, startup: StartupProgress | None = None,
                 model: str | None = None) -> None:
        """``engine`` None: still starting (``startup`` says where); set it once ready."""
        if engine is None and startup is None:
            raise ValueError("an EngineServer without its engine needs the start-up progress")
        self.engine = engine
        self.telemetry = telemetry
        self.startup = startup
        self.model = engine.model_name if engine is not None else model
        self.created = now_s()
        self.draining = False
        self.app = web.Application(middlewares=[self._errors_middleware], client_max_size=16 * 2**20)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model_card),
            web.get("/health", self.health),
            web.get("/live", self.live),
            web.get("/ping", self.ping),
            web.post("/ping", self.ping),
            web.get("/version", self.version),
            web.get("/metrics", self.metrics),
            web.get("/debug/steps", self.debug_steps),
            web.get("/debug/startup", self.debug_startup),
        ])
        self._live_ids: set[str] = set()  # response ids of requests in flight (X-Request-Id reuse)

    # ---- plumbing -----------------------------------------------------------------------------
    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        """Every failure leaves in OpenAI's error shape (404/405 included); the server goes on."""
        if self.engine is None and request.path not in ("/health", "/live", "/version", "/metrics"):
            reply = _json_response(error_body(
                f"the engine is starting (phase {self.startup.state()['phase']}); retry once "
                "/health answers 200", "service_unavailable", None, "starting"), 503)
            reply.headers["Retry-After"] = str(RETRY_AFTER_S)
            return reply
        try:
            return await handler(request)
        except ProtocolError as exc:
            self.engine.metrics.error(exc.status)
            reply = _json_response(exc.body(), exc.status)
            reply.headers.update(exc.headers)
            return reply
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            self.engine.metrics.error(exc.status)
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
            return _json_response(error_body(f"{request.method} {request.path}: {exc.reason}",
                                             "invalid_request_error", None, code), exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            log.exception("unhandled error in %s", request.path)
            self.engine.metrics.error(500)
            return _json_response(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                             "server_error", None, "internal_error"), 500)

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 once warm, 503 naming the start-up phase before, and while draining."""
        if self.engine is None:
            return _json_response(self.startup.state(), 503)
        if self.draining:
            return _json_response({"status": "draining"}, 503)
        report = self.engine.startup_report
        return _json_response({"status": "ok", "running": self.engine.scheduler.num_running,
                               "waiting": self.engine.scheduler.num_waiting,
                               "startup_s": round(report.total_s, 3),
                               "startup_trace_id": report.trace_id})

    async def live(self, request: web.Request) -> web.Response:
        """Liveness: 200 while the process serves HTTP, starting and draining included."""
        return _json_response({"status": "alive"})

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.draining else 200)

    async def version(self, request: web.Request) -> web.Response:
        return _json_response({"version": _version()})

    async def metrics(self, request: web.Request) -> web.Response:
        registries = [getattr(self.telemetry, "registry", None)]
        if self.engine is not None:
            registries.insert(0, self.engine.metrics.registry)
        # starting: the telemetry's series alone, so that the scrape target is up meanwhile
        body, content_type = exposition(registries, accept=request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "sightline",
                "max_model_len": self.engine.max_model_len}

    async def debug_steps(self, request: web.Request) -> web.Response:
        """The wall times of the engine's recent steps, oldest first (what a step-time
        histogram cannot answer: how many steps were over twice the median), and the loop's
        total time beside the part of it the engine thread spent recording telemetry."""
        engine = self.engine
        gpu = engine.gpu_telemetry
        return _json_response({
            "durations_s": list(engine.step_durations_s), "loop_s": engine.loop_s,
            "telemetry_engine_thread_s": engine.telemetry_thread_s
            + (gpu.stats.engine_thread_s if gpu is not None else 0.0),
            # the traced steps' part of it, and how many steps were traced
            "telemetry_traced_steps_s": gpu.stats.engine_thread_traced_s if gpu is not None else 0.0,
            "steps_traced": gpu.stats.steps_traced_sampled + gpu.stats.steps_traced_tail
            if gpu is not None else 0,
            # untraced steps whose probe records were read: their part, and every probed step
            "telemetry_probed_steps_s": gpu.stats.engine_thread_probed_s if gpu is not None else 0.0,
            "steps_probed": gpu.stats.steps_probed if gpu is not None else 0,
            "ctas_probed": gpu.stats.ctas_probed if gpu is not None else 0,   # fed the histograms
            "gpu_telemetry_worker_cpu_s": gpu.stats.worker_cpu_s if gpu is not None else 0.0,
            "gpu_telemetry_worker_phases_cpu_s":
                gpu.stats.worker_phases_cpu_s() if gpu is not None else {}})

    async def debug_startup(self, request: web.Request) -> web.Response:
        """The start-up report: each phase's time and the kernel variants it compiled or
        took from the cache (``StartupReport.to_dict``)."""
        return _json_response(self.engine.startup_report.to_dict())

    async def models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.model:
            raise ProtocolError(f"model {model_id!r} does not exist; this server serves {self.model!r}",
                                status=404, param="model", code="model_not_found")
        return _json_response(self._model_card())

    # ---- generation ---------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, http: web.Request, chat: bool) -> web.StreamResponse:
        if self.draining:
            raise ProtocolError("the server is shutting down", status=503, type="service_unavailable",
                                code="shutting_down")
        body = parse_json(await http.read())
        params: ChatCompletionRequest | CompletionRequest = (
            parse_chat_request(body) if chat else parse_completion_request(body))
        if params.model != self.model:
            raise ProtocolError(f"model {params.model!r} does not exist; this server serves {self.model!r}",
                                status=404, param="model", code="model_not_found")
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = http.headers.get(REQUEST_ID_HEADER)
        if request_id is None:
            request_id = response_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        elif not _REQUEST_ID.fullmatch(request_id):
            raise ProtocolError(f"{REQUEST_ID_HEADER}={request_id[:300]!r} must be 1..256 visible ASCII "
                                "characters", param=REQUEST_ID_HEADER, code="invalid_value")
        else:
            response_id = f"{prefix}-{request_id}"
        if response_id in self._live_ids:
            raise ProtocolError(f"{REQUEST_ID_HEADER}={request_id!r} names a request still in flight",
                                param=REQUEST_ID_HEADER, code="duplicate_request_id")
        route = "/v1/chat/completions" if chat else "/v1/completions"
        trace = self.telemetry.start_request(
            route=route, headers=http.headers, model=self.model,
            operation="chat" if chat else "text_completion", request_id=request_id,
            priority=params.priority) if self.telemetry is not None else None
        self._live_ids.add(response_id)
        try:
            return await self._run(http, params, chat, response_id, request_id, trace)
        except ProtocolError as exc:
            if trace is not None:
                trace.finish(status_code=exc.status, finish_reason=None, input_tokens=0, output_tokens=0,
                             error_type=exc.code or exc.type)
            raise
        except Exception as exc:  # a bug: the middleware answers 500; the span must still end
            if trace is not None:
                trace.finish(status_code=500, finish_reason=None, input_tokens=0, output_tokens=0,
                             error_type=type(exc).__name__)
            raise
        finally:
            self._live_ids.discard(response_id)

    async def _run(self, http: web.Request, params, chat: bool, response_id: str, request_id: str, trace):
        engine = self.engine
        tokenize_start = time.time_ns()
        try:
            prompt_text, prompt_ids = self._tokenize(params, chat)
        finally:
            if trace is not None:
                trace.tokenized(tokenize_start, time.time_ns())
        room = engine.max_model_len - len(prompt_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(room, 1) if chat else 16
        if len(prompt_ids) + max_tokens > engine.max_model_len:
            raise ProtocolError(
                f"this model's maximum context length is {engine.max_model_len} tokens; the request has "
                f"{len(prompt_ids)} prompt tokens and max_tokens={max_tokens} "
                f"({len(prompt_ids) + max_tokens} in all)", param="max_tokens", code="context_length_exceeded")
        try:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=params.temperature,
                                      top_p=params.top_p, seed=params.seed, stop=params.stop,
                                      ignore_eos=params.ignore_eos, top_k=params.top_k, min_p=params.min_p,
                                      repetition_penalty=params.repetition_penalty,
                                      presence_penalty=params.presence_penalty,
                                      frequency_penalty=params.frequency_penalty,
                                      allowed_token_ids=params.allowed_token_ids)
        except ValueError as exc:
            raise ProtocolError(str(exc), code="invalid_value") from None
        if trace is not None:
            trace.set_attributes({sc.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
                                  sc.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
                                  sc.GEN_AI_REQUEST_TOP_P: params.top_p, sc.REQUEST_STREAM: params.stream,
                                  **({sc.GEN_AI_REQUEST_TOP_K: params.top_k} if params.top_k else {})})
        try:
            stream = engine.add_request(response_id, prompt_ids, sampling, priority=params.priority,
                                        trace=trace, loop=asyncio.get_running_loop())
        except QueueFullError as exc:
            raise ProtocolError(f"the waiting queue is full, retry later ({exc})", status=429,
                                type="rate_limit_error", code="queue_full",
                                headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStoppedError:
            raise ProtocolError("the server is shutting down", status=503, type="service_unavailable",
                                code="shutting_down") from None
        except ValueError as exc:
            raise ProtocolError(str(exc), param="max_tokens", code="context_length_exceeded") from None
        created = now_s()
        finished: RequestOutput | None = None
        pieces: list[str] = []
        response: web.StreamResponse | None = None
        try:
            if params.stream:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache",
                                                       REQUEST_ID_HEADER: request_id})
                await response.prepare(http)
            first = True
            async for out in stream:
                pieces.append(out.text)
                if out.finished:
                    finished = out
                if response is None or out.error or not (out.token_ids or out.finished):
                    continue
                usage_now = (usage(out.num_prompt_tokens, out.num_output_tokens)
                             if params.continuous_usage else None)
                if chat:
                    delta = {"role": "assistant", "content": out.text} if first else {"content": out.text}
                    payload = chat_chunk(response_id, self.model, created, delta, out.finish_reason,
                                         params.include_usage, usage_now)
                else:
                    payload = completion_chunk(response_id, self.model, created, out.text,
                                               out.finish_reason, params.include_usage, usage_now)
                first = False
                await response.write(sse(payload))
            assert finished is not None
            if finished.error:
                self.engine.metrics.error(500)
                error = error_body(finished.error, "server_error", None, "engine_error")
                if response is None:
                    self._finish_trace(trace, finished, 500, pieces, prompt_text, "engine_error")
                    return _json_response(error, 500)
                await response.write(sse(error))
                await response.write(SSE_DONE)
                self._finish_trace(trace, finished, 200, pieces, prompt_text, "engine_error")
                return response
            text = "".join(pieces)
            if response is None:
                build = chat_response if chat else completion_response
                self._finish_trace(trace, finished, 200, pieces, prompt_text, None)
                reply = _json_response(build(response_id, self.model, created, text, finished.finish_reason,
                                             finished.num_prompt_tokens, finished.num_output_tokens))
                reply.headers[REQUEST_ID_HEADER] = request_id
                return reply
            if params.include_usage:
                await response.write(sse(usage_chunk(response_id, self.model, created, chat,
                                                     finished.num_prompt_tokens, finished.num_output_tokens)))
            await response.write(SSE_DONE)
            await response.write_eof()
            self._finish_trace(trace, finished, 200, pieces, prompt_text, None)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: free its KV blocks before the next step.
            engine.abort(response_id)
            if trace is not None:
                trace.finish(status_code=499, finish_reason="abort", input_tokens=len(prompt_ids),
                             output_tokens=finished.num_output_tokens if finished else 0,
                             error_type=sc.ERROR_TYPE_CLIENT_DISCONNECTED)
            raise
        finally:
            if finished is None:
                engine.abort(response_id)

    def _tokenize(self, params, chat: bool) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); a token id outside the vocabulary (in the
        prompt or in allowed_token_ids) is a 400."""
        engine = self.engine
        vocab = engine.model_config.vocab_size
        bad = next((t for t in params.allowed_token_ids or () if t >= vocab), None)
        if bad is not None:
            raise ProtocolError(f"allowed_token_ids holds {bad}, outside the vocabulary [0, {vocab})",
                                param="allowed_token_ids", code="invalid_value")
        if chat:
            prompt_text = apply_chat_template(params.messages)
            prompt_ids = engine.tokenizer.encode(prompt_text)
        elif isinstance(params.prompt, str):
            prompt_text = params.prompt
            prompt_ids = engine.tokenizer.encode(prompt_text)
        else:
            prompt_text, prompt_ids = None, params.prompt
            bad = next((t for t in prompt_ids if t >= vocab), None)
            if bad is not None:
                raise ProtocolError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                                    param="prompt", code="invalid_value")
        return prompt_text, prompt_ids

    def _finish_trace(self, trace, out: RequestOutput, status: int, pieces: list[str],
                      prompt_text: str | None, error_type: str | None) -> None:
        if trace is None:
            return
        trace.set_content(prompt_text, "".join(pieces))
        trace.finish(status_code=status, finish_reason=out.finish_reason, input_tokens=out.num_prompt_tokens,
                     output_tokens=out.num_output_tokens, ttft_s=out.ttft_s, tpot_s=out.tpot_s,
                     queue_s=out.queue_s, e2e_s=out.e2e_s, preemptions=out.num_preemptions,
                     error_type=error_type)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def drain(self, timeout_s: float, force: asyncio.Event | None = None) -> None:
        """Refuse new work, give live requests ``timeout_s`` to finish (or until ``force`` is
        set: a second SIGTERM), then abort the rest."""
        self.draining = True
        self.engine.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while self.engine.num_live and time.monotonic() < deadline and not (force and force.is_set()):
            await asyncio.sleep(0.02)
        if self.engine.num_live:
            log.warning("shutdown: aborting %d live requests", self.engine.num_live)
        await asyncio.to_thread(self.engine.shutdown)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sightline")
    except PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


@dataclass
class RunningServer:
    """A server started by ``serve_in_thread``: its port, engine, and a way to stop it."""

    port: int
    engine: LLMEngine
    server: EngineServer
    loop: asyncio.AbstractEventLoop
    stop_event: asyncio.Event
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 60.0) -> None:
        """Same path as SIGTERM: drain, abort leftovers, flush telemetry; joins the thread."""
        self.loop.call_soon_threadsafe(self.stop_event.set)
        if self.thread is not None:
            self.thread.join(timeout_s)


async def _serve(config: EngineConfig, on_ready: Callable[[RunningServer], None] | None = None,
                 telemetry=None, startup: StartupProgress | None = None) -> int:
    telemetry = _pipeline(config, telemetry)
    startup = startup if startup is not None else StartupProgress()
    server = EngineServer(None, telemetry, startup, config.model_name)   # /live, /health 503
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        port = runner.addresses[0][1] if runner.addresses else config.port
        log.info("starting on http://%s:%d: /live answers, /health is 503 until warm",
                 config.host, port)
        engine = await asyncio.to_thread(LLMEngine, config, telemetry, startup)
    except BaseException as exc:
        startup.fail(exc)
        await runner.cleanup()
        if telemetry is not None:
            telemetry.shutdown()
        raise
    engine.start()
    server.engine = engine
    log.info("serving %s on http://%s:%d (device %s, %d KV blocks, max_model_len %d, trace level %s)",
             engine.model_name, config.host, port, engine.runner.device, engine.runner.num_blocks,
             engine.max_model_len,
             telemetry.config.level.name.lower() if telemetry is not None else "off")
    stop, force = asyncio.Event(), asyncio.Event()  # first signal drains, a second one aborts
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, lambda: force.set() if stop.is_set() else stop.set())
    if on_ready is not None:
        on_ready(RunningServer(port, engine, server, loop, stop))
    else:
        print(f"sightline engine: serving {engine.model_name} on http://{config.host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("shutting down: draining for up to %.1f s", config.shutdown_timeout_s)
        started = time.monotonic()
        await server.drain(config.shutdown_timeout_s, force)
        await runner.cleanup()
        if telemetry is not None:
            await asyncio.to_thread(telemetry.shutdown)
        log.info("stopped in %.1f s", time.monotonic() - started)
    return 0


def _pipeline(config: EngineConfig, telemetry) -> TelemetryPipeline | None:
    """The server's telemetry: ``telemetry`` as given (a pipeline, or a started Telemetry
    whose spans are then built on a thread here), else one started from the config, its
    spans built in the telemetry process."""
    if telemetry is None:
        if config.telemetry is None:
            return None
        return TelemetryPipeline.start(config.telemetry, mode=config.telemetry_mode)
    if isinstance(telemetry, TelemetryPipeline):
        return telemetry
    return TelemetryPipeline.around(telemetry)


def serve(config: EngineConfig) -> int:
    """Runs the server in this (main) thread until SIGTERM/SIGINT; returns the exit code.
    Start-up is reported from the process's own start."""
    return asyncio.run(_serve(config, startup=StartupProgress(from_process_start=True)))


def serve_in_thread(config: EngineConfig, timeout_s: float = 300.0, telemetry=None,
                    on_phase=None) -> RunningServer:
    """Starts the server on a daemon thread with its own event loop; returns once it is
    ready (warm). ``telemetry``: a started Telemetry to use instead of one built from
    ``config.telemetry`` (the server shuts it down when it stops). ``on_phase(name,
    report)``: called at each start-up phase's start (report None) and end. Raises
    whatever start-up raised (bad model path, port in use, ...)."""
    ready: list[RunningServer] = []
    failed: list[BaseException] = []
    event = threading.Event()

    def on_ready(running: RunningServer) -> None:
        ready.append(running)
        event.set()

    def main() -> None:
        try:
            asyncio.run(_serve(config, on_ready, telemetry, StartupProgress(on_phase)))
        except BaseException as exc:  # reported to the caller below
            failed.append(exc)
            event.set()

    thread = threading.Thread(target=main, name="sightline-server", daemon=True)
    thread.start()
    if not event.wait(timeout_s):
        raise TimeoutError(f"the engine server did not start within {timeout_s} s")
    if failed:
        raise failed[0]
    ready[0].thread = thread
    return ready[0]
