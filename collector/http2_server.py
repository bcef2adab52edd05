"""What the HTTP/2 connections of one listener share, and their bounds.

``Http2Server`` listens (:mod:`.listener`), admits each connection through the listener's
:class:`~.connection_table.ConnectionTable` (a blocked address is refused at accept; one
without a slot waits on probation), keeps the open connections, the streams per peer and
the bytes of partial requests of all connections together (beyond ``max_buffered_bytes``
no window is granted until they drain), and stops gracefully: GOAWAY, then ``grace_s`` for
the open streams. A connection older than ``max_connection_age_s`` goes the same way on its
own (:mod:`.http2_connection`), its calls given ``max_connection_age_grace_s``. ``Http2Limits`` holds the bounds :mod:`.http2_connection` enforces.

Cost: one connection object per admitted connection; a dictionary entry per peer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .connection_table import ConnectionTable
from .listener import Listener

if TYPE_CHECKING:
    from .http2_connection import Http2Connection

__all__ = ["Http2Limits", "Http2Server", "TokenBucket"]


@dataclass(frozen=True)
class Http2Limits:
    """The transport's bounds (see the module docstring); the two budgets are token buckets
    per connection: ``abandoned_*`` for streams refused or reset by the client, ``control_*``
    for frames that carry no request data (SETTINGS, PING, WINDOW_UPDATE, PRIORITY, ...),
    which every frame of request data also refills by ``control_per_data_frame`` (clients
    send such frames in proportion to their requests: window updates, BDP pings)."""

    max_streams_per_connection: int = 32
    handshake_timeout_s: float = 5.0
    response_timeout_s: float = 10.0
    idle_timeout_s: float = 15.0
    max_connection_age_s: float = 0.0  # 0: no limit
    max_connection_age_grace_s: float = 30.0
    max_buffered_bytes: int = 64 << 20
    max_header_block_bytes: int = 16 << 10
    abandoned_burst: int = 64
    abandoned_per_s: float = 16.0
    control_burst: int = 1024
    control_per_s: float = 64.0
    control_per_data_frame: float = 8.0


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` a second; ``give`` adds some at once."""

    __slots__ = ("tokens", "burst", "rate", "stamp")

    def __init__(self, burst: int, rate: float) -> None:
        self.tokens, self.burst, self.rate, self.stamp = float(burst), burst, rate, time.monotonic()

    def give(self, tokens: float) -> None:
        self.tokens = min(self.burst, self.tokens + tokens)

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True



class Http2Server:
    """What the connections of one listener share: the connection table, the open
    connections, streams per peer and the budget of buffered request bytes. A subclass
    makes the connections (``connection(peer)``)."""

    def __init__(self, limits: Http2Limits, table: ConnectionTable,
                 on_refused=None) -> None:
        self.limits = limits
        self.table = table
        self._on_refused = on_refused
        self.connections: set[Http2Connection] = set()
        self.peer_streams: dict[str, int] = {}
        self.buffered = 0
        self.starved: set[Http2Connection] = set()
        self.closing = False
        self._listener: Listener | None = None
        self._all_closed: asyncio.Event | None = None

    def connection(self, peer: str) -> Http2Connection:
        raise NotImplementedError

    def refused(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

    def unbuffer(self, size: int) -> None:
        before, self.buffered = self.buffered, self.buffered - size
        if before > self.limits.max_buffered_bytes >= self.buffered and self.starved:
            starved, self.starved = self.starved, set()
            for connection in starved:
                connection.grant_all()

    def connection_closed(self) -> None:
        if self._all_closed is not None and not self.connections:
            self._all_closed.set()

    def _admit(self, peer: str, heard: bool) -> Http2Connection | None:
        if self.table.blocked(peer):
            self.refused("unauthenticated")
            return None
        connection = self.connection(peer)
        connection.slot = self.table.admit(peer, connection.evicted, heard)
        if connection.slot is None:  # on probation until a slot comes its way
            connection.heard = heard
            self.table.enter_probation(connection, peer, heard, connection.refuse, connection.promote)
        return connection

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Binds and listens; returns the bound port (``port`` 0 picks a free one)."""
        self._listener = Listener(self._admit, self.table.room, ssl_context, self.limits.handshake_timeout_s)
        return await self._listener.start(host, port)

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, sends GOAWAY; open streams get ``grace_s`` to be answered."""
        self.closing = True
        if self._listener is not None:
            self._listener.close()
        self._all_closed = asyncio.Event()
        for connection in list(self.connections):
            connection.goaway()
        if self.connections:
            try:
                await asyncio.wait_for(self._all_closed.wait(), grace_s)
            except asyncio.TimeoutError:
                pass
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
