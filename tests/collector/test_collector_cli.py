"""``sightline collector run``'s aggregation flags: parsed into the exact config, bad
values refused naming the allowed range, and the settings in force in a real process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from sightline.collector.aggregation_config import AggregationConfig, TraceStoreConfig, WindowConfig
from sightline.collector.cli import aggregation_config
from sightline.deploy.cli import build_parser, main
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import otlp_cta_point, otlp_metrics
from tests.collector.servers import scrape
from tests.support import free_port, wait_for_collector


def _args(*flags: str):
    return build_parser().parse_args(["collector", "run", *flags])


def test_defaults_are_the_dataclass_defaults():
    assert aggregation_config(_args()) == AggregationConfig()


def test_flags_map_onto_the_config():
    got = aggregation_config(_args(
        "--window-slot-s", "2.5", "--window-slots", "40", "--gauge-window-s", "30",
        "--max-sm-series", "100", "--max-kernel-series", "7", "--max-request-series", "8",
        "--max-step-series", "3", "--no-expose-sm-histograms", "--trace-store", "eager",
        "--trace-store-max-traces", "50", "--trace-store-max-spans", "500", "--trace-store-max-bytes", "65536"))
    assert got == AggregationConfig(
        window=WindowConfig(slot_s=2.5, num_slots=40), gauge_window_s=30.0, max_sm_series=100,
        max_kernel_series=7, max_request_series=8, max_step_series=3, expose_sm_histograms=False,
        trace_store=TraceStoreConfig(max_traces=50, max_spans=500, max_bytes=65536, mode="eager"))
    assert aggregation_config(_args("--trace-store", "off")).store_traces is False


@pytest.mark.parametrize("flags, message", [
    (("--window-slots", "0"), "num_slots=0 is not an integer in [1, 1440]"),
    (("--window-slot-s", "0.001"), "slot_s=0.001 is not a number in [0.01, 3600.0]"),
    (("--gauge-window-s", "500"), "gauge_window_s=500.0 is not a number in (0.0, 180.0] (the window horizon)"),
    (("--window-slot-s", "1", "--window-slots", "30", "--gauge-window-s", "31"), "gauge_window_s=31.0 is not a number in (0.0, 30.0] (the window horizon)"),
    (("--max-sm-series", "0"), "max_sm_series=0 is not an integer in [1, 1000000]"),
    (("--max-request-series", "2000000"), "max_request_series=2000000 is not an integer in [1, 1000000]"),
    (("--trace-store-max-bytes", "10"), "max_bytes=10 is not an integer in [1024, 1099511627776]"),
])
def test_out_of_range_values_are_refused_by_name(flags, message, capsys):
    assert main(["collector", "run", "--http", f"127.0.0.1:{free_port()}", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_untyped_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["collector", "run", "--window-slots", "many"])
    assert exit_.value.code == 2 and "invalid int value: 'many'" in capsys.readouterr().err


def test_settings_in_force_in_a_running_collector(tmp_path):
    """2 SM series at most, no per-SM histogram lines: 3 SMs sent -> 2 gauges, 1 series refused."""
    ports = {name: free_port() for name in ("grpc", "http", "zipkin", "query")}
    env = {k: v for k, v in os.environ.items() if k != "SIGHTLINE_COLLECTOR_TOKEN"}
    process = subprocess.Popen(
        [sys.executable, "-m", "sightline.deploy.cli", "collector", "run",
         "--otlp-grpc", f"127.0.0.1:{ports['grpc']}", "--otlp-http", f"127.0.0.1:{ports['http']}",
         "--zipkin", f"127.0.0.1:{ports['zipkin']}", "--http", f"127.0.0.1:{ports['query']}",
         "--log-level", "WARNING", "--max-sm-series", "2", "--no-expose-sm-histograms",
         "--window-slot-s", "1", "--window-slots", "30", "--gauge-window-s", "30"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_collector(f"http://127.0.0.1:{ports['query']}", process)
        now = time.time()
        body = otlp_metrics([otlp_cta_point(0, sm, "attn", [1e-5 * (sm + 1)] * 10, now) for sm in range(3)])
        request = urllib.request.Request(f"http://127.0.0.1:{ports['http']}/v1/metrics", data=body.SerializeToString(),
                                         headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        # One scrape reads the counters, then the per-SM page: an export applied between the
        # two shows its gauges before its refusal is counted, so wait for both.
        overflow_key = (sc.COLLECTOR_SERIES_OVERFLOW_TOTAL + "_total", (("family", "sm_cta"),))
        deadline = time.monotonic() + 10
        while True:
            metrics = scrape(f"http://127.0.0.1:{ports['query']}/metrics")
            p99 = {dict(labels)["sm"]: v for (name, labels), v in metrics.items()
                   if name == sc.COLLECTOR_SM_CTA_P99_SECONDS}
            if (len(p99) == 2 and metrics.get(overflow_key)) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert set(p99) == {"0", "1"}
        assert metrics[overflow_key] == 1
        assert not any(name.startswith(sc.COLLECTOR_SM_CTA_DURATION_SECONDS) for name, _ in metrics)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.mark.parametrize("where", ["/proc/self/sightline/summary.json", "{tmp}/a-file/summary.json", "{tmp}"])
def test_a_summary_file_that_cannot_be_written_is_refused_at_start(where, tmp_path, capsys):
    """Before: a read-only or full filesystem was found only at exit (exit 1, a .tmp left)."""
    (tmp_path / "a-file").write_text("not a directory")
    path = where.format(tmp=tmp_path)
    started = time.monotonic()
    assert main(["collector", "run", "--http", f"127.0.0.1:{free_port()}", "--summary-file", path]) == 2
    err = capsys.readouterr().err
    assert f"summary_file={path!r}" in err and "Traceback" not in err
    assert time.monotonic() - started < 10  # refused before anything started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no probe or .tmp left


def test_malformed_http_requests_do_not_flood_the_log(tmp_path):
    """Before: 2,000 malformed requests wrote 1.45 MB of tracebacks (aiohttp logs one each)."""
    from tests.collector.servers import collector_process

    process, ports, _ = collector_process(tmp_path)
    try:
        for i in range(2_000):
            port = (ports["http"], ports["zipkin"], ports["query"])[i % 3]
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost x\r\nContent-Length: 0\r\n\r\n")
                assert b" 400 " in sock.recv(100)  # answered: the server stays up
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert len(output) < 16 * 1024, f"{len(output)} bytes of log for 2,000 bad requests"
    assert output.count(b"Traceback") <= 3  # once per kind (here: one kind), then counted
