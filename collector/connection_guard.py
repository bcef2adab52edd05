"""Connection-level guards for the collector's HTTP listeners, and rate-limited error logs.

``GuardedListener`` serves an aiohttp ``AppRunner`` on one address through two guards:
a connection past ``max_connections`` is answered ``503`` with ``Retry-After`` and closed,
and one that has not sent its first request's headers within ``header_timeout_s`` is
answered ``408`` and closed. ``effective_max_connections`` keeps the caps of all listeners
together under the ``RLIMIT_NOFILE`` soft limit, so a flood of sockets cannot take every
file descriptor. ``RateLimitedLog`` logs the first error of each kind in full, then at most
one line per interval counting the ones it held back (asyncio's loop errors go through it).

Cost: one wrapper call per ``data_received`` and, until the first headers end, one
``find`` over the received bytes.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

__all__ = ["ConnectionLimits", "GuardedListener", "RateLimitedLog", "effective_max_connections"]

_REFUSAL_LINGER_S = 0.2  # how long a refused connection may take to send its headers
_RESERVED_FDS = 128  # descriptors left for gRPC, files, outgoing sockets


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    retry_after_s: int


def effective_max_connections(configured: int, listeners: int) -> int:
    """``configured``, lowered so that ``listeners`` caps together stay under the soft
    ``RLIMIT_NOFILE`` minus a reserve (at least 8 per listener)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(8, min(configured, (soft - _RESERVED_FDS) // max(1, listeners)))


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
    """One connection: aiohttp's RequestHandler behind the two guards."""

    __slots__ = ("_listener", "_inner", "_transport", "_timer", "_tail")

    def __init__(self, listener: GuardedListener) -> None:
        self._listener = listener
        self._inner = None
        self._transport = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""

    def connection_made(self, transport) -> None:
        listener = self._listener
        self._transport = transport
        loop = asyncio.get_running_loop()
        if listener.open_connections >= listener.limits.max_connections:
            # refused (503) once its request headers arrived, or after _REFUSAL_LINGER_S
            self._timer = loop.call_later(_REFUSAL_LINGER_S, self._refuse)
            return
        listener.open_connections += 1
        # only the first request's headers have a deadline here: later requests on a
        # kept-alive connection are bounded by aiohttp's keep-alive timeout
        self._timer = loop.call_later(listener.limits.header_timeout_s, self._headers_late)
        self._inner = listener.runner.server()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            if _headers_end(self._tail, data):
                self._timer.cancel()
                self._timer = None
                if self._inner is None:
                    self._refuse()
                    return
            else:
                self._tail = (self._tail + data[-3:])[-3:]
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self):
        if self._inner is not None:
            return self._inner.eof_received()
        return None

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._inner is not None:
            self._listener.open_connections -= 1
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

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
    """Listens on one address for ``runner`` (already set up) through the guards.

    ``on_refused(reason)`` is called for every connection refused (``too_many_connections``,
    ``timeout``), from the event-loop thread."""

    def __init__(self, runner: web.AppRunner, limits: ConnectionLimits,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.runner = runner
        self.limits = limits
        self.open_connections = 0
        self._on_refused = on_refused
        self._server: asyncio.base_events.Server | None = None
        self.port: int | None = None

    def refused(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

    async def start(self, host: str, port: int, ssl_context=None, backlog: int = 1024) -> int:
        """Binds and listens; returns the bound port (``port`` 0 picks a free one)."""
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
