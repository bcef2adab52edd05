"""What the engine thread's per-step GPU telemetry calls cost warm and with cold caches (a
CPU diagnosis).

On the served engine the calls run right after the model's work, which has evicted them
from the CPU's caches; a warm loop of the same calls misses that. This times each call of
an untraced step replaying a graph, as the model runner makes them (``begin_step`` and
``end_step`` only when ``next_step_plain`` is not set; ``observe_step``) on a ``GpuTelemetry`` without CUDA (no probe, no CUPTI), once in a tight
loop and once with a cache-evicting workload (Python dict walks and an 8 MB copy) between
steps. Cost: a few seconds; prints µs per call, median of ``--repeats``.

    python -m bench.telemetry_cold_path
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from sightline.instrumentation.gpu_telemetry import GpuTelemetry, GpuTelemetryConfig
from sightline.instrumentation.lifecycle import OpenStep

CALLS = ("begin_step", "end_step", "observe_step")


class _Recorder:
    kernels_on = True

    def record(self, event) -> None:
        pass


class _Graphs:
    probe = None


def run(steps: int, evict: bool) -> dict[str, float]:
    gpu = GpuTelemetry(_Recorder(), 0, GpuTelemetryConfig(cupti=False, probe=False, seed=0))
    graphs, junk = _Graphs(), [{f"k{i}": list(range(50))} for i in range(20000)]
    buffer, spent = bytearray(64 << 20), dict.fromkeys(CALLS, 0.0)
    draw = random.Random(0)
    durations = [0.005 * draw.lognormvariate(0.0, 0.05) for _ in range(steps)]
    try:
        for i in range(steps):
            if evict:   # stands for the step's own Python and memory traffic
                total = 0
                for d in junk[(i * 997) % 15000:(i * 997) % 15000 + 3000]:
                    for v in d.values():
                        total += v[3]
                bytes(buffer[:8 << 20])
            step = OpenStep(i, 1, 2, 0)
            t0 = time.perf_counter()
            plain = gpu.next_step_plain   # as the model runner does: the usual step calls nothing
            if not plain:
                gpu.begin_step(step)
            t1 = time.perf_counter()
            if not plain:
                gpu.end_step(step, None, (graphs, 64))
            t2 = time.perf_counter()
            gpu.observe_step(step, durations[i])
            t3 = time.perf_counter()
            for name, a, b in zip(CALLS, (t0, t1, t2), (t1, t2, t3)):
                spent[name] += b - a
    finally:
        gpu.shutdown()
    return {name: round(1e6 * s / steps, 2) for name, s in spent.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    result = {}
    for label, evict in (("warm", False), ("cold", True)):
        runs = [run(args.steps if evict else 20 * args.steps, evict) for _ in range(args.repeats)]
        result[label] = {name: statistics.median(r[name] for r in runs) for name in CALLS}
        result[label]["total"] = round(sum(result[label][name] for name in CALLS), 2)
    print(json.dumps({"us_per_call": result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
