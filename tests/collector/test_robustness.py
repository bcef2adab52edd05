"""Bad input, overload and shutdown: the right refusal, and nothing accepted is lost.

One collector (real receivers, real aggregator behind a gate the test can close) takes
malformed, oversized, compressed-bomb, wrongly typed, unauthenticated and over-capacity
requests; every refusal is checked in the protocol's own shape and counted by reason in
/metrics, exactly. Afterwards the same collector still serves and counts real SDK
exports exactly. Two more tests run ``sightline collector run`` as a process (with torch made
unimportable, as on a collector-only machine): SIGTERM
under load (acknowledged == aggregated, from the collector's exit summary) and peak
memory under a sustained overload (VmHWM under a bound while 429s are flowing).
"""

from __future__ import annotations

import gzip
import http.client
import json
import signal
import socket
import threading
import time
import zlib

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from sightline.instrumentation import semconv as sc
from tests.collector.servers import (GatedAggregator, RunningCollector, collector_process, emit_spans,
                                     fresh_copies, post, running_collector, scrape, sdk_tracer, trace_request)

TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PB = {"Content-Type": "application/x-protobuf", **AUTH}
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
KiB, MiB = 1024, 1024 * 1024


@pytest.fixture(scope="module")
def col(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    sink = GatedAggregator()
    running = RunningCollector(sink=sink, auth_token_file=token_file, max_request_bytes=512 * KiB,
                               max_decompressed_bytes=1 * MiB, queue_max_items=1000)
    sink.inner = running.collector.aggregator
    running.sink = sink
    yield running
    running.stop()


def _rejected(col, receiver: str, reason: str) -> float:
    return col.metrics()[(sc.COLLECTOR_REJECTED_TOTAL + "_total", (("reason", reason), ("receiver", receiver)))]


def _grpc_export(col, body: bytes, metadata=(("authorization", f"Bearer {TOKEN}"),)):
    with grpc.insecure_channel(col.grpc_target) as channel:
        call = channel.unary_unary(TRACE_EXPORT)
        try:
            call(body, metadata=metadata, timeout=10)
            return grpc.StatusCode.OK, None
        except grpc.RpcError as error:
            return error.code(), error


def _rpc_status(body: bytes) -> status_pb2.Status:
    return status_pb2.Status.FromString(body)


def test_malformed_is_400_and_invalid_argument(col):
    before = {r: _rejected(col, r, "malformed") for r in ("otlp_http", "otlp_grpc", "zipkin")}
    status, headers, body = post(col.http_url + "/v1/traces", b"\xff\xff\xff\xff", PB)
    assert status == 400 and _rpc_status(body).code == code_pb2.INVALID_ARGUMENT
    for bad in (b"{not json", b"[1, 2]", b'{"resourceSpans": [{"bogusField": 1}]}',
                b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}'):
        status, headers, body = post(col.http_url + "/v1/traces", bad, {"Content-Type": "application/json", **AUTH})
        assert status == 400, bad
        assert json.loads(body)["code"] == code_pb2.INVALID_ARGUMENT
    status, _, body = post(col.http_url + "/v1/traces", gzip.compress(b"x")[:-4], {**PB, "Content-Encoding": "gzip"})
    assert status == 400  # truncated gzip
    code, _ = _grpc_export(col, b"\xff\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    for bad in (b"{}", b"[{\"id\": \"a2fb4a1d1a96d312\"}]",
                b"[{\"traceId\": \"463ac35c9f6413ad\", \"id\": \"xyz\"}]",
                b"[{\"traceId\": \"463ac35c9f6413ad\", \"id\": \"a2fb4a1d1a96d312\", \"kind\": \"SIDEWAYS\"}]"):
        status, _, body = post(col.zipkin_url, bad, {"Content-Type": "application/json", **AUTH})
        assert status == 400, (bad, body)
    assert _rejected(col, "otlp_http", "malformed") - before["otlp_http"] == 6
    assert _rejected(col, "otlp_grpc", "malformed") - before["otlp_grpc"] == 1
    assert _rejected(col, "zipkin", "malformed") - before["zipkin"] == 4


def test_oversized_is_413_and_resource_exhausted(col):
    before = _rejected(col, "otlp_http", "too_large")
    big = trace_request(4000).SerializeToString()  # ~0.9 MB > 512 KiB
    assert len(big) > 512 * KiB
    status, _, body = post(col.http_url + "/v1/traces", big, PB)
    assert status == 413 and _rpc_status(body).code == code_pb2.RESOURCE_EXHAUSTED
    # chunked (no Content-Length): refused while reading
    conn = http.client.HTTPConnection("127.0.0.1", col.ports.otlp_http, timeout=10)
    chunks = (big[i:i + 64 * KiB] for i in range(0, len(big), 64 * KiB))
    conn.request("POST", "/v1/traces", body=chunks, headers=PB, encode_chunked=True)
    assert conn.getresponse().status == 413
    conn.close()
    status, _, _ = post(col.zipkin_url, b"[" + b" " * (600 * KiB) + b"]", {"Content-Type": "application/json", **AUTH})
    assert status == 413
    code, _ = _grpc_export(col, trace_request(6000).SerializeToString())  # > 1 MiB decompressed limit
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # gzip on the wire: small compressed, over the limit once inflated (gRPC core checks that)
    inflated = trace_request(1).SerializeToString() + b"\x0a\x00" * (700 * KiB)  # 716,800 empty ResourceSpans
    with grpc.insecure_channel(col.grpc_target, compression=grpc.Compression.Gzip) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            channel.unary_unary(TRACE_EXPORT)(inflated, timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _rejected(col, "otlp_http", "too_large") - before == 2


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_gzip_bomb_is_413_with_memory_bounded(col):
    # One gzip member of 64 MiB of zeros, and 256 one-MiB members back to back (a valid
    # multi-member gzip body): 64 and 256 MiB inflated, both under the 512 KiB wire limit.
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(MiB)
    single = b"".join(compressor.compress(zeros) for _ in range(64)) + compressor.flush()
    multi = gzip.compress(zeros) * 256
    assert len(single) < 512 * KiB and len(multi) < 512 * KiB
    del zeros
    before = _rejected(col, "otlp_http", "too_large")
    with open("/proc/self/clear_refs", "w") as refs:  # resets VmHWM to the current RSS
        refs.write("5")
    baseline = _rss_kib()
    for bomb in (single, multi):
        status, _, body = post(col.http_url + "/v1/traces", bomb, {**PB, "Content-Encoding": "gzip"})
        assert status == 413 and "decompressed" in _rpc_status(body).message
        status, _, _ = post(col.zipkin_url, bomb, {"Content-Type": "application/json",
                                                   "Content-Encoding": "gzip", **AUTH})
        assert status == 413
    peak_growth_mib = (_vm_hwm_kib() - baseline) / 1024
    assert peak_growth_mib < 32, f"peak RSS grew {peak_growth_mib:.0f} MiB for 64 and 256 MiB bombs"
    assert _rejected(col, "otlp_http", "too_large") - before == 2
    # multi-member gzip within the limit is fine and every member counts
    two = gzip.compress(trace_request(3, seed=7).SerializeToString()) + \
        gzip.compress(trace_request(2, seed=8).SerializeToString())
    before_spans = col.received("otlp_http")
    assert post(col.http_url + "/v1/traces", two, {**PB, "Content-Encoding": "gzip"})[0] == 200
    assert col.received("otlp_http") - before_spans == 5


def test_wrong_content_type_or_encoding_is_415(col):
    before = _rejected(col, "otlp_http", "unsupported_media_type")
    body = trace_request(3).SerializeToString()
    assert post(col.http_url + "/v1/traces", body, {**AUTH, "Content-Type": "text/plain"})[0] == 415
    assert post(col.http_url + "/v1/traces", body, {**PB, "Content-Encoding": "br"})[0] == 415
    assert post(col.zipkin_url, b"[]", {**AUTH, "Content-Type": "application/x-protobuf"})[0] == 415
    assert _rejected(col, "otlp_http", "unsupported_media_type") - before == 2


def test_wrong_auth_is_401_and_unauthenticated(col):
    before = _rejected(col, "otlp_http", "unauthenticated")
    body = trace_request(3).SerializeToString()
    status, headers, _ = post(col.http_url + "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    status, _, _ = post(col.http_url + "/v1/traces", body,
                        {"Content-Type": "application/x-protobuf", "Authorization": "Bearer wrong"})
    assert status == 401
    assert post(col.zipkin_url, b"[]", {"Content-Type": "application/json"})[0] == 401
    code, _ = _grpc_export(col, body, metadata=(("authorization", "Bearer wrong"),))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = _grpc_export(col, body, metadata=())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert _rejected(col, "otlp_http", "unauthenticated") - before == 2
    assert _rejected(col, "otlp_grpc", "unauthenticated") >= 2


def test_over_capacity_is_429_with_retry_after_then_drains(col):
    pipeline = col.collector.pipeline
    col.idle()
    acked_before = pipeline.summary.spans_acknowledged
    col.sink.gate.clear()
    try:
        assert post(col.http_url + "/v1/traces", trace_request(600, seed=1).SerializeToString(), PB)[0] == 200
        deadline = time.monotonic() + 10
        while pipeline.depth and time.monotonic() < deadline:  # the worker took it and waits
            time.sleep(0.01)
        assert pipeline.depth == 0
        assert post(col.http_url + "/v1/traces", trace_request(600, seed=2).SerializeToString(), PB)[0] == 200
        assert pipeline.depth == 600
        status, headers, body = post(col.http_url + "/v1/traces", trace_request(600, seed=3).SerializeToString(), PB)
        assert status == 429 and headers["Retry-After"] == "1"
        rpc_status = _rpc_status(body)
        info = error_details_pb2.RetryInfo()
        assert rpc_status.details[0].Unpack(info) and info.retry_delay.seconds == 1
        code, error = _grpc_export(col, trace_request(600, seed=4).SerializeToString())
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailer = dict(error.trailing_metadata())["grpc-status-details-bin"]
        info = error_details_pb2.RetryInfo()
        assert status_pb2.Status.FromString(trailer).details[0].Unpack(info) and info.retry_delay.seconds == 1
        zipkin = json.dumps([{"traceId": "463ac35c9f6413ad", "id": f"{i + 1:016x}"} for i in range(500)]).encode()
        status, headers, _ = post(col.zipkin_url, zipkin, {"Content-Type": "application/json", **AUTH})
        assert status == 429 and headers["Retry-After"] == "1"
        assert _rejected(col, "otlp_http", "over_capacity") == 1
        assert _rejected(col, "otlp_grpc", "over_capacity") == 1
        assert _rejected(col, "zipkin", "over_capacity") == 1
    finally:
        col.sink.gate.set()
    col.idle()
    assert pipeline.summary.spans_acknowledged - acked_before == 1200
    assert pipeline.summary.spans_processed == pipeline.summary.spans_acknowledged


def test_still_serves_and_counts_exactly_after_abuse(col):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    before_http, before_grpc = col.received("otlp_http"), col.received("otlp_grpc")
    emit_spans(sdk_tracer(HttpExporter(endpoint=col.http_url + "/v1/traces", headers=AUTH)), 400)
    emit_spans(sdk_tracer(GrpcExporter(endpoint=col.grpc_target, insecure=True,
                                       headers={"authorization": f"Bearer {TOKEN}"})), 300)
    assert col.received("otlp_http") - before_http == 400
    assert col.received("otlp_grpc") - before_grpc == 300
    col.idle()
    summary = col.collector.pipeline.summary
    assert summary.spans_processed == summary.spans_acknowledged and summary.dropped == 0
    assert col.collector.aggregator.spans_seen == summary.spans_processed
    with urllib_open(col.query_url + "/readyz") as response:
        assert response.status == 200


def urllib_open(url):
    import urllib.request

    return urllib.request.urlopen(url, timeout=5)


# -- as a process ------------------------------------------------------------------------


def _load(port_http: int, grpc_port: int, stop: threading.Event, acked: list, errors: list,
          n_spans: int, use_grpc: bool, seed: int) -> None:
    """Sends until the collector refuses; ``acked`` gets the spans it acknowledged."""
    bodies = fresh_copies(trace_request(n_spans, seed=seed))
    body = next(bodies)  # the same body again only as a retry of a refused one
    total = 0
    try:
        if use_grpc:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                call = channel.unary_unary(TRACE_EXPORT)
                while True:
                    try:
                        call(body, timeout=10)
                    except grpc.RpcError as error:
                        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not stop.is_set():
                            continue
                        break
                    total += n_spans
                    body = next(bodies)
        else:
            conn = http.client.HTTPConnection("127.0.0.1", port_http, timeout=10)
            while True:
                try:
                    conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
                    response = conn.getresponse()
                    response.read()
                except (OSError, http.client.HTTPException):
                    break
                if response.status == 200:
                    total += n_spans
                    body = next(bodies)
                elif response.status == 429 and not stop.is_set():
                    continue
                else:
                    break
    except Exception as exc:  # surfaced by the test
        errors.append(repr(exc))
    acked.append(total)


def test_sigterm_under_load_loses_nothing_acknowledged(tmp_path):
    process, ports, summary_path = collector_process(tmp_path)
    stop = threading.Event()
    acked: list[int] = []
    errors: list[str] = []
    threads = [threading.Thread(target=_load, args=(ports["http"], ports["grpc"], stop, acked, errors,
                                                    200, i % 2 == 1, i)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        metric = (sc.COLLECTOR_SPANS_RECEIVED_TOTAL + "_total", (("receiver", "otlp_http"),))
        while scrape(f"http://127.0.0.1:{ports['query']}/metrics")[metric] < 2000:
            assert time.monotonic() < deadline, "no load reached the collector"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        stop.set()
        for thread in threads:
            thread.join(30)
        assert process.wait(60) == 0, process.stdout.read().decode()
    finally:
        stop.set()
        if process.poll() is None:
            process.kill()
    assert not errors, errors
    summary = json.loads(summary_path.read_text())
    client_acked = sum(acked)
    assert client_acked > 0
    assert summary["spans_acknowledged"] == client_acked
    assert summary["spans_processed"] == client_acked
    assert summary["spans_aggregated"] == client_acked
    assert summary["dropped"] == 0 and summary["drained_cleanly"] is True


def _process_status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def _refused(metrics) -> float:
    return sum(v for (name, labels), v in metrics.items()
               if name == sc.COLLECTOR_REJECTED_TOTAL + "_total" and ("reason", "over_capacity") in labels)


def test_memory_bounded_under_sustained_overload(tmp_path):
    # Overloaded on purpose, whatever the aggregator's speed: the queue holds one 5,000-span
    # request (a batch is admitted only into an empty queue), so of 4 senders that each
    # parse-and-send faster than the aggregator takes 5,000 spans, most are refused.
    process, ports, summary_path = collector_process(
        tmp_path, "--queue-max-bytes", str(4 * MiB), "--queue-max-items", "5000")
    try:
        baseline_mib = _process_status_kib(process.pid, "VmRSS") / 1024
        stop = threading.Event()
        acked: list[int] = []
        errors: list[str] = []
        # 5,000-span (~1.1 MB) requests from 4 senders, HTTP and gRPC.
        threads = [threading.Thread(target=_load, args=(ports["http"], ports["grpc"], stop, acked, errors,
                                                        5000, i % 2 == 1, 100 + i)) for i in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30   # a loaded CI machine may take longer to overload it
        time.sleep(3.0)
        while True:
            metrics = scrape(f"http://127.0.0.1:{ports['query']}/metrics")
            if _refused(metrics) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        peak_mib = _process_status_kib(process.pid, "VmHWM") / 1024
        stop.set()
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert _refused(metrics) > 0, "the load did not overload the collector; the bound was not exercised"
    summary = json.loads(summary_path.read_text())
    assert summary["spans_processed"] == summary["spans_acknowledged"] == sum(acked)
    # The bound from configuration: queue <= one 1.1 MB request (parsed + encoded), in-flight
    # bodies (4 senders x 1.1 MB, raw + parsed), and the aggregator's own bounded trace
    # store (200,000 spans at ~1 KiB by default, the store's bound; 3 s of load fills a fraction).
    assert peak_mib - baseline_mib < 350, f"peak RSS {peak_mib:.0f} MiB from a {baseline_mib:.0f} MiB baseline"


def _partial_request(port: int, path: str) -> socket.socket:
    """Headers promising 10,000 bytes, then only 10: a stalled sender holding a slot."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                 f"Content-Length: 10000\r\n\r\n".encode() + b"\0" * 10)
    return sock


def test_stalled_senders_hold_no_slot_forever():
    # Slow bodies hold no decode slot: with 2 slots and 2 (then 64) stalled senders, a
    # fast exporter is still answered 200 at once; each stalled one gets 408 after
    # request_timeout_s and is counted.
    with running_collector(max_inflight_requests=2, request_timeout_s=1.0) as col:
        stalled = [_partial_request(col.ports.otlp_http, "/v1/traces") for _ in range(2)]
        time.sleep(0.2)  # both are inside the handler, reading
        bodies = fresh_copies(trace_request(5))
        started = time.monotonic()
        status, _, _ = post(col.http_url + "/v1/traces", next(bodies), {"Content-Type": "application/x-protobuf"})
        assert status == 200 and time.monotonic() - started < 0.9
        stalled += [_partial_request(col.ports.otlp_http, "/v1/traces") for _ in range(62)]
        time.sleep(0.2)
        for _ in range(3):
            assert post(col.http_url + "/v1/traces", next(bodies), {"Content-Type": "application/x-protobuf"})[0] == 200
        for sock in stalled:  # after request_timeout_s: 408
            assert sock.recv(200).startswith(b"HTTP/1.1 408")
            sock.close()
        assert col.received("otlp_http") == 20
        assert col.rejected("otlp_http", "timeout") == 64
        assert col.rejected("otlp_http", "over_capacity") == 0
