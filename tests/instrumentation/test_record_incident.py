"""bench/record_incident.py on the CPU: the tiny engine served over HTTP while the noisy
neighbour kernel runs under the Triton interpreter (fake SM ids, the host's clock), and
the capture's metadata says what was planted and when."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from sightline.deploy.incident import Incident
from sightline.instrumentation.capture import read_capture, read_capture_meta

ROOT = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, TRITON_INTERPRET="1")  # before triton is imported: in subprocesses


def test_neighbour_kernel_interpreted_records_its_ctas_and_computes():
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, "bench")
        from noisy_neighbour import NoisyNeighbour, reference_sink
        n = NoisyNeighbour(11, "cpu")
        run = n.run(0.2, fake_iters=3)
        want = float(reference_sink(n.tile, 3))
        print("RESULT" + json.dumps({"run": run.__dict__, "sink": n.last_sink.tolist(), "want": want}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT")[-1])
    run = out["run"]
    assert run["fake"] is True and run["ctas"] == 11
    assert run["cta_sms"] == [pid % 8 for pid in range(11)] and run["sms"] == list(range(8))
    assert (run["start_ns"], run["end_ns"]) == (0, 10 * 1000 + 500)  # fake times: pid * 1000 (+500)
    assert 0.2e9 <= run["host_done_ns"] - run["host_launch_ns"] < 30e9  # the host waited out 0.2 s
    assert all(abs(s - out["want"]) <= 1e-3 * abs(out["want"]) for s in out["sink"])


def test_recording_plants_the_neighbour_interval_in_the_capture_metadata(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/record_incident.py", "--device", "cpu", "--model", "tiny",
         "--duration-s", "12", "--interval", "3,6", "--rate", "1", "--burst", "3",
         "--burst-every-s", "8", "--out", str(tmp_path)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    capture = tmp_path / "h200-noisy-neighbour.jsonl.gz"
    incident = Incident.from_meta(read_capture_meta(capture))
    assert incident is not None and incident.synthetic is False and incident.num_sms == 8
    [interval] = incident.intervals
    assert interval.sms == tuple(range(8))  # 33 fake CTAs on fake SMs 0..7
    assert 3.0 <= interval.duration_s < 6.0  # requested 3 s; the launch may start late
    assert incident.details["clock"] == ["host clock"] and incident.details["neighbour_fake"] is True
    [result] = tmp_path.glob("record_incident-cpu-*.json")
    record = json.loads(result.read_text())
    assert record["requests_ok"] == record["requests"] > 0 and record["errors"] == []
    records = list(read_capture(capture))  # the metadata line is skipped, every export parses
    roots = [s for r in records if r.signal == "traces" for rs in r.request.resource_spans
             for ss in rs.scope_spans for s in ss.spans if s.name.startswith("POST ")]
    assert len(roots) == record["requests"]
    spans_during = [s for s in roots if s.start_time_unix_nano < interval.end_unix_nano
                    and s.end_time_unix_nano > interval.start_unix_nano]
    assert spans_during  # the load ran while the neighbour did
