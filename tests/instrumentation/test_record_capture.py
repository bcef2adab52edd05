"""bench/record_capture.py end to end on the CPU: the tiny engine served over real HTTP, its
capture read back, every count exact."""

from __future__ import annotations

import json

from bench import record_capture

REQUESTS = 6


def test_capture_holds_every_request_with_ttft_and_the_continued_traces(tmp_path):
    capture = tmp_path / "capture.jsonl.gz"
    code = record_capture.main(["--model", "tiny", "--device", "cpu", "--requests", str(REQUESTS),
                                "--waves", "2", "--capture", str(capture), "--out", str(tmp_path)])

    assert code == 0
    [result] = tmp_path.glob("record_capture-*.json")
    summary = json.loads(result.read_text())["summary"]
    assert summary["requests_sent"] == summary["requests_ok"] == REQUESTS
    assert summary["server_spans"] == summary["server_spans_with_ttft"] == REQUESTS
    # Half the tiny model's ids are bytes, so text streams early; random weights give no exact count.
    assert summary["client_ttft"]["count"] >= 1
    assert summary["step_spans"] > 0
    assert summary["kernel_spans"] == summary["per_sm_points"] == 0  # no CUDA: the tree ends at steps
    assert summary["dropped_spans"] == 0
    assert len(summary["w3c_trace_id"]) == len(summary["b3_trace_id"]) == 32
    assert summary["w3c_continued"] is True
    assert summary["b3_continued"] is True
