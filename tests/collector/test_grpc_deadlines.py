"""The gRPC port honours a call's grpc-timeout and ends connections at their maximum age.

A real collector on free ports. A raw HTTP/2 client (``bench.h2_raw``) sends HEADERS with a
short ``grpc-timeout`` and never a message (or half of one): DEADLINE_EXCEEDED in time,
counted ``deadline_exceeded``. With a maximum connection age of a fraction of a second, the
OTel SDK's gRPC exporter exports on across many GOAWAYs and every span arrives (counted);
a raw client sees the two-step GOAWAY, finishes the call it had open within the grace, and a
call still open when the grace ends is cut.
"""

from __future__ import annotations

import time

import pytest
from google.rpc import code_pb2

from bench.h2_raw import RawH2, grpc_frame
from bench.lockouts import sdk_spans
from sightline.collector.grpc_server import grpc_timeout_s
from tests.collector.servers import running_collector, trace_request

pytestmark = pytest.mark.timeout(120)
NO_ERROR, MAX_STREAM_ID = 0, 2**31 - 1


def test_grpc_timeout_values():
    assert grpc_timeout_s(b"300m") == pytest.approx(0.3)
    assert grpc_timeout_s(b"2S") == 2.0 and grpc_timeout_s(b"1H") == 3600.0 and grpc_timeout_s(b"5M") == 300.0
    assert grpc_timeout_s(b"99999999n") == pytest.approx(0.099999999)
    assert grpc_timeout_s(b"7u") == pytest.approx(7e-6)
    for bad in (b"", b"100", b"m", b"123456789m", b"1.5S", b"-1S", b"10s", b"1 m"):
        assert grpc_timeout_s(bad) is None, bad


@pytest.fixture(scope="module")
def col():
    # request_timeout_s far above the calls' own deadlines: what ends them is the deadline
    with running_collector(request_timeout_s=60.0) as running:
        yield running


def test_a_call_without_its_message_ends_at_its_deadline(col):
    before = col.rejected("otlp_grpc", "deadline_exceeded")
    conn = RawH2(col.ports.otlp_grpc)
    try:
        started = time.monotonic()
        idle = conn.open(extra=(("grpc-timeout", "300m"),))  # HEADERS, never a message
        half = conn.open(extra=(("grpc-timeout", "300m"),))
        conn.send(half, grpc_frame(b"\x0a" * 100)[:50], end_stream=False)  # half a message
        outcomes = [conn.wait(idle, 10), conn.wait(half, 10)]
        elapsed = time.monotonic() - started
        assert [o.grpc_status for o in outcomes] == [code_pb2.DEADLINE_EXCEEDED] * 2
        assert all("deadline" in o.trailers.get("grpc-message", o.headers.get("grpc-message", ""))
                   for o in outcomes)
        assert 0.25 <= elapsed < 5.0, elapsed  # at its deadline, not at the 60-s message timeout
        assert col.rejected("otlp_grpc", "deadline_exceeded") - before == 2
    finally:
        conn.close()


def test_calls_within_their_deadline_are_answered_and_bad_timeouts_refused(col):
    received, malformed = col.received("otlp_grpc"), col.rejected("otlp_grpc", "malformed")
    conn = RawH2(col.ports.otlp_grpc)
    try:
        ok = conn.call(trace_request(7, seed=41).SerializeToString(), extra=(("grpc-timeout", "20S"),))
        bad = conn.open(extra=(("grpc-timeout", "soon"),))
        assert conn.wait(ok, 10).grpc_status == code_pb2.OK
        outcome = conn.wait(bad, 10)
        assert outcome.grpc_status == code_pb2.INTERNAL and "grpc-timeout" in outcome.headers["grpc-message"]
        col.idle()
        assert col.received("otlp_grpc") - received == 7
        assert col.rejected("otlp_grpc", "malformed") - malformed == 1
    finally:
        conn.close()


@pytest.fixture(scope="module")
def aging():
    with running_collector(max_connection_age_s=0.4, max_connection_age_grace_s=1.5,
                           request_timeout_s=60.0, keepalive_timeout_s=60.0) as running:
        yield running


def test_the_sdk_exporter_exports_on_across_connection_age_goaways(aging):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    server = aging.collector._grpc.server
    seen: set[int] = set()
    exporter = OTLPSpanExporter(endpoint=aging.grpc_target, insecure=True, timeout=10)
    received = aging.received("otlp_grpc")
    results = []
    try:
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # ~7 connection ages
            results.append(exporter.export(sdk_spans(10)))
            seen.update(id(c) for c in list(server.connections))
            time.sleep(0.05)
    finally:
        exporter.shutdown()
    aging.idle()
    assert results and all(r == SpanExportResult.SUCCESS for r in results), results
    assert aging.received("otlp_grpc") - received == 10 * len(results)  # every span, once
    assert len(seen) >= 3, len(seen)  # the exporter was made to reconnect, again and again


def test_a_call_open_at_the_age_goaway_finishes_within_the_grace(aging):
    received = aging.received("otlp_grpc")
    conn = RawH2(aging.ports.otlp_grpc, past_goaway=True)
    try:
        stream = conn.open()  # open before the connection's age: it must still be served
        deadline = time.monotonic() + 10
        while len(conn.goaways) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        # first "no new streams" (2^31-1), then, after our PING answer, the last stream taken
        assert conn.goaways[:2] == [(NO_ERROR, MAX_STREAM_ID), (NO_ERROR, stream)], conn.goaways
        conn.send(stream, grpc_frame(trace_request(5, seed=42).SerializeToString()))
        assert conn.wait(stream, 10).grpc_status == code_pb2.OK
        assert conn.wait_closed(10)  # nothing open: the connection ends
        aging.idle()
        assert aging.received("otlp_grpc") - received == 5
    finally:
        conn.close()


def test_a_call_still_open_when_the_grace_ends_is_cut(aging):
    before = aging.rejected("otlp_grpc", "timeout")
    conn = RawH2(aging.ports.otlp_grpc, past_goaway=True)
    try:
        started = time.monotonic()
        conn.open()  # never sends its message
        assert conn.wait_closed(15)
        elapsed = time.monotonic() - started
        assert 0.4 * 0.9 + 1.5 <= elapsed < 10.0, elapsed  # age, then the whole grace
        assert aging.rejected("otlp_grpc", "timeout") - before == 1
    finally:
        conn.close()
