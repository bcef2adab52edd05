"""What a client's HTTP/2 frames do to a server connection (RFC 9113), within its budgets.

``Http2Reader`` parses the buffered frames, at most ``_FRAMES_PER_TURN`` per turn of the
event loop (so no client delays the others), and applies them: the preface and SETTINGS,
PING, WINDOW_UPDATE, GOAWAY, header blocks (HPACK-decoded, at most
``max_header_block_bytes``), DATA within the windows it granted, RST_STREAM. Streams refused
or reset by the client, and frames that carry no request, draw on two budgets per
connection; an empty one, or a protocol error, ends the connection (``fail``: GOAWAY). It
grants windows back as requests are kept, unless the partial requests of all connections
together are over the server's budget. :class:`~.http2_connection.Http2Connection` adds
the connection's life and its answers.

Cost: per frame, one header parse and a dispatch; DATA is copied once, into its stream.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import hpack

from . import http2_frames as h2
from .http2_server import TokenBucket

if TYPE_CHECKING:
    from .http2_server import Http2Limits, Http2Server

__all__ = ["CONNECTION_WINDOW", "STREAM_WINDOW", "Http2Reader", "Http2Stream"]

_FRAMES_PER_TURN = 128
STREAM_WINDOW = 1 << 20  # what a client may send on one stream before we grant more
CONNECTION_WINDOW = 4 << 20


class Http2Stream:
    """A stream's transport state; ``answered``: its answer (or refusal) is decided, so a
    reset by the client no longer cancels anything."""

    __slots__ = ("id", "remote_closed", "answered", "recv_window", "owed", "send_window", "pending",
                 "trailers", "timer", "buffered")

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.id = stream_id
        self.remote_closed = False
        self.answered = False
        self.recv_window = STREAM_WINDOW
        self.owed = 0  # received bytes not yet granted back
        self.send_window = send_window
        self.pending = b""  # answer bytes waiting for flow control
        self.trailers = b""
        self.timer: asyncio.TimerHandle | None = None
        self.buffered = 0  # request bytes it holds, counted in the server's budget


class Http2Reader(asyncio.Protocol):
    """The reading half of a connection. The connection supplies ``server``, ``peer``,
    ``transport``, ``closed`` and the hooks below; a subclass of the connection gives the
    streams their meaning (``new_stream``, ``on_request``, ``on_data``, ``on_cancel``)."""

    server: Http2Server
    peer: str
    transport: asyncio.Transport | None
    closed: bool

    def __init__(self, limits: Http2Limits) -> None:
        self.limits = limits
        self.streams: dict[int, Http2Stream] = {}
        self.draining = False
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
        self._recv_window = CONNECTION_WINDOW
        self._owed = 0
        self._send_window = h2.DEFAULT_WINDOW
        self._peer_window = h2.DEFAULT_WINDOW
        self._peer_frame = h2.DEFAULT_MAX_FRAME
        self._turn: asyncio.Handle | None = None
        self._paused = False
        self._abandoned = TokenBucket(self.limits.abandoned_burst, self.limits.abandoned_per_s)
        self._control = TokenBucket(self.limits.control_burst, self.limits.control_per_s)

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

    # -- what the connection supplies -----------------------------------------------------
    def on_ping_ack(self, payload: bytes) -> None:
        """The client acknowledged a PING of ours carrying ``payload``."""

    def on_settled(self) -> None:
        """The client's first SETTINGS arrived."""

    def fail(self, code: int, message: str, reason: str) -> None:
        raise NotImplementedError

    def send_blocked(self) -> None:
        raise NotImplementedError

    def close_if_drained(self) -> None:
        raise NotImplementedError

    def update_state(self) -> None:
        raise NotImplementedError

    def reset(self, stream: Http2Stream, code: int) -> None:
        raise NotImplementedError

    def drop(self, stream: Http2Stream) -> None:
        raise NotImplementedError

    # -- reading ----------------------------------------------------------------------------
    def _process(self) -> None:
        self._turn = None
        try:
            more = self._parse()
        except h2.Http2Error as error:
            self.fail(error.code, str(error), error.reason)
            return
        except hpack.HPACKError as error:
            self.fail(h2.COMPRESSION_ERROR, f"header block: {type(error).__name__}", "protocol_error")
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
                else:
                    self.on_ping_ack(bytes(payload))
            elif kind == h2.WINDOW_UPDATE:
                self._on_window_update(stream_id, payload)
            elif kind == h2.GOAWAY:
                if stream_id != 0:
                    raise h2.Http2Error(h2.PROTOCOL_ERROR, "GOAWAY on a stream")
                self.draining = True
                self.close_if_drained()
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
            self.on_settled()
        self.send_blocked()

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
        self.send_blocked()

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
        if self._owed >= CONNECTION_WINDOW // 4:
            self._out.append(h2.window_update(0, self._owed))
            self._recv_window += self._owed
            self._owed = 0
        if stream is not None and stream.owed >= STREAM_WINDOW // 4 and stream.id in self.streams:
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
