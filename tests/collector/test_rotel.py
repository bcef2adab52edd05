"""The production path: SDK exporter -> rotel (sidecar) -> collector, every span counted.

rotel (the PyPI package's agent binary) receives OTLP gRPC and HTTP and forwards OTLP
to the collector, once over gRPC (gzip, rotel's default) and once over HTTP/protobuf
with a bearer token set through rotel's custom headers (the collector requires it).
Spans and metric data points counted by the collector's /metrics must equal what the
SDK sent: none lost, none duplicated.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest
import rotel as rotel_pkg

from sightline.instrumentation import semconv as sc
from tests.collector.servers import emit_spans, running_collector, sdk_tracer
from tests.support import free_port

TOKEN = "rotel-test-token"


def _wait_port(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"rotel exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _wait_count(read, expected: float, timeout_s: float = 20.0) -> float:
    """Polls until ``read()`` reaches ``expected``, then once more after rotel's batch timeout."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while value < expected and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    time.sleep(0.3)  # a duplicate would arrive within a few batch timeouts
    return read()


@pytest.fixture(scope="module", params=["grpc", "http"])
def chain(request, tmp_path_factory):
    """(collector, rotel endpoints, the collector receiver rotel delivers to)."""
    tmp = tmp_path_factory.mktemp(f"rotel-{request.param}")
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    with running_collector(auth_token_file=token_file) as collector:
        grpc_port, http_port = free_port(), free_port()
        if request.param == "grpc":
            export = ["--otlp-exporter-protocol", "grpc",
                      "--otlp-exporter-endpoint", f"http://{collector.grpc_target}"]
            receiver = sc.RECEIVER_OTLP_GRPC
        else:
            export = ["--otlp-exporter-protocol", "http", "--otlp-exporter-compression", "none",
                      "--otlp-exporter-endpoint", collector.http_url]
            receiver = sc.RECEIVER_OTLP_HTTP
        log = tmp / "rotel.log"
        with open(log, "wb") as log_file:
            process = subprocess.Popen(
                [str(Path(rotel_pkg.__file__).parent / "rotel-agent"), "start",
                 "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}",
                 "--otlp-http-endpoint", f"127.0.0.1:{http_port}",
                 "--pid-file", str(tmp / "rotel.pid"), "--log-file", str(tmp / "rotel-agent.log"),
                 "--exporter", "otlp", *export,
                 "--otlp-exporter-custom-headers", f"authorization=Bearer {TOKEN}",
                 "--batch-timeout", "50ms"],
                stdout=log_file, stderr=subprocess.STDOUT,
            )
        try:
            _wait_port(grpc_port, process, log)
            _wait_port(http_port, process, log)
            yield collector, {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}"}, receiver
        finally:
            process.terminate()
            process.wait(timeout=10)


def test_spans_through_rotel_all_counted(chain):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    collector, rotel, receiver = chain
    before = collector.received(receiver)
    emit_spans(sdk_tracer(GrpcExporter(endpoint=rotel["grpc"], insecure=True)), 500)
    emit_spans(sdk_tracer(HttpExporter(endpoint=rotel["http"] + "/v1/traces")), 300)
    assert _wait_count(lambda: collector.received(receiver) - before, 800) == 800
    collector.idle()
    summary = collector.collector.pipeline.summary
    assert summary.spans_processed == summary.spans_acknowledged
    assert collector.rejected(receiver, "unauthenticated") == 0


def test_metrics_through_rotel_all_counted(chain):
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    collector, rotel, receiver = chain
    before = collector.received(receiver, "points")
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=rotel["grpc"], insecure=True),
                                           export_interval_millis=60_000)
    provider = MeterProvider(metric_readers=[reader])
    histogram = provider.get_meter("t").create_histogram("sightline.test.latency", unit="s")
    for sm in range(12):
        histogram.record(0.001 * (sm + 1), {"gpu.sm.id": sm})
    provider.shutdown()  # one export: 12 data points
    assert _wait_count(lambda: collector.received(receiver, "points") - before, 12) == 12
