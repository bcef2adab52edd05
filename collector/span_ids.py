"""Span identity: id checks on every trace export, and a bounded window of ids seen.

``span_keys`` checks that every span has a 16-byte trace id and an 8-byte span id, neither
all zeros (OTLP trace.proto; Zipkin ids are converted to these lengths first), else raises
IngestError(400) naming the first bad span; it returns the keys as one ``uint8`` array,
a row of trace id + span id per span, in span order. ``SpanWindow`` remembers a 64-bit
fingerprint of the key of about the last ``capacity`` spans admitted, so a span sent again
by an exporter's retry is recognised (false "repeat" only for a fingerprint collision:
~capacity / 2**63 per span for random ids).

Cost: for a protobuf body, an ids-only re-parse and re-encoding (upb's C code), then a
fixed number of bytes operations over the 30-byte records read in place (other bodies: a
Python loop over the spans); fingerprints and the window's one lookup per request, a fixed
number of numpy operations, each over the whole request (no sort), and Python for the few
spans sharing a bucket. The window: 8 bytes per span, 1 more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError

from .ingest import IngestError
from .otlp_points import lean_trace_request_class

__all__ = ["Lookup", "SpanWindow", "fingerprints", "remove_spans", "span_fingerprints", "span_keys"]

_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)
_RECORD = 30  # one span of the ids-only encoding: 12 1c | 0a 10 <trace id> | 12 08 <span id>
# That record's fixed bytes, (offset, byte), and the record as one numpy row (unaligned
# fields, read in place): the ids three 64-bit words to copy out.
_RECORD_FIXED = ((0, b"\x12"), (1, b"\x1c"), (2, b"\x0a"), (3, b"\x10"))
_RECORD_DTYPE = np.dtype({"names": ["trace_hi", "trace_lo", "span"], "formats": ["<u8", "<u8", "<u8"],
                          "offsets": [4, 12, 22], "itemsize": _RECORD})
_ZERO_SPAN_RECORD = b"\x12\x08" + bytes(8) + b"\x12\x1c"  # an all-zero span id, a record after it
_ZERO_SPAN_END = b"\x12\x08" + bytes(8)  # ... or at the end
_NO_KEYS = np.zeros((0, 24), dtype=np.uint8)
_F = descriptor_pb2.FieldDescriptorProto
_IdsRequest = lean_trace_request_class("sightline.collector.ids", [
    ("trace_id", 1, _F.TYPE_BYTES, False, None), ("span_id", 2, _F.TYPE_BYTES, False, None)])


def span_keys(request, encoded: bytes | None = None) -> np.ndarray:
    """``uint8[spans, 24]``: trace id + span id of each span of ``request`` (``encoded``: its
    protobuf encoding, when at hand), or IngestError(400) for the first span with a bad id."""
    # A parent span id is a reference, not the span's identity: one of any length is kept
    # and (like a parent that never reports) matches no span.
    if encoded is not None:
        keys = _canonical_keys(encoded)
        if keys is not None:
            return keys
    return _exact_keys(request)


def span_fingerprints(request, encoded: bytes | None = None) -> np.ndarray:
    """``fingerprints(span_keys(request, encoded))``, read from the records in place when
    ``encoded`` takes the fast path (no key array in between)."""
    if encoded is not None:
        rows = _canonical_rows(encoded)
        if rows is not None:
            return _fingerprint_words(rows["trace_hi"], rows["trace_lo"], rows["span"])
    return fingerprints(_exact_keys(request))


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _canonical_keys(encoded: bytes) -> np.ndarray | None:
    """The keys of :func:`_canonical_rows`' records, or None as it."""
    rows = _canonical_rows(encoded)
    if rows is None:
        return None
    keys = np.empty((len(rows), 3), dtype=np.uint64)  # [n, 3]: trace id high, low; span id
    keys[:, 0] = rows["trace_hi"]
    keys[:, 1] = rows["trace_lo"]
    keys[:, 2] = rows["span"]
    return keys.view(np.uint8)


def _canonical_rows(encoded: bytes) -> np.ndarray | None:
    """The span records of upb's re-encoding of the ids alone (``_RECORD_DTYPE``); None when
    it is not the shape that only valid ids give (the exact path then decides, and names
    the bad span).

    Why the shape check is exact: a scope's bytes (ids-only) are its span records back to
    back. Its first record starts at 0; a header ``12 1c`` says that record is 28 bytes of
    content, so the next record starts at 30; and so on through every row. Content that
    starts ``0a 10`` holds a 16-byte trace id, and its other 10 bytes can only be the span id
    field (upb writes each field once, and the unknown ones are gone): ``12 08`` + 8."""
    try:
        ids = _IdsRequest.FromString(encoded)
    except DecodeError:
        return None
    ids.DiscardUnknownFields()
    compact = ids.SerializeToString()
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
            parts.append(compact[at:at + size])
            at += size
    # bytes, not numpy, for the join and the checks: one strided slice per fixed byte, one
    # search for a zero id
    records = parts[0] if len(parts) == 1 else b"".join(parts)
    n = len(records) // _RECORD
    for offset, byte in _RECORD_FIXED:
        if records[offset::_RECORD] != byte * n:
            return None
    # An all-zero id holds 8 zero bytes in a row, which random ids almost never do. Where they
    # are: 16 zero bytes in a row can only be a whole trace id (a span id is 8, and fixed bytes
    # follow it); the span id pattern may also match inside a trace id: then the exact path
    # decides (slower, same answer)
    if _ZERO_SPAN in records and (_ZERO_TRACE in records or _ZERO_SPAN_RECORD in records
                                  or records.endswith(_ZERO_SPAN_END)):
        return None
    return np.frombuffer(records, dtype=_RECORD_DTYPE)


def _exact_keys(request) -> np.ndarray:
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
                keys.append(trace_id + span_id)
                index += 1
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, 24) if keys else _NO_KEYS


def remove_spans(request, positions) -> None:
    """Deletes the spans at ``positions`` (indexes in span order) from ``request``."""
    doomed = set(int(i) for i in positions)
    index = 0
    for rs in request.resource_spans:
        for scope in rs.scope_spans:
            spans = scope.spans
            drop = [i for i in range(len(spans)) if index + i in doomed]
            index += len(spans)
            for i in reversed(drop):
                del spans[i]


# splitmix64's multipliers and shifts (uint64 products wrap, as intended): each id word is
# XORed in, then the state is mixed by a shift-XOR (which carries high bits down: a product
# alone carries low bits upward only, so big-endian counters would keep their top bits) and
# a product; every step is a bijection, so spans of one trace with distinct span ids never
# share a fingerprint. Structured ids (counters, in either byte order) spread like random ones.
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15))
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ONE = np.uint64(1)
_WAYS = 4  # fingerprints per bucket, the newest first
_NO_POSITIONS = np.zeros(0, dtype=np.intp)
_NO_SPAN = np.iinfo(np.int32).max  # past any position in a request
_NO_HELD = np.zeros((0, _WAYS), dtype=np.uint64)


def fingerprints(keys: np.ndarray) -> np.ndarray:
    """uint64 fingerprint (never 0) of each ``uint8[n, 24]`` key row."""
    words = np.ascontiguousarray(keys).view(np.uint64)  # [n, 3]: trace id high, low; span id
    return _fingerprint_words(words[:, 0], words[:, 1], words[:, 2])


def _fingerprint_words(trace_hi: np.ndarray, trace_lo: np.ndarray, span: np.ndarray) -> np.ndarray:
    fp = np.multiply(trace_hi, _MIX[2])
    fp ^= trace_lo
    fp ^= fp >> _S30
    fp *= _MIX[0]
    fp ^= span
    fp ^= fp >> _S27
    fp *= _MIX[1]
    fp ^= fp >> _S31
    fp |= _ONE
    return fp


@dataclass(frozen=True, slots=True)
class Lookup:
    """One request's fingerprints looked up in a :class:`SpanWindow` (``SpanWindow.lookup``);
    what ``remember`` needs of them is kept, so admitting the request costs no second pass."""

    fingerprints: np.ndarray  # uint64[n], as looked up
    repeats: np.ndarray  # positions (ascending) seen before: in the window or earlier in the request
    buckets: np.ndarray  # intp[n]: each span's bucket
    held: np.ndarray  # uint64[n, ways]: what each span's bucket held before the request
    shared: list[list[tuple[int, int]]]  # per bucket several spans share: (position, fingerprint), in order

    @property
    def others(self) -> list[int]:
        """Positions (ascending) of the spans that are not their bucket's first."""
        return sorted(i for group in self.shared for i, _ in group[1:])


class SpanWindow:
    """Fingerprints of about the last ``capacity`` spans admitted: a table of ``capacity / 4``
    buckets of 4, each bucket forgetting its oldest fingerprint first.

    Not thread-safe: the receivers call it from the event-loop thread. ``capacity`` 0 turns
    it off (every span is new)."""

    def __init__(self, capacity: int) -> None:
        if not 0 <= capacity <= 100_000_000:
            raise ValueError(f"capacity={capacity!r} is outside the allowed range 0..100000000")
        self.capacity = capacity
        bits = max(1, (max(capacity, 1) // _WAYS - 1).bit_length())
        self._shift = np.uint64(64 - bits)
        # [bucket, way], way 0 the newest: a bucket's ways share a cache line; read a row per
        # span (np.take), written way by way through views (numpy scatters rows slower)
        self._table = np.zeros((1 << bits, _WAYS), dtype=np.uint64)
        self._ways = tuple(self._table[:, way] for way in range(_WAYS))
        self._owner = np.full(1 << bits, _NO_SPAN, dtype=np.int32)  # per bucket: lookup's scratch
        self._positions = np.arange(1024, dtype=np.int32)  # 0, 1, ...: grown as requests need

    def repeats(self, fp: np.ndarray) -> np.ndarray:
        """Positions (ascending) of the spans with fingerprints ``fp`` (:func:`fingerprints`)
        seen before: in the window, or earlier in the same request."""
        return self.lookup(fp).repeats

    def lookup(self, fp: np.ndarray) -> Lookup:
        """``fp`` looked up: :attr:`Lookup.repeats` as :meth:`repeats`, and what
        :meth:`remember` reuses."""
        n = len(fp)
        if not self.capacity or not n:
            return Lookup(fp, _NO_POSITIONS, _NO_POSITIONS, _NO_HELD, [])
        if n > len(self._positions):
            self._positions = np.arange(1 << (n - 1).bit_length(), dtype=np.int32)
        positions = self._positions[:n]
        # the shifted values are below 2**bits: read as intp (int64) without a conversion
        buckets = (fp >> self._shift).view(np.intp)
        # Spans sharing a bucket: each bucket is owned by one of its spans (whichever was
        # written last), the others are found by comparing owners with positions.
        owner = self._owner
        owner[buckets] = positions
        owners = owner[buckets]
        owner[buckets] = _NO_SPAN
        held = np.take(self._table, buckets, axis=0)  # [span, way]: one row of the table each
        hits = held == fp[:, None]
        shared: list[list[tuple[int, int]]] = []
        lost_at = np.flatnonzero(owners != positions)
        if lost_at.size:  # a few per request
            groups: dict[int, list[int]] = {}
            for i, o in zip(lost_at.tolist(), owners[lost_at].tolist()):
                group = groups.get(o)
                if group is None:
                    groups[o] = group = [o]
                group.append(i)
            members = [sorted(group) for group in groups.values()]
            values = fp[[i for group in members for i in group]].tolist()
            at = 0
            for group in members:
                shared.append(list(zip(group, values[at:at + len(group)])))
                at += len(group)
        copies = [i for group in shared if len({value for _, value in group}) < len(group)
                  for i in _copies(group)]
        if not copies and not np.count_nonzero(hits):
            return Lookup(fp, _NO_POSITIONS, buckets, held, shared)
        seen = hits.any(axis=1)
        seen[copies] = True
        return Lookup(fp, np.flatnonzero(seen), buckets, held, shared)

    def remember(self, spans: np.ndarray | Lookup) -> None:
        """Adds the fingerprints of spans just admitted (a :class:`Lookup` of exactly them, or
        the fingerprints themselves)."""
        seen = spans if isinstance(spans, Lookup) else self.lookup(spans)
        if not self.capacity or not seen.held.size:
            return
        # Each span goes into way 0 of its bucket and what the bucket held moves one way on,
        # the oldest out. A bucket of several spans of the request was written by one of them:
        # its row is then rebuilt from them (the newest first) and what it held.
        fp, buckets, held, ways = seen.fingerprints, seen.buckets, seen.held, self._ways
        for way in range(_WAYS - 1, 0, -1):
            ways[way][buckets] = held[:, way - 1]
        ways[0][buckets] = fp
        if not seen.shared:
            return
        firsts = [group[0][0] for group in seen.shared]
        for group, row in zip(seen.shared, held[firsts].tolist()):
            self._table[int(buckets[group[0][0]])] = ([value for _, value in reversed(group)] + row)[:_WAYS]


def _copies(group: list[tuple[int, int]]) -> list[int]:
    """Positions in ``group`` (``(position, fingerprint)`` in order) of copies of an earlier one."""
    earlier: set[int] = set()
    copies = []
    for i, value in group:
        if value in earlier:
            copies.append(i)
        earlier.add(value)
    return copies
