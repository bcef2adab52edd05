"""The engine-core process: one ROUTER socket, the step loop, one send per step and API server.

``run_core`` points the kernel compilers at the compile cache, binds a ZMQ ROUTER (API
servers connect DEALERs ``api-<i>``), starts the core's telemetry pipeline, builds and warms
up the ``EngineCore`` (a ``Phase`` record per start-up phase to the API servers that said
hello), calls the plugins of ``$SIGHTLINE_CORE_PLUGINS`` with it (``start_plugins``: what must
run in this process, on its CUDA context and under its GIL) and answers each ``Hello`` with
``Ready``. Then it loops on one thread: take every record waiting (add, abort, stop,
utility), run one step, send each API server ONE ``OutputBatch`` (its requests' tokens and
ends, the step's stats). The loop blocks only while the core has no work. An API server's
death shows as EOF on a pipe only it holds open: its requests are aborted and their KV
blocks freed before the next step. SIGTERM: live requests aborted, telemetry flushed, exit
0; SIGINT is the parent's (the API servers drain first). A failed tensor-parallel group
ends every live request with its error; the core exits 1 within seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

from .compile_cache import resolve_compile_cache
from .config import EngineConfig
from .core_records import (ERROR_INVALID, ERROR_QUEUE_FULL, ERROR_STOPPED, Abort, AddRequest,
                           FinalOutput, Hello, OutputBatch, Phase, TelemetryDrops, UtilityCall,
                           UtilityResult, core_decoder, encode)
from .engine_core import EngineCore, EngineStoppedError
from .scheduler import QueueFullError
from .startup import StartupProgress

__all__ = ["CORE_PLUGINS_ENV", "CoreLoop", "run_core", "start_plugins"]

log = logging.getLogger(__name__)

CORE_PLUGINS_ENV = "SIGHTLINE_CORE_PLUGINS"
_IDLE_POLL_MS = 500      # how often an idle core looks at its parent and its stop flag
_TP_FAILED_EXIT_S = 5.0  # a failed tensor-parallel group: the latest the core exits


class CoreLoop:
    """The core's loop over its socket and its API servers' lifelines (see module doc)."""

    def __init__(self, core: EngineCore, sock, lifelines: dict[int, object],
                 telemetry_endpoint: str | None = None) -> None:
        import zmq

        self._zmq = zmq
        self.core = core
        self.sock = sock
        self.lifelines = dict(lifelines)         # API server index -> its pipe's read end
        self.telemetry_endpoint = telemetry_endpoint
        self.clients: dict[int, bytes] = {}      # index -> ROUTER identity
        self.received: dict[int, int] = {}       # AddRequests taken per API server
        self.client_of: dict[str, int] = {}      # live request id -> its API server
        self.pending: dict[int, list[FinalOutput]] = {}   # ends to send before the next step
        self.stopping = False
        self.failed = False                      # the tensor-parallel group failed
        self._decode = core_decoder().decode
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        for conn in self.lifelines.values():
            self._poller.register(conn.fileno(), zmq.POLLIN)
        self._parent = os.getppid()

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        step = core.step_overlapped if core.async_scheduling else core.step
        timeout = _IDLE_POLL_MS
        while not self.stopping:
            if core.failed is not None and not core.has_work:   # its requests were ended
                log.error("engine core: %s; stopping", core.failed)
                self.failed = True
                break
            self._receive(0 if core.has_work else timeout)
            if self.pending:
                self._send(OutputBatch([], [], [], core.queue_stats()))
            if not core.has_work:
                timeout = _IDLE_POLL_MS
                continue
            batch = step()
            stats = batch.stats
            # a step that only launched (overlapped) still reports what its planning counted
            if (batch.request_ids or batch.finished or stats.duration_s is not None or stats.num_preemptions
                    or stats.prefix_cache_queries or stats.prefix_cache_evictions):
                self._send(batch)
            # work exists but nothing fits yet (all blocks held): wait a little, don't spin
            idle = not (batch.request_ids or batch.finished or core.last_plan_nonempty
                        or core.step_in_flight)
            timeout = 5 if idle else _IDLE_POLL_MS
            if idle:
                self._receive(timeout)
        self._stop()

    def _receive(self, timeout_ms: int) -> None:
        """Takes every waiting record; blocks up to ``timeout_ms`` for the first one."""
        events = dict(self._poller.poll(timeout_ms))
        if self.sock in events:
            zmq = self._zmq
            while True:
                try:
                    identity, payload = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._handle(identity.bytes, self._decode(payload.buffer))
                except Exception:   # a bad record never stops the core
                    log.exception("engine core: a record from an API server failed")
        for index, conn in list(self.lifelines.items()):
            if conn.fileno() in events:
                self._client_gone(index)
        if not events and os.getppid() != self._parent:
            log.error("engine core: the serving process is gone; stopping")
            self.stopping = True

    def _handle(self, identity: bytes, record) -> None:
        core = self.core
        kind = type(record)
        if kind is AddRequest:
            index = record.client_index
            self.received[index] = self.received.get(index, 0) + 1
            try:
                core.add_request(record)
            except (QueueFullError, EngineStoppedError, ValueError) as exc:
                code = (ERROR_QUEUE_FULL if isinstance(exc, QueueFullError) else
                        ERROR_STOPPED if isinstance(exc, EngineStoppedError) else ERROR_INVALID)
                self.pending.setdefault(index, []).append(FinalOutput(
                    record.request_id, [], "abort", str(exc), code, len(record.prompt_token_ids)))
                return
            self.client_of[record.request_id] = index
        elif kind is Abort:
            if self.client_of.get(record.request_id) != record.client_index:
                return   # not this server's (ended already)
            if record.stop_at is None:
                core.abort(record.request_id)
            else:
                final = core.finish_stop(record.request_id, record.stop_at)
                if final is not None:
                    del self.client_of[record.request_id]
                    self.pending.setdefault(record.client_index, []).append(final)
        elif kind is TelemetryDrops:
            if core.telemetry is not None:   # the API server's producer id is its index + 1
                core.telemetry.count_producer_drops(record.client_index + 1, record.dropped)
        elif kind is Hello:
            self.clients[record.client_index] = identity
            self.received.setdefault(record.client_index, 0)
            self._send_to(record.client_index, encode(core.ready(os.getpid(), self.telemetry_endpoint)))
        elif kind is UtilityCall:
            result = core.utility(record.method, record.argument)
            if record.method == "kv_blocks":   # with the live requests of each API server
                by_server = dict.fromkeys(map(str, self.clients), 0)
                for index in self.client_of.values():
                    by_server[str(index)] = by_server.get(str(index), 0) + 1
                result["live_by_api_server"] = by_server
            self._send_to(record.client_index, encode(UtilityResult(record.call_id, result)))

    def _client_gone(self, index: int) -> None:
        """API server ``index`` exited: abort its requests, stop sending to it."""
        conn = self.lifelines.pop(index)
        self._poller.unregister(conn.fileno())
        conn.close()
        self.clients.pop(index, None)
        self.pending.pop(index, None)
        mine = [request_id for request_id, i in self.client_of.items() if i == index]
        for request_id in mine:
            self.core.abort(request_id)
        log.log(logging.WARNING if mine else logging.INFO,
                "engine core: API server %d exited; aborting its %d requests", index, len(mine))

    # -- sending ------------------------------------------------------------------------------
    def _send(self, batch: OutputBatch) -> None:
        """ONE encode per API server: its requests' part of the batch, the stats."""
        client_of = self.client_of
        if len(self.clients) == 1 and not self.pending:
            for final in batch.finished:
                client_of.pop(final.request_id, None)
            [index] = self.clients
            batch.received = self.received[index]
            self._send_to(index, encode(batch))
            return
        parts = {index: ([], [], self.pending.pop(index, [])) for index in self.clients}
        self.pending.clear()
        for request_id, token in zip(batch.request_ids, batch.token_ids):
            part = parts.get(client_of.get(request_id))
            if part is not None:
                part[0].append(request_id)
                part[1].append(token)
        for final in batch.finished:
            part = parts.get(client_of.pop(final.request_id, None))
            if part is not None:
                part[2].append(final)
        for index, (ids, tokens, finished) in parts.items():
            self._send_to(index, encode(OutputBatch(ids, tokens, finished, batch.stats,
                                                    self.received[index])))

    def _send_to(self, index: int, payload: bytes) -> None:
        identity = self.clients.get(index)
        if identity is None:
            return
        try:
            self.sock.send_multipart((identity, payload), self._zmq.NOBLOCK, copy=False)
        except self._zmq.ZMQError:   # gone (ROUTER_MANDATORY) or stalled: its lifeline tells
            log.warning("engine core: could not send to API server %d", index)

    def _stop(self) -> None:
        core = self.core
        core.stop_accepting()
        core.abort_all()
        step = core.step_overlapped if core.async_scheduling else core.step
        deadline = time.monotonic() + 10
        while core.has_work and time.monotonic() < deadline:
            step()
        core.close()


def run_core(config: EngineConfig, address: str, lifelines: dict[int, object], core_lifeline,
             log_level: str = "INFO", budget_from_device: bool = False,
             start_ns: int | None = None) -> None:
    """The process's entry point (multiprocessing, spawn). ``core_lifeline``: the write end
    of the pipe the API servers watch (held open, never written, until this process exits);
    ``budget_from_device``: the step's token budget is the device's default; ``start_ns``:
    when ``engine serve`` started (start-up is reported from then)."""
    import zmq

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    resolve_compile_cache(config.compile_cache_dir).apply()   # before any kernel is imported
    if budget_from_device:
        from .model_runner import default_max_num_batched_tokens, resolve_device
        scheduler = config.scheduler
        budget = max(default_max_num_batched_tokens(resolve_device(config.device)),
                     scheduler.max_num_seqs)
        config = config.replace(scheduler=dataclasses.replace(scheduler,
                                                              max_num_batched_tokens=budget))

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(address)
    loop: CoreLoop | None = None
    stop = {"now": False}

    def on_term(signum, frame) -> None:
        stop["now"] = True
        if loop is not None:
            loop.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    from .telemetry_link import start_core_pipeline
    pipeline, endpoint = start_core_pipeline(config)
    try:
        clients: dict[int, bytes] = {}

        def on_phase(name: str, report) -> None:
            """A phase starts (``report`` None): say so to the API servers that said hello."""
            if report is not None:
                return
            while True:
                try:
                    identity, payload = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                record = core_decoder().decode(payload)
                if type(record) is Hello:
                    clients[record.client_index] = identity
            phase = encode(Phase(name, tuple(p.name for p in progress.phases), progress.start_ns))
            for identity in clients.values():
                sock.send_multipart((identity, phase), zmq.NOBLOCK)

        progress = StartupProgress(on_phase, from_process_start=True, start_ns=start_ns)
        core = EngineCore(config, pipeline, progress)
        start_plugins(core, os.environ.get(CORE_PLUGINS_ENV, ""))
        if core.tp is not None:
            core.tp.on_failure = _exit_soon
        loop = CoreLoop(core, sock, lifelines, endpoint)
        for index, identity in clients.items():   # hellos taken during start-up
            loop._handle(identity, Hello(index, 0))
        loop.stopping = stop["now"]
        log.info("engine core ready in %.1f s: %s on %s, %d KV blocks, max_model_len %d",
                 core.startup_report.total_s, core.model_name, core.runner.device,
                 core.runner.num_blocks, core.max_model_len)
        loop.run()
        if loop.failed:
            raise SystemExit(1)
    finally:
        if pipeline is not None:
            pipeline.shutdown()
        sock.close()
        ctx.term()
        core_lifeline.close()


def start_plugins(core: EngineCore, spec: str) -> None:
    """Calls each ``module:function`` of ``spec`` (comma-separated) with ``core``. One that
    cannot be found raises ValueError naming it; one that raises stops start-up with its own
    error (a plugin asked for and not running would go unnoticed)."""
    import importlib

    for entry in filter(None, (part.strip() for part in spec.split(","))):
        module_name, _, function_name = entry.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"{CORE_PLUGINS_ENV}: {entry!r} is not an importable module:function ({exc})") from exc
        function(core)
        log.info("core plugin %s started", entry)


def _exit_soon(reason: str) -> None:
    """The group failed: the loop ends the requests and exits 1; should it be stuck in a
    collective that never returns (NCCL waits for a dead peer), this exits anyway."""
    def exit_now() -> None:
        log.error("engine core: exiting (%s)", reason)
        os._exit(1)

    timer = threading.Timer(_TP_FAILED_EXIT_S, exit_now)
    timer.daemon = True
    timer.start()
