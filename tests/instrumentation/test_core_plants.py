"""The scenario suite's plants in the engine core (bench/core_plants.py): a real ``engine
serve`` on the CPU runs a control and a GIL hog at their planned times, and the suite reads
back each segment's interval and what the hog measured."""

from __future__ import annotations

import argparse
import time

from bench._collector import CollectorProcess
from bench.scenarios import ServedEngine, segments


def test_the_plants_run_in_the_engine_core_at_their_planned_times_and_report_each_segment(tmp_path):
    args = argparse.Namespace(model="tiny", device="cpu", out=tmp_path, order=["control", "host_stall"], runs=1,
                              lead_s=0.5, planted_s=1.5, tail_s=0.2, gil_hold_s=0.03, gil_period_s=0.05,
                              hbm_mib=1, kernel_sample_ratio=0.02, kernel_sample_ratio_slow=0.1,
                              metric_export_interval=2.0, start_timeout=120.0)
    timeline = segments(args.order, args.runs, args.lead_s, args.planted_s, args.tail_s)
    collector = CollectorProcess(tmp_path / "collector.log", [])
    engine = None
    try:
        engine = ServedEngine.start(args, tmp_path / "raw.jsonl.gz", collector.url("http"))
        assert (engine.model, engine.device, engine.num_sms) == ("tiny", "cpu", 8)   # 8: the fake neighbour's SMs
        go_ns = time.time_ns() + 200_000_000
        engine.go(go_ns)
        engine.follow(timeline).join(timeout=30)
        dropped = engine.dropped_spans()
    finally:
        if engine is not None:
            engine.stop(60.0)
        collector.stop()
    assert dropped == 0   # the engine telemetry counter, summed over its reasons
    # the plan and the core's replies lived outside the run's output, and are gone
    assert not engine.plan.parent.exists() and not list(tmp_path.glob("*plan*"))
    control, hog = timeline
    assert control.error is None and hog.error is None
    for seg in timeline:   # each planted from its onset for planted_s, by the core's clock
        start_s = (seg.interval.start_unix_nano - go_ns) / 1e9
        length_s = (seg.interval.end_unix_nano - seg.interval.start_unix_nano) / 1e9
        assert seg.onset_s - 0.05 <= start_s <= seg.onset_s + 0.3 and 1.4 <= length_s <= 1.8
    assert (control.interval.kind, hog.interval.kind) == ("control", "host_stall")
    # the hog held the core's GIL for about hold / period of its interval, in holds of hold_s
    assert hog.plant["holds"] >= 15 and 0.3 <= hog.plant["held_share"] <= 0.9
    # about hold_s each, calibrated by wall time at start: a busy machine that preempts the
    # holding thread stretches a hold (the GIL stays held), and one busy while it calibrated
    # shortens them, so the bounds are half the hold and the period
    assert 0.5 * args.gil_hold_s <= hog.plant["held_s"] / hog.plant["holds"] <= args.gil_period_s + 0.02
