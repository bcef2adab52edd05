"""The scenario suite's plants inside the engine core's process, where they must run: an SM
neighbour or an HBM hog on the core's CUDA context, a GIL hog under the step loop's GIL.

``bench/scenarios.py`` starts ``engine serve`` with ``SIGHTLINE_CORE_PLUGINS=bench.core_plants:start``
and ``SIGHTLINE_SCENARIO_PLAN`` naming a JSON plan (the scenarios' timeline and the plants'
settings). :func:`start`, called with the warm core before it serves, builds every plant (the
neighbour's kernel compiled, the hog's buffers allocated), writes ``<plan>.device.json`` (the
device and its SM count), then on a thread waits for ``<plan>.go`` (the load's start, Unix ns),
plants each segment at its onset and appends what it did to ``<plan>.segments.jsonl``, a
line per segment, as each ends. Guarantee: the same plants, timeline and records as an
in-process run. Cost: a file poll every 50 ms until the go, then the plants' own.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

__all__ = ["PLAN_ENV", "apply_record", "interval_record", "start"]

PLAN_ENV = "SIGHTLINE_SCENARIO_PLAN"


def interval_record(index: int, seg) -> dict:
    """One segment's plant as a JSON line: what ``bench/scenarios.py`` reads back."""
    interval = seg.interval
    return {"index": index, "plant": seg.plant, "error": seg.error,
            "interval": None if interval is None else {
                "start_unix_nano": interval.start_unix_nano, "end_unix_nano": interval.end_unix_nano,
                "sms": list(interval.sms), "kind": interval.kind}}


def apply_record(timeline: list, record: dict) -> None:
    """Sets the segment ``record`` (an :func:`interval_record`) names: its interval, plant and error."""
    from sightline.deploy.incident import PlantedInterval

    seg, got = timeline[record["index"]], record["interval"]
    seg.plant, seg.error = record["plant"], record["error"]
    seg.interval = None if got is None else PlantedInterval(
        got["start_unix_nano"], got["end_unix_nano"], tuple(got["sms"]), kind=got["kind"])


def start(core) -> None:
    """The plugin (module docstring)."""
    from ._common import device_name
    from .record_incident import _num_sms
    from .scenarios import make_plants, run_plants, segments

    plan_path = Path(os.environ[PLAN_ENV])
    plan = json.loads(plan_path.read_text())
    args = argparse.Namespace(**plan["args"])
    device = core.runner.device
    num_sms = _num_sms(device)
    plants = make_plants(args, device, num_sms, plan["order"])
    timeline = segments(plan["order"], args.runs, args.lead_s, args.planted_s, args.tail_s)
    Path(f"{plan_path}.device.json").write_text(json.dumps({"device": device_name(device, cpu_fallback="cpu"),
                                                           "num_sms": num_sms}))
    out = Path(f"{plan_path}.segments.jsonl")

    def target() -> None:
        go = Path(f"{plan_path}.go")
        while not go.exists():
            time.sleep(0.05)
        t0 = time.monotonic() + (int(go.read_text()) - time.time_ns()) / 1e9
        with out.open("a") as sink:
            def on_done(index: int, seg) -> None:
                sink.write(json.dumps(interval_record(index, seg)) + "\n")
                sink.flush()

            run_plants(plants, timeline, t0, args.planted_s, on_done).join()

    threading.Thread(target=target, name="scenario-plants", daemon=True).start()
