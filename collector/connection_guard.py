"""Connection-level guards for the collector's HTTP listeners, and rate-limited error logs.

``GuardedListener`` serves an aiohttp app on one address. Each connection takes a slot in
a :class:`~.connection_table.ConnectionTable` (a full table takes back an idle or
incomplete connection before it refuses: 503 with ``Retry-After``) and has two deadlines:
every request's headers must arrive within ``header_timeout_s`` of its first byte (of the
connection's opening, for the first) or it is answered 408, and a kept-alive connection
idle for ``keepalive_timeout_s`` is closed. A 401 closes the connection after it is sent.
``effective_max_connections`` keeps all listeners' caps (gRPC's included) under the
``RLIMIT_NOFILE`` soft limit. ``RateLimitedLog`` logs the first error of each kind in full,
then at most one line per interval counting the ones it held back.

Cost: one wrapper call per ``data_received``; until a request's headers end, one ``find``
over the received bytes; one middleware call per request.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from .connection_table import ConnectionState, ConnectionTable, Slot

__all__ = ["ConnectionLimits", "GuardedListener", "RateLimitedLog", "effective_max_connections",
           "peer_address"]

_REFUSAL_LINGER_S = 0.2  # how long a refused connection may take to send its headers
_MAX_LINGERING = 8  # refused connections answered after their headers; more are answered at once
_RESERVED_FDS = 128  # descriptors left for files, outgoing sockets, refused connections
_EVICTION_GRACE_S = 1.0  # a connection waiting for its request longer than this may be taken back


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    retry_after_s: int
    keepalive_timeout_s: float = 15.0

    @property
    def eviction_grace_s(self) -> float:
        return min(_EVICTION_GRACE_S, self.header_timeout_s / 2)


def effective_max_connections(configured: int, listeners: int) -> int:
    """``configured``, lowered so that ``listeners`` caps together stay under the soft
    ``RLIMIT_NOFILE`` minus a reserve (at least 8 per listener)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(8, min(configured, (soft - _RESERVED_FDS) // max(1, listeners)))


def peer_address(transport: asyncio.BaseTransport) -> str:
    """The peer's IP address (no port): the unit the connection table shares slots by."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return str(peer)


def _response(status: str, text: str, retry_after_s: int | None = None) -> bytes:
    body = (text + "\n").encode()
    retry = f"Retry-After: {retry_after_s}\r\n" if retry_after_s is not None else ""
    return (f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n{retry}"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _headers_end(tail: bytes, data: bytes) -> bool:
    # llhttp accepts bare LF line ends too; either ends the header block
    return (b"\r\n\r\n" in data or b"\n\n" in data
            or b"\r\n\r\n" in tail + data[:3] or b"\n\n" in tail + data[:1])


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's RequestHandler behind the slot and the two deadlines.

    ``_reading_headers``: bytes arriving now belong to a request's headers (the connection
    is new, or was idle when they started), so the header deadline runs."""

    __slots__ = ("_listener", "_inner", "_transport", "_timer", "_tail", "_slot", "_reading_headers",
                 "_in_request", "_write_paused")

    def __init__(self, listener: GuardedListener) -> None:
        self._listener = listener
        self._inner = None
        self._transport = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._slot: Slot | None = None
        self._reading_headers = False
        self._in_request = False
        self._write_paused = False

    def connection_made(self, transport) -> None:
        listener = self._listener
        self._transport = transport
        self._slot = listener.table.admit(peer_address(transport), self._evicted)
        if self._slot is None:
            listener.lingering += 1
            if listener.lingering > _MAX_LINGERING:
                self._refuse()
            else:  # refused (503) once its request headers arrived, or after _REFUSAL_LINGER_S
                self._timer = asyncio.get_running_loop().call_later(_REFUSAL_LINGER_S, self._refuse)
            return
        listener.guards[transport] = self
        self._start_headers()
        self._inner = listener.runner.server()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:  # refused: answer as soon as its headers are in
            if self._timer is not None and _headers_end(self._tail, data):
                self._timer.cancel()
                self._refuse()
            else:
                self._tail = (self._tail + data[-3:])[-3:]
            return
        if not self._reading_headers and not self._in_request:
            self._start_headers()  # a kept-alive connection's next request begins
        if self._reading_headers:
            if _headers_end(self._tail, data):  # what follows is its body, until it is answered
                self._reading_headers = False
                self._in_request = True
                self._cancel_timer()
            else:
                self._tail = (self._tail + data[-3:])[-3:]
        self._inner.data_received(data)

    def eof_received(self):
        if self._inner is not None:
            return self._inner.eof_received()
        return None

    def connection_lost(self, exc) -> None:
        self._cancel_timer()
        listener = self._listener
        if self._slot is None:  # refused or taken back: its descriptor is free again
            listener.lingering -= 1
        else:
            listener.table.release(self._slot)
            listener.guards.pop(self._transport, None)
        if self._inner is not None:
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._write_paused = True  # a response still going out: not idle
        self._set_state()
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._set_state()
        if self._inner is not None:
            self._inner.resume_writing()

    # -- the request cycle (from the listener's middleware) -------------------------------
    def request_started(self) -> None:
        self._in_request = True
        self._reading_headers = False
        self._cancel_timer()
        self._set_state()

    def request_finished(self) -> None:
        self._in_request = False
        self._set_state()

    def _set_state(self) -> None:
        if self._slot is None or self._inner is None:
            return
        table = self._listener.table
        if self._in_request or self._write_paused:
            table.set_state(self._slot, ConnectionState.BUSY)
        elif self._reading_headers:
            table.set_state(self._slot, ConnectionState.WAITING)
        else:
            table.set_state(self._slot, ConnectionState.IDLE)
            self._cancel_timer()
            self._timer = asyncio.get_running_loop().call_later(
                self._listener.limits.keepalive_timeout_s, self._idle_expired)

    def _start_headers(self) -> None:
        self._reading_headers = True
        self._tail = b""
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(self._listener.limits.header_timeout_s,
                                                            self._headers_late)
        if self._inner is not None:
            self._set_state()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- endings -------------------------------------------------------------------------
    def _refuse(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        limits = self._listener.limits
        self._listener.refused("too_many_connections")
        transport.write(_response("503 Service Unavailable",
                                  f"more than {limits.max_connections} open connections; retry later",
                                  limits.retry_after_s))
        transport.close()

    def _evicted(self, state: ConnectionState) -> None:
        """The table took this slot back for a newer connection."""
        self._cancel_timer()
        self._slot = None
        transport = self._transport
        self._listener.guards.pop(transport, None)
        self._listener.lingering += 1  # released already: counted like a refusal until closed
        if transport is None or transport.is_closing():
            return
        if state is ConnectionState.WAITING:  # it had not sent a whole request: refused
            self._listener.refused("too_many_connections")
            transport.write(_response("503 Service Unavailable", "the listener is full and this "
                                      "connection sent no request; retry later",
                                      self._listener.limits.retry_after_s))
        transport.close()

    def _idle_expired(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size():  # the last response is still going out
            self._timer = asyncio.get_running_loop().call_later(
                self._listener.limits.keepalive_timeout_s, self._idle_expired)
            return
        transport.close()

    def _headers_late(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._listener.refused("timeout")
        transport.write(_response("408 Request Timeout", "request headers did not arrive within "
                                  f"{self._listener.limits.header_timeout_s} s"))
        transport.close()


class GuardedListener:
    """Serves ``app`` on one address through the guards (see the module docstring).

    ``on_refused(reason)`` is called for every connection refused (``too_many_connections``,
    ``timeout``), from the event-loop thread. ``runner_options`` go to ``web.AppRunner``."""

    def __init__(self, app: web.Application, limits: ConnectionLimits,
                 on_refused: Callable[[str], None] | None = None, **runner_options) -> None:
        app.middlewares.insert(0, self._middleware)  # outermost: sees every response
        self.runner = web.AppRunner(app, keepalive_timeout=limits.keepalive_timeout_s, **runner_options)
        self.limits = limits
        self.table = ConnectionTable(limits.max_connections, limits.eviction_grace_s)
        self.guards: dict[asyncio.BaseTransport, _Guarded] = {}
        self.lingering = 0
        self._on_refused = on_refused
        self._server: asyncio.base_events.Server | None = None
        self.port: int | None = None

    @property
    def open_connections(self) -> int:
        return self.table.size

    def refused(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        guard = self.guards.get(request.transport)
        if guard is None:
            return await handler(request)
        guard.request_started()
        try:
            response = await handler(request)
            if response.status == 401:  # an unauthenticated client gets no kept-alive slot
                response.force_close()
            return response
        except web.HTTPException as error:
            if error.status == 401:
                error.force_close()
            raise
        finally:
            guard.request_finished()

    async def start(self, host: str, port: int, ssl_context=None, backlog: int = 1024) -> int:
        """Sets the runner up, binds and listens; returns the bound port (``port`` 0 picks one)."""
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        extra = {"ssl_handshake_timeout": self.limits.header_timeout_s} if ssl_context is not None else {}
        self._server = await loop.create_server(lambda: _Guarded(self), host, port, ssl=ssl_context,
                                                backlog=backlog, reuse_address=True, **extra)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def close(self) -> None:
        """Stops accepting; open connections are left to ``runner.cleanup()`` to finish."""
        if self._server is not None:
            self._server.close()


class RateLimitedLog:
    """Logs each kind of error in full once, then one summary line per ``interval_s``."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._kinds: dict[str, list] = {}  # kind -> [next log time, held back]

    def error(self, kind: str, message: str, *args, exc_info=None) -> bool:
        """Logs ``message % args`` unless ``kind`` was logged within the interval; True if logged."""
        now = self._clock()
        state = self._kinds.get(kind)
        if state is None:
            if len(self._kinds) >= 1024:  # bounded: forget old kinds rather than grow
                self._kinds.clear()
            self._kinds[kind] = [now + self._interval_s, 0]
            self._logger.error(message, *args, exc_info=exc_info)
            return True
        if now < state[0]:
            state[1] += 1
            return False
        held, state[0], state[1] = state[1], now + self._interval_s, 0
        self._logger.error(message + " (%d more like this in the last %.0f s, not logged)",
                           *args, held, self._interval_s)
        return True

    def loop_exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """For ``loop.set_exception_handler``: asyncio's errors, rate-limited by message."""
        exc = context.get("exception")
        kind = f"{context.get('message', '')}:{type(exc).__name__}:{getattr(exc, 'errno', '')}"
        self.error(kind, "event loop: %s: %r", context.get("message", "error"), exc,
                   exc_info=exc if isinstance(exc, BaseException) else None)
