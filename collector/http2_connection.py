"""The server side of HTTP/2 connections on asyncio (RFC 9113), with the bounds no client passes.

``Http2Connection`` frames, decodes headers, keeps flow control both ways and ends streams;
a subclass gives streams their meaning (``grpc_server``). Each connection holds a slot in
the listener's :class:`~.connection_table.ConnectionTable` and must finish TLS and the
preface within ``handshake_timeout_s``; streams past ``max_streams_per_connection`` are
refused (REFUSED_STREAM); an answer the client does not read within ``response_timeout_s``
is reset; a connection with no stream is closed after ``idle_timeout_s``; partial requests
of all connections together hold at most ``max_buffered_bytes`` (beyond, no window is
granted until they drain). Streams refused or reset by the client, and frames that carry no
request, are budgeted per connection: a flood ends in GOAWAY ENHANCE_YOUR_CALM. A connection
parses at most ``_FRAMES_PER_TURN`` frames per turn of the event loop, so none delays the
others, and a closing one drains its input so that the client reads the GOAWAY.

Cost: per frame, one header parse and a dispatch; DATA is copied once, into its stream.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import hpack

from . import http2_frames as h2
from .connection_table import ConnectionState, ConnectionTable, Slot
from .listener import Listener, has_input

__all__ = ["Http2Connection", "Http2Limits", "Http2Server", "Http2Stream"]

_FRAMES_PER_TURN = 128
_PROBATION_S = 0.25  # how long a newcomer at a full listener may wait for a slot
_PROBATION_BYTES = 64 * 1024  # what it may send meanwhile
_LINGER_S = 1.0  # a closing connection's input is drained this long
_STREAM_WINDOW = 1 << 20  # what a client may send on one stream before we grant more
_CONNECTION_WINDOW = 4 << 20


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
    max_buffered_bytes: int = 64 << 20
    max_header_block_bytes: int = 16 << 10
    abandoned_burst: int = 64
    abandoned_per_s: float = 16.0
    control_burst: int = 1024
    control_per_s: float = 64.0
    control_per_data_frame: float = 8.0


class _Bucket:
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


class Http2Stream:
    """A stream's transport state; ``answered``: its answer (or refusal) is decided, so a
    reset by the client no longer cancels anything."""

    __slots__ = ("id", "remote_closed", "answered", "recv_window", "owed", "send_window", "pending",
                 "trailers", "timer", "buffered")

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.id = stream_id
        self.remote_closed = False
        self.answered = False
        self.recv_window = _STREAM_WINDOW
        self.owed = 0  # received bytes not yet granted back
        self.send_window = send_window
        self.pending = b""  # answer bytes waiting for flow control
        self.trailers = b""
        self.timer: asyncio.TimerHandle | None = None
        self.buffered = 0  # request bytes it holds, counted in the server's budget


class Http2Connection(asyncio.Protocol):
    """One connection (event-loop thread only). A subclass implements ``new_stream``,
    ``on_request``, ``on_data``, ``on_cancel`` and ``busy``; it answers with ``answer``,
    ``end_with`` and ``reset``."""

    def __init__(self, server: Http2Server, peer: str) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.peer = peer
        self.slot: Slot | None = None
        self.closed = False
        self.streams: dict[int, Http2Stream] = {}
        self.draining = False
        self.heard = False
        self._buf = bytearray()
        self._pos = 0
        self._out: list[bytes] = []
        self._preface = False
        self._settled = False  # the client's first SETTINGS arrived
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = self.limits.max_header_block_bytes * 4
        self._table_update: int | None = None
        self._block: list[bytes] = []  # a header block waiting for its CONTINUATION frames
        self._block_stream = 0
        self._block_flags = 0
        self._block_size = 0
        self._last_stream = 0
        self._recv_window = _CONNECTION_WINDOW
        self._owed = 0
        self._send_window = h2.DEFAULT_WINDOW
        self._peer_window = h2.DEFAULT_WINDOW
        self._peer_frame = h2.DEFAULT_MAX_FRAME
        self._blocked: dict[int, Http2Stream] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._turn: asyncio.Handle | None = None
        self._paused = False
        self._abandoned = _Bucket(self.limits.abandoned_burst, self.limits.abandoned_per_s)
        self._control = _Bucket(self.limits.control_burst, self.limits.control_per_s)
        self._closing = False  # counted in the table's ``closing`` until its socket is gone

    # -- what a subclass gives streams ----------------------------------------------------
    def new_stream(self, stream_id: int, send_window: int) -> Http2Stream:
        raise NotImplementedError

    def on_request(self, stream: Http2Stream, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        """A new stream's request headers (the stream is registered)."""
        raise NotImplementedError

    def on_data(self, stream: Http2Stream, data: memoryview, end_stream: bool) -> None:
        """Request data of an open stream (``end_stream``: the last; trailers give empty data)."""
        raise NotImplementedError

    def on_cancel(self, stream: Http2Stream) -> None:
        """The client reset the stream, or left, before it was answered (counted already)."""

    @property
    def busy(self) -> bool:
        """Whether a request is being handled (the slot is then never taken back)."""
        return False

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.closed:  # taken back or refused while its TLS handshake ran
            transport.close()
            return
        self.server.connections.add(self)
        if self.slot is None:  # on probation: its first bytes may win it a slot
            self._timer = asyncio.get_running_loop().call_later(_PROBATION_S, self.refuse)
            return
        self._start()

    def _start(self) -> None:
        self._out.append(h2.settings({h2.SETTINGS_MAX_CONCURRENT_STREAMS: self.limits.max_streams_per_connection,
                                      h2.SETTINGS_INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
                                      h2.SETTINGS_ENABLE_PUSH: 0}))
        self._out.append(h2.window_update(0, _CONNECTION_WINDOW - h2.DEFAULT_WINDOW))
        self.flush()
        self._timer = asyncio.get_running_loop().call_later(self.limits.handshake_timeout_s, self._handshake_late)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.slot is None:  # on probation: kept until a slot comes
            self._buf += data
            if len(self._buf) > _PROBATION_BYTES:
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
        for handle in (self._timer, self._write_timer, self._turn):
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

    # -- reading ----------------------------------------------------------------------------
    def _process(self) -> None:
        self._turn = None
        try:
            more = self._parse()
        except h2.Http2Error as error:
            self._fail(error.code, str(error), error.reason)
            return
        except hpack.HPACKError as error:
            self._fail(h2.COMPRESSION_ERROR, f"header block: {type(error).__name__}", "protocol_error")
            return
        if self.closed:
            return
        if more:  # yield to the other connections, then go on
            if not self._paused:
                self._paused = True
                self.transport.pause_reading()
            self._turn = asyncio.get_running_loop().call_soon(self._process)
        elif self._paused:
            self._paused = False
            self.transport.resume_reading()
        self.flush()

    def _parse(self) -> bool:
        """Handles the complete frames buffered, at most _FRAMES_PER_TURN; True if more remain."""
        buf = self._buf
        if not self._preface:
            if len(buf) < len(h2.PREFACE):
                if not h2.PREFACE.startswith(bytes(buf)):
                    raise h2.Http2Error(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return False
            if buf[:len(h2.PREFACE)] != h2.PREFACE:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._pos = len(h2.PREFACE)
            self._preface = True
        pos = self._pos
        frames = 0
        more = False
        with memoryview(buf) as view:
            while len(buf) - pos >= 9:
                length = int.from_bytes(view[pos:pos + 3], "big")
                if length > h2.DEFAULT_MAX_FRAME:
                    raise h2.Http2Error(h2.FRAME_SIZE_ERROR, f"frame of {length} bytes")
                end = pos + 9 + length
                if end > len(buf):
                    break
                if frames == _FRAMES_PER_TURN:
                    more = True
                    break
                kind, flags = view[pos + 3], view[pos + 4]
                stream_id = int.from_bytes(view[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                pos = end
                frames += 1
                self._frame(kind, flags, stream_id, view[end - length:end])  # no view outlives the call
                if self.closed:
                    return False
        # new buffers rather than resizing this one: a view held by a traceback cannot block it
        if pos == len(buf):
            self._buf = bytearray()
            pos = 0
        elif pos > 1 << 16:
            self._buf = buf[pos:]
            pos = 0
        self._pos = pos
        return more

    def _frame(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._block and kind != h2.CONTINUATION:
            raise h2.Http2Error(h2.PROTOCOL_ERROR, "header block interrupted")
        if not self._settled and kind != h2.SETTINGS:
            raise h2.Http2Error(h2.PROTOCOL_ERROR, "the first frame must be SETTINGS")
        if kind == h2.DATA:
            self._on_data_frame(flags, stream_id, payload)
        elif kind == h2.HEADERS:
            if stream_id == 0:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, "HEADERS on stream 0")
            fragment = h2.strip_padding(flags, payload, priority=bool(flags & h2.PRIORITY_FLAG))
            self._block_stream, self._block_flags, self._block_size = stream_id, flags, 0
            self._add_fragment(fragment, flags)
        elif kind == h2.CONTINUATION:
            if not self._block or stream_id != self._block_stream:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self._add_fragment(payload, flags)
        elif kind == h2.RST_STREAM:
            self._on_reset(stream_id, payload)
        else:
            self._charge_control()
            if kind == h2.SETTINGS:
                self._on_settings(flags, stream_id, payload)
            elif kind == h2.PING:
                if stream_id != 0 or len(payload) != 8:
                    raise h2.Http2Error(h2.PROTOCOL_ERROR, "malformed PING")
                if not flags & h2.ACK:
                    self._out.append(h2.frame(h2.PING, h2.ACK, 0, bytes(payload)))
            elif kind == h2.WINDOW_UPDATE:
                self._on_window_update(stream_id, payload)
            elif kind == h2.GOAWAY:
                if stream_id != 0:
                    raise h2.Http2Error(h2.PROTOCOL_ERROR, "GOAWAY on a stream")
                self.draining = True
                self._close_if_drained()
            elif kind == h2.PUSH_PROMISE:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
            elif kind == h2.PRIORITY and len(payload) != 5:
                raise h2.Http2Error(h2.FRAME_SIZE_ERROR, "PRIORITY of the wrong size")
            # PRIORITY and unknown frame types carry nothing we use

    def _charge_control(self) -> None:
        if not self._control.take():
            raise h2.Http2Error(h2.ENHANCE_YOUR_CALM, "too many frames that carry no request")

    def charge_abandoned(self) -> None:
        """One more stream refused, or reset by the client, on this connection."""
        if not self._abandoned.take():
            raise h2.Http2Error(h2.ENHANCE_YOUR_CALM, "too many streams refused or reset", "rapid_reset")

    def _on_settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id != 0:
            raise h2.Http2Error(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise h2.Http2Error(h2.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise h2.Http2Error(h2.FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for i in range(0, len(payload), 6):
            key, value = int.from_bytes(payload[i:i + 2], "big"), int.from_bytes(payload[i + 2:i + 6], "big")
            if key == h2.SETTINGS_INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise h2.Http2Error(h2.FLOW_CONTROL_ERROR, "initial window above 2^31-1")
                delta, self._peer_window = value - self._peer_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == h2.SETTINGS_MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= (1 << 24) - 1:
                    raise h2.Http2Error(h2.PROTOCOL_ERROR, f"max frame size {value}")
                self._peer_frame = value
            elif key == h2.SETTINGS_HEADER_TABLE_SIZE and value < 4096:
                self._table_update = 0  # our encoder never uses the table: say so at its size 0
            elif key == h2.SETTINGS_ENABLE_PUSH and value > 1:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, "ENABLE_PUSH above 1")
        self._out.append(h2.frame(h2.SETTINGS, h2.ACK, 0))
        if not self._settled:
            self._settled = True
            self._cancel_timer()
            self.update_state()
        self._send_blocked()

    def _on_window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise h2.Http2Error(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0 or self._send_window + increment > h2.MAX_WINDOW:
                raise h2.Http2Error(h2.FLOW_CONTROL_ERROR, "bad connection window update")
            self._send_window += increment
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                return
            if increment == 0 or stream.send_window + increment > h2.MAX_WINDOW:
                self.reset(stream, h2.FLOW_CONTROL_ERROR)
                return
            stream.send_window += increment
        self._send_blocked()

    def _on_reset(self, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0 or len(payload) != 4:
            raise h2.Http2Error(h2.PROTOCOL_ERROR, "malformed RST_STREAM")
        if stream_id > self._last_stream:
            raise h2.Http2Error(h2.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        stream = self.streams.get(stream_id)
        if stream is None:
            self._charge_control()
            return
        if not stream.answered:
            stream.answered = True
            self.server.refused("cancelled")
            self.on_cancel(stream)
            self.charge_abandoned()
        self.drop(stream)

    def _add_fragment(self, fragment: memoryview, flags: int) -> None:
        self._block_size += len(fragment)
        if self._block_size > self.limits.max_header_block_bytes:
            raise h2.Http2Error(h2.ENHANCE_YOUR_CALM, "header block too large")
        self._block.append(bytes(fragment))
        if flags & h2.END_HEADERS:
            block, self._block = b"".join(self._block), []
            self._on_headers(self._block_stream, self._block_flags, block)

    def _on_headers(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block, raw=True)  # always: the table must stay in step
        end_stream = bool(flags & h2.END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client end its request
            if not end_stream or stream.remote_closed:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, "HEADERS after the request headers")
            stream.remote_closed = True
            if not stream.answered:
                self.on_data(stream, memoryview(b""), True)
            return
        if stream_id <= self._last_stream or stream_id % 2 == 0:
            if stream_id % 2 == 0 or stream_id > self._last_stream:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
            self._charge_control()  # a closed stream: nothing to do
            return
        self._last_stream = stream_id
        if self.draining or self.server.closing:
            self._out.append(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            return
        if len(self.streams) >= self.limits.max_streams_per_connection:
            self.server.refused("too_many_streams")
            self._out.append(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            self.charge_abandoned()
            return
        stream = self.new_stream(stream_id, self._peer_window)
        stream.remote_closed = end_stream
        self.streams[stream_id] = stream
        peers = self.server.peer_streams
        peers[self.peer] = peers.get(self.peer, 0) + 1
        self.update_state()
        self.on_request(stream, headers, end_stream)

    def _on_data_frame(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0:
            raise h2.Http2Error(h2.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if size > self._recv_window:
            raise h2.Http2Error(h2.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_window -= size
        self._owed += size
        data = h2.strip_padding(flags, payload)
        stream = self.streams.get(stream_id)
        if stream is None or stream.answered or stream.remote_closed:
            if stream_id > self._last_stream:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None and stream.remote_closed and not stream.answered:
                self.reset(stream, h2.STREAM_CLOSED)
            if not data:
                self._charge_control()
            self._grant(None)
            return
        if size > stream.recv_window:
            self.reset(stream, h2.FLOW_CONTROL_ERROR)
            self._grant(None)
            return
        if data:
            self._control.give(self.limits.control_per_data_frame)
        elif not flags & h2.END_STREAM:
            self._charge_control()  # empty DATA frames carry nothing
        stream.recv_window -= size
        stream.owed += size
        end_stream = bool(flags & h2.END_STREAM)
        stream.remote_closed = end_stream
        self.on_data(stream, data, end_stream)
        self._grant(stream if not stream.answered and not end_stream else None)

    # -- flow control of what clients send -------------------------------------------------
    def hold(self, stream: Http2Stream, size: int) -> None:
        """``stream`` keeps ``size`` more request bytes (counted in the server's budget)."""
        stream.buffered += size
        self.server.buffered += size

    def let_go(self, stream: Http2Stream) -> None:
        """``stream`` no longer keeps its request bytes."""
        if stream.buffered:
            size, stream.buffered = stream.buffered, 0
            self.server.unbuffer(size)

    def _grant(self, stream: Http2Stream | None) -> None:
        """Returns received bytes to the client's windows, unless the partial requests of all
        connections together are over budget (then once they are back under it)."""
        server = self.server
        if server.buffered > self.limits.max_buffered_bytes:
            server.starved.add(self)
            return
        if self._owed >= _CONNECTION_WINDOW // 4:
            self._out.append(h2.window_update(0, self._owed))
            self._recv_window += self._owed
            self._owed = 0
        if stream is not None and stream.owed >= _STREAM_WINDOW // 4 and stream.id in self.streams:
            self._out.append(h2.window_update(stream.id, stream.owed))
            stream.recv_window += stream.owed
            stream.owed = 0

    def grant_all(self) -> None:
        if self.closed:
            return
        self._grant(None)
        for stream in self.streams.values():
            if not stream.answered and not stream.remote_closed:
                self._grant(stream)
        self.flush()

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

    def _send_blocked(self) -> None:
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
            self._close_if_drained()

    @staticmethod
    def _cancel_stream_timer(stream: Http2Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None

    # -- the connection's slot and its endings ---------------------------------------------
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
        self._close_if_drained()

    def flush(self) -> None:
        if self._out and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(self._out)
        self._out = []

    def _count_closing(self) -> None:
        if not self._closing:
            self._closing = True
            self.server.table.closing += 1

    def _handshake_late(self) -> None:
        self._timer = None
        self._abort("timeout")

    def _idle_late(self) -> None:
        self._timer = None
        if not self.streams and not self.closed:
            self._out.append(h2.goaway(self._last_stream, h2.NO_ERROR, b"idle"))
            self._close()

    def _fail(self, code: int, message: str, reason: str) -> None:
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

    def _close_if_drained(self) -> None:
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
