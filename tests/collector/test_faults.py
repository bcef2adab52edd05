"""Faults with real sockets, bounded in time: what each gets, and that the receivers and
/healthz keep answering through it.

- slow headers (a connection that never finishes its request headers): 408 after
  ``header_timeout_s``, counted ``timeout``;
- more connections than ``max_connections``: 503 with Retry-After, counted
  ``too_many_connections``; the query port keeps its own room;
- a collector process at a low ``ulimit -n`` flooded with sockets: /healthz answers, the
  log stays small (no traceback per refused accept), and ingest works again afterwards;
- clients disconnecting mid-body, in parallel: counted ``client_disconnected``;
- 500 parallel clients per receiver (OTLP/HTTP, Zipkin, OTLP/gRPC): every span
  acknowledged is counted once and aggregated.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp
import grpc
import pytest

from sightline.instrumentation import semconv as sc
from tests.collector.servers import fresh_copies, post, running_collector, scrape, trace_request
from tests.support import free_port, wait_for_collector

PB = {"Content-Type": "application/x-protobuf"}
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
pytestmark = pytest.mark.timeout(180)


def _healthz(url: str, timeout_s: float = 5.0) -> int:
    with urllib.request.urlopen(url + "/healthz", timeout=timeout_s) as response:
        return response.status


def _read_status(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def test_slow_headers_get_408_and_are_counted():
    with running_collector(header_timeout_s=0.5) as col:
        socks = []
        for port in (col.ports.otlp_http, col.ports.zipkin):
            for i in range(10):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                if i % 2:  # half send a partial request line, half nothing at all
                    sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Ty")
                socks.append(sock)
        assert _healthz(col.query_url) == 200
        started = time.monotonic()
        statuses = [_read_status(sock) for sock in socks]
        assert time.monotonic() - started < 5
        assert statuses == [b"HTTP/1.1 408 Request Timeout"] * 20
        for sock in socks:
            assert sock.recv(4096) == b"" or True  # closed by the collector
            sock.close()
        assert col.rejected("otlp_http", "timeout") == 10 and col.rejected("zipkin", "timeout") == 10
        # A connection that finishes its headers in time is not cut, however slow its body.
        assert post(col.http_url + "/v1/traces", trace_request(2).SerializeToString(), PB)[0] == 200


def test_connections_past_the_cap_get_503_and_the_query_port_stays_up():
    with running_collector(max_connections=16, header_timeout_s=30) as col:
        held = [socket.create_connection(("127.0.0.1", col.ports.otlp_http), timeout=10) for _ in range(16)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", col.ports.otlp_http), timeout=10)
        extra.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        response = extra.recv(4096)
        assert response.startswith(b"HTTP/1.1 503 Service Unavailable") and b"Retry-After: 1" in response
        extra.close()
        assert col.rejected("otlp_http", "too_many_connections") == 1
        assert _healthz(col.query_url) == 200  # its own cap, not the ingest port's
        assert post(col.zipkin_url, b"[]", {"Content-Type": "application/json"})[0] == 202
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while True:  # the collector notices the closes
            status = post(col.http_url + "/v1/traces", trace_request(2).SerializeToString(), PB)[0]
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200


def _count_answers(socks: list[socket.socket], prefix: bytes, wait_s: float) -> int:
    """How many of ``socks`` received a response starting with ``prefix`` within ``wait_s``."""
    pending = {sock.fileno(): sock for sock in socks}
    answered = 0
    deadline = time.monotonic() + wait_s
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while pending and time.monotonic() < deadline:
            for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                sock = key.fileobj
                selector.unregister(sock)
                pending.pop(sock.fileno(), None)
                try:
                    answered += sock.recv(len(prefix)).startswith(prefix)
                except OSError:
                    pass
    return answered


def _limit_fds(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    return apply


def test_fd_exhaustion_under_a_low_ulimit(tmp_path):
    ports = {name: free_port() for name in ("grpc", "http", "zipkin", "query")}
    log_path = tmp_path / "collector.log"
    command = [sys.executable, "-m", "sightline.deploy.cli", "collector", "run",
               "--otlp-grpc", f"127.0.0.1:{ports['grpc']}", "--otlp-http", f"127.0.0.1:{ports['http']}",
               "--zipkin", f"127.0.0.1:{ports['zipkin']}", "--http", f"127.0.0.1:{ports['query']}",
               "--header-timeout-s", "20", "--log-level", "WARNING"]
    env = {k: v for k, v in os.environ.items() if k != "SIGHTLINE_COLLECTOR_TOKEN"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=_limit_fds(256))
    query = f"http://127.0.0.1:{ports['query']}"
    socks: list[socket.socket] = []
    try:
        wait_for_collector(query, process)
        # 3 x 300 sockets against 256 descriptors: the caps (32 per listener) refuse most with
        # 503; the rest wait in the kernel's backlog while accept() is at the limit.
        for port in (ports["http"], ports["zipkin"], ports["http"]):
            for _ in range(300):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    break
        for _ in range(20):  # /healthz answers throughout
            assert _healthz(query, 10) == 200
            time.sleep(0.1)
        held_back = _count_answers(socks, b"HTTP/1.1 503", wait_s=3.0)
        assert held_back > 100, f"only {held_back} connections were answered 503"
        for sock in socks:
            sock.close()
        socks.clear()
        deadline = time.monotonic() + 30
        bodies = fresh_copies(trace_request(3, seed=11))
        body = next(bodies)
        while True:  # ingest works again once the flood is gone
            try:
                status = post(f"http://127.0.0.1:{ports['http']}/v1/traces", body, PB, timeout=5)[0]
            except OSError:
                status = None
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 200
        metrics = scrape(query + "/metrics")
        refused = metrics[(sc.COLLECTOR_REJECTED_TOTAL + "_total",
                           (("reason", "too_many_connections"), ("receiver", "otlp_http")))]
        assert refused > 0
    finally:
        for sock in socks:
            sock.close()
        process.terminate()
        process.wait(60)
    size = log_path.stat().st_size
    assert size < 64 * 1024, f"log grew to {size} bytes:\n{log_path.read_text()[-2000:]}"


def test_parallel_mid_body_disconnects_are_counted():
    with running_collector() as col:
        async def disconnect() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", col.ports.otlp_http)
            writer.write(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                         b"Content-Length: 50000\r\n\r\n" + b"\0" * 1000)
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()

        async def all_of_them() -> None:
            await asyncio.gather(*(disconnect() for _ in range(50)))

        asyncio.run(all_of_them())
        deadline = time.monotonic() + 10
        while col.rejected("otlp_http", "client_disconnected") < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert col.rejected("otlp_http", "client_disconnected") == 50
        assert _healthz(col.query_url) == 200


def test_500_parallel_clients_per_receiver_are_counted_exactly():
    clients = 500
    with running_collector(max_connections=2048) as col:
        bodies = fresh_copies(trace_request(4, seed=31))
        protobuf = [next(bodies) for _ in range(2 * clients)]
        zipkin = [json.dumps([{"traceId": f"{c + 1:032x}", "id": f"{c * 4 + k + 1:016x}", "name": "z"}
                              for k in range(4)]).encode() for c in range(clients)]

        async def until_accepted(send) -> None:
            deadline = time.monotonic() + 60
            while True:
                status = await send()
                if status in (200, 202, grpc.StatusCode.OK):
                    return
                assert status in (429, 503, grpc.StatusCode.RESOURCE_EXHAUSTED), status
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)

        async def load() -> None:
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector) as session:
                async def http(url, body, headers):
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        return response.status

                channels = [grpc.aio.insecure_channel(col.grpc_target) for _ in range(8)]
                try:
                    async def rpc(i, body):
                        try:
                            await channels[i % 8].unary_unary(TRACE_EXPORT)(body, timeout=30)
                            return grpc.StatusCode.OK
                        except grpc.aio.AioRpcError as error:
                            return error.code()

                    jobs = []
                    for c in range(clients):
                        jobs.append(until_accepted(lambda b=protobuf[c]: http(col.http_url + "/v1/traces", b, PB)))
                        jobs.append(until_accepted(lambda b=zipkin[c]: http(
                            col.zipkin_url, b, {"Content-Type": "application/json"})))
                        jobs.append(until_accepted(lambda c=c: rpc(c, protobuf[clients + c])))
                    await asyncio.gather(*jobs)
                    assert _healthz(col.query_url) == 200
                finally:
                    for channel in channels:
                        await channel.close()

        asyncio.run(load())
        col.idle()
        for receiver in ("otlp_http", "zipkin", "otlp_grpc"):
            assert col.received(receiver) == 4 * clients, receiver
        assert col.dropped("duplicate") == 0
        summary = col.collector.pipeline.summary
        assert summary.spans_acknowledged == summary.spans_processed == 12 * clients
        assert col.collector.aggregator.spans_seen == 12 * clients
