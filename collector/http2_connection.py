"""A server-side HTTP/2 connection on asyncio: its slot, deadlines, answers and end.

``Http2Connection`` (reading: :mod:`.http2_reader`) holds a slot in the listener's
:class:`~.connection_table.ConnectionTable` (on probation without one) and tells it what the
connection does; it must finish TLS and the preface within ``handshake_timeout_s``, is closed
after ``idle_timeout_s`` with no stream, and aborted when the client stops reading. Answers go
out as flow control allows; one not read within ``response_timeout_s`` is reset. A closing
connection sends GOAWAY, half-closes and drains its input for ``_LINGER_S`` (the client reads
the GOAWAY, not a reset). At ``max_connection_age_s`` (+-10 %) it drains as grpc-go's
MaxConnectionAge does: GOAWAY(2^31-1) and a PING; once that is acknowledged (or after
``_ACK_WAIT_S``) GOAWAY naming the last stream taken, so no call sent meanwhile is lost; open
calls get ``max_connection_age_grace_s``. A subclass gives the streams their meaning
(``grpc_server``) and answers with ``answer``, ``end_with`` and ``reset``.
Cost: header blocks written as given; data in frames of the client's largest size.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

from . import http2_frames as h2
from .connection_table import PROBATION_BYTES, PROBATION_S, ConnectionState, Slot
from .http2_reader import CONNECTION_WINDOW, STREAM_WINDOW, Http2Reader, Http2Stream
from .listener import has_input

if TYPE_CHECKING:
    from .http2_server import Http2Server

__all__ = ["Http2Connection", "Http2Stream"]

_LINGER_S = 1.0  # a closing connection's input is drained this long
_ACK_WAIT_S = 1.0  # the max-age GOAWAY's PING: the final GOAWAY goes out after this at most
_AGE_PING = b"max-age\0"
_MAX_STREAM_ID = 2**31 - 1


class Http2Connection(Http2Reader):
    """One connection (event-loop thread only). A subclass implements ``new_stream``,
    ``on_request``, ``on_data``, ``on_cancel`` and ``busy``; it answers with ``answer``,
    ``end_with`` and ``reset``."""

    def __init__(self, server: Http2Server, peer: str) -> None:
        super().__init__(server.limits)
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = peer
        self.slot: Slot | None = None
        self.closed = False
        self.heard = False
        self._blocked: dict[int, Http2Stream] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._age_timer: asyncio.TimerHandle | None = None  # max connection age, then its grace
        self._closing = False  # counted in the table's ``closing`` until its socket is gone

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.closed:  # taken back or refused while its TLS handshake ran
            transport.close()
            return
        self.server.connections.add(self)
        if self.slot is None:  # on probation: its first bytes may win it a slot
            self._timer = asyncio.get_running_loop().call_later(PROBATION_S, self.refuse)
            return
        self._start()

    def _start(self) -> None:
        self._out.append(h2.settings({h2.SETTINGS_MAX_CONCURRENT_STREAMS: self.limits.max_streams_per_connection,
                                      h2.SETTINGS_INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                                      h2.SETTINGS_ENABLE_PUSH: 0}))
        self._out.append(h2.window_update(0, CONNECTION_WINDOW - h2.DEFAULT_WINDOW))
        self.flush()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.limits.handshake_timeout_s, self._handshake_late)
        if self.limits.max_connection_age_s > 0:
            self._age_timer = loop.call_later(self.limits.max_connection_age_s * random.uniform(0.9, 1.1),
                                              self._age_reached)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.slot is None:  # on probation: kept until a slot comes
            self._buf += data
            if len(self._buf) > PROBATION_BYTES:
                self.refuse()
            elif not self.heard:
                self.heard = True
                self.server.table.probation_heard(self)  # may promote it at once
            return
        if not self.heard:
            self.heard = True
            self.server.table.heard(self.slot)
        self._buf += data
        if self._turn is None:
            self._process()

    def eof_received(self) -> bool:
        return False  # the client finished sending (or answered our GOAWAY): close once written

    def connection_lost(self, exc) -> None:
        self.closed = True
        for handle in (self._timer, self._write_timer, self._turn, self._age_timer):
            if handle is not None:
                handle.cancel()
        for stream in list(self.streams.values()):
            if not stream.answered:
                stream.answered = True
                self.server.refused("cancelled")  # the client went away before its answer
                self.on_cancel(stream)
            self.drop(stream)
        self._release_slot()
        server = self.server
        server.table.leave_probation(self)
        if self._closing:
            self._closing = False
            server.table.closing -= 1
        server.connections.discard(self)
        server.starved.discard(self)
        server.connection_closed()

    def pause_writing(self) -> None:  # the client does not read what we send
        if self._write_timer is None:
            self._write_timer = asyncio.get_running_loop().call_later(
                self.limits.response_timeout_s, self._abort, "timeout")

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # -- answering ------------------------------------------------------------------------
    def _headers_frame(self, stream_id: int, block: bytes, end_stream: bool) -> bytes:
        if self._table_update is not None:
            block = h2.encode_headers([], self._table_update) + block
            self._table_update = None
        return h2.frame(h2.HEADERS, h2.END_HEADERS | (h2.END_STREAM if end_stream else 0), stream_id, block)

    def answer(self, stream: Http2Stream, headers: bytes, data: bytes, trailers: bytes) -> None:
        """Answers with a header block, ``data`` (as flow control allows) and trailers."""
        stream.answered = True
        if self.closed or stream.id not in self.streams:
            return
        self._out.append(self._headers_frame(stream.id, headers, False))
        stream.pending, stream.trailers = data, trailers
        self._send(stream)

    def end_with(self, stream: Http2Stream, headers: bytes) -> None:
        """Answers with one header block and ends the stream (stopping its upload)."""
        stream.answered = True
        if self.closed:
            return
        self._out.append(self._headers_frame(stream.id, headers, True))
        if not stream.remote_closed:  # the answer is complete: the rest of the request is not needed
            self._out.append(h2.rst_stream(stream.id, h2.NO_ERROR))
        self.drop(stream)

    def _send(self, stream: Http2Stream) -> None:
        """Sends what flow control allows of the answer; the trailers once it is all out."""
        data = stream.pending
        while data:
            room = min(len(data), stream.send_window, self._send_window, self._peer_frame)
            if room <= 0:
                break
            self._out.append(h2.frame(h2.DATA, 0, stream.id, data[:room]))
            data = data[room:]
            stream.send_window -= room
            self._send_window -= room
        stream.pending = data
        if data:  # the client does not grant room: give it response_timeout_s
            if stream.id not in self._blocked:
                self._blocked[stream.id] = stream
                self._cancel_stream_timer(stream)
                stream.timer = asyncio.get_running_loop().call_later(
                    self.limits.response_timeout_s, self.reset, stream, h2.CANCEL)
            return
        self._blocked.pop(stream.id, None)
        self._out.append(self._headers_frame(stream.id, stream.trailers, True))
        self.drop(stream)

    def send_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                return
            if stream.send_window > 0:
                self._send(stream)

    def reset(self, stream: Http2Stream, code: int) -> None:
        stream.answered = True
        if not self.closed:
            self._out.append(h2.rst_stream(stream.id, code))
            self.drop(stream)
            self.flush()

    def drop(self, stream: Http2Stream) -> None:
        """Forgets a finished stream."""
        self._cancel_stream_timer(stream)
        self.let_go(stream)
        self._blocked.pop(stream.id, None)
        if self.streams.pop(stream.id, None) is None:
            return
        peers = self.server.peer_streams
        left = peers[self.peer] - 1
        if left:
            peers[self.peer] = left
        else:
            del peers[self.peer]
        if not self.closed:
            self.update_state()
            self.close_if_drained()

    @staticmethod
    def _cancel_stream_timer(stream: Http2Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None

    # -- the connection's slot and its endings ---------------------------------------------
    def on_settled(self) -> None:
        self._cancel_timer()  # the handshake deadline
        self.update_state()

    def update_state(self) -> None:
        """Tells the connection table what this connection does; arms the idle deadline."""
        if self.slot is None:
            return
        table = self.server.table
        busy = self.busy
        if busy:
            table.set_state(self.slot, ConnectionState.BUSY)
        elif self.streams or not self._settled:
            table.set_state(self.slot, ConnectionState.WAITING)
        else:
            table.set_state(self.slot, ConnectionState.IDLE)
        idle = self._settled and not self.streams and not busy
        if idle and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.limits.idle_timeout_s, self._idle_late)
        elif not idle and self._settled:
            self._cancel_timer()

    def promote(self, slot: Slot) -> None:
        """The table gave this connection on probation a slot."""
        slot.evict = self.evicted
        self.slot = slot
        self._cancel_timer()
        if self.transport is None or self.closed:  # still connecting: started from connection_made
            return
        self._start()
        if self._buf:
            self._process()

    def refuse(self) -> None:
        """Refused for want of a slot (from probation)."""
        self._cancel_timer()
        self.server.table.leave_probation(self)
        self._count_closing()
        if not self.closed:
            self.server.refused("too_many_connections")
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def evicted(self, state: ConnectionState) -> bool:
        """The connection table takes this slot back for a newer connection (declined, False,
        when the idle connection's client is already sending again)."""
        if state is ConnectionState.IDLE and (self._buf or has_input(self.transport)):
            return False
        self.slot = None
        self._count_closing()
        if state is ConnectionState.WAITING:
            self.server.refused("too_many_connections")
        if self.transport is None:
            self.closed = True  # connection_made closes it
        elif not self.closed:
            code = h2.NO_ERROR if state is ConnectionState.IDLE else h2.ENHANCE_YOUR_CALM
            self._out.append(h2.goaway(self._last_stream, code, b"connection taken back"))
            self._close()
        return True

    def goaway(self) -> None:
        """Graceful stop: no new streams; closes once the open ones are answered."""
        if self.closed or self.draining:
            return
        self.draining = True
        self._out.append(h2.goaway(self._last_stream, h2.NO_ERROR, b"shutting down"))
        self.flush()
        self.close_if_drained()

    def flush(self) -> None:
        if self._out and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(self._out)
        self._out = []

    def _count_closing(self) -> None:
        if not self._closing:
            self._closing = True
            self.server.table.closing += 1

    # -- max connection age ---------------------------------------------------------------
    def _age_reached(self) -> None:
        self._age_timer = None
        if self.closed or self.draining:
            return
        # GOAWAY(2^31-1): "stop opening streams"; the PING's answer marks the point after
        # which the client has seen it, so the final GOAWAY cannot strand a call in flight
        self._out.append(h2.goaway(_MAX_STREAM_ID, h2.NO_ERROR, b"max connection age"))
        self._out.append(h2.frame(h2.PING, 0, 0, _AGE_PING))
        self.flush()
        self._age_timer = asyncio.get_running_loop().call_later(_ACK_WAIT_S, self._age_goaway)

    def on_ping_ack(self, payload: bytes) -> None:
        if payload == _AGE_PING and self._age_timer is not None and not self.draining:
            self._age_timer.cancel()
            self._age_goaway()

    def _age_goaway(self) -> None:
        self._age_timer = None
        if self.closed or self.draining:
            return
        self.draining = True  # streams above the last one taken are refused (the client retries them)
        self._out.append(h2.goaway(self._last_stream, h2.NO_ERROR, b"max connection age"))
        self.flush()
        self._age_timer = asyncio.get_running_loop().call_later(self.limits.max_connection_age_grace_s,
                                                                self._grace_over)
        self.close_if_drained()

    def _grace_over(self) -> None:
        """The calls still open when the grace ends are cut (counted as timeouts)."""
        self._age_timer = None
        if self.closed:
            return
        for stream in list(self.streams.values()):
            if not stream.answered:
                stream.answered = True
                self.server.refused("timeout")
                self.on_cancel(stream)
            self._out.append(h2.rst_stream(stream.id, h2.CANCEL))
            self.drop(stream)
        if not self.closed:
            self._close()

    def _handshake_late(self) -> None:
        self._timer = None
        self._abort("timeout")

    def _idle_late(self) -> None:
        self._timer = None
        if not self.streams and not self.closed:
            self._out.append(h2.goaway(self._last_stream, h2.NO_ERROR, b"idle"))
            self._close()

    def fail(self, code: int, message: str, reason: str) -> None:
        self.server.refused(reason)
        self._out.append(h2.goaway(self._last_stream, code, message.encode()[:200]))
        self._close()

    def _abort(self, reason: str) -> None:
        if not self.closed:
            self.server.refused(reason)
            self.closed = True
            self.transport.abort()

    def _close(self) -> None:
        """Closes after what is queued (a GOAWAY); what the client still sends is read and
        dropped for up to ``_LINGER_S``, so that it gets the GOAWAY instead of a reset."""
        self.flush()
        self.closed = True
        self._cancel_timer()
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None
        self._release_slot()
        self._count_closing()
        transport = self.transport
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self._paused:
            transport.resume_reading()
        self._timer = asyncio.get_running_loop().call_later(_LINGER_S, transport.abort)

    def close_if_drained(self) -> None:
        if self.draining and not self.streams and not self.closed:
            self._close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release_slot(self) -> None:
        if self.slot is not None:
            self.server.table.release(self.slot)
            self.slot = None
