"""Connection limits for an aiohttp server: deadlines on every request's headers and body and
on idle keep-alive, and a connection cap with a per-peer share.

``LimitedSite`` replaces ``web.TCPSite`` and ``track_requests`` must be among the app's
middlewares (the site checks). A connection is *waiting* until a request's headers are in,
and again once its response is done: a first request, or bytes after an idle spell, must
complete their headers within ``header_timeout_s`` (else 408), silence lasts at most
``keepalive_timeout_s``, a body must arrive within ``body_timeout_s`` (408). Past the cap
(``max_connections``, lowered to fit ``RLIMIT_NOFILE``) or a peer's share of it, a new
connection takes the place of the longest-waiting one (of that peer, for the share); only
when every slot is serving a request is it refused with 503. So half-sent headers, however
many, cannot keep a request out, and one peer cannot hold more than its share of busy slots.
Every server-side close is reported to ``on_closed(reason)``, ``CLOSE_REASONS``; a client
gone mid-response ends its request quietly. Cost: per connection one wrapper call per ``data_received``, per request two timer changes.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
from collections.abc import Callable

from aiohttp import web

from .config import HttpLimits  # the settings; here, what they do

__all__ = ["CLOSE_REASONS", "HttpLimits", "LimitedSite", "track_requests"]

# Why the server closed a connection: a deadline passed, it gave its slot to a newer one,
# or it was refused because every slot (of all, or of its peer's share) serves a request.
CLOSE_REASONS = ("header_timeout", "body_timeout", "idle_timeout", "evicted", "refused_full",
                 "refused_peer_share")
_NEW, _IDLE, _HEAD, _BUSY, _CLOSED = range(5)
_CLOSE_AFTER_REPLY_S = 1.0  # a request whose body was late: its 408 has this long to leave
# asyncio accepts up to its `backlog` connections per loop tick before any is admitted (or
# evicted): a burst of 1,024 would take 1,024 descriptors at once. Accepts per tick stay
# small; the kernel's queue of connections waiting to be accepted stays long.
_ACCEPTS_PER_TICK = 16
_LISTEN_BACKLOG = 1024


def effective_max_connections(limits: HttpLimits) -> int:
    """``limits.max_connections``, lowered to fit ``RLIMIT_NOFILE`` with the descriptors open
    now and ``reserved_fds`` more left free."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: the reserve alone
        open_now = 0
    free = soft - open_now - limits.reserved_fds - 2 * _ACCEPTS_PER_TICK
    return max(2, min(limits.max_connections, free))


def _reply(status: str, text: str) -> bytes:
    body = (text + "\n").encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class _Connection(asyncio.Protocol):
    """One client connection: aiohttp's RequestHandler behind the deadlines and the cap."""

    def __init__(self, site: LimitedSite) -> None:
        self.site = site
        self.peer = ""
        self.state = _NEW
        self.inner = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""  # the last bytes of a header block still coming in

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        if not self.site.admit(self):
            return
        self._arm(self.site.limits.header_timeout_s, self._headers_late)
        self.inner = self.site.runner.server()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.state == _IDLE:  # a new request begins: its headers have a deadline
            self.site.stop_waiting(self)
            self.state = _HEAD
            self.tail = b""
            self.site.start_waiting(self)
            self._arm(self.site.limits.header_timeout_s, self._headers_late)
        if self.state in (_NEW, _HEAD):
            # The deadline is the client's: it stops when the blank line arrives, not when a
            # busy server gets round to the request (dispatch, in track_requests, stops it too).
            window = self.tail + data
            if b"\r\n\r\n" in window or b"\n\n" in window:
                self.request_started()
            else:
                self.tail = window[-3:]
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.site.release(self)
        self.state = _CLOSED
        if self.inner is not None:
            inner, self.inner = self.inner, None
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # requests (from track_requests)
    def request_started(self) -> None:
        if self.state in (_NEW, _IDLE, _HEAD):
            self._disarm()
            self.site.stop_waiting(self)
            self.state = _BUSY

    def request_done(self) -> None:
        if self.state == _BUSY:
            self.state = _IDLE
            self.site.start_waiting(self)
            self._arm(self.site.limits.keepalive_timeout_s, self._idle_too_long)

    # closing
    def close(self, reason: str, reply: bytes | None = None) -> None:
        """Frees the slot now; the reply (if any) has a moment to leave before the socket closes."""
        self._disarm()
        self.site.release(self)
        self.site.closed(reason)
        self.state = _CLOSED
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if reply is None:
            transport.close()
            return
        transport.write(reply)
        transport.close()

    def close_after_reply(self, reason: str) -> None:
        """For a request answered with an error that ends the connection (its body was late):
        it keeps its slot until the socket is closed, a moment after the reply."""
        self.site.closed(reason)
        self.state = _CLOSED
        self._arm(_CLOSE_AFTER_REPLY_S, self._abort)

    def _headers_late(self) -> None:
        self.timer = None
        self.close("header_timeout", _reply(
            "408 Request Timeout", f"request headers did not arrive within {self.site.limits.header_timeout_s} s"))

    def _idle_too_long(self) -> None:
        self.timer = None
        self.close("idle_timeout")

    def _abort(self) -> None:
        self.timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class LimitedSite(web.TCPSite):
    """A ``web.TCPSite`` whose connections go through ``_Connection``. ``on_closed(reason)``
    is called, on the event loop, for every connection the server closes (``CLOSE_REASONS``)."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, limits: HttpLimits,
                 on_closed: Callable[[str], None] | None = None, sock: socket.socket | None = None) -> None:
        super().__init__(runner, host, port)
        self._sock = sock   # a listening socket shared by several API server processes
        self.runner = runner
        self.limits = limits
        self.max_connections = effective_max_connections(limits)
        self.max_per_peer = max(1, int(self.max_connections * limits.peer_share))
        self._on_closed = on_closed
        self._open: dict[str, int] = {}  # peer -> connections holding a slot
        self.num_open = 0
        # waiting connections, oldest first: all, and per peer
        self._waiting: dict[_Connection, None] = {}
        self._waiting_by_peer: dict[str, dict[_Connection, None]] = {}
        self._slots: set[_Connection] = set()

    async def start(self) -> None:
        app = getattr(self.runner, "app", None)
        if app is not None and track_requests not in app.middlewares:
            raise RuntimeError("LimitedSite needs http_limits.track_requests among the app's middlewares: "
                               "without it every request would be cut at the header deadline")
        await web.BaseSite.start(self)  # registers the site with its runner
        host = self._host or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = self._sock or socket.create_server(
            (host, self._port), family=family, backlog=_LISTEN_BACKLOG,
            dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), sock=sock, backlog=_ACCEPTS_PER_TICK)
        sock.listen(_LISTEN_BACKLOG)  # asyncio set the kernel's queue to its accept batch: long again
        self._bound_port = sock.getsockname()[1]

    # admission
    def admit(self, conn: _Connection) -> bool:
        """Gives ``conn`` a slot, closing the longest-waiting connection (of its peer when the
        peer is at its share) to make room; False (and a 503) when every slot serves a request."""
        if self._open.get(conn.peer, 0) >= self.max_per_peer:
            victim = next(iter(self._waiting_by_peer.get(conn.peer, ())), None)
            refusal = "refused_peer_share"
        elif self.num_open >= self.max_connections:
            victim = next(iter(self._waiting), None)
            refusal = "refused_full"
        else:
            victim = refusal = None
        if victim is not None:
            victim.close("evicted", None if victim.state == _IDLE else _reply(
                "408 Request Timeout", "closed to make room for a newer connection; retry"))
        elif refusal is not None:
            conn.state = _CLOSED
            self.closed(refusal)
            conn.transport.write(_reply("503 Service Unavailable",
                                        f"all {self.max_connections} connections are serving requests "
                                        f"({self.max_per_peer} per client address); retry later"))
            conn.transport.close()
            return False
        self._slots.add(conn)
        self._open[conn.peer] = self._open.get(conn.peer, 0) + 1
        self.num_open += 1
        self.start_waiting(conn)
        return True

    def start_waiting(self, conn: _Connection) -> None:
        self._waiting[conn] = None
        self._waiting_by_peer.setdefault(conn.peer, {})[conn] = None

    def stop_waiting(self, conn: _Connection) -> None:
        self._waiting.pop(conn, None)
        peer = self._waiting_by_peer.get(conn.peer)
        if peer is not None:
            peer.pop(conn, None)
            if not peer:
                del self._waiting_by_peer[conn.peer]

    def release(self, conn: _Connection) -> None:
        """Frees ``conn``'s slot (once)."""
        if conn not in self._slots:
            return
        self._slots.discard(conn)
        self.stop_waiting(conn)
        self.num_open -= 1
        left = self._open[conn.peer] - 1
        if left:
            self._open[conn.peer] = left
        else:
            del self._open[conn.peer]

    def closed(self, reason: str) -> None:
        if self._on_closed is not None:
            self._on_closed(reason)


@web.middleware
async def track_requests(request: web.Request, handler):
    """Marks the connection busy while a request is served (no deadline but the body's), and
    reads the body within ``body_timeout_s`` (aiohttp keeps it for the handler's ``read()``)."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if not isinstance(conn, _Connection):
        return await handler(request)
    conn.request_started()
    try:
        # a body that came with the headers is read without leaving this task (wait_for would
        # wrap the read in a task of its own: one more turn of a busy event loop per request)
        if request.body_exists and not request.content.is_eof():
            try:
                await asyncio.wait_for(request.read(), conn.site.limits.body_timeout_s)
            except asyncio.TimeoutError:
                conn.close_after_reply("body_timeout")
                raise web.HTTPRequestTimeout(
                    text=f"the request body did not arrive within {conn.site.limits.body_timeout_s} s",
                    headers={"Connection": "close"}) from None
        return await handler(request)
    except ConnectionResetError:
        if transport is not None and not transport.is_closing():
            raise
        # The client left mid-response and a write noticed before connection_lost did: end
        # as aiohttp ends a request it cancels for that, quietly, not as a logged 500.
        raise asyncio.CancelledError from None
    finally:
        conn.request_done()
