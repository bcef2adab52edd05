"""The causes a recorded capture's slowest requests are given, replayed on the CPU.

Each capture (default: the shipped ones with a planted interval, and the plain HTTP one) is
replayed into an in-process collector, clock pinned and slot-aligned as the demo and the
capture tests replay it. Per planted interval (the whole capture where none is planted):
the causes of its 10 slowest requests with their evidence, the count of the cause planted,
per probed kernel the SMs flagged against the planted ones, its requests blamed on an SM,
the GPU or the host that was not planted, and the traced decode steps inside and outside
it by why they were traced, with their duration, GPU and host time (median, mean, P90), and
the decode steps by how many steps after the last traced one they began: what the cause
rules had to go on.
Guarantee: every figure is the collector's own reading (replay, engine timeline, explain).
Cost: about 5 s per MB of capture on one core.

    python -m bench.replay_causes [CAPTURE ...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from sightline.collector.aggregator import Aggregator
from sightline.collector.engine_timeline import step_facts
from sightline.collector.explain import explain_slowest
from sightline.collector.replay import AggregatorSink, ReplayConfig, replay
from sightline.deploy.demo import CAPTURES_DIR
from sightline.deploy.incident import Incident, find, probe_heatmaps
from sightline.instrumentation import read_capture_meta
from sightline.instrumentation import semconv as sc

from ._common import steps_since_traced, write_cpu_result

NOW_NS = 1_800_000_000 * 10**9   # the replay's pinned clock (tests/deploy/test_captures.py's)
PLANTED_CAUSE = {"sm_neighbour": sc.CAUSE_SM_CONTENTION, "hbm_hog": sc.CAUSE_DEVICE_CONTENTION,
                 "host_stall": sc.CAUSE_HOST_STALL, "priority_burst": sc.CAUSE_QUEUEING}
# causes that blame something: an SM, the GPU, the host
BLAMES = (sc.CAUSE_SM_CONTENTION, sc.CAUSE_DEVICE_CONTENTION, sc.CAUSE_HOST_STALL)
WINDOW_LIMIT = 1000   # requests of an interval explained: all of any recorded one
EVIDENCE = ("engine_slowdown", "gpu_slowdown", "host_slowdown", "cta_slowdown", "traced_steps", "traced_near",
            "steps", "idle_excess_s", "interference_s", "batch", "usual_batch", "traced_slowdown")


def _spread(values: list[float]) -> dict | None:
    x = np.array([v for v in values if np.isfinite(v)])
    if not x.size:
        return None
    return {"median": round(float(np.median(x)), 3), "mean": round(float(x.mean()), 3),
            "p90": round(float(np.percentile(x, 90)), 3)}


def stored_steps(aggregator: Aggregator) -> list[tuple]:
    """Every stored step's facts with its trace reason (``none``: not traced), read once."""
    rows: list[tuple] = []

    def read(store):
        for trace in store.traces():
            for step in trace.step_spans:
                rows.append((step_facts(trace, step), step.record().attributes.get(sc.STEP_TRACE_REASON) or "none"))
    aggregator.store.read(read)
    return rows


def traced_decode_steps(steps: list[tuple], lo_ns: int, hi_ns: int) -> dict:
    """Decode-only ``steps`` (``stored_steps``) inside ``[lo_ns, hi_ns)`` and outside it, by
    trace reason: their count and duration, GPU and host time in ms."""
    rows = [(f, reason) for f, reason in steps if f.kind == 0]
    out: dict = {}
    for where, inside in (("inside", True), ("outside", False)):
        for reason in sorted({r for _, r in rows}):
            chosen = [f for f, r in rows if r == reason and (lo_ns <= f.start_ns < hi_ns) == inside]
            if chosen:
                out.setdefault(where, {})[reason] = {
                    "steps": len(chosen),
                    "duration_ms": _spread([(f.end_ns - f.start_ns) / 1e6 for f in chosen]),
                    "gpu_ms": _spread([f.gpu_s * 1e3 for f in chosen]),
                    "host_ms": _spread([f.host_s * 1e3 for f in chosen])}
    return out


def steps_after_traced(steps: list[tuple], lo_ns: int, hi_ns: int, reach: int = 6) -> dict:
    """Decode-only steps inside ``[lo_ns, hi_ns)`` and outside it by how many steps after the
    last kernel-traced one they began (1 to ``reach``), traced or not: their count, median
    duration and median time from the previous step's start (where that step is the one
    before it) in ms. Tracing's close falls a few steps after each traced step: a step
    launched late there shows what the close cost the engine, and a phase that runs unlike
    the others makes the traced steps there a biased sample."""
    facts = sorted((f for f, _ in steps if f.step_id is not None), key=lambda f: f.step_id)
    if not facts:
        return {}
    traced = np.array([np.isfinite(f.gpu_s) for f in facts])
    since = np.array([-1 if k is None else k for k in steps_since_traced([f.step_id for f in facts], traced)])
    decode = np.array([f.kind == 0 for f in facts])
    start = np.array([f.start_ns for f in facts])
    duration = np.array([(f.end_ns - f.start_ns) / 1e6 for f in facts])
    ids = np.array([f.step_id for f in facts])
    # from the previous step's start, where the previous step is the one before it
    after_previous = np.r_[np.nan, np.where(np.diff(ids) == 1, np.diff(start) / 1e6, np.nan)]
    out: dict = {}
    for where, inside in (("inside", True), ("outside", False)):
        here = decode & (((start >= lo_ns) & (start < hi_ns)) == inside)
        for k in range(1, reach + 1):
            row = {}
            for name, pick in (("untraced", ~traced), ("traced", traced)):
                rows = here & (since == k) & pick
                chosen, gaps = duration[rows], after_previous[rows]
                gaps = gaps[np.isfinite(gaps)]
                row[name] = {"steps": int(chosen.size),
                             "duration_ms": round(float(np.median(chosen)), 2) if chosen.size else None,
                             "after_previous_ms": round(float(np.median(gaps)), 2) if gaps.size else None}
            out.setdefault(where, {})[str(k)] = row
    return out


def replayed(capture: Path) -> tuple[Aggregator, object, list]:
    """``capture`` replayed into an in-process collector on the pinned clock, slot-aligned:
    the aggregator, the replay's result (its time map) and the planted intervals (none: [])."""
    aggregator, result, incident = _replayed(capture)
    return aggregator, result, list(incident.intervals) if incident is not None else []


def _replayed(capture: Path) -> tuple[Aggregator, object, Incident | None]:
    aggregator = Aggregator(clock=lambda: NOW_NS / 1e9)
    result = replay(capture, AggregatorSink(aggregator), ReplayConfig(speed=0.0, align_slot_s=10.0),
                    clock_ns=lambda: NOW_NS)
    meta = read_capture_meta(capture)
    return aggregator, result, Incident.from_meta(meta) if meta else None


def sms_found(aggregator: Aggregator, incident: Incident, time_map) -> dict[tuple[int, int], list[dict]]:
    """Per planted interval (its start and end, ns as recorded): per probed kernel, the SMs
    the contention tests flagged in it against the planted ones (deploy/incident.py)."""
    heatmaps = probe_heatmaps(aggregator)
    found: dict[tuple[int, int], list[dict]] = {}
    for interval in incident.intervals:
        one = dataclasses.replace(incident, intervals=(interval,))
        found[(interval.start_unix_nano, interval.end_unix_nano)] = [
            {"kernel": f.kernel, "planted": len(f.planted), "flagged": len(f.flagged), "precision": f.precision,
             "recall": f.recall} for f in find(one, heatmaps, time_map)]
    return found


def analyse(capture: Path) -> dict:
    aggregator, result, incident = _replayed(capture)
    steps = stored_steps(aggregator)
    found = sms_found(aggregator, incident, result.time_map) if incident is not None else {}
    intervals = list(incident.intervals) if incident is not None else []
    out = {"capture": capture.name, "intervals": []}
    for interval in intervals or [None]:
        if interval is None:
            lo_ns, hi_ns, kind, within = 0, 1 << 62, None, None
        else:
            lo_ns, hi_ns = result.time_map(interval.start_unix_nano), result.time_map(interval.end_unix_nano)
            kind, within = interval.kind, (lo_ns / 1e9, hi_ns / 1e9)
        explained = explain_slowest(aggregator, quantile=0.0, limit=WINDOW_LIMIT, within_s=within)
        every = Counter(r.cause.name for r in explained.requests)
        causes = [r.cause.name for r in explained.requests[:10]]
        out["intervals"].append({
            "kind": kind, "causes": causes,
            "planted_cause_in_10_slowest": causes.count(PLANTED_CAUSE[kind]) if kind in PLANTED_CAUSE else None,
            "sms": found.get((interval.start_unix_nano, interval.end_unix_nano)) if interval is not None else None,
            # every request of the interval blamed on an SM, the GPU or the host that was not planted
            "misnamed": {c: n for c, n in every.items() if c in BLAMES and c != PLANTED_CAUSE.get(kind)},
            "requests": len(explained.requests),
            "slowest": [{"cause": r.cause.name, **{k: r.cause.evidence[k] for k in EVIDENCE if k in r.cause.evidence}}
                        for r in explained.requests[:10]],
            "decode_steps": traced_decode_steps(steps, lo_ns, hi_ns) if interval is not None else None,
            "after_traced": steps_after_traced(steps, lo_ns, hi_ns) if interval is not None else None})
    return out


def _line(interval: dict) -> str:
    counts = {c: interval["causes"].count(c) for c in dict.fromkeys(interval["causes"])}
    planted = interval["planted_cause_in_10_slowest"]
    sms = "; ".join(f"{f['kernel']}: {f['flagged']} SMs flagged"
                    + (f", precision {f['precision']:.2f} recall {f['recall']:.2f}" if f["planted"] else "")
                    for f in interval["sms"] or [] if f["flagged"] or f["planted"])
    misnamed = ", ".join(f"{c} {n}" for c, n in interval["misnamed"].items())
    return (f"  {interval['kind'] or 'no incident'}: " + ", ".join(f"{c} {n}" for c, n in counts.items())
            + ("" if planted is None else f" (planted cause {planted}/10)")
            + (f"\n    {sms}" if sms else "")
            + (f"\n    of its {interval['requests']} requests, blamed on what was not planted: {misnamed}"
               if misnamed else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("captures", nargs="*", type=Path,
                    help="captures to replay (default: the shipped ones in deploy/captures)")
    ap.add_argument("--json", type=Path, help="write the full result here")
    args = ap.parse_args(argv)
    captures = args.captures or sorted(CAPTURES_DIR.glob("*.jsonl.gz"))
    results = []
    for capture in captures:
        results.append(analyse(capture))
        print(capture.name)
        for interval in results[-1]["intervals"]:
            print(_line(interval))
    if args.json:
        write_cpu_result(args.json, "bench.replay_causes", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
