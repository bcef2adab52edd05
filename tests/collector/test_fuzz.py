"""Property-based fuzzing (hypothesis) of every collector decoder, in-process.

Generated inputs include wrong types, extreme numbers (NaN, infinities, 2**70, year 3000),
deep nesting, lone surrogates, bad UTF-8, ids of every length, truncated and bit-flipped
protobuf and corrupt gzip. The properties: a decoder either returns a value or refuses
with its protocol error (``IngestError`` / ``PointRefused`` / protobuf's ``DecodeError``,
which the receivers answer 400); nothing else ever escapes. And where two code paths must
agree, they do: the span-id fast path and the exact one, linear decompression and
Python's ``gzip``, the exact-integer bucket total and Python's ``sum``.

CI runs a small, seeded slice (``derandomize``); ``SIGHTLINE_FUZZ_EXAMPLES`` raises it.
bench/fuzz.py runs the receivers themselves, over HTTP and gRPC, for 100,000s of cases.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib

import numpy as np
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.metrics.v1 import metrics_pb2

from sightline.collector.ingest import IngestError, decompress_bounded, json_depth, load_json
from sightline.collector.decoding import count_data_points, count_spans
from sightline.collector.otlp_http import parse_otlp_json
from sightline.collector.otlp_points import cta_point_histogram
from sightline.collector.point_check import PointRefused, check_exp_point, exact_total
from sightline.collector.span_ids import _exact_keys, _walked, span_keys
from sightline.collector.zipkin import zipkin_to_otlp
from sightline.instrumentation import semconv as sc

FUZZ = settings(max_examples=int(os.environ.get("SIGHTLINE_FUZZ_EXAMPLES", "60")), derandomize=True,
                deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DEPTH = 64

# -- strategies -----------------------------------------------------------------------------------
EXTREME_NUMBERS = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**70), 1e30, -1e30,
                                   math.nan, math.inf, -math.inf, 32503680000000000, 1.5, -0.0, 5e-324])
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates included
HEX = st.text("0123456789abcdefABCDEF", min_size=0, max_size=40)
IDS = st.one_of(HEX, st.sampled_from(["0123456789abcdef", "0123456789abcdef0123456789abcdef", "",
                                      "01 23 45 67 89ab", "0x23456789abcdef", "0" * 16, "0" * 32]),
                TEXT, EXTREME_NUMBERS, st.none(), st.booleans())
SCALARS = st.one_of(st.none(), st.booleans(), EXTREME_NUMBERS, st.integers(), st.floats(), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


@st.composite
def nested(draw, inner=JSON):
    """``inner`` wrapped in up to 2,000 lists or objects: past every depth limit, sometimes."""
    value = draw(inner)
    for _ in range(draw(st.sampled_from([0, 1, 5, DEPTH - 2, DEPTH + 1, 200, 2000]))):
        value = [value] if draw(st.booleans()) else {"k": value}
    return value


def maybe(strategy):
    return st.one_of(strategy, JSON, nested())


ZIPKIN_SPAN = st.fixed_dictionaries({}, optional={
    "traceId": IDS, "id": IDS, "parentId": IDS, "name": maybe(TEXT), "kind": maybe(st.sampled_from(
        ["SERVER", "CLIENT", "PRODUCER", "CONSUMER", "SIDEWAYS"])),
    "timestamp": maybe(EXTREME_NUMBERS), "duration": maybe(EXTREME_NUMBERS),
    "localEndpoint": maybe(st.fixed_dictionaries({}, optional={"serviceName": maybe(TEXT), "ipv4": maybe(TEXT),
                                                               "port": maybe(EXTREME_NUMBERS)})),
    "remoteEndpoint": maybe(st.fixed_dictionaries({}, optional={"serviceName": maybe(TEXT)})),
    "tags": maybe(st.dictionaries(TEXT, maybe(TEXT), max_size=4)), "shared": maybe(st.booleans()),
    "annotations": maybe(st.lists(st.fixed_dictionaries({}, optional={"timestamp": maybe(EXTREME_NUMBERS),
                                                                      "value": maybe(TEXT)}), max_size=3)),
})
ANY_VALUE = st.recursive(
    st.one_of(st.builds(lambda v: {"stringValue": v}, TEXT), st.builds(lambda v: {"intValue": v}, maybe(EXTREME_NUMBERS)),
              st.builds(lambda v: {"doubleValue": v}, maybe(EXTREME_NUMBERS)), JSON),
    lambda inner: st.one_of(st.builds(lambda vs: {"arrayValue": {"values": vs}}, st.lists(inner, max_size=3)),
                            st.builds(lambda kv: {"kvlistValue": {"values": [{"key": k, "value": v} for k, v in kv]}},
                                      st.lists(st.tuples(TEXT, inner), max_size=3))), max_leaves=8)
OTLP_SPAN = st.fixed_dictionaries({}, optional={
    "traceId": IDS, "spanId": IDS, "parentSpanId": IDS, "name": maybe(TEXT), "kind": maybe(EXTREME_NUMBERS),
    "startTimeUnixNano": maybe(st.one_of(EXTREME_NUMBERS, TEXT)), "endTimeUnixNano": maybe(EXTREME_NUMBERS),
    "attributes": maybe(st.lists(st.fixed_dictionaries({"key": maybe(TEXT), "value": ANY_VALUE}), max_size=3)),
    "bogusField": JSON})
OTLP_DOCUMENT = st.one_of(
    st.builds(lambda spans: {"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}, st.lists(OTLP_SPAN, max_size=4)),
    st.builds(lambda v: {"resourceSpans": v}, nested()), JSON)


def _encode(document) -> bytes:
    try:
        return json.dumps(document).encode("utf-8", "surrogatepass")  # lone surrogates -> bad UTF-8
    except (ValueError, RecursionError):
        return b"[" * 5000


# -- properties ---------------------------------------------------------------------------------------
@FUZZ
@given(st.one_of(st.lists(ZIPKIN_SPAN, max_size=4), nested(), JSON), st.booleans())
def test_zipkin_decoder_refuses_with_its_error_only(document, as_text):
    body = _encode(document) if as_text else json.dumps(document, ensure_ascii=True).encode() \
        if json_depth(document, 900) < 900 else b"[]"
    try:
        request = zipkin_to_otlp(load_json(body, DEPTH))
    except IngestError as error:
        assert error.status == 400 and error.reason == "malformed"
        return
    request.SerializeToString()  # what the aggregator and the trace store will do
    try:
        span_keys(request)
    except IngestError as error:
        assert error.status == 400


@FUZZ
@given(OTLP_DOCUMENT, st.booleans())
@example({"resourceSpans": [{"scopeSpans": [{"spans": [{"kind": math.inf}]}]}]}, False)  # was a 500
@example({"resourceSpans": [{"scopeSpans": [{"spans": [{"\udc80": 1}]}]}]}, True)  # was a 500
@example({"resourceSpans": "\udfff\udfff"}, True)  # was a 500 (the error message itself)
def test_otlp_json_decoder_refuses_with_its_error_only(document, as_text):
    body = _encode(document) if as_text else json.dumps(document).encode() \
        if json_depth(document, 900) < 900 else b"[]"
    try:
        request = parse_otlp_json(body, ExportTraceServiceRequest, DEPTH)
    except IngestError as error:
        assert error.status == 400
        return
    assert count_spans(request) >= 0
    try:
        keys = span_keys(request)
    except IngestError:
        return
    assert keys.shape == (count_spans(request), 24)


def _trace_request(spans) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    scopes = [request.resource_spans.add().scope_spans.add() for _ in range(2)]
    for i, (trace_id, span_id, parent, name) in enumerate(spans):
        span = scopes[i % 2].spans.add(trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name)
        span.attributes.add(key="k", value={"string_value": name})
    return request


ID_BYTES = st.one_of(st.binary(min_size=0, max_size=40), st.binary(min_size=16, max_size=16),
                     st.binary(min_size=8, max_size=8), st.just(bytes(16)), st.just(bytes(8)),
                     st.just(b"\n\x10" + bytes(16) + b"\x12\x08"), st.just(b"\x12\x1c\n\x10" + b"\x01" * 16))
VALID_TRACE = st.binary(min_size=16, max_size=16).filter(any)
VALID_SPAN = st.binary(min_size=8, max_size=8).filter(any)


@FUZZ
@given(st.lists(st.tuples(st.one_of(VALID_TRACE, ID_BYTES), st.one_of(VALID_SPAN, ID_BYTES),
                          st.one_of(st.just(b""), ID_BYTES), st.text(max_size=5)), max_size=12))
def test_span_id_fast_path_agrees_with_the_exact_one(spans):
    request = _trace_request(spans)
    encoded = request.SerializeToString()
    fast = _walked(encoded)
    try:
        exact = _exact_keys(request)
    except IngestError:
        assert fast is None  # the walk never takes what the exact path refuses
        return
    assert fast is not None and np.array_equal(fast.astype("<u8").view(np.uint8), exact)
    assert np.array_equal(span_keys(request, encoded), exact)
    assert exact.shape == (len(spans), 24)


@FUZZ
@given(st.binary(max_size=2000), st.integers(min_value=0, max_value=200), st.binary(min_size=1, max_size=4))
def test_protobuf_receivers_refuse_garbage_and_flipped_bytes(noise, position, flip):
    valid = _trace_request([(b"\1" * 16, b"\2" * 8, b"", "a"), (b"\3" * 16, b"\4" * 8, b"\2" * 8, "b")])
    encoded = valid.SerializeToString()
    at = position % len(encoded)
    for body in (noise, encoded[:at] + flip + encoded[at + len(flip):], encoded[:at]):
        walked = _walked(body)   # any bytes: the compiled walk reads within them and answers
        for message_cls, count in ((ExportTraceServiceRequest, count_spans),
                                   (ExportMetricsServiceRequest, count_data_points)):
            try:
                message = message_cls.FromString(body)
            except (DecodeError, ValueError):
                continue  # the receivers answer 400 / INVALID_ARGUMENT
            assert count(message) >= 0
            if message_cls is ExportTraceServiceRequest:
                try:
                    exact = _exact_keys(message)
                except IngestError as error:
                    assert error.status == 400 and walked is None
                    exact = None
                # where the walk answers, it read what the parser read
                assert walked is None or np.array_equal(walked.astype("<u8").view(np.uint8), exact)
                if exact is not None:
                    assert np.array_equal(span_keys(message, body), exact)


@FUZZ
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=20), st.sampled_from(["gzip", "deflate"]),
       st.sampled_from(["none", "truncate", "flip", "append"]), st.integers(min_value=0, max_value=10**6))
def test_decompression_matches_python_or_refuses(chunks, encoding, damage, where):
    if encoding == "gzip":
        body = b"".join(gzip.compress(chunk) for chunk in chunks)
    else:
        body = zlib.compress(b"".join(chunks))
    expected = b"".join(chunks)
    if damage == "truncate":
        body = body[:where % len(body)]
    elif damage == "flip":
        i = where % len(body)
        body = body[:i] + bytes([body[i] ^ 0x5A]) + body[i + 1:]
    elif damage == "append":
        body += b"\x1f\x8b\x08" if encoding == "gzip" else b""
    limit = 20_000
    try:
        out = decompress_bounded(body, encoding, limit)
    except IngestError as error:
        assert error.status in (400, 413)
        if error.status == 413:
            assert len(expected) > limit or damage != "none"
        else:
            assert damage != "none"
        return
    assert len(out) <= limit
    if damage == "none":
        assert out == expected


# -- metric points ----------------------------------------------------------------------------------
U64 = st.one_of(st.integers(min_value=0, max_value=2**64 - 1), st.sampled_from([0, 1, 2**40, 2**63, 2**64 - 1]))


@st.composite
def exp_points(draw):
    counts = draw(st.lists(U64 if draw(st.booleans()) else st.integers(0, 1000), max_size=40))
    negative = draw(st.lists(st.integers(0, 1000), max_size=3))
    zero = draw(st.one_of(st.integers(0, 10), U64))
    honest = sum(counts) + sum(negative) + zero
    count = honest if draw(st.booleans()) else draw(st.one_of(U64, st.just(honest % 2**64)))
    point = metrics_pb2.ExponentialHistogramDataPoint(
        scale=draw(st.integers(-30, 30)), count=count % 2**64, zero_count=zero,
        sum=draw(st.one_of(st.floats(), EXTREME_NUMBERS.filter(lambda x: isinstance(x, float)))),
        time_unix_nano=draw(st.integers(0, 2**64 - 1)))
    point.positive.offset = draw(st.integers(-(2**31), 2**31 - 1))
    point.positive.bucket_counts.extend(counts)
    point.negative.bucket_counts.extend(negative)
    for key, value in ((sc.ATTR_GPU_ID, "0"), (sc.ATTR_SM_ID, "1"), (sc.ATTR_KERNEL_NAME, "k")):
        point.attributes.add(key=key, value={"string_value": value})
    if draw(st.booleans()):
        point.exemplars.add(as_double=draw(st.floats()), trace_id=draw(ID_BYTES), span_id=draw(ID_BYTES))
    return point


@FUZZ
@given(exp_points())
def test_exponential_histogram_validator(point):
    try:
        counts = check_exp_point(point)
    except PointRefused as refused:
        assert refused.reason in ("bad_scale", "too_many_buckets", "count_overflow", "inconsistent_count",
                                  "bad_sum", "bad_exemplar")
        return
    total = sum(point.positive.bucket_counts) + sum(point.negative.bucket_counts) + point.zero_count
    assert total == point.count <= 2**40 and math.isfinite(point.sum)
    assert counts.dtype == np.int64 and int(counts.sum()) == sum(point.positive.bucket_counts)
    try:
        hist = cta_point_histogram(point, 160)
    except PointRefused as refused:
        assert refused.reason == "out_of_range"
        return
    assert hist.count == point.count and math.isfinite(hist.sum)


@FUZZ
@given(st.lists(U64, max_size=200))
def test_exact_total_is_pythons_sum(values):
    total, largest = exact_total(np.asarray(values, dtype=np.uint64))
    assert total == sum(values) and largest == max(values, default=0)


@FUZZ
@given(nested())
def test_json_depth_counts_like_recursion(document):
    def depth(node) -> int:
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        return 0 if children is None else 1 + max((depth(c) for c in children), default=0)

    if json_depth(document, 5000) <= 500:
        assert json_depth(document, 5000) == depth(document)
    assert json_depth(document, 3) <= 4
