"""A gRPC server for unary calls, on :mod:`.http2_connection`: calls, their limits, their answers.

Calls are capped per peer IP (``max_calls_per_peer``: RESOURCE_EXHAUSTED) besides the
transport's per-connection cap; ``screen(call)`` (authentication) runs on a call's headers.
A call's one message must arrive, with its half-close, within ``message_timeout_s`` (else
DEADLINE_EXCEEDED); it is refused from its length prefix when over ``max_message_bytes``.
A call's own deadline (``grpc-timeout``) is honoured as gRPC servers do: once it passes, the
handler (run once the message is whole) is cancelled, so nothing it had not queued is
acknowledged, and the call ends with DEADLINE_EXCEEDED. Every refusal, the transport's
included, reaches ``on_refused(reason)``: no_message, malformed (a compressed flag without
grpc-encoding, two messages, a truncated one, an unknown method, a bad grpc-timeout),
unsupported_media_type, too_large, timeout, deadline_exceeded, too_many_streams, cancelled,
and the handlers' own. Cost per call: one HPACK decode of the request headers, one copy of
the message, one task; the response's header blocks are constant bytes.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from google.rpc import code_pb2

from . import http2_frames as h2
from .connection_table import ConnectionTable
from .http2_connection import Http2Connection, Http2Stream
from .http2_server import Http2Limits, Http2Server

__all__ = ["GrpcAbort", "GrpcCall", "GrpcLimits", "GrpcServer", "grpc_timeout_s"]

log = logging.getLogger(__name__)

_ENCODINGS = ("identity", "gzip", "deflate")
_ACCEPT_ENCODING = (b"grpc-accept-encoding", b"identity,deflate,gzip")
_RESPONSE_HEADERS = h2.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc"),
                                       _ACCEPT_ENCODING])
_OK_TRAILERS = h2.encode_headers([(b"grpc-status", b"0")])
# grpc-timeout: at most 8 digits and a unit (the gRPC over HTTP/2 protocol)
_TIMEOUT = re.compile(rb"\s*(\d{1,8})([HMSmun])\s*")
_TIMEOUT_UNIT_S = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def grpc_timeout_s(value: bytes) -> float | None:
    """A ``grpc-timeout`` header's seconds; None when malformed."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        return None
    return int(match[1]) * _TIMEOUT_UNIT_S[match[2]]


@dataclass(frozen=True)
class GrpcLimits(Http2Limits):
    """The transport's bounds (``Http2Limits``) and the calls' (see the module docstring)."""

    max_message_bytes: int = 8 << 20
    max_calls_per_peer: int = 256
    message_timeout_s: float = 30.0


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


class _Call(Http2Stream):
    __slots__ = ("call", "data", "length", "task", "deadline")

    def __init__(self, stream_id: int, send_window: int) -> None:
        super().__init__(stream_id, send_window)
        self.deadline: float | None = None  # the loop's time when the client's deadline passes
        self.call: GrpcCall | None = None
        self.data = bytearray()
        self.length: int | None = None  # the message's length, once its prefix arrived
        self.task: asyncio.Task | None = None


class _GrpcConnection(Http2Connection):
    server: GrpcServer

    def __init__(self, server: GrpcServer, peer: str) -> None:
        super().__init__(server, peer)
        self._running = 0

    @property
    def busy(self) -> bool:
        return self._running > 0

    def new_stream(self, stream_id: int, send_window: int) -> _Call:
        return _Call(stream_id, send_window)

    def on_request(self, stream: _Call, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        fields = {}
        metadata = []
        for name, value in headers:
            name = name.lower()
            if name[:1] == b":":
                fields[name] = value
            else:
                metadata.append((name.decode("latin-1"), value.decode("latin-1")))
                if name in (b"content-type", b"grpc-encoding", b"grpc-timeout"):
                    fields[name] = value
        encoding = fields.get(b"grpc-encoding", b"identity").decode("latin-1").strip().lower()
        stream.call = GrpcCall(fields.get(b":path", b"").decode("latin-1"), tuple(metadata), encoding, self.peer)
        refusal = self._screen(stream, fields)
        if refusal is not None:
            self._refuse(stream, refusal)
            if refusal.reason == "too_many_streams":
                self.charge_abandoned()
        elif end_stream:
            self._end_of_request(stream)
        else:
            wait = self.limits.message_timeout_s
            if stream.deadline is not None and stream.deadline - asyncio.get_running_loop().time() < wait:
                stream.timer = asyncio.get_running_loop().call_at(stream.deadline, self._deadline_passed, stream)
            else:
                stream.timer = asyncio.get_running_loop().call_later(wait, self._message_late, stream)

    def _screen(self, stream: _Call, fields: dict[bytes, bytes]) -> GrpcAbort | None:
        """Why the call is refused from its headers alone, or None."""
        server, call = self.server, stream.call
        if server.peer_streams[self.peer] > self.limits.max_calls_per_peer:
            return GrpcAbort(code_pb2.RESOURCE_EXHAUSTED, f"more than {self.limits.max_calls_per_peer} "
                             "calls open from this address", "too_many_streams")
        if fields.get(b":method") != b"POST":
            return GrpcAbort(code_pb2.UNIMPLEMENTED, "gRPC calls are POST requests", "malformed")
        if not fields.get(b"content-type", b"").startswith(b"application/grpc"):
            return GrpcAbort(code_pb2.INTERNAL, "content-type is not application/grpc", "unsupported_media_type")
        if call.method not in server.methods:
            return GrpcAbort(code_pb2.UNIMPLEMENTED, f"unknown method {call.method[:200]!r}", "malformed")
        if call.encoding not in _ENCODINGS:
            return GrpcAbort(code_pb2.UNIMPLEMENTED, f"grpc-encoding {call.encoding[:100]!r} is not "
                             "identity, gzip or deflate", "unsupported_media_type")
        if b"grpc-timeout" in fields:
            timeout_s = grpc_timeout_s(fields[b"grpc-timeout"])
            if timeout_s is None:
                return GrpcAbort(code_pb2.INTERNAL, f"malformed grpc-timeout {fields[b'grpc-timeout'][:20]!r}",
                                 "malformed")
            stream.deadline = asyncio.get_running_loop().time() + timeout_s
        if server.screen is not None:
            try:
                server.screen(call)
            except GrpcAbort as abort:
                return abort.with_traceback(None)  # its frames hold views of the read buffer
        return None

    def on_data(self, stream: _Call, data: memoryview, end_stream: bool) -> None:
        if data:
            stream.data += data
            self.hold(stream, len(data))
            if stream.length is None and len(stream.data) >= 5:
                refusal = self._check_prefix(stream)
                if refusal is not None:
                    self._refuse(stream, refusal)
                    return
            if stream.length is not None and len(stream.data) > 5 + stream.length:
                self._refuse(stream, GrpcAbort(code_pb2.INVALID_ARGUMENT, "an export call carries one request "
                                               "message", "malformed"))
                return
        if end_stream:
            self._end_of_request(stream)

    def on_cancel(self, stream: _Call) -> None:
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    def _check_prefix(self, stream: _Call) -> GrpcAbort | None:
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

    def _end_of_request(self, stream: _Call) -> None:
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
        if stream.deadline is not None:  # the handler too must finish within it
            stream.timer = asyncio.get_running_loop().call_at(stream.deadline, self._deadline_passed, stream)
        with memoryview(stream.data) as view:
            stream.call.message = bytes(view[5:])
        stream.data = bytearray()
        self.let_go(stream)
        stream.task = asyncio.get_running_loop().create_task(self._run(stream))
        self._running += 1
        self.update_state()

    async def _run(self, stream: _Call) -> None:
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
                self.answer(stream, _RESPONSE_HEADERS, b"\x00" + len(response).to_bytes(4, "big") + response,
                            _OK_TRAILERS)
        finally:
            self._running -= 1
            if not self.closed:
                self.update_state()
                self.flush()

    def _refuse(self, stream: _Call, abort: GrpcAbort) -> None:
        """Answers ``abort`` in trailers only, counts it, and ends the stream."""
        self.server.refused(abort.reason)
        if abort.reason == "unauthenticated":
            self.server.table.auth_failed(self.peer)
        fields = [(b":status", b"200"), (b"content-type", b"application/grpc"),
                  (b"grpc-status", str(abort.code).encode()), (b"grpc-message", _percent_encode(abort.message))]
        if abort.code == code_pb2.UNIMPLEMENTED:
            fields.append(_ACCEPT_ENCODING)
        if abort.details is not None:
            fields.append((b"grpc-status-details-bin", base64.b64encode(abort.details).rstrip(b"=")))
        self.end_with(stream, h2.encode_headers(fields))

    def _deadline_passed(self, stream: _Call) -> None:
        stream.timer = None
        if stream.answered or self.closed:
            return
        self.on_cancel(stream)  # a handler still running stops before it queues anything
        message = ("the call's deadline passed before its request message arrived" if stream.task is None
                   else "the call's deadline passed before its answer")
        self._refuse(stream, GrpcAbort(code_pb2.DEADLINE_EXCEEDED, message, "deadline_exceeded"))
        self.flush()

    def _message_late(self, stream: _Call) -> None:
        stream.timer = None
        if not stream.answered and not self.closed:
            self._refuse(stream, GrpcAbort(code_pb2.DEADLINE_EXCEEDED, "the request message did not arrive "
                                           f"within {self.limits.message_timeout_s} s", "timeout"))
            self.flush()


class GrpcServer(Http2Server):
    """Serves ``methods`` ({"/package.Service/Method": handler}) on one address.

    ``screen(call)`` runs on a call's headers (before its message) and may raise GrpcAbort;
    ``on_refused(reason)`` is called for every refused connection or call."""

    limits: GrpcLimits

    def __init__(self, methods: dict[str, Handler], limits: GrpcLimits, table: ConnectionTable,
                 screen: Callable[[GrpcCall], None] | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        super().__init__(limits, table, on_refused)
        self.methods = methods
        self.screen = screen

    def connection(self, peer: str) -> _GrpcConnection:
        return _GrpcConnection(self, peer)
