"""Span identity: the id check's compiled walk, fingerprints and the duplicate window, each
against an exact answer (span_ids.py; the receivers' behaviour is in test_hostile_input)."""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from sightline.collector.ingest import IngestError
from sightline.collector.span_ids import (SpanWindow, _exact_keys, _walked, fingerprints, span_fingerprints,
                                          span_keys)


def _request(ids_per_scope: list[list[tuple[bytes, bytes]]]) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for ids in ids_per_scope:
        scope = request.resource_spans.add().scope_spans.add()
        for trace_id, span_id in ids:
            span = scope.spans.add(trace_id=trace_id, span_id=span_id, name="s", parent_span_id=b"\1" * 8)
            span.attributes.add(key="k", value={"string_value": "v"})
    return request


def _counter_keys(n: int) -> np.ndarray:
    """``n`` keys of structured ids: one trace id, span ids 1..n (big-endian counters)."""
    keys = np.zeros((n, 24), dtype=np.uint8)
    keys[:, :16] = np.frombuffer(bytes(15) + b"\1", dtype=np.uint8)
    keys[:, 16:] = np.arange(1, n + 1, dtype=">u8").view(np.uint8).reshape(n, 8)
    return keys


def test_fast_path_reads_every_scope_in_span_order():
    rng = np.random.default_rng(7)
    ids = [[(rng.bytes(16), rng.bytes(8)) for _ in range(n)] for n in (3, 0, 5, 1)]
    request = _request(ids)
    keys = span_keys(None, request.SerializeToString())   # the walk alone: the request is not read
    expected = np.frombuffer(b"".join(t + s for scope in ids for t, s in scope), dtype=np.uint8).reshape(-1, 24)
    assert keys is not None and keys.shape == (9, 24)
    assert np.array_equal(keys, expected)
    assert np.array_equal(keys, _exact_keys(request))


@pytest.mark.parametrize("trace_id, span_id, bad", [(bytes(16), b"\2" * 8, "trace id"),
                                                    (b"\1" * 16, bytes(8), "span id"),
                                                    (b"\1" * 15, b"\2" * 8, "trace id"),
                                                    (b"\1" * 16, b"\2" * 9, "span id")])
def test_a_bad_id_leaves_the_fast_path_and_is_refused_by_position(trace_id, span_id, bad):
    good = [(b"\3" * 16, b"\4" * 8)] * 2
    request = _request([good, [good[0], (trace_id, span_id)]])
    encoded = request.SerializeToString()
    assert _walked(encoded) is None
    with pytest.raises(IngestError) as refused:
        span_keys(request, encoded)
    assert refused.value.status == 400 and refused.value.reason == "malformed"
    assert str(refused.value).startswith(f"span 3: {bad} ")


def test_fingerprints_of_structured_ids_are_distinct_non_zero_and_spread():
    n = 1 << 18
    fp = fingerprints(_counter_keys(n))
    assert fp.dtype == np.uint64 and fp.shape == (n,)
    assert (fp != 0).all()
    assert len(np.unique(fp)) == n
    assert np.array_equal(fp, fingerprints(_counter_keys(n)))
    # The window's bucket is the top bits: counters must fill 2**14 buckets about evenly
    # (a uniform hash puts 16 in each, and more than 40 in one bucket with odds < 1e-6).
    load = np.bincount((fp >> np.uint64(50)).astype(np.intp), minlength=1 << 14)
    assert load.min() > 0 and load.max() <= 40


def test_fingerprints_of_big_endian_counters_in_both_ids_are_distinct():
    # Zipkin-born ids such as trace 00..01f4, span 00..07d0: every word's information sits in
    # its top bytes once read as a little-endian uint64.
    traces, spans_per_trace = 2000, 64
    keys = np.zeros((traces * spans_per_trace, 24), dtype=np.uint8)
    trace = np.repeat(np.arange(1, traces + 1, dtype=">u8"), spans_per_trace)
    keys[:, 8:16] = trace.view(np.uint8).reshape(-1, 8)
    keys[:, 16:] = np.arange(1, len(keys) + 1, dtype=">u8").view(np.uint8).reshape(-1, 8)
    assert len(np.unique(fingerprints(keys))) == len(keys)


def test_window_remembers_admitted_spans_and_flags_copies_within_a_request():
    window = SpanWindow(1 << 12)
    fp = fingerprints(_counter_keys(100))
    assert len(window.repeats(fp)) == 0
    window.remember(fp)
    assert np.array_equal(window.repeats(fp), np.arange(100))
    fresh = fingerprints(_counter_keys(110))[100:]
    mixed = np.concatenate((fresh[:3], fp[[5]], fresh[:2], fresh[3:]))  # 4 new, 1 seen, 2 copies
    assert window.repeats(mixed).tolist() == [3, 4, 5]
    assert SpanWindow(0).repeats(fp).size == 0


def test_each_bucket_forgets_its_oldest_fingerprint_first_over_many_writes():
    window = SpanWindow(8)  # 2 buckets of 4
    shift = np.uint64(63)
    fp = fingerprints(_counter_keys(4000))
    same = fp[(fp >> shift) == fp[0] >> shift][:300]  # 300 writes to one bucket: the counter wraps
    for i, value in enumerate(same):
        window.remember(same[i:i + 1])
        newest = same[max(0, i - 3):i + 1]
        assert len(window.repeats(newest)) == len(newest)
        if i >= 4:
            assert len(window.repeats(same[i - 4:i - 3])) == 0


def test_window_capacity_is_checked():
    with pytest.raises(ValueError, match=r"capacity=-1 is not an integer in \[0, 100000000\]"):
        SpanWindow(-1)


def test_fingerprints_read_in_place_equal_those_of_the_keys_and_zero_ids_leave_the_fast_path():
    rng = np.random.default_rng(3)
    ids = [[(rng.bytes(16), rng.bytes(8)) for _ in range(n)] for n in (700, 2, 333)]
    # a valid trace id holding what a span record with an all-zero span id looks like
    ids[1][0] = (b"\1\1" + b"\x12\x08" + bytes(8) + b"\x12\x1c\1\1", rng.bytes(8))
    request = _request(ids)
    encoded = request.SerializeToString()
    assert np.array_equal(span_fingerprints(request, encoded), fingerprints(span_keys(request, encoded)))
    assert np.array_equal(span_fingerprints(request, encoded), fingerprints(_exact_keys(request)))
    assert _walked(encoded) is not None


def test_copies_within_a_request_are_found_across_chunks_and_every_span_is_remembered():
    window = SpanWindow(1 << 20)
    fp = fingerprints(_counter_keys(1200))
    sent = np.concatenate((fp, fp[[3, 700, 1199]]))  # copies past the first 500 and 1,000 spans
    assert window.repeats(sent).tolist() == [1200, 1201, 1202]
    window.remember(fp)
    assert len(window.repeats(fp)) == 1200
    tiny = SpanWindow(8)  # 2 buckets of 4: one request of 8 fills every way
    eight = fingerprints(_counter_keys(4000))
    top = eight >> np.uint64(63)
    both = np.concatenate((eight[top == 0][:4], eight[top == 1][:4]))
    tiny.remember(both)
    assert len(tiny.repeats(both)) == 8


def test_remembering_writes_each_span_in_turn_and_each_bucket_keeps_its_four_newest():
    # one request of 1,200 spans into 256 buckets: every bucket takes several, most more than 4
    fp = fingerprints(_counter_keys(1200))
    window = SpanWindow(1 << 10)
    seen = window.lookup(fp)
    assert seen.repeats.size == 0 and np.array_equal(seen.kept, fp)
    window.remember(seen.kept)
    bucket = (fp >> window._shift).astype(np.intp)
    for b in np.unique(bucket):
        newest = fp[bucket == b][-4:][::-1].tolist()                      # way 0 the newest
        assert window._table[b].tolist() == newest + [0] * (4 - len(newest))
    kept = {int(value) for b in np.unique(bucket) for value in fp[bucket == b][-4:]}
    assert window.repeats(fp).tolist() == [i for i, value in enumerate(fp.tolist()) if value in kept]


def _encode_span(*fields: bytes) -> bytes:
    """A request of one resource, one scope and one span made of ``fields`` (encoded)."""
    def message(tag: int, body: bytes) -> bytes:
        return bytes([tag]) + _varint(len(body)) + body
    return message(0x0A, message(0x12, message(0x12, b"".join(fields))))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


@pytest.mark.parametrize("fields", [
    (b"\x0a\x10" + b"\1" * 16, b"\x0a\x10" + b"\2" * 16, b"\x12\x08" + b"\3" * 8),   # two trace ids
    (b"\x12\x08" + b"\3" * 8, b"\x0a\x10" + b"\2" * 16),                                # span id first
    (b"\x2a\x01s", b"\x0a\x10" + b"\2" * 16, b"\x39" + bytes(8), b"\x12\x08" + b"\3" * 8),  # other fields between
    (b"\x0a\x10" + b"\2" * 16, b"\x12\x08" + b"\3" * 8, b"\x12\x03abc"),                # a bad span id last
    (b"\x0a\x10" + b"\2" * 16, b"\x12\x08" + b"\3" * 8, b"\x6b\x08\x01\x6c"),          # a group (unknown)
])
def test_the_walk_reads_what_a_protobuf_parser_reads(fields):
    encoded = _encode_span(*fields)
    request = ExportTraceServiceRequest.FromString(encoded)   # the receiver's parse
    try:
        expected = _exact_keys(request)
    except IngestError as error:
        with pytest.raises(IngestError, match=str(error)):
            span_keys(request, encoded)
    else:
        assert np.array_equal(span_keys(request, encoded), expected)


def test_the_walk_skips_links_events_and_resources_that_hold_ids_of_their_own():
    rng = np.random.default_rng(11)
    request = ExportTraceServiceRequest()
    for r in range(3):
        rs = request.resource_spans.add()
        rs.resource.attributes.add(key="service.name", value={"string_value": f"s{r}"})
        for _ in range(2):
            scope = rs.scope_spans.add()
            scope.scope.name = "lib"
            for _ in range(int(rng.integers(0, 4))):
                span = scope.spans.add(trace_id=rng.bytes(16), span_id=rng.bytes(8), name="op")
                span.links.add(trace_id=rng.bytes(16), span_id=rng.bytes(8))
                span.events.add(name="e").attributes.add(key="k", value={"bytes_value": rng.bytes(24)})
    encoded = request.SerializeToString()
    assert _walked(encoded) is not None
    assert np.array_equal(span_keys(None, encoded), _exact_keys(request))
