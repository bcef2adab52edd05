"""``engine serve``: one engine-core process and N API-server processes, supervised here.

This process binds the HTTP port once (port 0 works; a port in use fails here) and hands
the listening socket to every API server: they accept on it in turn, so N servers share one
port. The core's ROUTER socket lives in a private directory (``ipc://``). Two kinds of pipe
carry no data and say who is alive: the core holds the write end of one that every API
server watches (EOF: the core is gone, streams end with an error at once), each API server
the write end of one the core watches (EOF: abort that server's requests). The API servers
turn ready together (any may answer a client); with N > 1 they keep their Prometheus series
in prometheus_client's multiprocess files, so any answers a scrape with the sums.
SIGTERM/SIGINT: the API servers drain (a second signal aborts) and ship their last
telemetry, then the core stops (its telemetry process exports all it holds); exit 0. The
core dying exits non-zero once the API servers have failed their streams; an API server
dying is logged, and the others serve on (all gone: exit non-zero).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time

from ..instrumentation import check_range
from .config import EngineConfig

__all__ = ["serve"]

log = logging.getLogger(__name__)

_CORE_STOP_S = 30.0       # how long the core may take to stop once the API servers are gone
# the core gone, the API servers answer 503 (and /health fails) this long before they stop:
# a client or a load balancer then gets an answer, not a refused connection
_DEAD_CORE_GRACE_S = 2.0


def serve(config: EngineConfig, api_server_count: int = 1, log_level: str = "info",
          budget_from_device: bool = False) -> int:
    """Runs the processes until SIGTERM/SIGINT or a death; returns the exit code.
    ``budget_from_device``: the core sets the step's token budget from its device's memory."""
    check_range("api_server_count", api_server_count, 1, 256, integer=True)
    from .api_server import run_api_server
    from .core_process import run_core

    from .startup import process_start_ns

    started = process_start_ns()   # start-up is reported from this process's start
    ctx = multiprocessing.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="sightline-engine-")
    address = f"ipc://{workdir}/core"
    listener = socket.create_server((config.host, config.port), backlog=4096)
    port = listener.getsockname()[1]
    core_watch, core_alive = ctx.Pipe(duplex=False)
    server_pipes = [ctx.Pipe(duplex=False) for _ in range(api_server_count)]
    core = ctx.Process(target=run_core, name="sightline-engine-core", args=(
        config, address, {i: watch for i, (watch, _) in enumerate(server_pipes)}, core_alive,
        log_level, budget_from_device, started))
    core.start()
    core_alive.close()
    for watch, _ in server_pipes:
        watch.close()
    metrics_dir = None
    if api_server_count > 1:
        metrics_dir = os.path.join(workdir, "metrics")
        os.mkdir(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir   # the API servers' environment
    servers = {}
    peers = ctx.Array("b", api_server_count)   # each API server's start-up state
    for i, (_, alive) in enumerate(server_pipes):
        process = ctx.Process(target=run_api_server, name=f"sightline-api-server-{i}", args=(
            config, i, api_server_count, address, listener, core_watch, alive, log_level, peers))
        process.start()
        servers[i] = process
        alive.close()
    if metrics_dir is not None:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    core_watch.close()
    listener.close()
    print(f"sightline engine: serving {config.model_name} on http://{config.host}:{port} "
          f"({api_server_count} API server{'s' if api_server_count > 1 else ''}, engine core "
          f"pid {core.pid})", flush=True)
    try:
        return _supervise(core, servers, config, metrics_dir, peers)
    finally:
        for process in (core, *servers.values()):
            if process.is_alive():
                process.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(core, servers: dict, config: EngineConfig, metrics_dir: str | None, peers) -> int:
    from .api_server import SERVER_GONE

    signals = []

    def on_signal(signum, frame) -> None:
        signals.append(signum)
        for process in servers.values():   # the first drains, a second one aborts
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    code = 0
    core_died = None
    while servers:
        watched = [p.sentinel for p in servers.values()]
        if core_died is None:
            watched.append(core.sentinel)
        ready = multiprocessing.connection.wait(watched, timeout=0.2 if core_died else 1.0)
        if core.sentinel in ready and core_died is None and not signals:
            log.error("the engine core exited with %s; stopping the API servers in %.0f s",
                      core.exitcode, _DEAD_CORE_GRACE_S)
            code, core_died = 1, time.monotonic()
        if core_died is not None and not signals and time.monotonic() > core_died + _DEAD_CORE_GRACE_S:
            on_signal(signal.SIGTERM, None)   # their streams failed already: they stop at once
        for index, process in list(servers.items()):
            if process.sentinel in ready or not process.is_alive():
                process.join()
                del servers[index]
                peers[index] = SERVER_GONE   # the others stop waiting on it to turn ready
                if metrics_dir is not None:
                    from prometheus_client import multiprocess
                    multiprocess.mark_process_dead(process.pid, metrics_dir)
                if process.exitcode != 0:
                    code = 1
                if not signals and core.is_alive():
                    log.error("API server %d exited with %s; the core aborted its requests",
                              index, process.exitcode)
    if core.is_alive():
        if not signals:
            log.error("every API server exited; stopping the engine core")
            code = 1
        core.terminate()
        core.join(_CORE_STOP_S + config.shutdown_timeout_s)
    if core.exitcode not in (0, None) or core.is_alive():
        code = 1
    return code
