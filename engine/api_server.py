"""The OpenAI-compatible HTTP server (aiohttp): one API server, in front of an engine core.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models[/{id}]``,
``/health``, ``/live``, ``/ping``, ``/version``, ``/debug/{steps,kv,startup}``, ``/metrics``
(OpenMetrics with trace-id exemplars when asked). Streams as vLLM does: one SSE chunk per
token even when its text is empty, the chat role on the first, usage at the end
(``include_usage``) or on every chunk (``continuous_usage_stats``); ``X-Request-Id`` echoed.
It reads nothing of the engine but its client (``core_client``): its ``Ready``, ``Phase``
records and step stats. Text is tokenized on a thread pool, token ids checked on the loop.

Errors in OpenAI's shape: 400, 404, 429 with ``Retry-After`` (queue full, decided here), 503
(starting, draining, core gone), 500; the process serves on. ``/live`` is 200 at once, ``/health`` 503
``{"status": "starting", "phase", "elapsed_s", "phases_done"}`` until the core is warm and
ready. A client that disconnects has its request aborted. SIGTERM: new requests get 503,
in-flight ones ``shutdown_timeout_s`` (a second signal cuts it short).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web

from ..instrumentation import TelemetryPipeline
from ..instrumentation import semconv as sc
from .config import EngineConfig, resolve_model_config
from .core_client import REFUSALS, EngineDeadError, InProcessClient, MPClient
from .http_limits import LimitedSite, track_requests
from .engine_core import EngineStoppedError, QueueFullError
from .llm_engine import LLMEngine
from .metrics import EngineMetrics
from .openai_protocol import (
    SSE_DONE, ChatCompletionRequest, CompletionRequest, ProtocolError, chat_chunk, chat_response,
    completion_chunk, completion_response, error_body, now_s, parse_chat_request,
    parse_completion_request, parse_json, sse, usage, usage_chunk)
from .request import SamplingParams
from .request_output import RequestOutput
from .startup import StartupProgress
from .tokenizer import Tokenizer, apply_chat_template, load_tokenizer

__all__ = ["EngineServer", "RunningServer", "run_api_server", "serve_in_thread"]

log = logging.getLogger(__name__)

SERVER_STARTING, SERVER_READY, SERVER_GONE = 0, 1, 2   # an API server's shared start-up state

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
    """Routes bound to one engine client; ``app`` is the aiohttp application."""

    def __init__(self, client: InProcessClient | MPClient, telemetry, metrics: EngineMetrics,
                 tokenizer: Tokenizer, model: str, index: int = 0, tokenize_threads: int = 2) -> None:
        self.client = client
        self.index = index   # which API server of ``engine serve`` this is
        self.telemetry = telemetry
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.model = model
        self.created = now_s()
        self.draining = False
        self.joined = False    # the core is ready and this server's telemetry joined it
        self.peers = None      # with several API servers: their shared start-up states
        self._started = False
        self._tokenize_pool = ThreadPoolExecutor(tokenize_threads, "sightline-tokenize")
        self.app = web.Application(middlewares=[self._errors_middleware, track_requests],
                                   client_max_size=16 * 2**20)
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
            web.get("/metrics", self.scrape),
            web.get("/debug/steps", self.debug_steps),
            web.get("/debug/kv", self.debug_kv),
            web.get("/debug/startup", self.debug_startup),
        ])
        self._live_ids: set[str] = set()  # response ids of requests in flight (X-Request-Id reuse)
        self._drops_reported: dict[str, int] = {}

    def _report_drops(self) -> None:
        """A joined telemetry's drops, to the core's series when they changed (split only)."""
        dropped_events = getattr(self.telemetry, "dropped_events", None)
        if dropped_events is None or not isinstance(self.client, MPClient):
            return
        dropped = dropped_events()
        if dropped != self._drops_reported:
            self.client.report_drops(dropped)
            self._drops_reported = dropped

    # ---- plumbing -----------------------------------------------------------------------------
    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        """Every failure leaves in OpenAI's error shape (404/405 included); the server goes on."""
        try:
            return await handler(request)
        except ProtocolError as exc:
            self.metrics.error(exc.status)
            reply = _json_response(exc.body(), exc.status)
            reply.headers.update(exc.headers)
            return reply
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            self.metrics.error(exc.status)
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
            return _json_response(error_body(f"{request.method} {request.path}: {exc.reason}",
                                             "invalid_request_error", None, code), exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            log.exception("unhandled error in %s", request.path)
            self.metrics.error(500)
            return _json_response(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                             "server_error", None, "internal_error"), 500)

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 once the core is warm and ready; 503 naming the start-up phase
        before, while draining, and once the core is gone."""
        client = self.client
        if client.dead is not None:
            return _json_response({"status": "engine_dead", "error": client.dead}, 503)
        if self.draining:
            return _json_response({"status": "draining"}, 503)
        if not self.started:
            peers = {} if self.peers is None else {
                "api_servers_ready": sum(state == SERVER_READY for state in self.peers[:])}
            return _json_response({"status": "starting", **client.progress(), **peers}, 503)
        stats, ready = client.stats, client.ready
        body = {"status": "ok", "running": stats.running if stats else 0,
                "waiting": stats.waiting if stats else 0,
                "api_server": self.index, "pid": os.getpid(),
                "core_pid": ready.core_pid, "startup_s": ready.startup_s,
                "startup_trace_id": ready.startup_trace_id}
        if ready.tp_worker_pids:
            body["tp_worker_pids"] = ready.tp_worker_pids
        return _json_response(body)

    @property
    def started(self) -> bool:
        """Joined, and no other API server on the port still starting (a client cannot
        choose which one answers it); once true, true for good."""
        if not self._started and self.joined and (
                self.peers is None or SERVER_STARTING not in self.peers[:]):
            self._started = True
        return self._started

    async def live(self, request: web.Request) -> web.Response:
        """Liveness: 200 while the process serves HTTP, starting and draining included."""
        return _json_response({"status": "alive"})

    async def ping(self, request: web.Request) -> web.Response:
        ok = self.started and not self.draining and self.client.dead is None
        return web.Response(status=200 if ok else 503)

    async def version(self, request: web.Request) -> web.Response:
        return _json_response({"version": _version()})

    async def scrape(self, request: web.Request) -> web.Response:
        accept = request.headers.get("Accept", "")
        client, core_series, extra = self.client, [], [getattr(self.telemetry, "registry", None)]
        if isinstance(client, MPClient):
            # the core's series (start-up, compiles while serving, every producer's telemetry
            # drops, held and orphaned events, restarts, spans exported), asked per scrape so
            # that each is counted once however many API servers there are; this server's
            # drops are reported to the core first and counted there
            extra = []
            if client.ready is not None and client.dead is None:
                with contextlib.suppress(EngineDeadError, asyncio.TimeoutError):
                    self._report_drops()
                    core_series.append((await client.call("core_metrics", accept))["body"].encode())
        elif client.engine is not None:   # in this process: the core's registry as it is
            extra.append(client.engine.core.series.registry)
        body, content_type = self.metrics.exposition(extra, accept=accept, encoded=core_series)
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "sightline",
                "max_model_len": self.client.ready.max_model_len if self.client.ready else None}

    async def debug_steps(self, request: web.Request) -> web.Response:
        """The wall times of the engine's recent steps, oldest first (what a step-time
        histogram cannot answer: how many steps were over twice the median), and the loop's
        total time beside the part of it the engine spent recording telemetry."""
        return _json_response(await self._call("debug_steps"))

    async def debug_kv(self, request: web.Request) -> web.Response:
        """The core's KV blocks in use and in all, and the requests it holds."""
        return _json_response(await self._call("kv_blocks"))

    async def _call(self, method: str) -> dict:
        if not self.started:
            raise _starting(self.client.phase)
        try:
            return await self.client.call(method)
        except (EngineDeadError, asyncio.TimeoutError) as exc:
            raise ProtocolError(f"the engine core did not answer: {exc}", status=503,
                                type="service_unavailable", code="engine_unavailable") from None

    async def debug_startup(self, request: web.Request) -> web.Response:
        """The start-up report: each phase's time and the kernel variants it compiled or
        took from the cache (``StartupReport.to_dict``)."""
        return _json_response(await self._call("startup_report"))

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
        if self.client.dead is not None:
            raise _engine_gone(self.client.dead)
        if not self.started:
            raise _starting(self.client.phase)
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
        client = self.client
        max_model_len = client.ready.max_model_len
        tokenize_start = time.time_ns()
        try:
            if chat or isinstance(params.prompt, str):
                prompt_text, prompt_ids = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize_pool, self._tokenize, params, chat)
            else:   # token ids: checked here, O(n) in C; a thread would cost a loop turn and a GIL wait
                prompt_text, prompt_ids = self._tokenize(params, chat)
        finally:
            if trace is not None:
                trace.tokenized(tokenize_start, time.time_ns())
        room = max_model_len - len(prompt_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(room, 1) if chat else 16
        if len(prompt_ids) + max_tokens > max_model_len:
            raise ProtocolError(
                f"this model's maximum context length is {max_model_len} tokens; the request has "
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
            stream = client.add_request(response_id, prompt_ids, sampling, params.priority, trace,
                                        params.cache_salt)
        except Exception as exc:
            raise _refusal(exc) from None
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
                if out.error_code in REFUSALS and response is None:
                    # the core's own check refused it (the front end's let it through)
                    finished = out
                    raise _refusal(REFUSALS[out.error_code](out.error))
                pieces.append(out.text)
                if out.finished:
                    finished = out
                if response is None or out.error or not (out.token_ids or out.finished):
                    continue
                usage_now = (usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
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
                status, kind, code = _ERROR_SHAPES.get(finished.error_code, _ERROR_SHAPES[None])
                self.metrics.error(status)
                error = error_body(finished.error, kind, None, code)
                if response is None:
                    self._finish_trace(trace, finished, status, pieces, prompt_text, code)
                    return _json_response(error, status)
                await response.write(sse(error))
                await response.write(SSE_DONE)
                self._finish_trace(trace, finished, 200, pieces, prompt_text, code)
                return response
            text = "".join(pieces)
            if response is None:
                build = chat_response if chat else completion_response
                self._finish_trace(trace, finished, 200, pieces, prompt_text, None)
                reply = _json_response(build(response_id, self.model, created, text, finished.finish_reason,
                                             finished.num_prompt_tokens, finished.num_output_tokens,
                                             finished.num_cached_tokens))
                reply.headers[REQUEST_ID_HEADER] = request_id
                return reply
            if params.include_usage:
                await response.write(sse(usage_chunk(response_id, self.model, created, chat,
                                                     finished.num_prompt_tokens, finished.num_output_tokens,
                                                     finished.num_cached_tokens)))
            await response.write(SSE_DONE)
            await response.write_eof()
            self._finish_trace(trace, finished, 200, pieces, prompt_text, None)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: free its KV blocks before the next step.
            client.abort(response_id)
            if trace is not None:
                trace.finish(status_code=499, finish_reason="abort", input_tokens=len(prompt_ids),
                             output_tokens=finished.num_output_tokens if finished else 0,
                             error_type=sc.ERROR_TYPE_CLIENT_DISCONNECTED)
            raise
        finally:
            if finished is None:
                client.abort(response_id)

    def _tokenize(self, params, chat: bool) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); a token id outside the vocabulary (in the
        prompt or in allowed_token_ids) is a 400. Runs on the tokenizer pool."""
        vocab = self.client.ready.vocab_size
        if len(params.allowed_token_ids or ()) > vocab:  # so a mask row per request bounds them
            raise ProtocolError(f"allowed_token_ids holds {len(params.allowed_token_ids):,} ids, more than the "
                                f"vocabulary's {vocab:,}", param="allowed_token_ids", code="invalid_value")
        bad = _outside(params.allowed_token_ids, vocab)
        if bad is not None:
            raise ProtocolError(f"allowed_token_ids holds {bad}, outside the vocabulary [0, {vocab})",
                                param="allowed_token_ids", code="invalid_value")
        if chat:
            prompt_text = apply_chat_template(params.messages)
            prompt_ids = self.tokenizer.encode(prompt_text)
        elif isinstance(params.prompt, str):
            prompt_text = params.prompt
            prompt_ids = self.tokenizer.encode(prompt_text)
        else:
            prompt_text, prompt_ids = None, params.prompt
            bad = _outside(prompt_ids, vocab)
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
                     error_type=error_type, cached_tokens=out.num_cached_tokens)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def drain(self, timeout_s: float, force: asyncio.Event | None = None) -> None:
        """Refuse new work, give live requests ``timeout_s`` to finish (or until ``force`` is
        set: a second SIGTERM), then abort the rest."""
        self.draining = True
        client = self.client
        client.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while client.num_live and time.monotonic() < deadline and not (force and force.is_set()):
            await asyncio.sleep(0.02)
        if client.num_live:
            log.warning("shutdown: aborting %d live requests", client.num_live)
        if client.dead is None:
            self._report_drops()   # the last figures, before the socket closes
        await client.shutdown()
        self._tokenize_pool.shutdown(wait=False)


# an error ending a stream whose head was sent: (status it stands for, OpenAI type, code)
_ERROR_SHAPES = {None: (500, "server_error", "engine_error"),
                 "engine_error": (500, "server_error", "engine_error"),
                 "queue_full": (429, "rate_limit_error", "queue_full"),
                 "shutting_down": (503, "service_unavailable", "shutting_down"),
                 "invalid_request": (400, "invalid_request_error", "context_length_exceeded")}


def _outside(ids: Sequence[int] | None, vocab: int) -> int | None:
    """The first id of ``ids`` at or past ``vocab``, or None (the scan in C unless one is)."""
    if not ids or max(ids) < vocab:
        return None
    return next(t for t in ids if t >= vocab)


def _starting(phase: str) -> ProtocolError:
    return ProtocolError(f"the engine is starting (phase {phase}); retry once /health answers 200",
                         status=503, type="service_unavailable", code="starting",
                         headers={"Retry-After": str(RETRY_AFTER_S)})


def _engine_gone(reason: str) -> ProtocolError:
    return ProtocolError(f"the engine is unavailable: {reason}", status=503,
                         type="service_unavailable", code="engine_unavailable")


def _refusal(exc: Exception) -> ProtocolError:
    """The OpenAI-shaped error for a request the engine would not take."""
    if isinstance(exc, QueueFullError):
        return ProtocolError(f"the waiting queue is full, retry later ({exc})", status=429,
                             type="rate_limit_error", code="queue_full",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineStoppedError):
        return ProtocolError("the server is shutting down", status=503, type="service_unavailable",
                             code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return _engine_gone(str(exc))
    if isinstance(exc, ValueError):
        return ProtocolError(str(exc), param="max_tokens", code="context_length_exceeded")
    raise exc


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


def _watch_gpu(metrics: EngineMetrics, device: str) -> None:
    """GPU memory and contexts on /metrics whenever the model runs on CUDA, whatever the
    trace level: a leak must raise an alert even with tracing off."""
    if not device.startswith("cuda"):
        return
    try:
        reason = metrics.watch_gpu(int(device.partition(":")[2] or 0))
    except Exception as exc:  # NVML trouble never stops the server
        reason = str(exc)
    if reason:
        log.warning("GPU memory/context metrics unavailable: %s", reason)


async def _start_http(server: EngineServer, config: EngineConfig,
                      sock: socket.socket | None = None) -> tuple[web.AppRunner, int]:
    """Serves the app on ``config``'s address (or the shared listening ``sock``) with the
    connection limits of ``config.http`` (header and idle deadlines, a capped share per peer)."""
    host, port = config.host, config.port
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = LimitedSite(runner, host, port, config.http, server.metrics.connection_closed, sock=sock)
    await site.start()
    return runner, runner.addresses[0][1] if runner.addresses else port


def _signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, force: asyncio.Event,
             signals=(signal.SIGTERM, signal.SIGINT)) -> None:
    """The first of ``signals`` drains, a second one aborts (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, lambda: force.set() if stop.is_set() else stop.set())


async def _serve(config: EngineConfig, on_ready: Callable[[RunningServer], None] | None = None,
                 telemetry=None, startup: StartupProgress | None = None) -> int:
    """One process: the API server and an in-process engine (loop thread). HTTP is served
    first (``/live``; ``/health`` 503 naming the phase), then the engine is built and warmed
    up on a thread."""
    telemetry = _pipeline(config, telemetry)
    startup = startup if startup is not None else StartupProgress()
    metrics = EngineMetrics(config.model_name)
    loop = asyncio.get_running_loop()
    client = InProcessClient(loop, startup)
    model_config = resolve_model_config(config.model)
    tokenizer = load_tokenizer(model_config.path, model_config.bos_token_id, model_config.eos_token_id)
    server = EngineServer(client, telemetry, metrics, tokenizer, config.model_name)
    runner = None
    try:
        runner, port = await _start_http(server, config)
        log.info("starting on http://%s:%d: /live answers, /health is 503 until warm",
                 config.host, port)
        engine = await asyncio.to_thread(LLMEngine, config, telemetry, metrics, startup)
    except BaseException as exc:
        startup.fail(exc)
        if runner is not None:
            await runner.cleanup()
        if telemetry is not None:
            telemetry.shutdown()
        raise
    client.attach(engine)
    _watch_gpu(metrics, client.ready.device)
    server.joined = True
    log.info("serving %s on http://%s:%d (device %s, %d KV blocks, max_model_len %d, trace level %s)",
             engine.model_name, config.host, port, client.ready.device, client.ready.num_kv_blocks,
             client.ready.max_model_len,
             telemetry.config.level.name.lower() if telemetry is not None else "off")
    stop, force = asyncio.Event(), asyncio.Event()
    _signals(loop, stop, force)
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


def serve_in_thread(config: EngineConfig, timeout_s: float = 300.0, telemetry=None,
                    on_phase=None) -> RunningServer:
    """Starts the server and an in-process engine on a daemon thread with its own event loop;
    returns once it is ready (warm). ``telemetry``: a started Telemetry to use instead of one
    built from ``config.telemetry`` (the server shuts it down when it stops). ``on_phase(name,
    report)``: called at each start-up phase's start (report None) and end, on the thread
    that builds the engine. Raises whatever start-up raised (bad model path, port in use, ...)."""
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


# ---- an API server process of ``engine serve`` ---------------------------------------------------
async def _serve_split(config: EngineConfig, index: int, count: int, address: str,
                       sock: socket.socket, core_lifeline, peers=None) -> int:
    """API server ``index`` of ``count``: HTTP on the shared ``sock``, the core at ``address``.
    ``peers``: the API servers' shared start-up states (``_join_core``).
    Returns 1 when the core died under it, else 0."""
    model_config = resolve_model_config(config.model)
    tokenizer = load_tokenizer(model_config.path, model_config.bos_token_id, model_config.eos_token_id)
    metrics = EngineMetrics(config.model_name)
    # with several API servers, one records the step series (every server gets every step)
    client = MPClient(address, index, tokenizer, metrics, record_steps=index == 0,
                      core_lifeline=core_lifeline)
    server = EngineServer(client, None, metrics, tokenizer, config.model_name, index)
    server.peers = peers
    runner, _ = await _start_http(server, config, sock)
    await client.start()
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()
    # SIGTERM comes from the parent, which answers a terminal's Ctrl-C (sent to the whole
    # group) for all: the API servers ignore SIGINT, so that one Ctrl-C is one signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _signals(loop, stop, force, (signal.SIGTERM,))
    start = asyncio.create_task(_join_core(server, client, config, index))
    orphan = asyncio.create_task(_watch_parent(stop))
    dead_watch = asyncio.create_task(client.dead_event.wait())
    try:
        await asyncio.wait([asyncio.create_task(stop.wait()), dead_watch],
                           return_when=asyncio.FIRST_COMPLETED)
        if client.dead is not None and not stop.is_set():
            # the parent stops every API server when the core is gone; until then, 503s
            await stop.wait()
    finally:
        start.cancel()
        dead_watch.cancel()
        orphan.cancel()
        await server.drain(config.shutdown_timeout_s, force)
        await runner.cleanup()
        if server.telemetry is not None:
            await asyncio.to_thread(server.telemetry.shutdown)
    return 1 if client.dead is not None else 0


async def _join_core(server: EngineServer, client: MPClient, config: EngineConfig, index: int) -> None:
    """Once the core is ready: this server's telemetry joins the core's telemetry process
    (producer id ``index + 1``; the core is 0), then /health is 200. ``server.peers`` (a
    shared array, one state per API server; the supervisor marks the dead ``SERVER_GONE``):
    every server turns ready once none is starting, because they accept on one port and a
    client cannot choose which one answers it."""
    from .telemetry_link import join_pipeline

    ready = await client.wait_ready()
    telemetry = await asyncio.to_thread(join_pipeline, config, ready.telemetry_endpoint, index + 1)
    server.telemetry = telemetry
    # Detokenized events come from here: the core records none for this server's requests
    client.processor.recorder = telemetry.recorder if telemetry is not None else None
    if telemetry is not None:
        asyncio.create_task(_report_drops_every(server, 1.0))
    _watch_gpu(server.metrics, ready.device)
    if server.peers is not None:
        server.peers[index] = SERVER_READY
    server.joined = True
    log.info("API server %d ready: %s on %s (pid %d)", index, ready.model_name, ready.device,
             os.getpid())


async def _report_drops_every(server: EngineServer, interval_s: float) -> None:
    """This server's telemetry drops reach the core's series within ``interval_s``."""
    while server.client.dead is None:
        await asyncio.sleep(interval_s)
        server._report_drops()


async def _watch_parent(stop: asyncio.Event) -> None:
    """Stops this server when the process that started it is gone (killed)."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.error("the serving process is gone; stopping")
    stop.set()


def run_api_server(config: EngineConfig, index: int, count: int, address: str,
                   sock: socket.socket, core_lifeline, lifeline, log_level: str = "INFO",
                   peers=None) -> None:
    """The process's entry point (multiprocessing, spawn). ``lifeline``: the write end of the
    pipe the core watches for this server (held open, never written, until it exits);
    ``peers``: the API servers' shared start-up states."""
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api-{index}]: %(message)s")
    try:
        code = asyncio.run(_serve_split(config, index, count, address, sock, core_lifeline, peers))
    finally:
        lifeline.close()
    raise SystemExit(code)
