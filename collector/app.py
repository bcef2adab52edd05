"""The collector process: every receiver, the pipeline, the aggregator and the query port.

One asyncio loop serves four listeners: OTLP/gRPC (:mod:`.grpc_server`), OTLP/HTTP and
Zipkin (aiohttp, each on its own port) and the query port (``/metrics``, ``/healthz``,
``/readyz`` and ``/api/v1/`` from :mod:`.api`, behind an optional bearer token); ``/readyz``
also waits for the compiled byte walks (:mod:`.compiled`; ingest is served before that).
Every HTTP listener runs behind :class:`~.connection_guard.GuardedListener`; all four share
the descriptor budget fairly (:mod:`.connection_table`). Receivers parse and count on the
loop; the aggregator runs on the pipeline's worker thread(s).

Guarantee: a graceful stop (SIGTERM/SIGINT or ``Collector.stop``) drains everything
acknowledged into the aggregator within ``shutdown_timeout_s``, and its ``PipelineSummary``
(acknowledged vs aggregated) is logged and, with ``--summary-file``, written as JSON. Cost:
``/metrics`` (:func:`~.exposition.metrics_page`) renders and is gzipped on a thread, shared
by concurrent scrapers and streamed with a write deadline (:mod:`.scrape`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import disable_created_metrics

from .admission import Intake
from .aggregator import AggregationConfig, Aggregator
from .api import add_api_routes
from . import compiled
from .auth import TokenAuth, grpc_ssl_context, http_ssl_context
from .config import CollectorConfig
from .connection_guard import (ConnectionLimits, GuardedListener, RateLimitedLog,
                               effective_max_connections)
from .connection_table import ConnectionTable
from .grpc_server import GrpcLimits
from .exposition import metrics_page
from .ingest import IngestLimits
from .log_filter import limit_library_errors
from .loop_latency import settle
from .otlp_grpc import OtlpGrpcReceiver
from .otlp_http import OtlpHttpReceiver
from .pipeline import DiscardSink, Pipeline, PipelineSummary, Sink
from .scrape import SharedPages
from .self_metrics import SelfMetrics
from .span_ids import SpanWindow
from .zipkin import ZipkinReceiver

__all__ = ["BoundPorts", "Collector", "check_summary_file", "run"]

log = logging.getLogger("sightline.collector")


@dataclass(frozen=True)
class BoundPorts:
    """The ports actually bound (differ from the configuration when it said port 0)."""

    otlp_grpc: int
    otlp_http: int
    zipkin: int
    http: int


class Collector:
    """Owns the servers, the pipeline and the aggregator of one collector process."""

    def __init__(self, config: CollectorConfig,
                 aggregation: AggregationConfig | None = None,
                 sink: Sink | None = None) -> None:
        """``sink`` (embedding and tests): what the pipeline feeds instead of ``self.aggregator``
        (typically something that wraps it); the query API and /metrics still read
        ``self.aggregator``."""
        self.config = config
        self.metrics = SelfMetrics()
        if config.sink == "aggregator":
            self.aggregator: Aggregator | None = Aggregator(aggregation or AggregationConfig())
            self.metrics.registry.register(self.aggregator.prometheus_collector())
        else:
            self.aggregator = None
        if sink is None:
            sink = self.aggregator if self.aggregator is not None else DiscardSink()
        self.pipeline = Pipeline(sink, self.metrics, max_items=config.queue_max_items,
                                 max_bytes=config.queue_max_bytes, workers=config.workers)
        auth = TokenAuth(config.read_auth_token())
        self._query_auth = TokenAuth(config.read_query_token())
        limits = IngestLimits(config.max_request_bytes, config.max_decompressed_bytes,
                              config.retry_after_s, config.max_inflight_requests,
                              config.request_timeout_s, config.max_json_depth, config.max_decompression_ratio)
        self.errors = RateLimitedLog(log)
        intake = self._intake = Intake(self.pipeline, self.metrics, SpanWindow(config.dedupe_window_spans),
                                       config.request_limits())
        # every listener's cap, the gRPC port's included, from one descriptor budget
        self._limits = ConnectionLimits(effective_max_connections(config.max_connections, listeners=4),
                                        config.header_timeout_s, config.retry_after_s,
                                        config.keepalive_timeout_s)
        grpc_limits = GrpcLimits(max_message_bytes=config.max_request_bytes,
                                 max_streams_per_connection=config.max_streams_per_connection,
                                 max_calls_per_peer=config.max_calls_per_peer,
                                 handshake_timeout_s=config.handshake_timeout_s,
                                 message_timeout_s=config.request_timeout_s,
                                 response_timeout_s=config.response_timeout_s,
                                 idle_timeout_s=config.keepalive_timeout_s,
                                 max_connection_age_s=config.max_connection_age_s,
                                 max_connection_age_grace_s=config.max_connection_age_grace_s,
                                 max_buffered_bytes=4 * config.max_request_bytes)
        self._grpc = OtlpGrpcReceiver(intake, auth, limits, grpc_limits,
                                      ConnectionTable(self._limits.max_connections, self._limits.eviction_grace_s),
                                      self.errors)
        self._otlp_http = OtlpHttpReceiver(intake, auth, limits, self.errors)
        self._zipkin = ZipkinReceiver(intake, auth, limits, self.errors)
        self._ingest_runners: list[web.AppRunner] = []
        self._listeners: list[GuardedListener] = []
        self._http_runner: web.AppRunner | None = None
        self._pages = SharedPages(self._metrics_page, deadline_s=config.scrape_deadline_s,
                                  on_cut=self.metrics.scrapes_cut.inc)
        self._ready = False
        self.ports: BoundPorts | None = None

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> BoundPorts:
        cfg = self.config
        # the byte walks compile on a thread (tens of seconds on an empty numba cache):
        # liveness answers and ingest is served (on their Python paths) meanwhile
        compiled.warm_in_background()
        ssl_context = (http_ssl_context(cfg.tls_cert_file, cfg.tls_key_file)
                       if cfg.tls_enabled else None)
        grpc_ssl = grpc_ssl_context(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_enabled else None
        # asyncio's own errors (e.g. accept() at the descriptor limit) are logged rate-limited,
        # and so are aiohttp's (a traceback per malformed HTTP request otherwise)
        asyncio.get_running_loop().set_exception_handler(self.errors.loop_exception_handler)
        limit_library_errors()
        host, port = cfg.address("otlp_grpc")
        grpc_port = await self._grpc.start(host, port, grpc_ssl)
        http_ports = []
        for name, receiver in (("otlp_http", self._otlp_http), ("zipkin", self._zipkin)):
            runner, bound = await self._serve(receiver.build_app(), cfg.address(name), ssl_context,
                                              receiver.receiver)
            self._ingest_runners.append(runner)
            http_ports.append(bound)
        self._http_runner, query_port = await self._serve(self._query_app(), cfg.address("http"), None, None)
        self.ports = BoundPorts(grpc_port, http_ports[0], http_ports[1], query_port)
        self._ready = True
        log.info("collector listening: otlp-grpc %s, otlp-http %s, zipkin %s, http %s (tls %s, auth %s)",
                 self.ports.otlp_grpc, self.ports.otlp_http, self.ports.zipkin, self.ports.http,
                 "on" if cfg.tls_enabled else "off",
                 "on" if self._otlp_http._auth.enabled else "off")
        return self.ports

    async def _serve(self, app: web.Application, address: tuple[str, int], ssl_context,
                     receiver: str | None) -> tuple[web.AppRunner, int]:
        # access_log=None: a log line per export request would cost more than parsing it.
        # auto_decompress=False: the receivers decompress themselves, with a size cap.
        on_refused = None if receiver is None else functools.partial(self.metrics.rejected, receiver)
        listener = GuardedListener(app, self._limits, on_refused, access_log=None, auto_decompress=False,
                                   shutdown_timeout=self.config.shutdown_timeout_s)
        port = await listener.start(address[0], address[1], ssl_context)
        self._listeners.append(listener)
        return listener.runner, port

    async def stop(self) -> PipelineSummary:
        """Graceful stop; returns the summary."""
        # Order: readiness turns 503; the ingest listeners stop accepting and in-flight
        # requests finish; the pipeline drains everything acknowledged into the aggregator;
        # the summary is logged and written; the query port closes last, so /metrics stays
        # scrapeable during the drain.
        self._ready = False
        grace = self.config.shutdown_timeout_s
        for listener in self._listeners[:len(self._ingest_runners)]:
            listener.close()
        await asyncio.gather(self._grpc.stop(grace),
                             *(runner.cleanup() for runner in self._ingest_runners))
        self._otlp_http.close()
        self._zipkin.close()
        self._intake.close()
        loop = asyncio.get_running_loop()
        summary = await loop.run_in_executor(None, self.pipeline.close, grace)
        log.info("collector stopped: %s", json.dumps(summary.to_dict(), sort_keys=True))
        if self.config.summary_file is not None:
            try:
                _write_atomically(Path(self.config.summary_file), json.dumps(summary.to_dict(), indent=2))
            except OSError as error:  # checked writable at start; a disk may still fill up
                log.error("could not write the summary file %s: %s", self.config.summary_file, error)
                summary.drained_cleanly = False
        for listener in self._listeners[len(self._ingest_runners):]:
            listener.close()
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        return summary

    # -- query port ----------------------------------------------------------------------
    def _query_app(self) -> web.Application:
        app = web.Application(middlewares=[self._query_auth_middleware] if self._query_auth.enabled else [])
        app.router.add_get("/metrics", self._pages.handle)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        if self.aggregator is not None:
            add_api_routes(app, self.aggregator)
        return app

    @web.middleware
    async def _query_auth_middleware(self, request: web.Request, handler):
        if request.path.startswith("/api/") and not self._query_auth.allows(request.headers.get("Authorization")):
            return web.json_response({"error": {"code": 401, "message": "missing or wrong bearer token"}},
                                     status=401, headers={"WWW-Authenticate": 'Bearer realm="sightline-query"'})
        return await handler(request)

    def _metrics_page(self, accept: str, gzipped: bool) -> tuple[bytes, dict[str, str]]:
        # a scraper that asks for OpenMetrics (Accept: application/openmetrics-text) gets it,
        # so exemplars are visible; one that accepts gzip (Prometheus does) gets it gzipped
        # gzip: level 1 (most of level 9's reduction on this repetitive text at a fraction of
        # its CPU), per-SM blocks compressed once while unchanged; zlib lets go of the GIL
        # while it compresses, so ingest goes on
        body, content_type = metrics_page(self.metrics.registry, self.aggregator, accept, gzipped)
        if not gzipped:
            return body, {"Content-Type": content_type}
        return body, {"Content-Type": content_type, "Content-Encoding": "gzip"}

    async def _healthz(self, request: web.Request) -> web.Response:
        if not self.pipeline.workers_alive() and self.pipeline.accepting:
            return web.json_response({"status": "pipeline worker died"}, status=503)
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if not self._ready:
            return web.json_response({"status": "not ready"}, status=503)
        warm = compiled.state()
        if not warm.ready:
            return web.json_response({"status": "not ready", "reason": warm.reason}, status=503)
        return web.json_response({"status": "ready", "queue_depth": self.pipeline.depth})


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)  # a full disk must not leave a .tmp behind
        raise


def check_summary_file(path: Path) -> None:
    """Raises ValueError naming ``path`` unless a summary can be written there: its directory
    is made if missing and a probe file is written and removed (a read-only or full
    filesystem is found at start, not at exit)."""
    try:
        _write_atomically(path.with_name(f".{path.name}.probe"), "{}")
        os.unlink(path.with_name(f".{path.name}.probe"))
    except OSError as error:
        raise ValueError(f"summary_file={str(path)!r} cannot be written: {error.strerror or error} "
                         f"({type(error).__name__})") from None
    if path.is_dir():
        raise ValueError(f"summary_file={str(path)!r} is a directory")


def run(config: CollectorConfig, aggregation: AggregationConfig | None = None) -> int:
    """Runs the collector until SIGTERM/SIGINT; returns 0 after a clean drain, else 1."""

    # The *_created series double /metrics for no use; process-wide, so only here.
    disable_created_metrics()

    async def main() -> int:
        collector = Collector(config, aggregation)
        await collector.start()
        # what start made lives as long as the process: out of the full collections' way,
        # and the loop gets the GIL back quickly from busy threads (see loop_latency)
        settle()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received: stopping intake, draining")
        summary = await collector.stop()
        return 0 if summary.drained_cleanly and summary.dropped == 0 else 1

    return asyncio.run(main())
