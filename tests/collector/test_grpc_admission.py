"""The gRPC port's admission against raw HTTP/2 frames, beside the OTel SDK's gRPC exporter.

A real collector on free ports takes what a gRPC library never sends (``bench.h2_raw``):
calls with HEADERS and no message, calls whose answer is never read, streams past the
per-connection and per-peer caps, HEADERS + RST_STREAM floods, silent or non-HTTP/2
connections, a compressed flag without an encoding, an unknown encoding, a message over
the limit. Each gets its status (or RST_STREAM / GOAWAY code) and is counted with its own
reason in /metrics, exactly; the SDK exporter's exports meanwhile succeed within 1 s.
"""

from __future__ import annotations

import socket
import time

import pytest
from google.rpc import code_pb2

from bench.h2_raw import RawH2, grpc_frame
from bench.lockouts import Ports, hold_attack, sdk_spans
from sightline.instrumentation import semconv as sc
from tests.collector.servers import running_collector

pytestmark = pytest.mark.timeout(120)
ENHANCE_YOUR_CALM, REFUSED_STREAM, CANCEL = 0xB, 0x7, 0x8


@pytest.fixture(scope="module")
def col():
    with running_collector(request_timeout_s=1.5, response_timeout_s=1.0, handshake_timeout_s=0.5) as running:
        yield running


def _rejected(col, reason: str) -> float:
    return col.metrics()[(sc.COLLECTOR_REJECTED_TOTAL + "_total", (("reason", reason), ("receiver", "otlp_grpc")))]


def _counts(col, *reasons: str) -> dict[str, float]:
    return {reason: _rejected(col, reason) for reason in reasons}


def _exports_within(col, rounds: int = 3, limit_s: float = 1.0) -> None:
    """The SDK's gRPC exporter, connecting now, gets every export through within ``limit_s``."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporter = OTLPSpanExporter(endpoint=col.grpc_target, insecure=True, timeout=5)
    received = col.received("otlp_grpc")
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            result = exporter.export(sdk_spans(10))
            elapsed = time.perf_counter() - started
            assert result == SpanExportResult.SUCCESS and elapsed < limit_s, (result, elapsed)
    finally:
        exporter.shutdown()
    col.idle()
    assert col.received("otlp_grpc") - received == 10 * rounds


def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_calls_without_a_message_hold_no_slot_and_end_at_their_deadline(col):
    before = _counts(col, "timeout")
    conns = [RawH2(col.ports.otlp_grpc) for _ in range(8)]
    streams = [(conn, conn.open()) for conn in conns for _ in range(8)]  # 64 idle calls
    try:
        _exports_within(col)
        outcomes = [conn.wait(stream_id, 5) for conn, stream_id in streams]
        assert [o.grpc_status for o in outcomes] == [code_pb2.DEADLINE_EXCEEDED] * 64
        assert _rejected(col, "timeout") - before["timeout"] == 64
    finally:
        for conn in conns:
            conn.close()


def test_answers_never_read_hold_no_slot_and_are_reset(col):
    conns = [RawH2(col.ports.otlp_grpc, window=0) for _ in range(8)]  # SETTINGS_INITIAL_WINDOW_SIZE=0
    received = col.received("otlp_grpc")
    streams = [(conn, conn.call(b"")) for conn in conns for _ in range(25)]  # 200 calls, answers unread
    try:
        _exports_within(col)
        outcomes = [conn.wait(stream_id, 5) for conn, stream_id in streams]
        assert [o.reset_code for o in outcomes] == [CANCEL] * 200  # answer abandoned after response_timeout_s
        assert all(o.headers.get(":status") == "200" for o in outcomes)  # the call itself was taken
    finally:
        for conn in conns:
            conn.close()
    col.idle()
    assert col.received("otlp_grpc") == received + 30  # the exporter's spans; the 200 calls were empty


def test_streams_past_the_connection_cap_are_refused_and_counted(col):
    before = _counts(col, "too_many_streams", "cancelled")
    conn = RawH2(col.ports.otlp_grpc, unlimited=True)
    try:
        streams = [conn.open() for _ in range(33)]
        refused = conn.wait(streams[-1], 5)
        assert refused.reset_code == REFUSED_STREAM
        assert [conn.streams[s].ended for s in streams[:32]] == [False] * 32
        assert _rejected(col, "too_many_streams") - before["too_many_streams"] == 1
        for stream_id in streams[:32]:
            conn.reset(stream_id)
        _wait(lambda: _rejected(col, "cancelled") - before["cancelled"] == 32)
    finally:
        conn.close()


def test_calls_past_the_peer_cap_are_refused_while_other_peers_export(col):
    before = _counts(col, "too_many_streams", "timeout")
    conns = [RawH2(col.ports.otlp_grpc, source="127.0.0.2") for _ in range(9)]
    try:
        streams = [(conn, conn.open()) for conn in conns for _ in range(30)]  # 270 from one address
        _wait(lambda: _rejected(col, "too_many_streams") - before["too_many_streams"] == 14)
        _exports_within(col)  # 127.0.0.1: its own share
        statuses = sorted(conn.wait(s, 5).grpc_status for conn, s in streams)
        assert statuses == [code_pb2.DEADLINE_EXCEEDED] * 256 + [code_pb2.RESOURCE_EXHAUSTED] * 14
        assert _rejected(col, "timeout") - before["timeout"] == 256
    finally:
        for conn in conns:
            conn.close()


def test_a_rapid_reset_flood_is_cut_off_while_exporters_go_on(col):
    before = _counts(col, "rapid_reset", "cancelled")
    ports = Ports(col.ports.otlp_grpc, col.ports.otlp_http, col.ports.zipkin, col.ports.http)
    with hold_attack("rapid_reset", ports, settle_s=1.0) as attack:  # its own process
        _exports_within(col, rounds=5)
    cut_off = attack.summary["connections"] - 1  # the last one ended with the attack
    moved = {k: v - before[k] for k, v in _counts(col, "rapid_reset", "cancelled").items()}
    assert cut_off >= 1 and moved["rapid_reset"] in (cut_off, cut_off + 1)  # the last: maybe just then
    # each connection got the budget's burst (64) and what refilled while it flooded
    assert 64 * cut_off <= moved["cancelled"] <= attack.summary["resets_sent"]


def test_one_connection_reset_flood_gets_goaway_enhance_your_calm(col):
    before = _counts(col, "rapid_reset", "cancelled")
    conn = RawH2(col.ports.otlp_grpc)
    sent = 0
    # bounded in time, not in count: a loaded machine's collector reads behind the socket's
    # buffers, so the client can have sent 10,000 before the 65th reached it
    deadline = time.monotonic() + 30
    while conn.open_and_reset():
        sent += 1
        assert time.monotonic() < deadline
    assert conn.wait_closed(5) and conn.goaway_code == ENHANCE_YOUR_CALM
    conn.close()
    moved = {k: v - before[k] for k, v in _counts(col, "rapid_reset", "cancelled").items()}
    assert moved["rapid_reset"] == 1 and 65 <= moved["cancelled"] <= sent


def test_a_silent_or_foreign_connection_is_closed_and_counted(col):
    before = _counts(col, "timeout", "protocol_error")
    silent = socket.create_connection(("127.0.0.1", col.ports.otlp_grpc), timeout=5)
    http1 = socket.create_connection(("127.0.0.1", col.ports.otlp_grpc), timeout=5)
    http1.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    started = time.monotonic()
    for sock in (silent, http1):
        try:
            while sock.recv(4096):  # our SETTINGS, then the close
                pass
        except ConnectionResetError:
            pass
        sock.close()
    assert time.monotonic() - started < 3
    assert {k: v - before[k] for k, v in _counts(col, "timeout", "protocol_error").items()} == \
        {"timeout": 1, "protocol_error": 1}


@pytest.mark.parametrize("what,extra,frame,status,reason", [
    ("no message", (), None, code_pb2.INVALID_ARGUMENT, "no_message"),
    ("compressed flag without encoding", (), grpc_frame(b"\x0a\x00", compressed=1), code_pb2.INTERNAL,
     "malformed"),
    ("unknown encoding", (("grpc-encoding", "snappy"),), grpc_frame(b""), code_pb2.UNIMPLEMENTED,
     "unsupported_media_type"),
    ("over the limit, told by its prefix", (), b"\x00" + (64 << 20).to_bytes(4, "big"), code_pb2.RESOURCE_EXHAUSTED,
     "too_large"),
])
def test_each_refusal_is_counted_by_its_reason(col, what, extra, frame, status, reason):
    before = _counts(col, reason, "too_large")
    conn = RawH2(col.ports.otlp_grpc)
    try:
        stream_id = conn.open(end_stream=frame is None, extra=extra)
        if frame is not None:
            conn.send(stream_id, frame, end_stream=len(frame) > 5)
        outcome = conn.wait(stream_id, 5)
        assert outcome.grpc_status == status, (what, outcome.trailers, outcome.headers)
    finally:
        conn.close()
    moved = {k: v - before[k] for k, v in _counts(col, reason, "too_large").items()}
    assert moved[reason] == 1 and (reason == "too_large" or moved["too_large"] == 0), what


def test_a_call_reset_mid_message_is_counted_cancelled(col):
    before = _rejected(col, "cancelled")
    conn = RawH2(col.ports.otlp_grpc)
    try:
        stream_id = conn.open()
        conn.send(stream_id, grpc_frame(b"\x0a" * 1000)[:600], end_stream=False)
        conn.reset(stream_id)
        _wait(lambda: _rejected(col, "cancelled") - before == 1)
    finally:
        conn.close()
    _exports_within(col, rounds=1)


def test_grpc_connections_share_the_descriptor_budget():
    with running_collector(max_connections=8, header_timeout_s=10) as col:
        held = [socket.create_connection(("127.0.0.1", col.ports.otlp_grpc), timeout=5) for _ in range(8)]
        try:
            extra = socket.create_connection(("127.0.0.1", col.ports.otlp_grpc), timeout=5)
            extra.settimeout(5)
            assert extra.recv(4096) == b""  # the ninth, silent: refused after a short probation
            extra.close()
            assert col.rejected("otlp_grpc", "too_many_connections") == 1
            time.sleep(1.1)  # the eight have been silent for longer than the grace period
            _exports_within(col, rounds=2)  # one of them is taken back for the exporter
            assert col.rejected("otlp_grpc", "too_many_connections") == 2
        finally:
            for sock in held:
                sock.close()
