"""Accepting connections within the descriptor budget: refusal before a transport exists.

asyncio's own servers accept up to ``backlog`` sockets at once and start a transport for
each before any protocol can say no, so a flood holds hundreds of descriptors. ``Listener``
admits at most ``_ADMITS_PER_TURN`` sockets per turn of the event loop (of at most
``_ACCEPTS_PER_TURN`` accepted), none while ``room()`` (the descriptors its owner may still
open) is 0. Each socket goes to ``admit(peer, heard)`` (``heard``: the client already sent
bytes, seen without reading them), which returns its protocol, or for a refused one the
bytes to answer (sent after reading what arrived, without blocking) or None. When
``accept()`` fails for lack of descriptors or memory, accepting pauses briefly.

Cost: one ``accept`` and one peek per connection; one task per admitted one
(``connect_accepted_socket``, which also runs the TLS handshake within its timeout).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import select
import socket
from collections.abc import Callable

__all__ = ["Listener", "has_input"]

log = logging.getLogger(__name__)

_ADMITS_PER_TURN = 8
_ACCEPTS_PER_TURN = 256  # refusing at accept is cheap: drain the kernel's queue quickly
_PAUSE_S = 0.1  # after accept() ran out of descriptors or memory
_FULL_PAUSE_S = 0.01  # while the owner has no room
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Listener:
    """Listens on one TCP address; see the module docstring."""

    def __init__(self, admit: Callable[[str, bool], asyncio.Protocol | bytes | None], room: Callable[[], int],
                 ssl_context=None, ssl_handshake_timeout: float | None = None) -> None:
        self._admit = admit
        self._room = room
        self._ssl = ssl_context
        self._handshake_timeout = ssl_handshake_timeout
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port: int | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> int:
        """Binds and listens; returns the bound port (``port`` 0 picks a free one)."""
        self._loop = asyncio.get_running_loop()
        infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._loop.add_reader(sock.fileno(), self._accept)
        return self.port

    def close(self) -> None:
        """Stops accepting (open connections are their protocols' to end)."""
        if self._sock is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _accept(self) -> None:
        admitted = 0
        for _ in range(_ACCEPTS_PER_TURN):
            if admitted == _ADMITS_PER_TURN:
                return
            if self._sock is None:
                return
            if self._room() <= 0:  # every descriptor it may use is open: the kernel queue waits
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(_FULL_PAUSE_S, self._resume)
                return
            try:
                conn, address = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as error:
                if error.errno not in _OUT_OF_RESOURCES:
                    raise
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(_PAUSE_S, self._resume)
                return
            peer = str(address[0]) if isinstance(address, tuple) else str(address)
            conn.setblocking(False)
            try:
                heard = conn.recv(1, socket.MSG_PEEK)
                if not heard:  # already closed by the client
                    conn.close()
                    continue
            except (BlockingIOError, InterruptedError):
                heard = b""
            except OSError:
                conn.close()
                continue
            protocol = self._admit(peer, bool(heard))
            if not isinstance(protocol, asyncio.BaseProtocol):
                _refuse(conn, protocol)
                continue
            admitted += 1
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._connect(conn, protocol))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket, protocol: asyncio.Protocol) -> None:
        extra = {"ssl_handshake_timeout": self._handshake_timeout} if self._ssl is not None else {}
        try:
            await self._loop.connect_accepted_socket(lambda: protocol, conn, ssl=self._ssl, **extra)
        except Exception as error:  # TLS failed or timed out: the protocol never saw the connection
            conn.close()
            closed = getattr(protocol, "connection_lost", None)
            if closed is not None:
                closed(error)

    def _resume(self) -> None:
        if self._sock is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)


def _refuse(conn: socket.socket, answer: bytes | None) -> None:
    """Answers a refused socket without waiting for it: reads what already arrived (closing
    a socket with unread input resets it, and the client would lose the answer), sends."""
    try:
        if answer:
            while conn.recv(65_536):
                pass
    except OSError:
        pass
    try:
        if answer:
            conn.send(answer)
    except OSError:
        pass
    conn.close()


def has_input(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the client has sent bytes not read yet (a kept-alive client sending its next
    request): such a connection is not idle, whatever its state says."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or transport.is_closing():
        return False
    try:
        return bool(select.select([sock.fileno()], [], [], 0)[0])
    except (OSError, ValueError):
        return False
