"""HTTP/2 framing for the gRPC server (RFC 9113): frame headers, the frames a server sends,
and the HPACK encoding of its response headers (RFC 7541).

Responses are encoded as literal header fields *without indexing* (plus the static entry
for ``:status: 200``), so the server's encoder never uses the dynamic table and needs no
state per connection; request headers are decoded by ``hpack.Decoder`` (Huffman and the
dynamic table included). ``Http2Error`` is a connection error: the caller answers GOAWAY
with its code and closes.

Cost: a frame header is one ``int.from_bytes`` per field; a response's header block is a
few bytes concatenated, no table lookups.
"""

from __future__ import annotations

__all__ = [
    "DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING", "GOAWAY",
    "WINDOW_UPDATE", "CONTINUATION", "END_STREAM", "ACK", "END_HEADERS", "PADDED", "PRIORITY_FLAG",
    "NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "FRAME_SIZE_ERROR",
    "STREAM_CLOSED", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR", "ENHANCE_YOUR_CALM",
    "SETTINGS_HEADER_TABLE_SIZE", "SETTINGS_ENABLE_PUSH", "SETTINGS_MAX_CONCURRENT_STREAMS",
    "SETTINGS_INITIAL_WINDOW_SIZE", "SETTINGS_MAX_FRAME_SIZE", "SETTINGS_MAX_HEADER_LIST_SIZE",
    "DEFAULT_WINDOW", "DEFAULT_MAX_FRAME", "MAX_WINDOW", "PREFACE", "Http2Error",
    "frame", "settings", "window_update", "rst_stream", "goaway", "encode_headers", "strip_padding",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, STREAM_CLOSED, REFUSED_STREAM, CANCEL = 0x6, 0x5, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
# settings
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2 ** 31 - 1


class Http2Error(Exception):
    """A connection error: answer GOAWAY(``code``) and close; ``reason`` labels the refusal."""

    def __init__(self, code: int, message: str, reason: str = "protocol_error") -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream_id.to_bytes(4, "big") + payload)


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big")
                                          for k, v in values.items()))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def strip_padding(flags: int, payload: memoryview, priority: bool = False) -> memoryview:
    """The payload without its padding (and, for HEADERS with the PRIORITY flag, without the
    5 priority bytes); Http2Error when the padding is longer than the frame."""
    if flags & PADDED:
        if not payload:
            raise Http2Error(PROTOCOL_ERROR, "padded frame without a pad length")
        pad = payload[0]
        payload = payload[1:]
        if pad > len(payload):
            raise Http2Error(PROTOCOL_ERROR, "padding longer than the frame")
        payload = payload[:len(payload) - pad]
    if priority:
        if len(payload) < 5:
            raise Http2Error(FRAME_SIZE_ERROR, "HEADERS priority block truncated")
        payload = payload[5:]
    return payload


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with ``first``'s high bits set in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(text: bytes) -> bytes:
    return _integer(len(text), 7, 0) + text  # no Huffman coding


_STATUS_200 = b"\x88"  # indexed: static table entry 8, ":status: 200"


def encode_headers(fields: list[tuple[bytes, bytes]], table_size_update: int | None = None) -> bytes:
    """An HPACK header block: ``:status: 200`` indexed, every other field a literal without
    indexing and with a literal name; first a dynamic table size update when asked for."""
    out = [] if table_size_update is None else [_integer(table_size_update, 5, 0x20)]
    for name, value in fields:
        if name == b":status" and value == b"200":
            out.append(_STATUS_200)
        else:
            out.append(b"\x00" + _string(name) + _string(value))
    return b"".join(out)
