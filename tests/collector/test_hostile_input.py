"""Hostile input against a real collector: each known attack gets its protocol's 4xx (or
gRPC status), is counted with its reason, and leaves every later export counted exactly.

One collector on free ports (real receivers, real aggregator) takes: gzip bodies of many
members, Zipkin numeric edge values and lone surrogates, JSON nested thousands deep,
corrupt exponential-histogram points, ids of the wrong length, metrics the aggregator does
not keep, mid-body disconnects, an internal error, retried (duplicate) spans, and bearer
tokens with the scheme in any case. Counts are read where operators read them: /metrics.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import socket
import threading
import time
import urllib.request

import grpc
import pytest
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from sightline.collector.admission import Intake
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import otlp_cta_point, otlp_metrics
from tests.collector.servers import GatedAggregator, fresh_copies, post, running_collector, trace_request

TOKEN = "hostile-test-token"
PB = {"Content-Type": "application/x-protobuf", "Authorization": f"bearer {TOKEN}"}
JSON = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


@pytest.fixture(scope="module")
def col(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    with running_collector(auth_token_file=token_file, max_request_bytes=4 * 1024 * 1024) as running:
        yield running


@pytest.fixture()
def fresh():
    return fresh_copies(trace_request(4, seed=77))


def _delta(col, fn, *keys):
    """Runs ``fn`` and returns how much each (kind, receiver/reason...) counter moved."""
    def read():
        m = col.metrics()
        out = []
        for key in keys:
            if key[0] == "rejected":
                out.append(m[(sc.COLLECTOR_REJECTED_TOTAL + "_total", (("reason", key[2]), ("receiver", key[1])))])
            elif key[0] == "received":
                out.append(m[(sc.COLLECTOR_SPANS_RECEIVED_TOTAL + "_total", (("receiver", key[1]),))])
            elif key[0] == "points":
                out.append(m[(sc.COLLECTOR_DATAPOINTS_RECEIVED_TOTAL + "_total", (("receiver", key[1]),))])
            elif key[0] == "dropped":
                out.append(m[(sc.COLLECTOR_DROPPED_TOTAL + "_total", (("reason", key[1]),))])
            elif key[0] == "aggregator_dropped":
                out.append(m.get((sc.COLLECTOR_AGGREGATOR_DROPPED_TOTAL + "_total", (("reason", key[1]),)), 0.0))
        return out

    before = read()
    result = fn()
    col.idle()
    return result, [after - b for after, b in zip(read(), before)]


def _grpc(col, path: str, body: bytes, compression=None):
    with grpc.insecure_channel(col.grpc_target, compression=compression) as channel:
        try:
            channel.unary_unary(path)(body, timeout=10, metadata=(("authorization", f"BEARER {TOKEN}"),))
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            return error.code()


def _still_counts_exactly(col, fresh) -> None:
    status, _, _ = post(col.http_url + "/v1/traces", next(fresh), PB)
    assert status == 200


# -- 1: gzip with many members ----------------------------------------------------------------
def test_many_gzip_members_are_linear_and_off_the_event_loop(col):
    body = gzip.compress(b"") * 160_000  # 3.2 MB of empty members: 33 s and a frozen loop before
    slowest = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            started = time.monotonic()
            with urllib.request.urlopen(col.query_url + "/healthz", timeout=10) as response:
                assert response.status == 200
            slowest.append(time.monotonic() - started)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        started = time.monotonic()
        (status, _, _), moved = _delta(col, lambda: post(col.http_url + "/v1/traces", body,
                                                         {**PB, "Content-Encoding": "gzip"}, timeout=60),
                                       ("received", "otlp_http"))
        took = time.monotonic() - started
    finally:
        done.set()
        prober.join(30)
    assert status == 200 and moved == [0]  # an empty request, acknowledged
    assert took < 8, f"160,000 gzip members took {took:.1f} s"
    assert slowest and max(slowest) < 2.0, f"/healthz stalled {max(slowest):.1f} s during decompression"
    # Many members inflating past the limit: 413, counted.
    bomb = gzip.compress(b"\0" * 4096) * 20_000  # ~80 MB inflated from ~700 KB
    (status, _, body), moved = _delta(col, lambda: post(col.http_url + "/v1/traces", bomb,
                                                        {**PB, "Content-Encoding": "gzip"}),
                                      ("rejected", "otlp_http", "too_large"))
    assert status == 413 and moved == [1]
    assert status_pb2.Status.FromString(body).code == code_pb2.RESOURCE_EXHAUSTED


# -- 2: Zipkin numeric edge values and lone surrogates ------------------------------------------
ZIPKIN_EDGES = [
    '{"timestamp": 1e30}', '{"timestamp": NaN}', '{"timestamp": Infinity}', '{"duration": -Infinity}',
    '{"timestamp": 1180591620717411303424}',  # 2**70
    '{"timestamp": 32503680000000000}',  # year 3000 in µs: past int64 nanoseconds
    '{"timestamp": 9223372036854775, "duration": 10}',  # in range alone, past it together
    '{"duration": 1e300}', '{"name": "\\udc80"}', '{"tags": {"k": "a\\ud800"}}',
    '{"tags": {"\\udfff": "v"}}', '{"localEndpoint": {"serviceName": "\\udc80"}}',
    '{"annotations": [{"timestamp": 1, "value": "\\udc80"}]}', '{"annotations": [{"timestamp": NaN, "value": "x"}]}',
    '{"tags": {"k": {"nested": 1}}}', '{"name": ["not", "a", "string"]}', '{"kind": ["SERVER"]}',
    '{"tags": {"k": NaN}}', '{"localEndpoint": {"serviceName": "s", "port": 18446744073709551616}}',
    '{"remoteEndpoint": {"port": 70000}}', '{"localEndpoint": {"port": "80"}}',
]


@pytest.mark.parametrize("extra", ZIPKIN_EDGES)
def test_zipkin_edge_values_are_400(col, extra):
    span = '{"traceId": "0123456789abcdef", "id": "0123456789abcdef", ' + extra[1:]
    (status, _, body), moved = _delta(col, lambda: post(col.zipkin_url, f"[{span}]".encode(), JSON),
                                      ("rejected", "zipkin", "malformed"), ("received", "zipkin"))
    assert status == 400 and body.startswith(b"span 0: "), body
    assert moved == [1, 0]


def test_zipkin_values_at_the_edges_are_taken(col):
    spans = [{"traceId": "0123456789abcdef", "id": f"{i + 1:016x}", "timestamp": t, "duration": d, "name": n}
             for i, (t, d, n) in enumerate([(0, 0, ""), (9223372036854774, 1, "\U0001f600 ok"), (1.5, 2.5, "µs")])]
    (status, _, _), moved = _delta(col, lambda: post(col.zipkin_url, json.dumps(spans).encode(), JSON),
                                   ("received", "zipkin"))
    assert status == 202 and moved == [3]


# -- 3: deeply nested JSON -------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [5000, 60_000, 70])  # 60,000: under the JSON value cap
def test_deeply_nested_json_is_400(col, depth):
    nested = "[" * depth + "]" * depth
    otlp = f'{{"resourceSpans": {nested}}}'.encode()
    (status, _, body), moved = _delta(col, lambda: post(col.http_url + "/v1/traces", otlp, JSON),
                                      ("rejected", "otlp_http", "malformed"))
    assert status == 400 and moved == [1]
    assert json.loads(body)["code"] == code_pb2.INVALID_ARGUMENT and "nested deeper" in json.loads(body)["message"]
    zipkin = f'[{{"traceId": "0123456789abcdef", "id": "0123456789abcdef", "tags": {{"k": {nested}}}}}]'.encode()
    (status, _, body), moved = _delta(col, lambda: post(col.zipkin_url, zipkin, JSON),
                                      ("rejected", "zipkin", "malformed"))
    assert status == 400 and moved == [1]


def test_nested_any_values_within_the_limit_are_taken(col):
    value = {"stringValue": "leaf"}
    for _ in range(8):  # kvlist inside kvlist: 8 levels of AnyValue, ~40 JSON levels
        value = {"kvlistValue": {"values": [{"key": "k", "value": value}]}}
    document = {"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "5b8efff798038103d269b633813fc60d", "spanId": "eee19b7ec3c1b176", "name": "x",
        "attributes": [{"key": "deep", "value": value}]}]}]}]}
    (status, _, _), moved = _delta(col, lambda: post(col.http_url + "/v1/traces", json.dumps(document).encode(),
                                                     JSON), ("received", "otlp_http"))
    assert status == 200 and moved == [1]


# -- 4: corrupt exponential-histogram points --------------------------------------------------------
def test_corrupt_exponential_histogram_points_are_refused(col):
    now = time.time()
    wraps = otlp_cta_point("0", "5", "hostile_kernel", [1e-5], now)
    del wraps.positive.bucket_counts[:]
    wraps.positive.bucket_counts.extend([2**63, 2**63])  # int64 sum wraps to 0
    wraps.count = 0
    nan_sum = otlp_cta_point("0", "5", "hostile_kernel", [1e-5, 2e-5], now)
    nan_sum.sum = math.nan
    inf_sum = otlp_cta_point("0", "5", "hostile_kernel", [1e-5], now)
    inf_sum.sum = math.inf
    huge = otlp_cta_point("0", "5", "hostile_kernel", [1e-5], now)
    huge.positive.bucket_counts[-1] += 2**41
    huge.count += 2**41
    mismatch = otlp_cta_point("0", "5", "hostile_kernel", [1e-5, 3e-5], now)
    mismatch.count = 3
    bad_exemplar = otlp_cta_point("0", "5", "hostile_kernel", [1e-5], now, exemplar=(1e-5, b"\1" * 3, b"\2" * 8))
    good = otlp_cta_point("0", "5", "hostile_kernel", [1e-5, 2e-5, 4e-5], now)
    request = otlp_metrics([wraps, nan_sum, inf_sum, huge, mismatch, bad_exemplar, good])
    reasons = ("count_overflow", "bad_sum", "inconsistent_count", "bad_exemplar")
    (status, _, _), moved = _delta(
        col, lambda: post(col.http_url + "/v1/metrics", request.SerializeToString(), PB),
        ("points", "otlp_http"), *(("aggregator_dropped", r) for r in reasons))
    assert status == 200
    assert moved == [7, 2, 2, 1, 1]  # 7 acknowledged = 1 taken + 6 refused, by reason
    series = [k for k in col.collector.aggregator.kernels() if k["kernel"] == "hostile_kernel"]
    assert [{k: s[k] for k in ("gpu", "kernel", "sms", "ctas", "source")} for s in series] == [
        {"gpu": "0", "kernel": "hostile_kernel", "sms": 1, "ctas": 3, "source": "sm_probe"}]
    families = col.metrics()
    sums = [v for (name, labels), v in families.items()
            if name == sc.COLLECTOR_GPU_CTA_DURATION_SECONDS + "_sum" and ("kernel", "hostile_kernel") in labels]
    assert sums and all(math.isfinite(v) and v > 0 for v in sums)


# -- 5: ids of the wrong length ------------------------------------------------------------------------
def _with_ids(trace_id: bytes, span_id: bytes) -> bytes:
    request = trace_request(3, seed=91)
    span = request.resource_spans[0].scope_spans[0].spans[1]
    span.trace_id, span.span_id = trace_id, span_id
    return request.SerializeToString()


BAD_IDS = [(b"\1" * 3, b"\2" * 8), (b"\1" * 40, b"\2" * 8), (b"\1" * 16, b""), (b"\1" * 16, b"\2" * 9),
           (bytes(16), b"\2" * 8), (b"\1" * 16, bytes(8)), (b"", b"\2" * 8)]


@pytest.mark.parametrize("trace_id,span_id", BAD_IDS)
def test_otlp_ids_of_the_wrong_length_are_refused(col, trace_id, span_id):
    body = _with_ids(trace_id, span_id)
    (status, _, response), moved = _delta(col, lambda: post(col.http_url + "/v1/traces", body, PB),
                                          ("rejected", "otlp_http", "malformed"), ("received", "otlp_http"))
    assert status == 400 and moved == [1, 0]
    assert "span 1:" in status_pb2.Status.FromString(response).message
    code, moved = _delta(col, lambda: _grpc(col, TRACE_EXPORT, body), ("rejected", "otlp_grpc", "malformed"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and moved == [1]


@pytest.mark.parametrize("trace_id,span_id", [
    ("01 23 45 67 89ab", "0123456789abcdef"), ("0123456789abcde", "0123456789abcdef"),
    ("0123456789abcdef", "0123456789abcdef0"), ("0123456789abcdef", "0x23456789abcdef"),
    ("0123456789abcdef0123456789abcde", "0123456789abcdef"), ("0123456789abcdef", "+123456789abcdef"),
    ("0000000000000000", "0123456789abcdef"), ("0123456789abcdef", "")])
def test_zipkin_ids_of_the_wrong_form_are_400(col, trace_id, span_id):
    body = json.dumps([{"traceId": trace_id, "id": span_id}]).encode()
    (status, _, _), moved = _delta(col, lambda: post(col.zipkin_url, body, JSON),
                                   ("rejected", "zipkin", "malformed"), ("received", "zipkin"))
    assert status == 400 and moved == [1, 0]


def test_otlp_json_ids_with_spaces_are_400(col):
    document = {"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "5b8efff7 98038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "x"}]}]}]}
    (status, _, _), moved = _delta(col, lambda: post(col.http_url + "/v1/traces", json.dumps(document).encode(),
                                                     JSON), ("rejected", "otlp_http", "malformed"))
    assert status == 400 and moved == [1]


# -- 8: counting gaps -----------------------------------------------------------------------------------
def test_metrics_the_aggregator_does_not_keep_are_counted_per_point(col):
    request = ExportMetricsServiceRequest()
    scope = request.resource_metrics.add().scope_metrics.add()
    gauge = scope.metrics.add(name=sc.METRIC_CTA_DURATION)  # the right name, an unsupported type
    for i in range(1000):
        gauge.gauge.data_points.add(as_double=float(i), time_unix_nano=1)
    unknown = scope.metrics.add(name="http.server.request.duration")  # as in OTLP's example metrics.json
    for i in range(7):
        unknown.sum.data_points.add(as_int=i, time_unix_nano=1)
    (status, _, _), moved = _delta(
        col, lambda: post(col.http_url + "/v1/metrics", request.SerializeToString(), PB),
        ("points", "otlp_http"), ("aggregator_dropped", "unsupported_metric_type"),
        ("aggregator_dropped", "unknown_metric"))
    assert status == 200 and moved == [1007, 1000, 7]


def test_grpc_size_refusals_are_counted(col):
    big = trace_request(1, seed=5).SerializeToString() + b"\x0a\x00" * (17 * 1024 * 1024)  # > 32 MiB
    code, moved = _delta(col, lambda: _grpc(col, TRACE_EXPORT, big), ("rejected", "otlp_grpc", "too_large"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and moved == [1]


def test_mid_body_disconnects_are_counted_without_tracebacks(col, caplog, fresh):
    def disconnect() -> None:
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", col.ports.otlp_http), timeout=5) as sock:
                sock.sendall(("POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                              f"Authorization: Bearer {TOKEN}\r\nContent-Length: 100000\r\n\r\n").encode()
                             + b"\0" * 5000)
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while col.rejected("otlp_http", "client_disconnected") < before + 5 and time.monotonic() < deadline:
            time.sleep(0.05)

    before = col.rejected("otlp_http", "client_disconnected")
    with caplog.at_level(logging.WARNING):
        _, moved = _delta(col, disconnect, ("rejected", "otlp_http", "client_disconnected"))
    assert moved == [5]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    _still_counts_exactly(col, fresh)


def test_an_internal_error_is_a_counted_500_logged_once(col, caplog, monkeypatch, fresh):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated aggregator-side bug")

    monkeypatch.setattr(Intake, "accept", broken)
    with caplog.at_level(logging.ERROR):
        results, moved = _delta(col, lambda: [post(col.http_url + "/v1/traces", next(fresh), PB) for _ in range(3)],
                                ("rejected", "otlp_http", "internal_error"))
        code, grpc_moved = _delta(col, lambda: _grpc(col, TRACE_EXPORT, next(fresh)),
                                  ("rejected", "otlp_grpc", "internal_error"))
    monkeypatch.undo()
    assert [status for status, _, _ in results] == [500, 500, 500] and moved == [3]
    assert status_pb2.Status.FromString(results[0][2]).code == code_pb2.INTERNAL
    assert code == grpc.StatusCode.INTERNAL and grpc_moved == [1]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 2, caplog.text  # once per receiver and kind, then rate-limited
    _still_counts_exactly(col, fresh)


# -- 11: auth -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("header,status", [(f"bearer {TOKEN}", 200), (f"BEARER   {TOKEN}", 200),
                                           (f"Bearer {TOKEN}", 200), (f"Basic {TOKEN}", 401),
                                           (f"Bearer {TOKEN}x", 401), (TOKEN, 401), ("bearer", 401)])
def test_bearer_scheme_is_case_insensitive(col, fresh, header, status):
    headers = {"Content-Type": "application/x-protobuf", "Authorization": header}
    assert post(col.http_url + "/v1/traces", next(fresh), headers)[0] == status


def test_query_api_takes_an_optional_read_token(tmp_path):
    read_token = tmp_path / "read"
    read_token.write_text("reader-secret")
    with running_collector(query_token_file=read_token) as running:
        def get(path, token=None):
            request = urllib.request.Request(running.query_url + path)
            if token:
                request.add_header("Authorization", f"bearer {token}")
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status
            except urllib.error.HTTPError as error:
                return error.code

        assert get("/api/v1/kernels") == 401 and get("/api/v1/traces/" + "ab" * 16, "wrong") == 401
        assert get("/api/v1/kernels", "reader-secret") == 200
        assert get("/api/v1/traces/" + "ab" * 16, "reader-secret") == 404  # authorized, no such trace
        assert get("/metrics") == 200 and get("/healthz") == 200 and get("/readyz") == 200
    ingest_token = tmp_path / "ingest"
    ingest_token.write_text("ingest-secret")
    with running_collector(query_auth=True, auth_token_file=ingest_token) as running:
        request = urllib.request.Request(running.query_url + "/api/v1/kernels",
                                         headers={"Authorization": "Bearer ingest-secret"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
    with pytest.raises(ValueError, match="query_auth is on but there is no token"):
        running_collector(query_auth=True).__enter__()


# -- 12: duplicates ----------------------------------------------------------------------------------------
def test_retried_spans_are_acknowledged_once_counted_as_duplicates(col):
    request = trace_request(10, seed=4242)
    body = request.SerializeToString()
    aggregator = col.collector.aggregator

    def send_twice_then_overlap():
        first = post(col.http_url + "/v1/traces", body, PB)[0]
        again = _grpc(col, TRACE_EXPORT, body)  # the same spans by another receiver: still a retry
        overlap = trace_request(12, seed=4242)  # its first 10 spans are those again
        third = post(col.http_url + "/v1/traces", overlap.SerializeToString(), PB)[0]
        return first, again, third

    seen = aggregator.spans_seen
    (first, again, third), moved = _delta(col, send_twice_then_overlap, ("received", "otlp_http"),
                                          ("received", "otlp_grpc"), ("dropped", "duplicate"))
    assert (first, again, third) == (200, grpc.StatusCode.OK, 200)
    assert moved == [22, 10, 20]  # 32 received, 20 of them repeats
    assert aggregator.spans_seen - seen == 12
    zipkin = json.dumps([{"traceId": "00000000000000000000000000abcdef", "id": f"{i + 1:016x}"}
                         for i in range(3)]).encode()
    statuses, moved = _delta(col, lambda: [post(col.zipkin_url, zipkin, JSON)[0] for _ in range(2)],
                             ("received", "zipkin"), ("dropped", "duplicate"))
    assert statuses == [202, 202] and moved == [6, 3]


def test_a_refused_request_is_no_duplicate_when_retried():
    sink = GatedAggregator()
    with running_collector(sink=sink, queue_max_items=3) as running:
        sink.inner = running.collector.aggregator
        pipeline = running.collector.pipeline
        bodies = [trace_request(3, seed=s).SerializeToString() for s in (1, 2, 3)]
        headers = {"Content-Type": "application/x-protobuf"}
        sink.gate.clear()
        try:
            assert post(running.http_url + "/v1/traces", bodies[0], headers)[0] == 200
            deadline = time.monotonic() + 10
            while pipeline.depth and time.monotonic() < deadline:  # the worker took it and waits
                time.sleep(0.01)
            assert post(running.http_url + "/v1/traces", bodies[1], headers)[0] == 200
            assert post(running.http_url + "/v1/traces", bodies[2], headers)[0] == 429
        finally:
            sink.gate.set()
        running.idle()
        assert post(running.http_url + "/v1/traces", bodies[2], headers)[0] == 200  # the retry
        running.idle()
        assert running.dropped("duplicate") == 0
        assert running.received("otlp_http") == 9 == running.collector.aggregator.spans_seen


@pytest.mark.parametrize("path", ["/api/v1/traces/" + "ab" * 16 + "%0a", "/api/v1/explain?trace_id=" + "ab" * 8 + "%0a"])
def test_an_id_with_a_trailing_newline_is_400(col, path):
    """Before: ``$`` matched before the trailing newline, so the id passed the check."""
    try:
        with urllib.request.urlopen(col.query_url + path, timeout=10) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    assert status == 400 and json.loads(body)["error"]["param"] == "trace_id", body
