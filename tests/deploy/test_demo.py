"""``sightline demo`` end to end with a small load: it finishes and writes what it says."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from sightline.deploy.demo import find_capture
from sightline.deploy.incident import Incident
from sightline.instrumentation.capture import read_capture_meta
from sightline.deploy.load import percentile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "sightline-out"
    result = subprocess.run(
        [sys.executable, "-m", "sightline.deploy.cli", "demo", "--out", str(out), "--device", "cpu",
         "--requests", "9", "--concurrency", "6", "--max-num-seqs", "2", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


def test_summary_numbers_are_those_of_the_requests(demo_run):
    out, stdout = demo_run
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["priority"] for r in records] == [0, 1, 2] * 3
    assert all(r["status"] == "ok" for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["model"] == "tiny"
    load = summary["load"]
    assert (load["requests"], load["ok"], load["errors"]) == (9, 9, 0)
    for row in load["by_priority"]:
        mine = [r for r in records if r["priority"] == row["priority"]]
        assert row["ok"] == 3
        assert row["ttft"]["p50_s"] == percentile([r["ttft_s"] for r in mine], 50)
        assert row["ttft"]["p99_s"] == percentile([r["ttft_s"] for r in mine], 99)
        assert row["tpot"]["p99_s"] == percentile([r["tpot_s"] for r in mine], 99)
    text = (out / "summary.txt").read_text()
    for prio in (0, 1, 2):
        p50_ms = load["by_priority"][prio]["ttft"]["p50_s"] * 1000
        assert re.search(rf"^\s+{prio}\s+3\s+0\s+{p50_ms:.1f}\s", text, re.M), text
    assert "TTFT p50" in stdout and "TPOT p99" in stdout  # printed, not only written


def test_slowest_requests_are_explained_from_the_collector(demo_run):
    out, _ = demo_run
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    explained = json.loads((out / "explain" / "this-run.json").read_text())
    assert explained["requests_considered"] == 9  # every request's trace reached the collector
    ids = [r["trace_id"] for r in explained["requests"]]
    assert len(ids) == 3
    by_id = {r["trace_id"]: r for r in records}
    assert set(ids) <= set(by_id)
    # Slowest first, by the collector's own e2e, with the priority the client sent.
    e2e = [r["e2e_s"] for r in explained["requests"]]
    assert e2e == sorted(e2e, reverse=True)
    for r in explained["requests"]:
        assert int(r["priority"]) == by_id[r["trace_id"]]["priority"]
        assert r["steps_total"] >= 1
    text = (out / "explain" / "this-run.txt").read_text()
    assert ids[0] in text and "phases: queue" in text


def test_dashboards_and_heatmaps_written(demo_run):
    out, stdout = demo_run
    from sightline.dashboards.build import render_all

    expected = render_all()
    written = {p.name: p.read_text() for p in (out / "dashboards").glob("*.json")}
    assert written == expected
    summary = json.loads((out / "summary.json").read_text())
    capture = find_capture()
    if capture is None:
        assert summary["gpu_data_source"].startswith("none: no GPU here")
        assert not (out / "heatmaps").exists() or not any((out / "heatmaps").iterdir())
    else:
        assert summary["gpu_data_source"].endswith(str(capture))
        assert "replayed into the collector" in stdout
        pngs = sorted((out / "heatmaps").glob("*.png"))
        htmls = sorted((out / "heatmaps").glob("*.html"))
        assert pngs and htmls
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
        assert all("<html" in p.read_text().lower() for p in htmls)
        gpu = json.loads((out / "explain" / "capture.json").read_text())
        assert gpu["requests"] and any(step["kernels"] for r in gpu["requests"] for step in r["steps"])
    assert "This machine has no GPU" in stdout
    for name in ("summary.txt", "summary.json", "requests.jsonl", "logs"):
        assert str(out / name) in stdout  # says where everything is
    logs = {p.name for p in (out / "logs").iterdir()}
    assert {"engine.log", "rotel.log", "collector.log", "prometheus.log", "alertmanager.log",
            "combined.log"} <= logs


def test_the_planted_incident_is_found_and_alerted(demo_run):
    """The capture's planted SMs against the SMs flagged hot in each interval; the heatmap
    spans the capture's minutes; the SM-hotspot alert reached the real Alertmanager; the
    heatmap page was screenshotted in headless Chromium."""
    out, stdout = demo_run
    capture = find_capture()
    incident = Incident.from_meta(read_capture_meta(capture)) if capture else None
    if incident is None:
        pytest.skip("no incident capture in deploy/captures")
    record = json.loads((out / "incident.json").read_text())
    assert Incident.from_meta(record["incident"]) == incident
    kernel = record["story_kernel"]
    assert kernel in ("sightline_fa2_prefill", "sightline_paged_decode")
    story = [f for f in record["findings"] if f["kernel"] == kernel]
    assert len(story) == len(incident.intervals)
    for finding, interval in zip(story, incident.intervals):
        assert finding["planted"] == sorted(interval.sms)
        assert finding["slots"] >= 2
        assert finding["precision"] >= 0.9 and finding["recall"] >= 0.9, finding
    [page] = (out / "heatmaps").glob(f"gpu*-{kernel}-time_sm.json")
    heatmap = json.loads(page.read_text())
    columns = [c for c in range(len(heatmap["times_unix_s"])) if any(row[c] is not None for row in heatmap["p99_s"])]
    assert len(columns) >= 12
    alerts = record["alerts"]
    assert alerts and {a["labels"]["alertname"] for a in alerts} == {"SightlineSMContention"}
    assert kernel in {a["labels"]["kernel"] for a in alerts}
    shot = page.with_name(page.stem + "-chromium.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    # the slowest replayed requests of the intervals are explained by the planted cause, and
    # the story says what every comparison was made against
    inside = [r for r in record["slowest_requests"] if r["intervals"]]
    assert len(record["slowest_requests"]) == 10 and inside
    assert sum(r["cause_is_planted"] for r in inside) >= 0.9 * len(inside), inside
    assert "cause: sm_contention: steps" in stdout and "(causes compared with: the usual step" in stdout
    assert "How: each SM is compared with the kernel's other SMs in the same 10 s slot" in stdout
    if incident.synthetic:
        assert "SYNTHETIC" in stdout and "not measured" in stdout
    assert f"precision {story[0]['precision']:.2f}, recall {story[0]['recall']:.2f}" in stdout
