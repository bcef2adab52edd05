"""How much a kernel-traced step slows the steps after it, from a capture.

A traced step's CUPTI records become kernel spans on other threads of the engine's process,
and that Python work takes the GIL from the engine thread. This reads a capture's
``engine.step`` spans in start order, finds the traced ones (with kernel-span children, or
with ``sightline.step.kernel_trace_reason``) and reports the duration of each traced step
and of the steps after it, against the median of the steps that are neither traced nor
right after a traced step; steps marked ``sightline.step.kernel_trace_backlog`` are counted.

    python -m bench.traced_step_stalls deploy/captures/h200-20261202-http.jsonl.gz \
        --out bench/results/traced_step_stalls-h200-capture.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from sightline.instrumentation import semconv

from .kernel_containment import attribute, capture_spans


# engines before the telemetry process marked steps run while a traced step was processed
LEGACY_BACKLOG_ATTRIBUTE = "sightline.step.kernel_trace_backlog"

def traced_step_stalls(path: str, after: int = 2, warmup_steps: int = 5) -> dict:
    """Per traced step: its duration and the next ``after`` steps' (ms); the first
    ``warmup_steps`` steps (compilation, allocator growth) are left out of the baseline."""
    steps, kernel_parents = [], set()
    for span in capture_spans(path):
        if span.name == semconv.SPAN_ENGINE_STEP:
            steps.append(span)
        elif span.name.startswith(semconv.SPAN_KERNEL_PREFIX):
            kernel_parents.add(span.parent_span_id)
    steps.sort(key=lambda s: s.start_time_unix_nano)
    ms = [(s.end_time_unix_nano - s.start_time_unix_nano) / 1e6 for s in steps]
    traced = [i for i, s in enumerate(steps)
              if s.span_id in kernel_parents or attribute(s, semconv.STEP_TRACE_REASON)]
    near = {j for i in traced for j in range(i, i + after + 1)}   # kept out of the baseline
    baseline = [ms[i] for i in range(warmup_steps, len(steps)) if i not in near]
    median = statistics.median(baseline) if baseline else None
    rows = [{"step_index": i, "traced_ms": round(ms[i], 1),
             "next_ms": [round(ms[j], 1) for j in range(i + 1, min(i + 1 + after, len(steps)))]}
            for i in traced]
    ends = [steps[i].end_time_unix_nano for i in traced]
    slow = []
    for i in range(warmup_steps, len(steps)):
        if i in traced or not median or ms[i] <= 5 * median:
            continue
        start = steps[i].start_time_unix_nano
        before = [end for end in ends if end <= start]
        slow.append({"step_index": i, "ms": round(ms[i], 1),
                     "ms_since_a_traced_step_ended":
                         round((start - max(before)) / 1e6, 1) if before else None})
    return {
        "capture": path, "steps": len(steps), "traced_steps": len(traced),
        "baseline_median_ms": None if median is None else round(median, 1),
        "traced": rows,
        "next_step_over_median": [round(r["next_ms"][0] / median, 1) for r in rows
                                  if r["next_ms"] and median],
        "marked_backlog": sum(1 for s in steps if attribute(s, LEGACY_BACKLOG_ATTRIBUTE)),
        # every untraced step over 5x the median, and how soon after a traced step it began
        "slow_steps": slow,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture")
    parser.add_argument("--after", type=int, default=2, help="steps reported after each traced one")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    result = traced_step_stalls(args.capture, after=args.after)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
