"""The OpenAI-compatible HTTP server (aiohttp) in front of one ``LLMEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream: true``,
ending ``data: [DONE]``; a usage chunk with ``stream_options.include_usage``), ``GET /v1/models``,
``GET /health``, ``GET /metrics``.

Errors come in OpenAI's shape with the right status: 400 for invalid parameters, malformed
JSON or prompt + max_tokens past the context; 404 for an unknown model or route; 429 when the
waiting queue is full; 503 while shutting down; 500 if the engine fails a request. The process
keeps serving after every one of them. A client that disconnects (mid-stream or while waiting)
has its request aborted, so its KV blocks return to the pool before the next engine step.

Shutdown (SIGTERM/SIGINT): new requests get 503 and ``/health`` turns 503, in-flight requests
get up to ``shutdown_timeout_s`` to finish (a second signal cuts that short), the rest are
aborted, then telemetry is flushed.
The event loop runs in the main thread, the engine loop in its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import EngineStoppedError, LLMEngine, QueueFullError, RequestOutput
from sightline.engine.openai_protocol import (
    SSE_DONE, ChatCompletionRequest, CompletionRequest, ProtocolError, chat_chunk, chat_response,
    completion_chunk, completion_response, error_body, now_s, parse_chat_request,
    parse_completion_request, parse_json, sse, usage_chunk)
from sightline.engine.request import SamplingParams
from sightline.engine.tokenizer import apply_chat_template
from sightline.instrumentation import semconv as sc

__all__ = ["EngineServer", "RunningServer", "serve", "serve_in_thread"]

log = logging.getLogger(__name__)

_CLIENT_GONE = "client_disconnected"
RETRY_AFTER_S = 1  # the hint sent with 429 (queue full): requests finish and free slots quickly
# The response id (also the engine's request id and the span attribute sightline.request.id).
REQUEST_ID_HEADER = "X-Request-Id"


def _json_response(payload: dict, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(payload).encode(), status=status, content_type="application/json")


class EngineServer:
    """Routes bound to one engine; ``app`` is the aiohttp application."""

    def __init__(self, engine: LLMEngine, telemetry) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.model = engine.model_name
        self.created = now_s()
        self.draining = False
        self.app = web.Application(middlewares=[self._errors_middleware], client_max_size=16 * 2**20)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])

    # ---- plumbing -----------------------------------------------------------------------------
    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        """Every failure leaves in OpenAI's error shape (404/405 included); the server goes on."""
        try:
            return await handler(request)
        except ProtocolError as exc:
            self.engine.metrics.error(exc.status)
            response = _json_response(exc.body(), exc.status)
            response.headers.update(exc.headers)
            return response
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
        if self.draining:
            return _json_response({"status": "draining"}, 503)
        return _json_response({"status": "ok", "running": self.engine.scheduler.num_running,
                               "waiting": self.engine.scheduler.num_waiting})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.engine.metrics.exposition([getattr(self.telemetry, "registry", None)])
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "sightline",
            "max_model_len": self.engine.max_model_len}]})

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
        response_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        route = "/v1/chat/completions" if chat else "/v1/completions"
        trace = self.telemetry.start_request(
            route=route, headers=http.headers, model=self.model,
            operation="chat" if chat else "text_completion", request_id=response_id,
            priority=params.priority) if self.telemetry.requests_on else None
        try:
            return await self._run(http, params, chat, response_id, trace)
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

    async def _run(self, http: web.Request, params, chat: bool, response_id: str, trace):
        engine = self.engine
        if trace is not None:
            trace.start_phase(sc.SPAN_TOKENIZE)
        if chat:
            prompt_text = apply_chat_template(params.messages)
            prompt_ids = engine.tokenizer.encode(prompt_text)
        elif isinstance(params.prompt, str):
            prompt_text = params.prompt
            prompt_ids = engine.tokenizer.encode(prompt_text)
        else:
            prompt_text, prompt_ids = None, params.prompt
            vocab = engine.model_config.vocab_size
            bad = next((t for t in prompt_ids if t >= vocab), None)
            if bad is not None:
                raise ProtocolError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                                    param="prompt", code="invalid_value")
        if trace is not None:
            trace.end_phase(sc.SPAN_TOKENIZE)
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
                                      ignore_eos=params.ignore_eos)
        except ValueError as exc:
            raise ProtocolError(str(exc), code="invalid_value") from None
        if trace is not None:
            trace.set_attributes({sc.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
                                  sc.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
                                  sc.GEN_AI_REQUEST_TOP_P: params.top_p, sc.REQUEST_STREAM: params.stream})
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
                                                       REQUEST_ID_HEADER: response_id})
                await response.prepare(http)
                if chat:
                    await response.write(sse(chat_chunk(response_id, self.model, created,
                                                        {"role": "assistant", "content": ""}, None,
                                                        params.include_usage)))
            async for out in stream:
                pieces.append(out.text)
                if out.finished:
                    finished = out
                if response is None or out.error:
                    continue
                if out.text or out.finished:
                    if chat:
                        delta = {"content": out.text} if out.text else {}
                        payload = chat_chunk(response_id, self.model, created, delta, out.finish_reason,
                                             params.include_usage)
                    else:
                        payload = completion_chunk(response_id, self.model, created, out.text,
                                                   out.finish_reason, params.include_usage)
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
                reply.headers[REQUEST_ID_HEADER] = response_id
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
                             error_type=_CLIENT_GONE)
            raise
        finally:
            if finished is None:
                engine.abort(response_id)

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
                 telemetry=None) -> int:
    from sightline.instrumentation.tracing import Telemetry

    if telemetry is None:
        telemetry = Telemetry.start(config.telemetry) if config.telemetry is not None else Telemetry.disabled()
    try:
        engine = await asyncio.to_thread(LLMEngine, config, telemetry)
    except BaseException:
        telemetry.shutdown()
        raise
    engine.start()
    server = EngineServer(engine, telemetry)
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else config.port
    log.info("serving %s on http://%s:%d (device %s, %d KV blocks, max_model_len %d, trace level %s)",
             engine.model_name, config.host, port, engine.runner.device, engine.runner.num_blocks,
             engine.max_model_len, telemetry.config.level.name.lower())
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
        await asyncio.to_thread(telemetry.shutdown)
        log.info("stopped in %.1f s", time.monotonic() - started)
    return 0


def serve(config: EngineConfig) -> int:
    """Runs the server in this (main) thread until SIGTERM/SIGINT; returns the exit code."""
    return asyncio.run(_serve(config))


def serve_in_thread(config: EngineConfig, timeout_s: float = 300.0, telemetry=None) -> RunningServer:
    """Starts the server on a daemon thread with its own event loop; returns once it listens.
    ``telemetry``: a started Telemetry to use instead of one built from ``config.telemetry``
    (the server shuts it down when it stops). Raises whatever start-up raised (bad model
    path, port in use, ...)."""
    ready: list[RunningServer] = []
    failed: list[BaseException] = []
    event = threading.Event()

    def on_ready(running: RunningServer) -> None:
        ready.append(running)
        event.set()

    def main() -> None:
        try:
            asyncio.run(_serve(config, on_ready, telemetry))
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
