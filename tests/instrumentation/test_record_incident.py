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

import pytest

from sightline.deploy.incident import Incident
from sightline.instrumentation.capture import read_capture, read_capture_meta

ROOT = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, TRITON_INTERPRET="1")  # before triton is imported: in subprocesses


def _run(script: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT")[-1])


def test_neighbour_holds_exactly_its_target_sms_in_every_slice_and_computes():
    out = _run("""
        import json
        from bench.noisy_neighbour import NeighbourConfig, NoisyNeighbour, reference_sink
        n = NoisyNeighbour(NeighbourConfig((1, 2, 5), slice_s=0.1, max_duration_s=1.0), "cpu")
        run = n.run(0.3, fake_iters=3)
        errors = []
        for bad in ({"warps": 6}, {"carveout": "l1"}, {"slice_s": 0.0}):
            try:
                NeighbourConfig((1,), **bad)
            except ValueError as exc:
                errors.append(str(exc))
        try:
            NoisyNeighbour(NeighbourConfig((8,)), "cpu")
        except ValueError as exc:
            errors.append(str(exc))
        print("RESULT" + json.dumps({"run": run.__dict__, "sink": n.sink.tolist(), "errors": errors,
                                     "occ": n.occ.view(-1, 8, 2)[:3].tolist(),
                                     "want": float(reference_sink(n.tile, 3))}))
    """)
    run = out["run"]
    assert run["fake"] is True and run["slices"] == 3 and run["target_sms"] == [1, 2, 5]
    # fake SM = pid % 8 over a grid of 4 x 8 CTAs: the first CTA on each target SM holds it
    assert run["sms"] == [1, 2, 5] and run["occupancy"] == {"1": 1.0, "2": 1.0, "5": 1.0}
    # fake times: slice * 10**6 + pid * 1000 (+ 500), written by pids 1, 2 and 5 of each slice
    assert out["occ"][1] == [[-1, -1], [1_001_000, 1_001_500], [1_002_000, 1_002_500], [-1, -1], [-1, -1],
                             [1_005_000, 1_005_500], [-1, -1], [-1, -1]]
    assert (run["start_ns"], run["end_ns"]) == (1000, 2_005_500)
    assert 0.3e9 <= run["host_done_ns"] - run["host_launch_ns"] < 30e9  # the host waited out 3 x 0.1 s
    assert [s != 0 for s in out["sink"]] == [sm in (1, 2, 5) for sm in range(8)]
    assert all(abs(s - out["want"]) <= 1e-3 * abs(out["want"]) for s in out["sink"] if s)
    assert [e.split(" ")[0] for e in out["errors"]] == ["warps=6", "carveout='l1'", "slice_s=0.0", "target"]


def test_sm_sets_parse_and_name_the_bad_one():
    from bench.noisy_neighbour import parse_sms

    assert parse_sms("0:132:4", 132) == tuple(range(0, 132, 4)) and len(parse_sms("0:132:4")) == 33
    assert parse_sms("5,1,5") == (1, 5)
    for bad in ("x", "", "0:200:4"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_sms(bad, 132)


def test_fa2_ctas_split_by_held_sms_and_the_variant_chosen():
    import numpy as np

    from bench.neighbour_calibration import CalibrationRun, choose, parse_variants, split_by_sms

    sm = np.array([0, 0, 1, 2, 2, 2, 3])
    dur = np.array([1.0, 1.0, 4.0, 2.0, 2.0, 2.0, 3.0])
    stats = split_by_sms(sm, dur, (1,), num_sms=4)
    # per-SM P99 (= median here): held SM 1: 4; others 1, 2, 3 -> median 2
    assert stats == {"ctas_held": 1, "ctas_other": 6, "held_share": 1 / 7, "even_share": 0.25,
                     "p99_ratio": 2.0, "median_ratio": 2.0}

    def run(warps, share, ratio):
        return CalibrationRun(warps, "max_shared", (1,), 1, 1, share, 0.25, ratio, ratio, 0.1, 1.0, False)

    # the baseline never wins; a variant whose FA2 CTAs hardly ran on its SMs does not either
    assert choose([run(0, 0.25, 9.0), run(8, 0.05, 3.0), run(4, 0.2, 1.4), run(8, 0.25, 1.6)]) == 3
    assert choose([run(0, 0.25, 1.0), run(8, 0.0, None)]) is None
    assert parse_variants("8:max_shared,4:default") == [(8, "max_shared"), (4, "default")]
    with pytest.raises(ValueError, match="'8'"):
        parse_variants("8:max_shared,8")


def test_calibration_measures_fa2_with_each_variant_interpreted():
    out = _run("""
        import json, torch
        from bench.neighbour_calibration import calibrate, choose
        runs = calibrate(torch.device("cpu"), (1, 2, 5), [(8, "max_shared"), (4, "default")], launches=2,
                         neighbour_s=0.3, seq=64, batch=2, heads=2, kv_heads=1, head_dim=16,
                         dtype=torch.float16, slice_s=0.1)
        print("RESULT" + json.dumps({"runs": [r.to_dict() for r in runs], "best": choose(runs)}))
    """)
    runs = out["runs"]
    assert [(r["warps"], r["held_sms"], r["fake"]) for r in runs] == [(0, [1, 2, 5], True), (8, [1, 2, 5], True),
                                                                      (4, [1, 2, 5], True)]
    # fake probe SMs are CTA slot % 8: 3 of 8 SMs hold 3/8 of the CTAs, the same in every run
    assert {(r["ctas_held"], r["ctas_other"], r["held_share"]) for r in runs} == {(12, 20, 0.375)}
    assert out["best"] == 1  # equal fake figures: the first variant
    assert runs[0]["overlap"] is None and all(0.0 <= r["overlap"] <= 1.0 for r in runs[1:])


def test_recording_plants_the_neighbour_interval_in_the_capture_metadata(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.record_incident", "--device", "cpu", "--model", "tiny",
         "--duration-s", "12", "--interval", "3,6", "--rate", "1", "--burst", "3",
         "--burst-every-s", "8", "--slice-s", "0.5", "--calibrate", "on", "--out", str(tmp_path)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    capture = tmp_path / "h200-noisy-neighbour.jsonl.gz"
    incident = Incident.from_meta(read_capture_meta(capture))
    assert incident is not None and incident.synthetic is False and incident.num_sms == 8
    [interval] = incident.intervals
    assert interval.sms == (0, 4)  # every 4th of the 8 fake SMs, held in every slice
    assert 2.99 <= interval.duration_s < 6.0  # requested 3 s (host clock); the launch may start late
    details = incident.details
    assert details["clock"] == ["host clock"] and details["neighbour_fake"] is True
    assert details["target_sms"] == [0, 4] and details["occupancy"] == [{"0": 1.0, "4": 1.0}]
    assert details["neighbour"]["chosen_by"] == "calibration: variant 8:max_shared"  # equal fake figures
    [result] = tmp_path.glob("record_incident-cpu-*.json")
    record = json.loads(result.read_text())
    assert record["requests_ok"] == record["requests"] > 0 and record["errors"] == []
    assert [r["warps"] for r in record["calibration"]] == [0, 8, 4, 8, 4]
    # no per-SM histograms off CUDA: nothing to find, and the diagnosis says so
    assert record["findings"] == [] and record["diagnostics"]["exports"]["count"] == 0
    assert record["diagnostics"]["steps"]["intervals"][0]["steps"] > 0
    records = list(read_capture(capture))  # the metadata line is skipped, every export parses
    roots = [s for r in records if r.signal == "traces" for rs in r.request.resource_spans
             for ss in rs.scope_spans for s in ss.spans if s.name.startswith("POST ")]
    assert len(roots) == record["requests"]
    spans_during = [s for s in roots if s.start_time_unix_nano < interval.end_unix_nano
                    and s.end_time_unix_nano > interval.start_unix_nano]
    assert spans_during  # the load ran while the neighbour did


@pytest.mark.gpu
def test_neighbour_holds_its_target_sms_on_the_gpu():
    import torch

    from bench.noisy_neighbour import NeighbourConfig, NoisyNeighbour

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    targets = tuple(range(0, sms, 4))
    neighbour = NoisyNeighbour(NeighbourConfig(targets, slice_s=0.1, max_duration_s=2.0), "cuda")
    neighbour.run(0.0)
    run = neighbour.run(1.0)
    assert run.fake is False and run.slices == 10 and neighbour.carveout == "max_shared"
    assert run.sms == targets and set(run.occupancy) == set(targets)  # held, and nothing else
    assert min(run.occupancy.values()) >= 0.9
    assert run.host_launch_ns - 1e9 <= run.start_ns < run.end_ns <= run.host_done_ns + 1e9  # %globaltimer
