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

from .connection_table import PROBATION_BYTES, PROBATION_S, ConnectionState, ConnectionTable, Slot
from .listener import Listener, has_input

__all__ = ["ConnectionLimits", "GuardedListener", "RateLimitedLog", "effective_max_connections"]

_RESERVED_FDS = 128  # descriptors left for files, outgoing sockets, connections on probation
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


def _response(status: str, text: str, retry_after_s: int | None = None, extra: str = "") -> bytes:
    body = (text + "\n").encode()
    retry = f"Retry-After: {retry_after_s}\r\n" if retry_after_s is not None else ""
    return (f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n{retry}{extra}"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


_UNAUTHENTICATED = _response("401 Unauthorized", "too many requests without a valid bearer token",
                             extra='WWW-Authenticate: Bearer realm="sightline-collector"\r\n')


def _headers_end(tail: bytes, data: bytes) -> bool:
    # llhttp accepts bare LF line ends too; either ends the header block
    return (b"\r\n\r\n" in data or b"\n\n" in data
            or b"\r\n\r\n" in tail + data[:3] or b"\n\n" in tail + data[:1])


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's RequestHandler behind the slot and the two deadlines.

    Without a slot, the connection is on probation: what it sends is kept (up to
    ``PROBATION_BYTES``) until the table gives it a slot, or a 503 after ``PROBATION_S``.
    ``_reading_headers``: bytes arriving now belong to a request's headers (the connection
    is new, or was idle when they started), so the header deadline runs."""

    __slots__ = ("_listener", "_peer", "_inner", "_transport", "_timer", "_tail", "_slot", "_reading_headers",
                 "_in_request", "_write_paused", "_taken_back", "_heard", "_pending", "_closing")

    def __init__(self, listener: GuardedListener, peer: str) -> None:
        self._listener = listener
        self._peer = peer
        self._heard = False
        self._pending = bytearray()
        self._closing = False  # counted in the table's ``closing`` until its socket is gone
        self._inner = None
        self._transport = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._slot: Slot | None = None
        self._reading_headers = False
        self._in_request = False
        self._write_paused = False
        self._taken_back = False

    def connection_made(self, transport) -> None:
        self._transport = transport
        if self._taken_back:  # refused or taken back before its transport existed (counted then)
            transport.write(self._listener._refusal())
            transport.close()
            return
        if self._slot is None:
            self._timer = asyncio.get_running_loop().call_later(PROBATION_S, self._refuse)
            return
        self._serve()

    def _serve(self) -> None:
        listener = self._listener
        listener.guards[self._transport] = self
        self._start_headers()
        self._inner = listener.runner.server()
        self._inner.connection_made(self._transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:  # on probation (or refused): kept until a slot comes
            if self._taken_back:
                return
            self._pending += data
            if len(self._pending) > PROBATION_BYTES:
                self._refuse()
            elif not self._heard:
                self._heard = True
                self._listener.table.probation_heard(self)  # may promote it at once
            return
        if not self._heard:
            self._heard = True
            self._listener.table.heard(self._slot)
        self._feed(data)

    def _promote(self, slot: Slot) -> None:
        """The table gave this connection on probation a slot."""
        slot.evict = self._evicted
        self._slot = slot
        self._cancel_timer()
        if self._transport is None:  # still connecting: served from connection_made
            return
        self._serve()
        pending, self._pending = bytes(self._pending), bytearray()
        if pending:
            self._feed(pending)

    def _feed(self, data: bytes) -> None:
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
        listener.table.leave_probation(self)
        if self._closing:
            self._closing = False
            listener.table.closing -= 1
        if self._slot is not None:
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
    def _count_closing(self) -> None:
        if not self._closing:
            self._closing = True
            self._listener.table.closing += 1

    def _refuse(self) -> None:
        self._cancel_timer()
        self._listener.table.leave_probation(self)
        self._count_closing()
        transport = self._transport
        if transport is None:  # not connected yet (TLS, or this turn's accepts): answered once it is
            self._taken_back = True
            self._listener.refused("too_many_connections")
            return
        if transport.is_closing():
            return
        self._listener.refused("too_many_connections")
        transport.write(self._listener._refusal())
        transport.close()

    def _evicted(self, state: ConnectionState) -> bool:
        """The table takes this slot back for a newer connection (declined, False, when the
        idle connection's client is already sending its next request)."""
        if state is ConnectionState.IDLE and has_input(self._transport):
            return False
        self._cancel_timer()
        self._slot = None
        self._taken_back = True
        self._count_closing()
        transport = self._transport
        self._listener.guards.pop(transport, None)
        if state is ConnectionState.WAITING:  # it had not sent a whole request: refused
            self._listener.refused("too_many_connections")
        if transport is None or transport.is_closing():  # not connected yet (TLS): refused once it is
            return True
        if state is ConnectionState.WAITING:
            transport.write(_response("503 Service Unavailable", "the listener is full and this "
                                      "connection sent no request; retry later",
                                      self._listener.limits.retry_after_s))
        transport.close()
        return True

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
        self._on_refused = on_refused
        self._listener: Listener | None = None
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
            # the response is written here, so the connection counts as busy until it is out
            # (a slot must not be taken back with its answer unsent)
            try:
                response = await handler(request)
            except web.HTTPException as error:
                await self._send(request, error, guard)
                raise
            await self._send(request, response, guard)
            return response
        finally:
            guard.request_finished()

    async def _send(self, request: web.Request, response: web.StreamResponse, guard: _Guarded) -> None:
        if response.status == 401:  # an unauthenticated client gets no kept-alive slot
            response.force_close()
            self.table.auth_failed(guard._peer)
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionError:  # the client left before its answer: aiohttp ends it quietly
            pass

    def _admit(self, peer: str, heard: bool) -> _Guarded | bytes:
        if self.table.blocked(peer):
            self.refused("unauthenticated")
            return _UNAUTHENTICATED
        guard = _Guarded(self, peer)
        guard._slot = self.table.admit(peer, guard._evicted, heard)
        if guard._slot is None:  # refused for now: on probation
            guard._heard = heard
            self.table.enter_probation(guard, peer, heard, guard._refuse, guard._promote)
        return guard

    def _refusal(self) -> bytes:
        return _response("503 Service Unavailable", f"more than {self.limits.max_connections} open "
                         "connections; retry later", self.limits.retry_after_s)

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Sets the runner up, binds and listens; returns the bound port (``port`` 0 picks one)."""
        await self.runner.setup()
        self._listener = Listener(self._admit, self.table.room, ssl_context, self.limits.header_timeout_s)
        self.port = await self._listener.start(host, port)
        return self.port

    def close(self) -> None:
        """Stops accepting; open connections are left to ``runner.cleanup()`` to finish."""
        if self._listener is not None:
            self._listener.close()


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
