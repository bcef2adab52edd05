"""What CUPTI costs the CUDA calls of a process while no step is traced (a diagnosis).

    python -m bench.cupti_idle_cost --out bench/results

Each state runs in its own fresh process (CUPTI's attachment is process-wide and sticky),
states alternating over ``--repeats``: host time per small kernel launch, per CUDA graph
replay (50 kernels), per pinned host-to-device copy and per ``synchronize``.

States: ``none`` (CUPTI never loaded); ``kinds-off`` (``CuptiTracer`` started, then its
kinds switched off: what the engine does between traced steps); ``kernel-kind-off`` (only
CONCURRENT_KERNEL ever enabled, then off); ``finalized`` (``CuptiTracer`` started, off,
then ``cuptiFinalize``: CUPTI detached); ``kinds-on`` (a traced step's state); ``cycled``
(20 traced replays, each with ``CuptiTracer.enable`` attaching CUPTI before and ``detach``
after: the cost of a traced step's attach and detach, and what detaching leaves behind). Besides host times: GPU time per
replay of a 300-kernel graph (CUDA events), the figure a decode step's graph pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ._common import ROOT, device_name, git_commit, utc_now, write_json

STATES = ("none", "kinds-off", "kernel-kind-off", "finalized", "kinds-on", "cycled")


def _per_call_us(fn, calls: int) -> float:
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def measure(state: str) -> dict:
    import torch

    from sightline.instrumentation.cupti_tracer import CuptiTracer
    x = torch.zeros(1024, device="cuda")
    host = torch.zeros(4096, pin_memory=True)
    dev = torch.empty(4096, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(50):
                x.add_(1)
    big = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(big, stream=stream):
            for _ in range(300):
                x.add_(1)
    torch.cuda.synchronize()
    tracer = None
    if state in ("kinds-off", "finalized", "kinds-on"):
        tracer = CuptiTracer(lambda buffer: None)
        assert tracer.start(), tracer.unavailable_reason
        if state != "kinds-on":
            tracer.disable()
        if state == "finalized":
            tracer.flush()
            tracer._cupti.finalize()
    elif state == "kernel-kind-off":
        from cupti import cupti
        kind = cupti.ActivityKind.CONCURRENT_KERNEL
        cupti.activity_enable(kind)
        x.add_(1)
        cupti.activity_disable(kind)
    result = {"state": state}
    if state == "cycled":
        tracer = CuptiTracer(lambda buffer: None)
        assert tracer.start(), tracer.unavailable_reason
        tracer.detach()
        cycles = []
        for i in range(20):     # what GpuTelemetry does around a traced step
            t0 = time.perf_counter()
            tracer.enable()
            tracer.push(i + 1)
            big.replay()
            torch.cuda.synchronize()
            tracer.pop()
            tracer.flush()
            tracer.detach()
            cycles.append(time.perf_counter() - t0)
        assert tracer.detaches == 21 and tracer.available
        tracer = None
        result["attach_detach_ms"] = 1e3 * statistics.median(cycles)
        result["attach_detach_max_ms"] = 1e3 * max(cycles)
    for _ in range(2):     # the second round is the one kept (warm)
        result["launch_us"] = _per_call_us(lambda: x.add_(1), 20000)
        result["graph_replay_us"] = _per_call_us(graph.replay, 2000)
        result["h2d_copy_us"] = _per_call_us(lambda: dev.copy_(host, non_blocking=True), 5000)
        result["synchronize_us"] = _per_call_us(torch.cuda.synchronize, 5000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            big.replay()
        end.record()
        end.synchronize()
        result["graph300_gpu_us"] = 1e3 * start.elapsed_time(end) / 200
    if tracer is not None and state == "kinds-on":
        tracer.stop()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", choices=STATES, help="measure one state in this process")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.state:
        print(json.dumps(measure(args.state)), flush=True)
        return 0
    runs: dict[str, list[dict]] = {s: [] for s in STATES}
    for _ in range(args.repeats):
        for state in STATES:
            out = subprocess.run([sys.executable, "-m", "bench.cupti_idle_cost", "--state", state],
                                 capture_output=True, text=True, cwd=ROOT)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode != 0 or not lines:
                print(f"{state}: failed\n{out.stderr[-2000:]}", flush=True)
                continue
            runs[state].append(json.loads(lines[-1]))
    keys = ("launch_us", "graph_replay_us", "h2d_copy_us", "synchronize_us", "graph300_gpu_us",
            "attach_detach_ms")
    summary = {s: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in keys}
               for s, rs in runs.items() if rs}
    print("| state | launch µs | graph replay µs | H2D copy µs | synchronize µs "
          "| 300-kernel graph, GPU µs | attach+detach ms |")
    print("|---|---|---|---|---|---|---|")
    for s, v in summary.items():
        print(f"| {s} | " + " | ".join(f"{v[k]:.2f}" for k in keys) + " |")
    if args.out is not None:
        record = {"bench": "cupti_idle_cost", "commit": git_commit(), "device": device_name("cuda"),
                  "time": utc_now(), "summary": summary, "runs": runs}
        write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
