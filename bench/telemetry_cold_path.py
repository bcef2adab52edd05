"""What the engine thread's per-step GPU telemetry calls cost warm and with cold caches (a
diagnosis), by kind of step: plain, probed (untraced), traced.

On the served engine the calls run right after the model's work, which has evicted them
from the CPU's caches; a warm loop of the same calls misses that. This makes the model
runner's calls of a step replaying a graph (``begin_step`` and ``end_step`` unless
``next_step_plain``; ``observe_step`` unless the step is quiet), once in a tight loop and
once with a cache-evicting workload (Python dict walks and an 8 MB copy) between steps.
``--device cpu``: a ``GpuTelemetry`` without probe or CUPTI. ``--device cuda``: with both, a
20-kernel graph replayed per step whose probed launches are snapshotted, and the probed
step's parts timed alone (the ring's device copy, a wake-up of the worker). Cost: seconds;
prints µs, medians.

    python -m bench.telemetry_cold_path [--device cuda] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

from sightline.instrumentation.gpu_telemetry import GpuTelemetry, GpuTelemetryConfig
from sightline.instrumentation.lifecycle import OpenStep

from ._common import device_name, git_commit, utc_now, write_json

CALLS = ("begin_step", "end_step", "observe_step")
KINDS = ("plain", "probed", "traced")
PROBED_LAUNCHES = 32 * [("fa2_paged_decode", 512)]   # a decode step's attention launches


class _Recorder:
    kernels_on = True

    def record(self, event) -> None:
        pass

    def name_step(self, step) -> None:
        if not step.trace_id:
            step.trace_id, step.span_id = 1, 2


class _Graphs:
    """The model runner's captured graphs, as ``end_step`` sees them."""

    def __init__(self, probe=None, replay=lambda: None) -> None:
        from sightline.instrumentation.sm_probe import ProbedLaunches
        self.probe, self.replay = probe, replay
        self._launches = ProbedLaunches(PROBED_LAUNCHES)

    def launches(self, bucket: int):
        return self._launches


def _telemetry(device: str) -> tuple[GpuTelemetry, _Graphs]:
    if device == "cpu":
        return GpuTelemetry(_Recorder(), 0, GpuTelemetryConfig(cupti=False, probe=False, seed=0)), _Graphs()
    import torch
    gpu = GpuTelemetry(_Recorder(), 0, GpuTelemetryConfig(seed=0))
    x = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.add_(1)
        with torch.cuda.graph(graph, stream=side):
            for _ in range(20):
                x.add_(1)
    torch.cuda.synchronize()
    assert gpu.start_kernel_tracing(), "CUPTI is unavailable"
    return gpu, _Graphs(gpu.probe, graph.replay)


def run(steps: int, evict: bool, device: str = "cpu") -> dict[str, dict[str, float]]:
    """µs per call of each kind of step, and how many steps of each kind ran."""
    gpu, graphs = _telemetry(device)
    junk = [{f"k{i}": list(range(50))} for i in range(20000)]
    buffer = bytearray(64 << 20)
    spent = {kind: dict.fromkeys(CALLS, 0.0) for kind in KINDS}
    counts = dict.fromkeys(KINDS, 0)
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
            probed_before = gpu.stats.steps_probed
            t0 = time.perf_counter()
            plain = gpu.next_step_plain   # as the model runner does: the usual step calls nothing
            if not plain:
                gpu.begin_step(step)
            t1 = time.perf_counter()
            graphs.replay()
            t2 = time.perf_counter()
            if not plain:
                gpu.end_step(step, None, (graphs, 64))
            t3 = time.perf_counter()
            duration = durations[i]
            # as the engine does: a quiet step is taken without a call (GpuTelemetry.quiet_steps)
            if gpu.quiet_steps and duration <= gpu.quiet_limit and not step.cupti_recorded:
                gpu.quiet_steps -= 1
                gpu.quiet_durations.append(duration)
            else:
                gpu.observe_step(step, duration)
            t4 = time.perf_counter()
            kind = ("traced" if step.attributes else
                    "probed" if gpu.stats.steps_probed > probed_before else "plain")
            counts[kind] += 1
            for name, took in zip(CALLS, (t1 - t0, t3 - t2, t4 - t3)):
                spent[kind][name] += took
            if device == "cuda" and i % 8 == 7:
                import torch
                torch.cuda.synchronize()   # as a step's token copy would, now and then
    finally:
        gpu.shutdown()
    return {kind: {**{name: round(1e6 * s / max(counts[kind], 1), 2) for name, s in spent[kind].items()},
                   "steps": counts[kind]} for kind in KINDS}


def probed_parts(calls: int = 2000) -> dict[str, float]:
    """µs per call, warm, on the engine thread with CUPTI attached and its kinds off (as
    between traced steps): the ring's device copy of a probed step, and the wake-up of the
    worker that a traced step makes."""
    gpu, graphs = _telemetry("cuda")
    try:
        ring, words = gpu.probe.snapshots, graphs.launches(64).ctas * 3
        t0 = time.perf_counter()
        for _ in range(calls):
            ring.place(words)
            ring.release_newest()
        place_us = 1e6 * (time.perf_counter() - t0) / calls
    finally:
        gpu.shutdown()
    return {"ring_copy_us": round(place_us, 2), "wake_us": round(wake_us(calls), 2)}


def wake_us(calls: int = 2000) -> float:
    """µs per ``threading.Event.set()`` that wakes a waiting thread (a traced step's hand-off)."""
    wake, woken = threading.Event(), threading.Event()
    stop = False

    def waiter() -> None:
        while not stop:
            if wake.wait(1.0):
                wake.clear()
                woken.set()
    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    spent = 0.0
    for _ in range(calls):
        woken.clear()
        time.sleep(0.0002)   # the waiter is back in wait()
        t0 = time.perf_counter()
        wake.set()
        spent += time.perf_counter() - t0
        woken.wait(1.0)
    stop = True
    wake.set()
    thread.join()
    return 1e6 * spent / calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result: dict = {"bench": "telemetry_cold_path", "commit": git_commit(),
                    "device": device_name(args.device), "time": utc_now()}
    for label, evict in (("warm", False), ("cold", True)):
        runs = [run(args.steps if evict else 10 * args.steps, evict, args.device)
                for _ in range(args.repeats)]
        result[label] = {kind: {name: statistics.median(r[kind][name] for r in runs)
                                for name in (*CALLS, "steps")} for kind in KINDS}
    if args.device == "cuda":
        result["probed_parts_warm"] = probed_parts()
    print(json.dumps(result, indent=1))
    if args.out is not None:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
