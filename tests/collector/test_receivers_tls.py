"""TLS on the ingest listeners, with the bearer token taken from an environment variable.

A self-signed certificate for 127.0.0.1 (made by the ``openssl`` command line) is
trusted by the OTel SDK exporters (gRPC and HTTP) and by a Zipkin client; every span
sent is counted. Plain-text clients get nothing through.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from sightline.instrumentation import semconv as sc
from tests.collector.servers import emit_spans, running_collector, sdk_tracer, trace_request

TOKEN_ENV = "SIGHTLINE_TEST_TLS_TOKEN"
TOKEN = "tls-token-from-env"


@pytest.fixture(scope="module")
def tls_collector(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    mp = pytest.MonkeyPatch()
    mp.setenv(TOKEN_ENV, TOKEN)
    # requests lets these override the exporter's certificate_file (its session.verify)
    mp.delenv("REQUESTS_CA_BUNDLE", raising=False)
    mp.delenv("CURL_CA_BUNDLE", raising=False)
    try:
        with running_collector(tls_cert_file=cert, tls_key_file=key, auth_token_env=TOKEN_ENV) as collector:
            collector.cert = cert
            yield collector
    finally:
        mp.undo()


def test_sdk_exporters_over_tls_all_counted(tls_collector):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    col = tls_collector
    credentials = grpc.ssl_channel_credentials(root_certificates=col.cert.read_bytes())
    grpc_exporter = GrpcExporter(endpoint=col.grpc_target, credentials=credentials,
                                 headers={"authorization": f"Bearer {TOKEN}"})
    emit_spans(sdk_tracer(grpc_exporter), 200)
    http_exporter = HttpExporter(endpoint=f"https://127.0.0.1:{col.ports.otlp_http}/v1/traces",
                                 certificate_file=str(col.cert), headers={"Authorization": f"Bearer {TOKEN}"})
    emit_spans(sdk_tracer(http_exporter), 100)
    assert col.received(sc.RECEIVER_OTLP_GRPC) == 200
    assert col.received(sc.RECEIVER_OTLP_HTTP) == 100


def test_zipkin_over_tls_and_plaintext_refused(tls_collector):
    col = tls_collector
    context = ssl.create_default_context(cafile=str(col.cert))
    body = json.dumps([{"traceId": "463ac35c9f6413ad", "id": "a2fb4a1d1a96d312", "name": "x"}]).encode()
    request = urllib.request.Request(f"https://127.0.0.1:{col.ports.zipkin}/api/v2/spans", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        assert response.status == 202
    assert col.received(sc.RECEIVER_ZIPKIN) == 1
    before = col.received(sc.RECEIVER_OTLP_HTTP), col.received(sc.RECEIVER_OTLP_GRPC)
    plain = urllib.request.Request(f"http://127.0.0.1:{col.ports.otlp_http}/v1/traces",
                                   data=trace_request(2).SerializeToString(), method="POST",
                                   headers={"Content-Type": "application/x-protobuf",
                                            "Authorization": f"Bearer {TOKEN}"})
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(plain, timeout=5).read()
    with grpc.insecure_channel(col.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")(
                trace_request(2).SerializeToString(), timeout=5,
                metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (col.received(sc.RECEIVER_OTLP_HTTP), col.received(sc.RECEIVER_OTLP_GRPC)) == before
