"""Receivers against real clients: every span and data point sent is counted, exactly.

Clients: the OpenTelemetry SDK's OTLP exporters (gRPC and HTTP/protobuf, with gzip),
py-zipkin (Zipkin v2 JSON), and raw OTLP/JSON with hex ids. The count is read where an
operator reads it: the collector's own /metrics
(``sightline_collector_spans_received_total{receiver=...}``), and checked against what
the aggregator was handed (the pipeline summary).
"""

from __future__ import annotations

import gzip
import json
import time
import urllib.request

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.proto.trace.v1 import trace_pb2

from sightline.collector.config import CollectorConfig
from sightline.collector.otlp_http import parse_otlp_json, to_otlp_json
from sightline.collector.zipkin import zipkin_to_otlp
from sightline.instrumentation import semconv as sc
from tests.collector.servers import emit_spans, post, running_collector, sdk_tracer, trace_request



@pytest.fixture(scope="module")
def collector():
    with running_collector() as running:
        yield running


def test_otel_sdk_grpc_exporter_spans_all_counted(collector):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    before = collector.received(sc.RECEIVER_OTLP_GRPC)
    exporter = OTLPSpanExporter(endpoint=collector.grpc_target, insecure=True)
    emit_spans(sdk_tracer(exporter), 600)
    assert collector.received(sc.RECEIVER_OTLP_GRPC) - before == 600


def test_otel_sdk_http_exporter_gzip_spans_all_counted(collector):
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    before = collector.received(sc.RECEIVER_OTLP_HTTP)
    exporter = OTLPSpanExporter(endpoint=collector.http_url + "/v1/traces", compression=Compression.Gzip)
    emit_spans(sdk_tracer(exporter), 600)
    assert collector.received(sc.RECEIVER_OTLP_HTTP) - before == 600
    collector.idle()
    summary = collector.collector.pipeline.summary
    assert summary.spans_processed == summary.spans_acknowledged


def test_otel_sdk_metric_exporter_data_points_counted(collector):
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    before = collector.received(sc.RECEIVER_OTLP_HTTP, "points")
    exporter = OTLPMetricExporter(endpoint=collector.http_url + "/v1/metrics")
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=60_000)
    provider = MeterProvider(metric_readers=[reader])
    counter = provider.get_meter("t").create_counter("sightline.test.count")
    for sm in range(5):  # 5 attribute sets -> 5 data points of one sum
        counter.add(1, {"sm": sm})
    histogram = provider.get_meter("t").create_histogram("sightline.test.hist")
    for gpu in range(3):  # 3 more data points
        histogram.record(0.5, {"gpu": gpu})
    provider.shutdown()  # one final export of 8 points
    assert collector.received(sc.RECEIVER_OTLP_HTTP, "points") - before == 8


def test_py_zipkin_spans_all_counted(collector):
    from py_zipkin.encoding import Encoding
    from py_zipkin.transport import BaseTransportHandler
    from py_zipkin.zipkin import zipkin_span

    statuses = []

    class HttpTransport(BaseTransportHandler):
        def get_max_payload_bytes(self):
            return None

        def send(self, payload):
            body = payload.encode() if isinstance(payload, str) else payload
            statuses.append(post(collector.zipkin_url, body, {"Content-Type": "application/json"})[0])

    before = collector.received(sc.RECEIVER_ZIPKIN)
    for _ in range(20):  # 20 traces x 3 spans
        with zipkin_span(service_name="zipkin-svc", span_name="root", transport_handler=HttpTransport(),
                         sample_rate=100.0, encoding=Encoding.V2_JSON):
            with zipkin_span(service_name="zipkin-svc", span_name="child-a"):
                pass
            with zipkin_span(service_name="zipkin-svc", span_name="child-b"):
                pass
    assert statuses and set(statuses) == {202}
    assert collector.received(sc.RECEIVER_ZIPKIN) - before == 60


def test_otlp_json_hex_ids_round_trip(collector):
    document = {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "json-svc"}}]},
        "scopeSpans": [{"scope": {"name": "t"}, "spans": [
            {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
             "parentSpanId": "eee19b7ec3c1b173", "name": "queue", "kind": 1,
             "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": "1544712661000000000",
             "attributes": [{"key": "sightline.request.priority", "value": {"intValue": "3"}}]},
            {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b175",
             "name": "decode", "kind": "SPAN_KIND_INTERNAL",
             "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": "1544712661000000000"},
        ]}]}]}
    parsed = parse_otlp_json(json.dumps(document).encode(), ExportTraceServiceRequest)
    span = parsed.resource_spans[0].scope_spans[0].spans[0]
    assert span.trace_id == bytes.fromhex("5b8efff798038103d269b633813fc60c")
    assert span.span_id == bytes.fromhex("eee19b7ec3c1b174")
    assert span.parent_span_id == bytes.fromhex("eee19b7ec3c1b173")
    assert span.end_time_unix_nano - span.start_time_unix_nano == 10**9
    assert to_otlp_json(parsed)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] == \
        "5b8efff798038103d269b633813fc60c"

    before = collector.received(sc.RECEIVER_OTLP_HTTP)
    duplicates = collector.dropped("duplicate")
    status, headers, body = post(collector.http_url + "/v1/traces", json.dumps(document).encode(),
                                 {"Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body) == {}
    gz = gzip.compress(json.dumps(document).encode())
    status, _, _ = post(collector.http_url + "/v1/traces", gz,
                        {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 200
    # Both acknowledged; the second carried the same two spans again (a retry): counted as
    # received and as duplicates, not stored twice.
    assert collector.received(sc.RECEIVER_OTLP_HTTP) - before == 4
    assert collector.dropped("duplicate") - duplicates == 2


def test_protobuf_response_is_export_response(collector):
    status, headers, body = post(collector.http_url + "/v1/traces", trace_request(7).SerializeToString(),
                                 {"Content-Type": "application/x-protobuf"})
    assert status == 200 and headers["Content-Type"] == "application/x-protobuf"
    response = ExportTraceServiceResponse.FromString(body)
    assert not response.HasField("partial_success")


def test_zipkin_conversion_fields():
    document = [{
        "traceId": "463ac35c9f6413ad", "id": "a2fb4a1d1a96d312", "parentId": "0020000000000001",
        "name": "get /api", "kind": "SERVER", "timestamp": 1_700_000_000_123_456, "duration": 2_500,
        "localEndpoint": {"serviceName": "frontend", "ipv4": "10.0.0.1", "port": 8080},
        "remoteEndpoint": {"serviceName": "browser", "ipv4": "10.0.0.9"},
        "tags": {"http.method": "GET", "error": "boom"}, "shared": True,
        "annotations": [{"timestamp": 1_700_000_000_124_000, "value": "ws"}],
    }, {
        "traceId": "463ac35c9f6413ad48485a3953bb6124", "id": "b2fb4a1d1a96d312", "name": "db",
        "kind": "CLIENT", "timestamp": 5, "duration": 1, "localEndpoint": {"serviceName": "backend"},
    }]
    request = zipkin_to_otlp(document)
    assert len(request.resource_spans) == 2
    rs = request.resource_spans[0]
    assert rs.resource.attributes[0].key == "service.name"
    assert rs.resource.attributes[0].value.string_value == "frontend"
    span = rs.scope_spans[0].spans[0]
    assert span.trace_id == bytes(8) + bytes.fromhex("463ac35c9f6413ad")
    assert span.span_id == bytes.fromhex("a2fb4a1d1a96d312")
    assert span.parent_span_id == bytes.fromhex("0020000000000001")
    assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert span.start_time_unix_nano == 1_700_000_000_123_456_000
    assert span.end_time_unix_nano - span.start_time_unix_nano == 2_500_000
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["http.method"].string_value == "GET"
    assert attrs[sc.ZIPKIN_SHARED].bool_value is True
    assert attrs[sc.PEER_SERVICE].string_value == "browser"
    assert attrs[sc.NETWORK_PEER_ADDRESS].string_value == "10.0.0.9"
    assert attrs[sc.NETWORK_LOCAL_PORT].int_value == 8080
    assert "error" not in attrs
    assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR and span.status.message == "boom"
    assert span.events[0].name == "ws" and span.events[0].time_unix_nano == 1_700_000_000_124_000_000
    other = request.resource_spans[1].scope_spans[0].spans[0]
    assert other.trace_id == bytes.fromhex("463ac35c9f6413ad48485a3953bb6124")
    assert other.kind == trace_pb2.Span.SPAN_KIND_CLIENT and other.parent_span_id == b""


def test_aggregator_saw_every_acknowledged_span(collector):
    collector.idle()
    summary = collector.collector.pipeline.summary
    metrics = collector.metrics()
    received = sum(metrics[(sc.COLLECTOR_SPANS_RECEIVED_TOTAL + "_total", (("receiver", r),))]
                   for r in (sc.RECEIVER_OTLP_GRPC, sc.RECEIVER_OTLP_HTTP, sc.RECEIVER_ZIPKIN))
    duplicates = metrics[(sc.COLLECTOR_DROPPED_TOTAL + "_total", (("reason", "duplicate"),))]
    # one meaning of "acknowledged": /metrics' received counts and the exit summary agree
    assert received == summary.spans_acknowledged
    assert summary.spans_acknowledged == summary.spans_processed + summary.spans_duplicate
    assert summary.spans_duplicate == duplicates and summary.spans_processed > 0
    assert summary.spans_aggregated == summary.spans_processed  # the aggregator took every span
    assert collector.collector.aggregator.spans_seen == summary.spans_processed


def test_metrics_endpoint_speaks_openmetrics_with_exemplars(collector):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    document = {"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": trace_id, "spanId": "b7ad6b7169203331", "name": sc.SPAN_HTTP_COMPLETIONS, "kind": 2,
        "startTimeUnixNano": str(time.time_ns() - 10**9), "endTimeUnixNano": str(time.time_ns()),
        "attributes": [{"key": sc.GEN_AI_REQUEST_MODEL, "value": {"stringValue": "exemplar-model"}},
                       {"key": sc.REQUEST_PRIORITY, "value": {"intValue": "0"}},
                       {"key": sc.REQUEST_TTFT_S, "value": {"doubleValue": 0.05}}]}]}]}]}
    assert post(collector.http_url + "/v1/traces", json.dumps(document).encode(),
                {"Content-Type": "application/json"})[0] == 200
    collector.idle()
    request = urllib.request.Request(collector.query_url + "/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        text = response.read().decode()
    assert text.rstrip().endswith("# EOF")
    ttft_lines = [line for line in text.splitlines()
                  if line.startswith(sc.COLLECTOR_REQUEST_TTFT_SECONDS + "_bucket") and "exemplar-model" in line]
    assert any(f'{sc.EXEMPLAR_TRACE_ID_LABEL}="{trace_id}"' in line for line in ttft_lines), ttft_lines
    with urllib.request.urlopen(collector.query_url + "/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        assert trace_id not in response.read().decode()  # classic text format has no exemplars


def test_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match=r"queue_max_items=0 is not an integer in"):
        CollectorConfig(queue_max_items=0)
    with pytest.raises(ValueError, match=r"otlp_http_address.*'localhost'"):
        CollectorConfig(otlp_http_address="localhost")
    with pytest.raises(ValueError, match=r"zipkin_address port=70000 is not an integer in \[0, 65535\]"):
        CollectorConfig(zipkin_address="127.0.0.1:70000")
    with pytest.raises(ValueError, match=r"max_decompressed_bytes=2048 is not an integer in \[4096, .*\] \(at least max_request_bytes\)"):
        CollectorConfig(max_request_bytes=4096, max_decompressed_bytes=2048)
    with pytest.raises(ValueError, match=r"give both or neither"):
        CollectorConfig(tls_cert_file="/etc/hostname")
