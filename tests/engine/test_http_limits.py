"""The engine server's connection limits (engine/http_limits.py) against real servers: raw
sockets play the slow or idle clients, the official ``openai`` SDK the client that must get
through. Deadlines are checked on a server with 0.5 s limits; the cap, its per-peer share and
the eviction of waiting connections on one with 8 slots and long deadlines (loopback sources
127.0.0.1, .2 and .3 are three peers); the last test runs ``sightline engine serve`` under
``RLIMIT_NOFILE`` 256 and holds 300 half-sent requests while a completion goes through.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request

import httpx2
import openai
import pytest

from sightline.engine.config import EngineConfig
from sightline.engine.http_limits import CLOSE_REASONS, HttpLimits
from sightline.engine.api_server import serve_in_thread
from sightline.instrumentation import semconv as sc
from tests.support import free_port, wait_for_http

MODEL = "tiny"
HALF = b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: appli"


def _serve(limits: HttpLimits):
    return serve_in_thread(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.02, port=0,
                                        shutdown_timeout_s=2, http=limits))


@pytest.fixture(scope="module")
def quick():
    """Deadlines of 0.5 s."""
    running = _serve(HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=0.5))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def small():
    """8 connections, 4 per client address; deadlines far away."""
    running = _serve(HttpLimits(header_timeout_s=60, body_timeout_s=60, keepalive_timeout_s=60, max_connections=8))
    yield running
    running.stop()


def _client(url: str, source: str = "127.0.0.1") -> openai.OpenAI:
    transport = httpx2.HTTPTransport(local_address=source)
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20,
                         http_client=httpx2.Client(transport=transport))


def _complete(url: str, source: str = "127.0.0.1") -> int:
    client = _client(url, source)
    try:
        return client.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens
    finally:
        client.close()


def _connect(port: int, data: bytes = HALF, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    if data:
        sock.sendall(data)
    return sock


def _until_eof(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``timeout_s``: inf), and when it closed.
    A reset counts as closed: a connection closed before the server read what it had sent
    (evicted or refused at once) is reset by the kernel, its reply possibly lost."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, float("inf")
    except ConnectionResetError:
        pass
    return data, time.monotonic() - started


def _was_closed(sock: socket.socket) -> bool:
    return _until_eof(sock, 0.2)[1] != float("inf")


def _closed(url: str) -> dict[str, float]:
    """sightline_engine_http_connections_closed_total by reason (read with Connection: close)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    name = sc.ENGINE_HTTP_CONNECTIONS_CLOSED_TOTAL + "_total{"
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            out[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _busy(port: int, source: str) -> socket.socket:
    """A connection whose request is being served: headers in, body awaited."""
    sock = _connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\nExpect: 100-continue\r\n\r\n", source)
    sock.settimeout(10)
    assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")  # routed: the middleware comes next
    time.sleep(0.05)
    return sock


# ---- deadlines -----------------------------------------------------------------------------------
def test_every_requests_headers_have_a_deadline(quick):
    before = _closed(quick.url)
    first = _connect(quick.port)
    reply, closed_after = _until_eof(first, 10)
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout") and 0.4 < closed_after < 3
    # a kept-alive connection's second request gets the same deadline (not only the first's)
    conn = http.client.HTTPConnection("127.0.0.1", quick.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read() and conn.sock is not None
    conn.sock.sendall(HALF)
    reply, closed_after = _until_eof(conn.sock, 10)
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout") and 0.4 < closed_after < 3
    after = _closed(quick.url)
    assert after["header_timeout"] == before["header_timeout"] + 2
    assert set(after) == set(CLOSE_REASONS)  # every reason at 0 or more from the start


def test_idle_keep_alive_has_a_deadline(quick):
    before = _closed(quick.url)["idle_timeout"]
    conn = http.client.HTTPConnection("127.0.0.1", quick.port, timeout=10)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["status"] == "ok"
    reply, closed_after = _until_eof(conn.sock, 10)
    assert reply == b"" and 0.4 < closed_after < 3
    assert _closed(quick.url)["idle_timeout"] == before + 1


def test_a_body_has_a_deadline_and_a_slow_one_gets_an_openai_408(quick):
    sock = _connect(quick.port, b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json"
                                b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")
    reply, closed_after = _until_eof(sock, 10)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and 0.4 < closed_after < 4
    error = json.loads(body)["error"]
    assert error == {"message": "POST /v1/completions: Request Timeout", "type": "invalid_request_error",
                     "param": None, "code": None}
    assert _complete(quick.url) == 3  # serving on


# ---- the cap and its per-peer share ----------------------------------------------------------------
def test_half_sent_requests_give_way_to_a_real_one(small):
    before = _closed(small.url)
    held = [_connect(small.port) for _ in range(12)]  # 4 per peer: each past the 4th evicts the oldest
    assert _complete(small.url) == 3  # its connection evicts one more, then serves
    evicted = [s for s in held if _was_closed(s)]
    assert len(evicted) == 9 and held[-3:] == [s for s in held if s not in evicted]
    # the SDK hung up after its request: the /metrics reader finds a free slot
    assert _closed(small.url)["evicted"] == before["evicted"] + 9
    for sock in held:
        sock.close()


def test_a_peer_keeps_to_its_share_and_busy_slots_are_never_taken(small):
    before = _closed(small.url)
    busy = [_busy(small.port, "127.0.0.1") for _ in range(4)]
    refused = _connect(small.port, b"", "127.0.0.1")  # a 5th from the same address
    reply, _ = _until_eof(refused, 5)
    assert reply.startswith(b"HTTP/1.1 503") and b"4 per client address" in reply  # it sent nothing: no reset
    assert _complete(small.url, "127.0.0.2") == 3  # another address still gets through
    busy += [_busy(small.port, "127.0.0.2") for _ in range(4)]  # all 8 slots serving
    reply, _ = _until_eof(_connect(small.port, b"", "127.0.0.3"), 5)
    assert reply.startswith(b"HTTP/1.1 503") and b"all 8 connections" in reply
    for sock in busy:
        sock.close()
    full_again, deadline = 0, time.monotonic() + 10
    while True:   # until the server has seen the closes; each refusal before that is counted
        try:
            assert _complete(small.url, "127.0.0.3") == 3
            break
        except openai.APIStatusError as refused:
            if refused.status_code != 503 or time.monotonic() > deadline:
                raise
            full_again += 1
            time.sleep(0.1)
    after = _closed(small.url)
    assert after["refused_peer_share"] == before["refused_peer_share"] + 1
    assert after["refused_full"] == before["refused_full"] + 1 + full_again


# ---- a client gone mid-response ----------------------------------------------------------------
def test_a_client_gone_mid_response_ends_its_request_quietly(caplog):
    """A write that meets the closing transport before connection_lost does raised
    ClientConnectionResetError out of the handler: aiohttp logged a traceback and a 500 per
    such client (an engine whose log went to an unread pipe then blocked on it)."""
    import asyncio

    from aiohttp import web

    from sightline.engine.http_limits import LimitedSite, track_requests

    ended: list[str] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        while (transport := request.transport) is not None and not transport.is_closing():
            await asyncio.sleep(0.005)  # until the client has gone: the next write fails
        try:
            await response.write(b"data: late\n\n")
        except ConnectionResetError:
            ended.append("reset")
            raise
        return response

    async def main() -> None:
        app = web.Application(middlewares=[track_requests])
        app.router.add_get("/stream", stream)
        runner = web.AppRunner(app)  # handler_cancellation off: the write, not a cancel, notices
        await runner.setup()
        site = LimitedSite(runner, "127.0.0.1", 0, HttpLimits())
        await site.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()
        for _ in range(200):
            if ended:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await runner.cleanup()

    with caplog.at_level("DEBUG", logger="aiohttp.server"):
        asyncio.run(main())
    assert ended == ["reset"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]


# ---- the CLI engine under its own slowloris ------------------------------------------------------
def test_engine_serves_a_completion_while_300_half_sent_requests_are_held_under_256_fds():
    """Before: no header deadline and no cap, accept() failed with EMFILE after ~250
    connections and the engine answered nothing while they were held."""
    port = free_port()

    def limit_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc = subprocess.Popen(
        [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", MODEL, "--device", "cpu",
         "--port", str(port), "--kv-cache-gib", "0.02", "--trace-level", "off", "--log-level", "warning"],
        env=dict(os.environ, SIGHTLINE_TRACE_LEVEL="off"), preexec_fn=limit_fds,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    held: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url + "/health", timeout_s=120, process=proc)
        held = [_connect(port) for _ in range(300)]
        time.sleep(0.5)
        started = time.monotonic()
        assert _complete(url) == 3
        assert time.monotonic() - started < 5
        started = time.monotonic()
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            assert json.loads(response.read())["status"] == "ok"
        assert time.monotonic() - started < 1
        # one address holds at most half the cap, which is under 256 - 64 reserved - 32 in accepts
        assert sum(map(_was_closed, held)) >= 300 - 80 and proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
    assert "Too many open files" not in output, output[-2000:]
