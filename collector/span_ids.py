"""Span identity: id checks on every trace export, and a bounded window of ids seen.

``span_keys`` checks that every span has a 16-byte trace id and an 8-byte span id, neither
all zeros (OTLP trace.proto; Zipkin ids are converted to these lengths first), else raises
IngestError(400) naming the first bad span; it returns a ``uint8`` row of trace id + span id
per span, in span order. ``SpanWindow`` keeps 64-bit fingerprints of the last spans admitted
(``capacity / 4`` buckets of 4, each forgetting its oldest first), so that a span sent again
is recognised (a false repeat only for a collision: ~capacity / 2**63 per span).

Cost: compiled code (numba, cached per machine, compiled off the loop: :mod:`.compiled`). For a
protobuf body one walk over its bytes, field by field (the last occurrence of an id wins,
as in any protobuf parser); for other bodies a Python loop over the parsed spans. The
window: one loop per request for lookup and one for remember, a few table reads per span;
copies within a request go through a scratch table salted per window, so that no choice of
ids makes them quadratic. Memory: 8 bytes per span of capacity.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
from numba import types

from ..instrumentation import check_range
from .compiled import ahead
from .ingest import IngestError
from .protowire import BAD_FIELD, NONE_LEFT, le64, message, next_message, skip, varint

__all__ = ["Lookup", "SpanWindow", "fingerprints", "remove_spans", "span_fingerprints", "span_keys",
           "with_variants"]

_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)
_NO_KEYS = np.zeros((0, 24), dtype=np.uint8)
_WAYS = 4  # fingerprints per bucket, the newest first
_NOT_UNDERSTOOD = -(1 << 40)  # the walk's answer for what it does not read (groups, bad framing)
_MIN_SPAN_BYTES = 30  # a span with both ids: 0a 10 <16> 12 08 <8>, and its own tag and length


_BYTES = types.Array(types.uint8, 1, "C", readonly=True)
_WORDS = types.Array(types.uint64, 2, "C")


@ahead(types.int64(_BYTES, _WORDS), nogil=True)  # on decoder threads: the loop goes on
def _walk_ids(buf, out):
    """Reads every span's ids of an encoded ExportTraceServiceRequest into ``out`` (a row of
    trace id high and low word, span id; little-endian), in span order. Returns the number
    of spans; ``-(i + 1)`` for the first span ``i`` with a bad id; ``_NOT_UNDERSTOOD``."""
    n = 0
    at = 0
    while True:  # request.resource_spans (1) / .scope_spans (2) / .spans (2)
        resource_at, resource_end, at = next_message(buf, at, len(buf), 0x0A)
        if resource_end < 0:
            return n if resource_end == NONE_LEFT else _NOT_UNDERSTOOD
        while True:
            scope_at, scope_end, resource_at = next_message(buf, resource_at, resource_end, 0x12)
            if scope_end == BAD_FIELD:
                return _NOT_UNDERSTOOD
            if scope_end == NONE_LEFT:
                break
            while True:
                span_at, span_end, scope_at = next_message(buf, scope_at, scope_end, 0x12)
                if span_end == NONE_LEFT:
                    break
                if span_end == BAD_FIELD or n >= out.shape[0]:
                    return _NOT_UNDERSTOOD
                trace_len = span_len = -1
                trace_at = span_id_at = 0
                while span_at < span_end:  # Span: trace_id = 1, span_id = 2 (the last of each wins)
                    tag, span_at = varint(buf, span_at, span_end)
                    if tag == 0x0A or tag == 0x12:
                        value_at, value_end = message(buf, span_at, span_end)
                        if value_end < 0:
                            return _NOT_UNDERSTOOD
                        if tag == 0x0A:
                            trace_len, trace_at = value_end - value_at, value_at
                        else:
                            span_len, span_id_at = value_end - value_at, value_at
                        span_at = value_end
                    elif tag < 0:
                        return _NOT_UNDERSTOOD
                    else:
                        span_at = skip(buf, span_at, span_end, tag & 7)
                        if span_at < 0:
                            return _NOT_UNDERSTOOD
                if trace_len != 16 or span_len != 8:
                    return -(n + 1)
                hi, lo = le64(buf, trace_at), le64(buf, trace_at + 8)
                span = le64(buf, span_id_at)
                if (hi == 0 and lo == 0) or span == 0:
                    return -(n + 1)
                out[n, 0] = hi
                out[n, 1] = lo
                out[n, 2] = span
                n += 1


# splitmix64's multipliers and shifts (uint64 products wrap, as intended): each id word is
# XORed in, then the state is mixed by a shift-XOR (which carries high bits down: a product
# alone carries low bits upward only, so big-endian counters would keep their top bits) and
# a product; every step is a bijection, so spans of one trace with distinct span ids never
# share a fingerprint. Structured ids (counters, in either byte order) spread like random ones.
@ahead(types.void(types.Array(types.uint64, 2, "A", readonly=True), types.uint64[::1]))
def _fingerprint_rows(words, out):
    for i in range(words.shape[0]):
        fp = words[i, 0] * np.uint64(0x9E3779B97F4A7C15)
        fp ^= words[i, 1]
        fp ^= fp >> np.uint64(30)
        fp *= np.uint64(0xBF58476D1CE4E5B9)
        fp ^= words[i, 2]
        fp ^= fp >> np.uint64(27)
        fp *= np.uint64(0x94D049BB133111EB)
        fp ^= fp >> np.uint64(31)
        out[i] = fp | np.uint64(1)


@ahead(types.int64(types.uint64[:, ::1], types.uint64, types.Array(types.uint64, 1, "A", readonly=True),
                   types.uint64[::1], types.uint64, types.uint64, types.boolean[::1]))
def _lookup(table, shift, fp, scratch, scratch_shift, salt, seen):
    """Marks in ``seen`` each fingerprint held by its bucket before this request, or met
    earlier in ``fp``; returns how many. ``scratch``: 2**(64 - scratch_shift) zeros, at
    least 2 len(fp) (zeros again on return); a slot is the top bits of the salted product
    (multiply-shift: the low bits of a product would follow the ids' low bits)."""
    mask = np.uint64(len(scratch) - 1)
    repeats = 0
    for i in range(len(fp)):
        value = fp[i]
        row = value >> shift
        hit = (table[row, 0] == value or table[row, 1] == value or table[row, 2] == value
               or table[row, 3] == value)
        slot = (value * salt) >> scratch_shift
        while scratch[slot] != 0:  # linear probing; a copy earlier in the request stops it
            if scratch[slot] == value:
                hit = True
                break
            slot = (slot + np.uint64(1)) & mask
        else:
            scratch[slot] = value
        seen[i] = hit
        repeats += hit
    scratch[:] = 0
    return repeats


@ahead(types.void(types.uint64[:, ::1], types.uint64, types.Array(types.uint64, 1, "A", readonly=True)))
def _remember(table, shift, fp):
    """Each fingerprint in turn into way 0 of its bucket, the bucket's others one way on."""
    for i in range(len(fp)):
        value = fp[i]
        row = value >> shift
        table[row, 3] = table[row, 2]
        table[row, 2] = table[row, 1]
        table[row, 1] = table[row, 0]
        table[row, 0] = value


def span_keys(request, encoded: bytes | None = None) -> np.ndarray:
    """``uint8[spans, 24]``: trace id + span id of each span of ``request`` (``encoded``: its
    protobuf encoding, when at hand), or IngestError(400) for the first span with a bad id."""
    # A parent span id is a reference, not the span's identity: one of any length is kept
    # and (like a parent that never reports) matches no span.
    if encoded is not None:
        words = _walked(encoded)
        if words is not None:
            return words.astype("<u8", copy=False).view(np.uint8)
    return _exact_keys(request)


def span_fingerprints(request, encoded: bytes | None = None) -> np.ndarray:
    """``fingerprints(span_keys(request, encoded))``, from the walk's words when ``encoded``
    is at hand (no key array in between)."""
    if encoded is not None:
        words = _walked(encoded)
        if words is not None:
            return _fingerprints(words)
    return fingerprints(_exact_keys(request))


def with_variants(fp: np.ndarray, variants: np.ndarray | None) -> np.ndarray:
    """``fp`` with each nonzero ``variants[i]`` mixed into ``fp[i]``: spans that share ids but
    differ in what the variant says (Zipkin: kind and ``shared``) get distinct fingerprints;
    variant 0 leaves a fingerprint as it is. Per variant the mix is a bijection (an XOR, then
    splitmix64's shift-XORs and products), so distinct ids stay distinct."""
    if variants is None or not variants.any():
        return fp
    out = fp.copy()
    mixed = variants != 0
    x = fp[mixed] ^ (variants[mixed] * np.uint64(0x9E3779B97F4A7C15))
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    out[mixed] = x | np.uint64(1)
    return out


def _walked(encoded: bytes) -> np.ndarray | None:
    """``uint64[spans, 3]`` read by the compiled walk, or None: a bad id (the exact path
    then names it) or an encoding the walk does not read (the exact path decides)."""
    out = np.empty((len(encoded) // _MIN_SPAN_BYTES + 1, 3), dtype=np.uint64)
    n = _walk_ids(np.frombuffer(encoded, dtype=np.uint8), out)
    return out[:n] if n >= 0 else None


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


def fingerprints(keys: np.ndarray) -> np.ndarray:
    """uint64 fingerprint (never 0) of each ``uint8[n, 24]`` key row."""
    return _fingerprints(np.ascontiguousarray(keys).view("<u8").reshape(-1, 3))


def _fingerprints(words: np.ndarray) -> np.ndarray:
    """The fingerprint of each row of ``uint64[n, 3]`` id words (trace high, low; span)."""
    out = np.empty(len(words), dtype=np.uint64)
    _fingerprint_rows(words, out)
    return out


@dataclass(frozen=True, slots=True)
class Lookup:
    """One request's fingerprints looked up in a :class:`SpanWindow` (``SpanWindow.lookup``)."""

    fingerprints: np.ndarray  # uint64[n], as looked up
    repeats: np.ndarray  # positions (ascending) seen before: in the window or earlier in the request

    @property
    def kept(self) -> np.ndarray:
        """The fingerprints of the spans that are not repeats, in order."""
        return np.delete(self.fingerprints, self.repeats) if self.repeats.size else self.fingerprints


_NO_POSITIONS = np.zeros(0, dtype=np.intp)


class SpanWindow:
    """Fingerprints of about the last ``capacity`` spans admitted: a table of ``capacity / 4``
    buckets of 4, each bucket forgetting its oldest fingerprint first.

    Not thread-safe: the receivers call it from the event-loop thread. ``capacity`` 0 turns
    it off (every span is new)."""

    def __init__(self, capacity: int) -> None:
        check_range("capacity", capacity, 0, 100_000_000, integer=True)
        self.capacity = capacity
        bits = max(1, (max(capacity, 1) // _WAYS - 1).bit_length())
        self._shift = np.uint64(64 - bits)
        self._table = np.zeros((1 << bits, _WAYS), dtype=np.uint64)  # [bucket, way], way 0 the newest
        self._scratch = np.zeros(2048, dtype=np.uint64)  # copies within a request; grown as needed
        # an odd multiplier only this window knows: where a fingerprint lands in the scratch
        # table cannot be chosen by whoever picks the ids
        self._salt = np.uint64(secrets.randbits(64) | 1)

    def repeats(self, fp: np.ndarray) -> np.ndarray:
        """Positions (ascending) of the spans with fingerprints ``fp`` (:func:`fingerprints`)
        seen before: in the window, or earlier in the same request."""
        return self.lookup(fp).repeats

    def lookup(self, fp: np.ndarray) -> Lookup:
        """``fp`` looked up (nothing remembered): :attr:`Lookup.repeats` as :meth:`repeats`."""
        n = len(fp)
        if not self.capacity or not n:
            return Lookup(fp, _NO_POSITIONS)
        if 2 * n > len(self._scratch):
            self._scratch = np.zeros(1 << (2 * n - 1).bit_length(), dtype=np.uint64)
        seen = np.empty(n, dtype=np.bool_)
        scratch_shift = np.uint64(65 - len(self._scratch).bit_length())
        if not _lookup(self._table, self._shift, fp, self._scratch, scratch_shift, self._salt, seen):
            return Lookup(fp, _NO_POSITIONS)
        return Lookup(fp, np.flatnonzero(seen))

    def remember(self, spans: np.ndarray | Lookup) -> None:
        """Adds the fingerprints of spans just admitted, in order (a :class:`Lookup` of
        exactly them, or the fingerprints themselves)."""
        if self.capacity:
            _remember(self._table, self._shift, spans.fingerprints if isinstance(spans, Lookup) else spans)
