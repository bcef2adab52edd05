"""What every ingest receiver shares: limits, refusals, body reading, decompression, JSON.

Guarantees: a body is refused before it costs more than ``max_request_bytes`` on the wire
and, once inflated, ``max_decompressed_bytes`` or ``max_decompression_ratio`` times its
wire size (whichever is less, never below ``MIN_INFLATED_BYTES``) (413); a body that has not arrived within
``request_timeout_s`` is refused (408) and one whose client went away is counted
(``client_disconnected``), never logged as an error. Decompression is linear in the body
(many gzip members included: input is fed in bounded chunks, so no member copies the rest
of the body) and runs on a worker thread, so the event loop keeps serving other clients
and /healthz. JSON is parsed with a nesting limit (``max_json_depth``): deeper documents
are refused (400) before anything recurses over them.

Cost: identity bodies are read exactly as before (no thread hop); compressed bodies pay
one hand-off to the receiver's decoder thread per request.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..instrumentation import check_range

__all__ = ["MIN_INFLATED_BYTES", "IngestError", "IngestLimits", "InflightLimit", "content_encoding",
           "decode_body", "decompress_bounded", "inflate", "json_depth", "load_json", "read_body", "read_raw"]

_CHUNK_BYTES = 64 * 1024  # compressed input handed to zlib at a time (bounds unused_data copies)
MIN_INFLATED_BYTES = 1024 * 1024  # the ratio never refuses a body that inflates to less


@dataclass(frozen=True)
class IngestLimits:
    """Per-request limits of the HTTP receivers (see ``CollectorConfig`` for each field)."""

    max_request_bytes: int
    max_decompressed_bytes: int
    retry_after_s: int
    max_inflight_requests: int = 64
    request_timeout_s: float = 30.0
    max_json_depth: int = 64
    max_decompression_ratio: int = 200

    def __post_init__(self) -> None:
        check_range("max_json_depth", self.max_json_depth, 2, 512, integer=True)
        check_range("max_decompression_ratio", self.max_decompression_ratio, 2, 1_000_000, integer=True)

    def inflated_limit(self, raw_bytes: int) -> int:
        """How large a body of ``raw_bytes`` on the wire may inflate (see the module docstring)."""
        return min(self.max_decompressed_bytes,
                   max(MIN_INFLATED_BYTES, raw_bytes * self.max_decompression_ratio))


class IngestError(Exception):
    """A request refused with ``status``; ``reason`` is the self-metric label. ``message``
    is made safe to send: UTF-8 encodable (a lone surrogate quoted from the request is
    escaped) and at most 1,000 characters."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")[:1000]
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


class InflightLimit:
    """Counts requests being decoded on one listener (event-loop thread only: no lock).

    A request takes a slot only once its whole body has arrived, so slow senders
    cannot hold slots that fast ones need."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.current = 0

    def try_enter(self) -> bool:
        if self.current >= self.limit:
            return False
        self.current += 1
        return True

    def leave(self) -> None:
        self.current -= 1


# -- body -------------------------------------------------------------------------------
def content_encoding(request: web.Request) -> str:
    """The request's Content-Encoding, or IngestError 415 when it is not one we decode."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "", "gzip", "x-gzip", "deflate"):
        raise IngestError(415, "unsupported_media_type",
                          f"Content-Encoding {encoding!r} is not gzip, deflate or identity")
    return "identity" if encoding == "" else encoding


async def read_raw(request: web.Request, limits: IngestLimits) -> bytes:
    """The body as it arrived (still compressed), within the size and time limits."""
    declared = request.content_length
    if declared is not None and declared > limits.max_request_bytes:
        raise IngestError(413, "too_large", f"body of {declared} bytes exceeds the "
                          f"{limits.max_request_bytes}-byte limit")
    try:
        # aiohttp stops reading at client_max_size
        return await _within(request.read(), limits.request_timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise IngestError(413, "too_large", f"body exceeds the {limits.max_request_bytes}-byte limit") from None
    except asyncio.TimeoutError:
        raise IngestError(408, "timeout", f"body did not arrive within {limits.request_timeout_s} s") from None
    except (ConnectionError, EOFError) as exc:  # the client went away mid-body
        raise IngestError(499, "client_disconnected", f"client disconnected mid-body: {exc}") from None


async def _within(awaitable, timeout_s: float):
    """``await awaitable``, or asyncio.TimeoutError after ``timeout_s``."""
    if hasattr(asyncio, "timeout"):
        # a timer on the current task: wait_for wraps the read in a task of its own and
        # wakes both for every chunk of the body
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)  # Python 3.10


async def decode_body(raw: bytes, encoding: str, limits: IngestLimits, executor) -> bytes:
    """``raw`` inflated on ``executor`` (identity: returned as is, no thread hop)."""
    if encoding == "identity":
        return raw
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, decompress_bounded, raw, encoding,
                                      limits.inflated_limit(len(raw)))


async def read_body(request: web.Request, limits: IngestLimits, executor=None) -> bytes:
    """The request body, decompressed, within both size limits (see the module docstring)."""
    encoding = content_encoding(request)
    return await decode_body(await read_raw(request, limits), encoding, limits, executor)


def inflate(raw: bytes, encoding: str, limits: IngestLimits) -> bytes:
    """``raw`` inflated within ``limits`` (identity: as is); IngestError 413 or 400."""
    if encoding == "identity":
        return raw
    return decompress_bounded(raw, encoding, limits.inflated_limit(len(raw)))


def decompress_bounded(raw: bytes, encoding: str, limit: int) -> bytes:
    """gzip/deflate-decodes ``raw`` producing at most ``limit`` bytes, else IngestError 413."""
    # wbits: 16+15 = gzip container; 15 = zlib container ("deflate" as HTTP means it);
    # -15 = the raw deflate some clients send under that name.
    wbits_options = (31,) if encoding in ("gzip", "x-gzip") else (15, -15)
    for wbits in wbits_options:
        try:
            return _inflate(raw, wbits, limit, encoding)
        except zlib.error:
            continue
    raise IngestError(400, "malformed", f"body is not valid {encoding} data")


def _inflate(raw: bytes, wbits: int, limit: int, encoding: str) -> bytes:
    # A gzip body may hold many members back to back (RFC 1952). Input goes to zlib in
    # chunks of at most _CHUNK_BYTES, so what a finished member leaves over
    # (``unused_data``, a copy) is at most one chunk: linear in the body, however many
    # members. Every member inflates into what is left of one shared output limit.
    parts: list[bytes] = []
    produced = 0
    view = memoryview(raw)
    position = 0
    decoder = zlib.decompressobj(wbits)
    pending: bytes | memoryview = b""
    while True:
        if not pending:
            if position >= len(view):
                break
            pending = view[position:position + _CHUNK_BYTES]
            position += len(pending)
        out = decoder.decompress(pending, limit - produced + 1)
        produced += len(out)
        if produced > limit:
            raise IngestError(413, "too_large", f"decompressed body exceeds the {limit}-byte limit for a "
                              f"{len(raw)}-byte body")
        parts.append(out)
        if not decoder.eof:
            pending = decoder.unconsumed_tail  # empty: the output limit was not reached
            continue
        pending = decoder.unused_data
        if wbits != 31 or (not pending and position >= len(view)):
            return parts[0] if len(parts) == 1 else b"".join(parts)
        decoder = zlib.decompressobj(wbits)
    raise IngestError(400, "malformed", f"truncated {encoding} body")


# -- JSON -------------------------------------------------------------------------------
def load_json(body: bytes | str, max_depth: int) -> Any:
    """``body`` parsed as JSON, nested at most ``max_depth`` deep, else IngestError 400."""
    try:
        document = json.loads(body)
    except RecursionError:  # the C parser's own guard, far deeper than max_depth
        raise IngestError(400, "malformed", f"JSON nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise IngestError(400, "malformed", f"body is not JSON: {exc}") from None
    depth = json_depth(document, max_depth)
    if depth > max_depth:
        raise IngestError(400, "malformed", f"JSON nested deeper than {max_depth} levels")
    return document


def json_depth(document: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), counted without recursion and
    only up to ``limit + 1`` (a deeper document stops the walk there)."""
    deepest = 0
    stack = [(document, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if depth > limit:
                return depth
        for child in node:
            if isinstance(child, (dict, list)):
                push((child, depth))
    return deepest

