"""Span identity: id checks on every trace export, and a bounded window of ids seen.

``span_keys`` checks that every span has a 16-byte trace id and an 8-byte span id, neither
all zeros (OTLP trace.proto; Zipkin ids are converted to these lengths first), else raises
IngestError(400) naming the first bad span. It returns one key per span, (trace id, span
id), in span order. A parent span id is a reference, not the span's identity: one of any
length is kept, and (like a parent that never reports) matches no span.
``SpanWindow`` remembers the keys of the last ``capacity`` to ``capacity / 2`` spans admitted
(two generations of sets), so a span sent again by an exporter's retry is recognised.

Cost: for a protobuf body, an ids-only re-parse, ``DiscardUnknownFields`` and a re-encoding
of just the ids (upb's C code), whose spans are then 30-byte records checked as one numpy
array; the keys come out of numpy as bytes. A request whose encoding is not of that shape,
or not protobuf (JSON, Zipkin), takes the exact path: a Python loop over the spans. The
window costs ~100 bytes per remembered span and set operations per request.
"""

from __future__ import annotations

import numpy as np
from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError

from .ingest import IngestError
from .otlp_points import lean_trace_request_class

__all__ = ["SpanWindow", "remove_spans", "span_keys"]

_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)
_SEPARATOR = b"\x12\x08"  # a key is trace id + this + span id, as in the canonical encoding
_RECORD = 30  # one span of the ids-only encoding: 12 1c | 0a 10 <trace id> | 12 08 <span id>
_KEY = np.dtype((np.void, 26))
# Each record's fixed bytes (header, trace id tag, span id tag): checked by one XOR and mask.
_EXPECTED = np.zeros(_RECORD, dtype=np.uint8)
_EXPECTED[[0, 1, 2, 3, 20, 21]] = (0x12, 0x1C, 0x0A, 0x10, 0x12, 0x08)
_FIXED = np.zeros(_RECORD, dtype=np.uint8)
_FIXED[[0, 1, 2, 3, 20, 21]] = 0xFF
# In records of that shape, 16 zero bytes fit only in a trace id's place, so this finds
# exactly the zero trace ids; the span id pattern may also hit inside a trace id (then the
# exact path looks closer).
_ZERO_TRACE_ID = b"\n\x10" + bytes(16) + b"\x12\x08"
_ZERO_SPAN_ID = b"\x12\x08" + bytes(8)
_F = descriptor_pb2.FieldDescriptorProto
_IdsRequest = lean_trace_request_class("sightline.collector.ids", [
    ("trace_id", 1, _F.TYPE_BYTES, False, None), ("span_id", 2, _F.TYPE_BYTES, False, None)])


def span_keys(request, encoded: bytes | None = None) -> list[bytes]:
    """One key per span of ``request`` (``encoded``: its protobuf encoding, when at hand),
    or IngestError(400) for the first span with a bad id."""
    if encoded is not None:
        keys = _canonical_keys(encoded)
        if keys is not None:
            return keys
    return _exact_keys(request)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _canonical_keys(encoded: bytes) -> list[bytes] | None:
    """Keys read from upb's re-encoding of the ids alone; None when it is not the shape that
    only valid ids give (the exact path then decides, and names the bad span).

    Why the shape check is exact: a scope's bytes (ids-only) are its span records back to
    back. Its first record starts at 0; a header ``12 1c`` says that record is 28 bytes of
    content, which ``0a 10`` + 16 + ``12 08`` + 8 fills exactly with a 16-byte trace id and
    an 8-byte span id, so the next record starts at 30; and so on through every row."""
    try:
        ids = _IdsRequest.FromString(encoded)
    except DecodeError:
        return None
    ids.DiscardUnknownFields()
    compact = ids.SerializeToString()
    data = np.frombuffer(compact, dtype=np.uint8)
    parts = []
    at, end = 0, len(compact)
    while at < end:  # resource_spans (field 1), each holding scope_spans (field 2)
        if compact[at] != 0x0A:
            return None
        size, at = _varint(compact, at + 1)
        resource_end = at + size
        while at < resource_end:
            if compact[at] != 0x12:
                return None
            size, at = _varint(compact, at + 1)
            if size % _RECORD:
                return None
            parts.append(data[at:at + size])
            at += size
    if not parts:
        return []
    rows = (np.concatenate(parts) if len(parts) > 1 else parts[0]).reshape(-1, _RECORD)
    if ((rows ^ _EXPECTED) & _FIXED).any():
        return None
    if _ZERO_TRACE_ID in compact or _ZERO_SPAN_ID in compact:
        return None
    return np.ascontiguousarray(rows[:, 4:30]).view(_KEY).ravel().tolist()


def _exact_keys(request) -> list[bytes]:
    keys = []
    index = 0
    for rs in request.resource_spans:
        for scope in rs.scope_spans:
            for span in scope.spans:
                trace_id, span_id = span.trace_id, span.span_id
                if len(trace_id) != 16 or trace_id == _ZERO_TRACE:
                    raise IngestError(400, "malformed", f"span {index}: trace id {trace_id.hex()!r} is not "
                                      "16 bytes with one non-zero")
                if len(span_id) != 8 or span_id == _ZERO_SPAN:
                    raise IngestError(400, "malformed", f"span {index}: span id {span_id.hex()!r} is not "
                                      "8 bytes with one non-zero")
                keys.append(trace_id + _SEPARATOR + span_id)
                index += 1
    return keys


def remove_spans(request, positions: list[int]) -> None:
    """Deletes the spans at ``positions`` (indexes in span order, ascending) from ``request``."""
    doomed = set(positions)
    index = 0
    for rs in request.resource_spans:
        for scope in rs.scope_spans:
            spans = scope.spans
            drop = [i for i in range(len(spans)) if index + i in doomed]
            index += len(spans)
            for i in reversed(drop):
                del spans[i]


class SpanWindow:
    """Keys of recently admitted spans: the last ``capacity / 2`` at least, ``capacity`` at most.

    Not thread-safe: the receivers call it from the event-loop thread. ``capacity`` 0 turns
    it off (every span is new)."""

    def __init__(self, capacity: int) -> None:
        if not 0 <= capacity <= 100_000_000:
            raise ValueError(f"capacity={capacity!r} is outside the allowed range 0..100000000")
        self.capacity = capacity
        self._half = max(1, capacity // 2)
        self._current: set[bytes] = set()
        self._previous: set[bytes] = set()

    def repeats(self, keys: list[bytes]) -> list[int]:
        """Positions in ``keys`` of spans seen before (in the window, or earlier in ``keys``)."""
        if not self.capacity:
            return []
        fresh = set(keys)
        if (len(fresh) == len(keys) and self._current.isdisjoint(fresh)
                and self._previous.isdisjoint(fresh)):
            return []
        seen: set[bytes] = set()
        repeated = []
        for i, key in enumerate(keys):
            if key in seen or key in self._current or key in self._previous:
                repeated.append(i)
            else:
                seen.add(key)
        return repeated

    def remember(self, keys: list[bytes]) -> None:
        """Adds the keys of spans just admitted."""
        if not self.capacity:
            return
        self._current.update(keys)
        if len(self._current) >= self._half:
            self._previous, self._current = self._current, set()

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)
