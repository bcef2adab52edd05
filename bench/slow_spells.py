"""How much of an engine's time the GPU telemetry's slow-spell rule would spend in a spell,
inside a capture's planted interval and outside it, for several settings of the rule.

Each capture is replayed into an in-process collector (as ``bench.replay_causes`` does); its
steps, in order, go through the engine's own rule: ``TailPolicy``'s window and slow limit
(``slow_step_factor`` x the window's median), a spell begun by ``SlowSpellRule`` (``slow_steps``
decode-only steps over it within ``slow_within_steps`` steps, beyond the engine's own rate of
them) and lasting ``slow_spell_s`` past the last
(kernel-traced steps stay out, as in the engine: their tracing slows them). A spell should
cover a stall (the GIL hog, the HBM hog) and little of the usual load.
Guarantee: the engine's classes and settings, the capture's step durations and kinds.
Cost: the replay (about 5 s per MB of capture), then O(steps) per setting.

    python -m bench.slow_spells [CAPTURE ...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np

from sightline.collector.engine_timeline import step_facts
from sightline.deploy.demo import CAPTURES_DIR
from sightline.instrumentation.gpu_telemetry import GpuTelemetryConfig, TailPolicy
from sightline.instrumentation.slow_spells import SlowSpellRule

from ._common import write_cpu_result
from .replay_causes import replayed

# (factor, slow steps, within steps, beyond the engine's own rate of slow steps too): the
# engine's default first
DEFAULT = GpuTelemetryConfig()
SETTINGS = [(DEFAULT.slow_step_factor, DEFAULT.slow_steps, DEFAULT.slow_within_steps, True),
            (DEFAULT.slow_step_factor, DEFAULT.slow_steps, DEFAULT.slow_within_steps, False),
            (1.5, 3, 64, False), (2.0, 3, 64, False), (2.0, 6, 64, False), (3.0, 6, 64, False)]


def steps_and_interval(capture: Path) -> tuple[dict, int, int]:
    """The capture's steps (the collector's arrays, by start) and its first planted interval
    on the replay's clock (0, 0 without one)."""
    aggregator, result, intervals = replayed(capture)
    facts = []
    aggregator.store.read(lambda store: facts.extend(step_facts(trace, step) for trace in store.traces()
                                                     for step in trace.step_spans))
    facts.sort(key=lambda f: f.start_ns)
    a = {"start": np.array([f.start_ns for f in facts], dtype=np.int64),
         "end": np.array([f.end_ns for f in facts], dtype=np.int64),
         "kind": np.array([f.kind for f in facts]), "gpu": np.array([f.gpu_s for f in facts]),
         "duration": np.array([(f.end_ns - f.start_ns) / 1e9 for f in facts])}
    if not intervals:
        return a, 0, 0
    return a, result.time_map(intervals[0].start_unix_nano), result.time_map(intervals[0].end_unix_nano)


def spells(a: dict, factor: float, slow_steps: int, within: int, beyond_rate: bool = True) -> list[tuple[int, int]]:
    """The spells (start, end ns) the engine's rule would have begun over ``a``'s steps
    (``beyond_rate`` False: ``slow_steps`` in ``within`` alone, the rule before 2026-12-05)."""
    c = DEFAULT
    policy = TailPolicy(c.kernel_sample_ratio, c.tail_quantile, c.tail_window_steps, c.tail_min_steps,
                        random.Random(0), refresh_steps=64, slow_factor=factor)
    rule = SlowSpellRule(slow_steps, within) if beyond_rate else SlowSpellRule(slow_steps, within,
                                                                                min_base_steps=1 << 62)
    out: list[list[int]] = []
    spell_ns = int(c.slow_spell_s * 1e9)
    for i in range(len(a["start"])):
        if np.isfinite(a["gpu"][i]):   # traced: out of both rules
            continue
        duration, start = float(a["duration"][i]), int(a["start"][i])
        is_slow = a["kind"][i] == 0 and duration > policy.slow_limit
        policy.is_tail(duration)
        if not is_slow:
            continue
        if not rule.observe(i, bool(out) and start < out[-1][1]):
            continue
        if out and start < out[-1][1]:
            out[-1][1] = start + spell_ns   # the spell lasts on
        else:
            out.append([start, start + spell_ns])
    return [(s, e) for s, e in out]


def shares(a: dict, lo: int, hi: int, found: list[tuple[int, int]]) -> dict:
    """The share of the interval's time, and of the rest of the capture's, spent in a spell."""
    first, last = int(a["start"][0]), int(a["end"][-1])
    inside = sum(max(0, min(e, hi) - max(s, lo)) for s, e in found)
    total = sum(max(0, min(e, last) - max(s, first)) for s, e in found)
    span_in, span_out = max(hi - lo, 0), (last - first) - max(hi - lo, 0)
    return {"inside": round(inside / span_in, 3) if span_in else None,
            "outside": round((total - inside) / span_out, 3) if span_out > 0 else None,
            "spells": len(found)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("captures", nargs="*", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    captures = args.captures or sorted(CAPTURES_DIR.glob("*.jsonl.gz"))
    results = []
    for capture in captures:
        a, lo, hi = steps_and_interval(capture)
        row = {"capture": capture.name, "interval_s": (hi - lo) / 1e9, "settings": {}}
        for factor, slow_steps, within, beyond_rate in SETTINGS:
            name = f"{factor:g}x, {slow_steps} in {within}{', beyond its rate' if beyond_rate else ''}"
            row["settings"][name] = shares(a, lo, hi, spells(a, factor, slow_steps, within, beyond_rate))
        results.append(row)
        print(capture.name, "; ".join(f"{k}: {v['inside']} in, {v['outside']} out" for k, v in row["settings"].items()),
              flush=True)
    if args.json:
        write_cpu_result(args.json, "bench.slow_spells", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
