"""The HTTP listeners' admission with real sockets: no client keeps the others out.

A real collector on free ports, its listeners capped small: kept-alive connections, silent
ones and another peer's incomplete ones are taken back for a client that talks; every
request's headers have a deadline, not only the first's; an idle kept-alive connection is
closed; a 401 closes its connection, and an address that keeps failing authentication is
refused at accept for a while. Exports go through the OTel SDK's HTTP exporter, Zipkin
and ``/healthz`` on new connections; every refusal reason is on /metrics at 0 from start.
"""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from bench.lockouts import sdk_spans
from sightline.collector.self_metrics import REJECT_REASONS, RECEIVERS
from sightline.instrumentation import semconv as sc
from tests.collector.servers import post, running_collector, scrape

pytestmark = pytest.mark.timeout(120)
TOKEN = "admission-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _raw(method: str, path: str, body: bytes = b"", token: str | None = None,
         content_type: str = "application/x-protobuf") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: collector\r\nContent-Type: {content_type}\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    sock.settimeout(5)
    return sock


def _response(sock: socket.socket) -> bytes:
    """One HTTP response's head (and what came with it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65_536)
        if not chunk:
            break
        data += chunk
    return data


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (what it sends is read)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65_536):
            pass
        return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def _healthz_s(col) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(col.query_url + "/healthz", timeout=5) as response:
        assert response.status == 200
    return time.perf_counter() - started


def _http_exports_within(col, rounds: int = 3, limit_s: float = 1.0) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporter = OTLPSpanExporter(endpoint=col.http_url + "/v1/traces", headers=AUTH, timeout=5)
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            result = exporter.export(sdk_spans(10))
            elapsed = time.perf_counter() - started
            assert result == SpanExportResult.SUCCESS and elapsed < limit_s, (result, elapsed)
    finally:
        exporter.shutdown()


@pytest.fixture()
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return path


def test_kept_alive_connections_are_taken_back_for_new_clients(token_file):
    with running_collector(max_connections=16, auth_token_file=token_file) as col:
        requests = {col.ports.otlp_http: _raw("POST", "/v1/traces", b"", TOKEN),
                    col.ports.zipkin: _raw("POST", "/api/v2/spans", b"[]", TOKEN, "application/json"),
                    col.ports.http: _raw("GET", "/healthz")}
        held = []
        for port, request in requests.items():  # every slot of every HTTP listener, kept alive
            for _ in range(16):
                sock = _connect(port)
                sock.sendall(request)
                assert _response(sock).split(b"\r\n", 1)[0] in (b"HTTP/1.1 200 OK", b"HTTP/1.1 202 Accepted")
                held.append(sock)
        try:
            assert _healthz_s(col) < 0.1
            _http_exports_within(col)
            started = time.perf_counter()
            status, _, _ = post(col.zipkin_url, b"[]", {"Content-Type": "application/json", **AUTH})
            assert status == 202 and time.perf_counter() - started < 1.0
            assert sum(_closed_within(sock, 0.05) for sock in held) >= 3  # taken back, one per newcomer
        finally:
            for sock in held:
                sock.close()
        for receiver in ("otlp_http", "zipkin"):  # an idle connection taken back is no refusal
            assert col.rejected(receiver, "too_many_connections") == 0


@pytest.mark.parametrize("listener,request_bytes", [
    ("otlp_http", _raw("POST", "/v1/traces", b"\x0a\x00")),
    ("zipkin", _raw("POST", "/api/v2/spans", b"[]", content_type="application/json")),
    ("http", _raw("GET", "/api/v1/heatmap?gpu=0")),
])
def test_a_401_closes_its_connection(token_file, listener, request_bytes):
    with running_collector(auth_token_file=token_file, query_auth=True) as col:
        sock = _connect(getattr(col.ports, listener))
        sock.sendall(request_bytes)
        head = _response(sock)
        assert head.startswith(b"HTTP/1.1 401 Unauthorized") and b"Connection: close" in head
        assert _closed_within(sock, 2.0)
        sock.close()


def test_every_requests_headers_have_a_deadline():
    with running_collector(header_timeout_s=0.5) as col:
        sock = _connect(col.ports.otlp_http)
        sock.sendall(_raw("POST", "/v1/traces", b""))
        assert _response(sock).startswith(b"HTTP/1.1 200 OK")
        time.sleep(0.3)
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: collector\r\nContent-Ty")  # the next, never finished
        started = time.monotonic()
        assert _response(sock).startswith(b"HTTP/1.1 408 Request Timeout")
        assert 0.4 < time.monotonic() - started < 2.0
        sock.close()
        assert col.rejected("otlp_http", "timeout") == 1


def test_an_idle_kept_alive_connection_is_closed():
    with running_collector(keepalive_timeout_s=0.5) as col:
        sock = _connect(col.ports.zipkin)
        sock.sendall(_raw("POST", "/api/v2/spans", b"[]", content_type="application/json"))
        assert _response(sock).startswith(b"HTTP/1.1 202")
        started = time.monotonic()
        assert _closed_within(sock, 3.0) and time.monotonic() - started < 1.5
        sock.close()
        assert col.rejected("zipkin", "timeout") == 0  # an idle close is no refusal


def test_one_peer_cannot_keep_another_out():
    with running_collector(max_connections=8, header_timeout_s=30) as col:
        hog = []
        for _ in range(8):  # another address, every slot, each mid-headers
            sock = _connect(col.ports.otlp_http, source="127.0.0.2")
            sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: collector\r\n")
            hog.append(sock)
        time.sleep(0.2)
        try:
            started = time.perf_counter()
            status, _, _ = post(col.http_url + "/v1/traces", b"", {"Content-Type": "application/x-protobuf"})
            assert status == 200 and time.perf_counter() - started < 1.0
            answers = [_response(sock) for sock in hog if _closed_within_peek(sock)]
            assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 503 Service Unavailable"]
        finally:
            for sock in hog:
                sock.close()
        assert col.rejected("otlp_http", "too_many_connections") == 1


def _closed_within_peek(sock: socket.socket, seconds: float = 0.3) -> bool:
    sock.settimeout(seconds)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except socket.timeout:
        return False


def test_silent_connections_give_way_after_the_grace_period():
    with running_collector(max_connections=8, header_timeout_s=30) as col:
        silent = [_connect(col.ports.otlp_http) for _ in range(8)]
        time.sleep(1.5)   # the 1 s grace counts from the server's accept, which may come later
        try:
            status, _, _ = post(col.http_url + "/v1/traces", b"", {"Content-Type": "application/x-protobuf"})
            assert status == 200
            answered = [sock for sock in silent if _closed_within_peek(sock)]
            assert len(answered) == 1 and _response(answered[0]).startswith(b"HTTP/1.1 503")
        finally:
            for sock in silent:
                sock.close()
        assert col.rejected("otlp_http", "too_many_connections") == 1


def test_an_address_failing_authentication_is_refused_at_accept_for_a_while(token_file):
    with running_collector(auth_token_file=token_file) as col:
        for _ in range(33):
            sock = _connect(col.ports.otlp_http, source="127.0.0.2")
            sock.sendall(_raw("POST", "/v1/traces", b""))
            assert _response(sock).startswith(b"HTTP/1.1 401")
            sock.close()
        blocked = _connect(col.ports.otlp_http, source="127.0.0.2")
        blocked.sendall(_raw("POST", "/v1/traces", b"", TOKEN))  # even with the token, for now
        head = _response(blocked)
        assert head.startswith(b"HTTP/1.1 401") and b"too many requests without a valid bearer token" in head
        blocked.close()
        assert col.rejected("otlp_http", "unauthenticated") == 34
        status, _, _ = post(col.http_url + "/v1/traces", b"", {"Content-Type": "application/x-protobuf", **AUTH})
        assert status == 200  # another address is not affected
        time.sleep(2.1)
        again = _connect(col.ports.otlp_http, source="127.0.0.2")
        again.sendall(_raw("POST", "/v1/traces", b"", TOKEN))
        assert _response(again).startswith(b"HTTP/1.1 200")
        again.close()


def test_every_refusal_reason_is_on_metrics_at_zero_from_start():
    with running_collector() as col:
        metrics = scrape(col.query_url + "/metrics")
    expected = {(receiver, reason) for receiver in RECEIVERS for reason in REJECT_REASONS}
    present = {(dict(labels)["receiver"], dict(labels)["reason"]): value for (name, labels), value in metrics.items()
               if name == sc.COLLECTOR_REJECTED_TOTAL + "_total"}
    assert set(present) == expected and set(present.values()) == {0.0}
    for reason in ("no_message", "cancelled", "too_many_streams", "rapid_reset", "protocol_error"):
        assert ("otlp_grpc", reason) in present
