"""A gRPC server for unary calls on asyncio, with its HTTP/2 transport and fair admission.

Each connection takes a slot in a :class:`~.connection_table.ConnectionTable` (counted in
the descriptor budget) and must finish TLS and the HTTP/2 preface within
``handshake_timeout_s``. Calls are capped per connection (REFUSED_STREAM) and per peer IP
(RESOURCE_EXHAUSTED); a call's message must arrive within ``message_timeout_s`` (else
DEADLINE_EXCEEDED) and is refused from its length prefix when over ``max_message_bytes``;
an answer the client does not read within ``response_timeout_s`` is reset; a connection
with no call is closed after ``idle_timeout_s``. Streams refused or reset by the client and
frames that carry no request are budgeted per connection: a rapid-reset or control-frame
flood ends in GOAWAY ENHANCE_YOUR_CALM. A connection parses at most ``_FRAMES_PER_TURN``
frames per turn of the event loop, so no client delays the others. Every refusal reaches
``on_refused(reason)``.

Cost per call: one HPACK decode of the request headers and one copy of the message.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import hpack
from google.rpc import code_pb2

from . import http2_frames as h2
from .connection_table import ConnectionState, ConnectionTable, Slot
from .listener import Listener

__all__ = ["GrpcAbort", "GrpcCall", "GrpcLimits", "GrpcServer"]

log = logging.getLogger(__name__)

_FRAMES_PER_TURN = 128
_PROBATION_S = 0.25  # how long a newcomer at a full listener may wait for a slot
_PROBATION_BYTES = 64 * 1024  # what it may send meanwhile
_LINGER_S = 1.0  # a closing connection's input is drained this long
_STREAM_WINDOW = 1 << 20  # what a client may send on one call before we grant more
_CONNECTION_WINDOW = 4 << 20
_ENCODINGS = ("identity", "gzip", "deflate")
_ACCEPT_ENCODING = (b"grpc-accept-encoding", b"identity,deflate,gzip")
_RESPONSE_HEADERS = h2.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc"),
                                       _ACCEPT_ENCODING])
_OK_TRAILERS = h2.encode_headers([(b"grpc-status", b"0")])


@dataclass(frozen=True)
class GrpcLimits:
    """Admission limits (see the module docstring); the two budgets are token buckets per
    connection: ``abandoned_*`` for streams refused or reset by the client, ``control_*``
    for frames that carry no request data (SETTINGS, PING, WINDOW_UPDATE, PRIORITY, ...),
    which every frame of request data also refills by ``control_per_data_frame`` (clients
    send such frames in proportion to their calls: window updates, BDP pings)."""

    max_message_bytes: int
    max_streams_per_connection: int = 32
    max_calls_per_peer: int = 256
    handshake_timeout_s: float = 5.0
    message_timeout_s: float = 30.0
    response_timeout_s: float = 10.0
    idle_timeout_s: float = 15.0
    max_buffered_bytes: int = 64 << 20  # partial messages held, all connections together
    max_header_block_bytes: int = 16 << 10
    abandoned_burst: int = 64
    abandoned_per_s: float = 16.0
    control_burst: int = 1024
    control_per_s: float = 64.0
    control_per_data_frame: float = 8.0


@dataclass
class GrpcCall:
    """One call as the handlers see it; ``message`` is as it arrived (compressed when
    ``compressed``, with ``encoding``)."""

    method: str
    metadata: tuple[tuple[str, str], ...]
    encoding: str
    peer: str
    message: bytes = b""
    compressed: bool = False


class GrpcAbort(Exception):
    """Ends a call with a google.rpc ``code``; ``reason`` is the refusal's self-metric label;
    ``details`` (a serialized google.rpc.Status) goes out as ``grpc-status-details-bin``."""

    def __init__(self, code: int, message: str, reason: str, details: bytes | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.details = details


Handler = Callable[[GrpcCall], Awaitable[bytes]]


def _percent_encode(text: str) -> bytes:
    raw = text.encode("utf-8", "backslashreplace")
    return b"".join(bytes((c,)) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c for c in raw)


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


class _Stream:
    __slots__ = ("id", "call", "data", "length", "remote_closed", "answered", "recv_window", "owed",
                 "send_window", "pending", "trailers", "timer", "task")

    def __init__(self, stream_id: int, call: GrpcCall, send_window: int) -> None:
        self.id = stream_id
        self.call = call
        self.data = bytearray()
        self.length: int | None = None  # the message's length, once its prefix arrived
        self.remote_closed = False
        self.answered = False  # an answer (or refusal) was decided: no longer counted as cancelled
        self.recv_window = _STREAM_WINDOW
        self.owed = 0  # received bytes not yet granted back
        self.send_window = send_window
        self.pending = b""  # answer bytes waiting for flow control
        self.trailers = b""
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection (event-loop thread only)."""

    def __init__(self, server: GrpcServer, peer: str) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.peer = peer
        self.slot: Slot | None = None
        self.closed = False
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
        self.streams: dict[int, _Stream] = {}
        self._last_stream = 0
        self._running = 0
        self._recv_window = _CONNECTION_WINDOW
        self._owed = 0
        self._send_window = h2.DEFAULT_WINDOW
        self._peer_window = h2.DEFAULT_WINDOW
        self._peer_frame = h2.DEFAULT_MAX_FRAME
        self._blocked: dict[int, _Stream] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._turn: asyncio.Handle | None = None
        self._paused = False
        self.draining = False
        self._abandoned = _Bucket(self.limits.abandoned_burst, self.limits.abandoned_per_s)
        self._control = _Bucket(self.limits.control_burst, self.limits.control_per_s)
        self._heard = False
        self._closing = False  # counted in the table's ``closing`` until its socket is gone

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
        self._flush()
        self._timer = asyncio.get_running_loop().call_later(self.limits.handshake_timeout_s, self._handshake_late)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.slot is None:  # on probation: kept until a slot comes
            self._buf += data
            if len(self._buf) > _PROBATION_BYTES:
                self.refuse()
            elif not self._heard:
                self._heard = True
                self.server.table.probation_heard(self)  # may promote it at once
            return
        if not self._heard:
            self._heard = True
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
                self.server.refused("cancelled")  # the client went away before its answer
            if stream.task is not None and not stream.task.done():
                stream.task.cancel()
            self._drop(stream)
        self._release_slot()
        self.server.table.leave_probation(self)
        if self._closing:
            self._closing = False
            self.server.table.closing -= 1
        self.server.connections.discard(self)
        self.server.starved.discard(self)
        self.server.connection_closed()

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
        self._flush()

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
            self._on_data(flags, stream_id, payload)
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

    def _charge_abandoned(self) -> None:
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
            self._update_state()
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
                self._reset(stream, h2.FLOW_CONTROL_ERROR)
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
            self._charge_abandoned()
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        self._drop(stream)

    # -- requests -----------------------------------------------------------------------
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
            self._end_of_request(stream)
            return
        if stream_id <= self._last_stream or stream_id % 2 == 0:
            if stream_id % 2 == 0 or stream_id > self._last_stream:
                raise h2.Http2Error(h2.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
            self._charge_control()  # a closed stream: nothing to do
            return
        self._last_stream = stream_id
        server = self.server
        if self.draining or server.closing:
            self._out.append(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            return
        if len(self.streams) >= self.limits.max_streams_per_connection:
            server.refused("too_many_streams")
            self._out.append(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            self._charge_abandoned()
            return
        fields = {}
        metadata = []
        for name, value in headers:
            name = name.lower()
            if name[:1] == b":":
                fields[name] = value
            else:
                metadata.append((name.decode("latin-1"), value.decode("latin-1")))
                if name in (b"content-type", b"grpc-encoding"):
                    fields[name] = value
        encoding = fields.get(b"grpc-encoding", b"identity").decode("latin-1").strip().lower()
        call = GrpcCall(fields.get(b":path", b"").decode("latin-1"), tuple(metadata), encoding, self.peer)
        stream = _Stream(stream_id, call, self._peer_window)
        self.streams[stream_id] = stream
        server.peer_calls[self.peer] = server.peer_calls.get(self.peer, 0) + 1
        self._update_state()
        if end_stream:
            stream.remote_closed = True
        refusal = self._screen(stream, fields)
        if refusal is not None:
            self._refuse(stream, refusal)
            if refusal.reason == "too_many_streams":
                self._charge_abandoned()
            return
        if end_stream:
            self._end_of_request(stream)
        else:
            stream.timer = asyncio.get_running_loop().call_later(
                self.limits.message_timeout_s, self._message_late, stream)

    def _screen(self, stream: _Stream, fields: dict[bytes, bytes]) -> GrpcAbort | None:
        """Why the call is refused from its headers alone, or None."""
        server = self.server
        if server.peer_calls[self.peer] > self.limits.max_calls_per_peer:
            return GrpcAbort(code_pb2.RESOURCE_EXHAUSTED, f"more than {self.limits.max_calls_per_peer} "
                             "calls open from this address", "too_many_streams")
        if fields.get(b":method") != b"POST":
            return GrpcAbort(code_pb2.UNIMPLEMENTED, "gRPC calls are POST requests", "malformed")
        if not fields.get(b"content-type", b"").startswith(b"application/grpc"):
            return GrpcAbort(code_pb2.INTERNAL, "content-type is not application/grpc", "unsupported_media_type")
        if stream.call.method not in server.methods:
            return GrpcAbort(code_pb2.UNIMPLEMENTED, f"unknown method {stream.call.method[:200]!r}", "malformed")
        if stream.call.encoding not in _ENCODINGS:
            return GrpcAbort(code_pb2.UNIMPLEMENTED, f"grpc-encoding {stream.call.encoding[:100]!r} is not "
                             "identity, gzip or deflate", "unsupported_media_type")
        if server.screen is not None:
            try:
                server.screen(stream.call)
            except GrpcAbort as abort:
                return abort.with_traceback(None)  # its frames hold views of the read buffer
        return None

    def _on_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
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
                self._reset(stream, h2.STREAM_CLOSED)
            if not data:
                self._charge_control()
            self._grant(None)
            return
        if size > stream.recv_window:
            self._reset(stream, h2.FLOW_CONTROL_ERROR)
            self._grant(None)
            return
        if not data and not flags & h2.END_STREAM:
            self._charge_control()  # empty DATA frames carry nothing
        stream.recv_window -= size
        stream.owed += size
        if data:
            self._control.give(self.limits.control_per_data_frame)
        stream.data += data
        self.server.buffered += len(data)
        if stream.length is None and len(stream.data) >= 5:
            refusal = self._check_prefix(stream)
            if refusal is not None:
                self._refuse(stream, refusal)
                self._grant(None)
                return
        if stream.length is not None and len(stream.data) > 5 + stream.length:
            self._refuse(stream, GrpcAbort(code_pb2.INVALID_ARGUMENT, "an export call carries one request message",
                                           "malformed"))
        elif flags & h2.END_STREAM:
            stream.remote_closed = True
            self._end_of_request(stream)
        self._grant(stream if not stream.answered else None)

    def _check_prefix(self, stream: _Stream) -> GrpcAbort | None:
        flag, length = stream.data[0], int.from_bytes(stream.data[1:5], "big")
        if flag > 1:
            return GrpcAbort(code_pb2.INTERNAL, f"message compressed-flag {flag} is not 0 or 1", "malformed")
        if flag and stream.call.encoding == "identity":
            return GrpcAbort(code_pb2.INTERNAL, "compressed message without grpc-encoding", "malformed")
        if length > self.limits.max_message_bytes:
            return GrpcAbort(code_pb2.RESOURCE_EXHAUSTED, f"message of {length} bytes exceeds the "
                             f"{self.limits.max_message_bytes}-byte limit", "too_large")
        stream.length = length
        stream.call.compressed = bool(flag)
        return None

    def _end_of_request(self, stream: _Stream) -> None:
        stream.remote_closed = True
        if stream.answered:
            return
        if stream.length is None:
            if not stream.data:
                abort = GrpcAbort(code_pb2.INVALID_ARGUMENT, "the call ended before its request message",
                                  "no_message")
            else:
                abort = GrpcAbort(code_pb2.INVALID_ARGUMENT, "truncated message prefix", "malformed")
            self._refuse(stream, abort)
            return
        if len(stream.data) < 5 + stream.length:
            self._refuse(stream, GrpcAbort(code_pb2.INVALID_ARGUMENT, "the call ended inside its message",
                                           "malformed"))
            return
        self._cancel_stream_timer(stream)
        with memoryview(stream.data) as view:
            stream.call.message = bytes(view[5:])
        self._unbuffer(stream)
        stream.task = asyncio.get_running_loop().create_task(self._run(stream))
        self._running += 1
        self._update_state()

    async def _run(self, stream: _Stream) -> None:
        try:
            response = await self.server.methods[stream.call.method](stream.call)
        except GrpcAbort as abort:
            if not stream.answered:
                self._refuse(stream, abort)
        except asyncio.CancelledError:
            pass  # the client reset the call or went away: counted there
        except Exception as exc:  # a bug in a handler
            log.error("gRPC handler for %s failed", stream.call.method, exc_info=exc)
            if not stream.answered:
                self._refuse(stream, GrpcAbort(code_pb2.INTERNAL, f"internal error: {type(exc).__name__}",
                                               "internal_error"))
        else:
            if not stream.answered:
                self._answer(stream, response)
        finally:
            self._running -= 1
            if not self.closed:
                self._update_state()
                self._flush()

    # -- answering ------------------------------------------------------------------------
    def _headers_frames(self, stream_id: int, block: bytes, end_stream: bool) -> bytes:
        if self._table_update is not None:
            block = h2.encode_headers([], self._table_update) + block
            self._table_update = None
        return h2.frame(h2.HEADERS, h2.END_HEADERS | (h2.END_STREAM if end_stream else 0), stream_id, block)

    def _answer(self, stream: _Stream, response: bytes) -> None:
        stream.answered = True
        if self.closed or stream.id not in self.streams:
            return
        self._out.append(self._headers_frames(stream.id, _RESPONSE_HEADERS, False))
        stream.pending = b"\x00" + len(response).to_bytes(4, "big") + response
        stream.trailers = _OK_TRAILERS
        self._send(stream)

    def _refuse(self, stream: _Stream, abort: GrpcAbort) -> None:
        """Answers ``abort`` in trailers only, counts it, and ends the stream."""
        stream.answered = True
        self.server.refused(abort.reason)
        if abort.reason == "unauthenticated":
            self.server.table.auth_failed(self.peer)
        if self.closed:
            return
        fields = [(b":status", b"200"), (b"content-type", b"application/grpc"),
                  (b"grpc-status", str(abort.code).encode()), (b"grpc-message", _percent_encode(abort.message))]
        if abort.code == code_pb2.UNIMPLEMENTED:
            fields.append(_ACCEPT_ENCODING)
        if abort.details is not None:
            fields.append((b"grpc-status-details-bin", base64.b64encode(abort.details).rstrip(b"=")))
        self._out.append(self._headers_frames(stream.id, h2.encode_headers(fields), True))
        if not stream.remote_closed:  # stop its upload: the answer is already complete
            self._out.append(h2.rst_stream(stream.id, h2.NO_ERROR))
        self._drop(stream)

    def _send(self, stream: _Stream) -> None:
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
                stream.timer = asyncio.get_running_loop().call_later(
                    self.limits.response_timeout_s, self._reset, stream, h2.CANCEL)
            return
        self._blocked.pop(stream.id, None)
        self._out.append(self._headers_frames(stream.id, stream.trailers, True))
        self._drop(stream)

    def _send_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                return
            if stream.send_window > 0:
                self._send(stream)

    # -- flow control of what clients send -------------------------------------------------
    def _grant(self, stream: _Stream | None) -> None:
        """Returns received bytes to the client's windows, unless the partial messages of all
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
        self._flush()

    def _unbuffer(self, stream: _Stream) -> None:
        if stream.data is not None:
            self.server.unbuffer(len(stream.data))
            stream.data = None

    # -- endings ---------------------------------------------------------------------------
    def _drop(self, stream: _Stream) -> None:
        """Forgets a finished stream."""
        self._cancel_stream_timer(stream)
        self._unbuffer(stream)
        self._blocked.pop(stream.id, None)
        if self.streams.pop(stream.id, None) is None:
            return
        server = self.server
        left = server.peer_calls[self.peer] - 1
        if left:
            server.peer_calls[self.peer] = left
        else:
            del server.peer_calls[self.peer]
        if not self.closed:
            self._update_state()
            self._close_if_drained()

    def _reset(self, stream: _Stream, code: int) -> None:
        stream.answered = True
        if not self.closed:
            self._out.append(h2.rst_stream(stream.id, code))
            self._drop(stream)
            self._flush()

    def _message_late(self, stream: _Stream) -> None:
        stream.timer = None
        if not stream.answered and not self.closed:
            self._refuse(stream, GrpcAbort(code_pb2.DEADLINE_EXCEEDED, "the request message did not arrive "
                                           f"within {self.limits.message_timeout_s} s", "timeout"))
            self._flush()

    def promote(self, slot: Slot) -> None:
        """The table gave this connection on probation a slot."""
        slot.evict = self._evicted
        self.slot = slot
        self._cancel_timer()
        if self.transport is None or self.closed:  # still connecting: started from connection_made
            return
        self._start()
        if self._buf:
            self._process()

    def _count_closing(self) -> None:
        if not self._closing:
            self._closing = True
            self.server.table.closing += 1

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

    def _handshake_late(self) -> None:
        self._timer = None
        self._abort("timeout")

    def _idle_late(self) -> None:
        self._timer = None
        if not self.streams and not self.closed:
            self._out.append(h2.goaway(self._last_stream, h2.NO_ERROR, b"idle"))
            self._close()

    def _evicted(self, state: ConnectionState) -> None:
        """The connection table took this slot back for a newer connection."""
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
        self._flush()
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

    def goaway(self) -> None:
        """Graceful stop: no new calls; closes once the open ones are answered."""
        if self.closed or self.draining:
            return
        self.draining = True
        self._out.append(h2.goaway(self._last_stream, h2.NO_ERROR, b"shutting down"))
        self._flush()
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        if self.draining and not self.streams and not self.closed:
            self._close()

    def _flush(self) -> None:
        if self._out and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(self._out)
        self._out = []

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @staticmethod
    def _cancel_stream_timer(stream: _Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None

    def _update_state(self) -> None:
        if self.slot is None:
            return
        table = self.server.table
        if self._running:
            table.set_state(self.slot, ConnectionState.BUSY)
        elif self.streams or not self._settled:
            table.set_state(self.slot, ConnectionState.WAITING)
        else:
            table.set_state(self.slot, ConnectionState.IDLE)
        idle = self._settled and not self.streams and not self._running
        if idle and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.limits.idle_timeout_s, self._idle_late)
        elif not idle and self._settled:
            self._cancel_timer()

    def _release_slot(self) -> None:
        if self.slot is not None:
            self.server.table.release(self.slot)
            self.slot = None


class GrpcServer:
    """Serves ``methods`` ({"/package.Service/Method": handler}) on one address.

    ``screen(call)`` runs on a call's headers (before its message) and may raise GrpcAbort;
    ``on_refused(reason)`` is called for every refused connection or call."""

    def __init__(self, methods: dict[str, Handler], limits: GrpcLimits, table: ConnectionTable,
                 screen: Callable[[GrpcCall], None] | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.methods = methods
        self.limits = limits
        self.table = table
        self.screen = screen
        self._on_refused = on_refused
        self.connections: set[_Connection] = set()
        self.peer_calls: dict[str, int] = {}
        self.buffered = 0
        self.starved: set[_Connection] = set()
        self.closing = False
        self._listener: Listener | None = None
        self._all_closed: asyncio.Event | None = None

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

    def _admit(self, peer: str, heard: bool) -> _Connection | None:
        if self.table.blocked(peer):
            self.refused("unauthenticated")
            return None
        connection = _Connection(self, peer)
        connection.slot = self.table.admit(peer, connection._evicted, heard)
        if connection.slot is None:  # on probation until a slot comes its way
            connection._heard = heard
            self.table.enter_probation(connection, peer, heard, connection.refuse, connection.promote)
        return connection

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Binds and listens; returns the bound port (``port`` 0 picks a free one)."""
        self._listener = Listener(self._admit, self.table.room, ssl_context, self.limits.handshake_timeout_s)
        return await self._listener.start(host, port)

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, sends GOAWAY; open calls get ``grace_s`` to be answered."""
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
