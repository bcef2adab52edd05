"""A live scenario run's kept captures replayed in the order they ran, as its collector saw them.

Each capture (``bench/scenarios.py --keep-captures all``) is one segment of a run. Replayed
together on their own clock, export by export, into one in-process collector: the per-SM
contention gauge and the slow requests counted by cause (what the cause alerts count) are
read every ``--scrape-s``, and each planted interval's 10 slowest requests are explained
``--settle-s`` after its end, as the scenario runner did. Per interval: the causes of its 10
slowest, the first read after its onset that showed a planted SM, the reads from its onset
to its end + ``--tail-s`` that showed SMs not planted, the slow requests counted by cause
from its onset to its explanation, and the first read with as many of them as the cause
alerts ask (``SloConfig.cause_min_requests``) counted for the planted cause.
Guarantee: a run's captures hold every export its collector received, so with the code of
its commit the causes are the live run's. Cost: about 8 s per capture on one core.

    python -m bench.replay_run CAPTURE ... [--json OUT.json]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import Counter
from pathlib import Path

from sightline.collector.aggregation_config import AggregationConfig
from sightline.collector.aggregator import Aggregator
from sightline.collector.explain import explain_slowest
from sightline.collector.replay import AggregatorSink
from sightline.deploy.incident import EXPECTED_CAUSE, Incident
from sightline.deploy.prometheus_rules import SloConfig
from sightline.instrumentation import read_capture, read_capture_meta

from ._common import write_cpu_result


def replay_run(captures: list[Path], scrape_s: float = 2.0, settle_s: float = 20.0, tail_s: float = 6.0,
               gauge_window_s: float = 15.0) -> list[dict]:
    """Per planted interval of ``captures`` (one segment each, in any order): see the module docstring."""
    intervals = sorted(((iv, c.name) for c in captures for iv in Incident.from_meta(read_capture_meta(c)).intervals),
                       key=lambda x: x[0].start_unix_nano)
    clock = [0.0]
    aggregator = Aggregator(AggregationConfig(gauge_window_s=gauge_window_s), clock=lambda: clock[0])
    sink = AggregatorSink(aggregator)
    reads: list[tuple[float, str, set[str]]] = []   # (time, kernel, SMs the gauge showed)
    counted: list[tuple[float, dict[str, int]]] = [(0.0, {})]  # (time, slow requests by cause so far)
    least = SloConfig().cause_min_requests  # the slow requests a cause alert needs
    due = [(iv.end_unix_nano / 1e9 + settle_s, n) for n, (iv, _) in enumerate(intervals)]
    out: list[dict] = []

    def explain_due(t: float) -> None:
        while due and t >= due[0][0]:
            at, n = due.pop(0)
            interval, name = intervals[n]
            clock[0] = at
            onset, end = interval.start_unix_nano / 1e9, interval.end_unix_nano / 1e9
            slowest = explain_slowest(aggregator, quantile=0.0, limit=10, within_s=(onset, end)).requests
            planted = {str(sm) for sm in interval.sms}
            found = [r - onset for r, _, sms in reads if r >= onset and sms & planted]
            others = [(round(r - onset, 1), kernel, len(sms - planted)) for r, kernel, sms in reads
                      if onset <= r <= end + tail_s and sms - planted]
            causes = Counter(r.cause.name for r in slowest)
            expected = EXPECTED_CAUSE.get(interval.kind)
            before = next(c for r, c in reversed(counted) if r <= onset)
            counted_since = {c: n - before.get(c, 0) for c, n in counted[-1][1].items() if n > before.get(c, 0)}
            third = next((r - onset for r, c in counted if r >= onset and expected
                          and c.get(expected, 0) - before.get(expected, 0) >= least), None)
            out.append({"capture": name, "kind": interval.kind, "causes": dict(causes),
                        "planted_cause_in_10_slowest": causes.get(expected, 0) if expected else None,
                        "first_planted_sm_read_s": round(found[0], 1) if found else None,
                        "reads_with_unplanted_sms": others, "counted_by_cause": counted_since,
                        "planted_cause_counted_3_s": None if third is None else round(third, 1)})

    streams = [((t, i, signal, request) for signal, t, request in read_capture(c)) for i, c in enumerate(captures)]
    next_read = None
    for t_ns, _, signal, request in heapq.merge(*streams, key=lambda e: (e[0], e[1])):
        t = t_ns / 1e9
        next_read = t + scrape_s if next_read is None else next_read
        while t >= next_read:
            clock[0] = next_read
            reads.extend((next_read, snap.key.kernel, set(snap.contended))
                         for snap in aggregator.sm.snapshot(next_read) if snap.contended)
            counted.append((next_read, dict(aggregator.slow_request_causes() or {})))
            explain_due(next_read)
            next_read += scrape_s
        clock[0] = t
        sink.send(signal, request, 0)
    explain_due(float("inf"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("captures", nargs="+", type=Path, help="the run's kept captures")
    ap.add_argument("--scrape-s", type=float, default=2.0)
    ap.add_argument("--settle-s", type=float, default=20.0)
    ap.add_argument("--tail-s", type=float, default=6.0)
    ap.add_argument("--gauge-window-s", type=float, default=15.0)
    ap.add_argument("--json", type=Path, help="write the full result here")
    args = ap.parse_args(argv)
    results = replay_run(args.captures, args.scrape_s, args.settle_s, args.tail_s, args.gauge_window_s)
    for r in results:
        planted, first, unplanted = (r["planted_cause_in_10_slowest"], r["first_planted_sm_read_s"],
                                     r["reads_with_unplanted_sms"])
        print(f"{r['capture']}: {', '.join(f'{c} {n}' for c, n in r['causes'].items())}"
              + ("" if planted is None else f" (planted cause {planted}/10)")
              + ("" if first is None else f"; planted SMs read {first} s after onset")
              + (f"; {len(unplanted)} reads with SMs not planted, the first {unplanted[0][0]} s after onset"
                 if unplanted else "")
              + f"; counted slow: {', '.join(f'{c} {n}' for c, n in r['counted_by_cause'].items()) or 'none'}"
              + ("" if r["planted_cause_counted_3_s"] is None
                 else f" (the planted cause's third {r['planted_cause_counted_3_s']} s after onset)"))
    if args.json:
        write_cpu_result(args.json, "bench.replay_run", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
