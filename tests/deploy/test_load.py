"""deploy/load.py against a real engine (``sightline engine serve``, tiny model, CPU)."""

from __future__ import annotations

import re
import sys
import urllib.request

import numpy as np
import pytest

from sightline.deploy.load import LoadConfig, percentile, run_load_sync, summarize
from sightline.deploy.processes import HealthCheck, ProcessSpec, Supervisor, free_port


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    port = free_port()
    logs = tmp_path_factory.mktemp("engine-logs")
    with Supervisor(logs) as sup:
        sup.start(ProcessSpec(
            name="engine",
            argv=(sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--host",
                  "127.0.0.1", "--port", str(port), "--model", "tiny", "--device", "cpu"),
            env={"SIGHTLINE_TRACE_LEVEL": "off", "OTEL_SDK_DISABLED": "true"},
            health=HealthCheck(http_url=f"http://127.0.0.1:{port}/health", timeout_s=180)))
        yield f"http://127.0.0.1:{port}"


def _metric_total(url: str, name: str) -> float:
    """Sum of every sample of ``name`` on a Prometheus text page."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"^{re.escape(name)}(\{{| )", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_percentile_matches_numpy():
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 101, 1000):
        values = rng.lognormal(size=n).tolist()
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


def test_config_names_bad_values():
    with pytest.raises(ValueError, match="concurrency=0"):
        LoadConfig(url="http://x", concurrency=0)
    with pytest.raises(ValueError, match="url='localhost:8000'"):
        LoadConfig(url="localhost:8000")


def test_streamed_mixed_priority_load(engine_url):
    requests_before = _metric_total(engine_url, "sightline_engine_requests_total")
    config = LoadConfig(url=engine_url, requests=9, concurrency=3, priorities=(0, 1, 2),
                        max_tokens=6, stream=True)
    result = run_load_sync(config, progress=None)
    assert [r.index for r in result.records] == list(range(9))
    assert all(r.status == "ok" for r in result.records), [r.error for r in result.records]
    # Round-robin priorities: exactly three of each, in order.
    assert [r.priority for r in result.records] == [0, 1, 2] * 3
    for r in result.records:
        assert 1 <= r.output_tokens <= 6
        assert r.finish_reason in ("stop", "length")
        if r.finish_reason == "length":
            assert r.output_tokens == 6
        assert 0 < r.ttft_s <= r.e2e_s
        if r.output_tokens > 1:
            assert r.tpot_s is not None and 0 < r.tpot_s
            assert r.ttft_s + r.tpot_s * (r.output_tokens - 1) == pytest.approx(r.e2e_s)
        assert re.fullmatch(r"[0-9a-f]{32}", r.trace_id)
    assert len({r.trace_id for r in result.records}) == 9
    summary = result.summary
    assert (summary.requests, summary.ok, summary.errors) == (9, 9, 0)
    assert [p.priority for p in summary.by_priority] == [0, 1, 2]
    for row in summary.by_priority:
        mine = [r for r in result.records if r.priority == row.priority]
        assert row.requests == row.ok == 3
        assert row.ttft.p50_s == percentile([r.ttft_s for r in mine], 50)
        assert row.ttft.p99_s == percentile([r.ttft_s for r in mine], 99)
        assert row.e2e.max_s == max(r.e2e_s for r in mine)
    assert summary.output_tokens == sum(r.output_tokens for r in result.records)
    # The server counted exactly the requests this client sent.
    assert _metric_total(engine_url, "sightline_engine_requests_total") - requests_before == 9


def test_non_streamed_and_chat(engine_url):
    result = run_load_sync(LoadConfig(url=engine_url + "/v1", requests=2, concurrency=2,
                                      priorities=(1,), max_tokens=3, stream=False, api="chat"),
                           progress=None)
    assert [r.status for r in result.records] == ["ok", "ok"]
    for r in result.records:
        assert r.tpot_s is None and r.ttft_s == r.e2e_s
        assert 1 <= r.output_tokens <= 3


def test_streamed_chat_ttft_is_the_first_token_not_the_role_chunk(engine_url):
    """A chat stream opens with a role chunk (empty content) before any token exists; the
    client's TTFT must wait for a token, so it is never below the server's own TTFT
    (arrival to first token, the engine's histogram), request by request in sum."""
    from sightline.instrumentation import semconv
    name = semconv.ENGINE_TTFT_SECONDS
    before = _metric_total(engine_url, name + "_sum")
    result = run_load_sync(LoadConfig(url=engine_url, requests=4, concurrency=2, priorities=(0,),
                                      max_tokens=4, stream=True, api="chat"), progress=None)
    assert [r.status for r in result.records] == ["ok"] * 4
    server_ttft = _metric_total(engine_url, name + "_sum") - before
    assert server_ttft > 0
    assert sum(r.ttft_s for r in result.records) >= server_ttft


def test_errors_are_recorded_not_raised(engine_url):
    result = run_load_sync(LoadConfig(url=engine_url, requests=2, concurrency=1,
                                      model="no-such-model", max_tokens=2), progress=None)
    assert [r.status for r in result.records] == ["error", "error"]
    assert all(r.http_status == 404 for r in result.records), [r.error for r in result.records]
    summary = summarize(result.records, 1.0)
    assert (summary.ok, summary.errors) == (0, 2)
    assert summary.ttft is None


def test_cli_prints_the_table_and_writes_records(engine_url, tmp_path):
    import json
    import subprocess

    records = tmp_path / "records.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "sightline.deploy.cli", "load", "--url", engine_url, "--requests", "4",
         "--concurrency", "2", "--priorities", "0,2", "--max-tokens", "3", "--records", str(records)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["priority"] for r in lines] == [0, 2, 0, 2]
    assert all(r["status"] == "ok" for r in lines)
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[:3] for row in rows if row and row[0] in ("0", "2", "all")] == [
        ["0", "2", "0"], ["2", "2", "0"], ["all", "4", "0"]]
    assert "load [" in result.stderr  # the progress display


def test_unreachable_server_is_recorded_per_request():
    closed = free_port()  # nothing listens here
    result = run_load_sync(LoadConfig(url=f"http://127.0.0.1:{closed}", requests=3, concurrency=3,
                                      model="tiny", max_tokens=2, timeout_s=10), progress=None)
    assert [r.status for r in result.records] == ["error"] * 3
    assert all(r.http_status is None and "Connection" in r.error for r in result.records)
    assert (result.summary.ok, result.summary.errors) == (0, 3)
