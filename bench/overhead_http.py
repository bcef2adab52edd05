"""What each telemetry level costs an engine served over HTTP, spans going to a collector.

    python -m bench.overhead_http --model llama-8b --device cuda --rounds 2 --bursts 6 \
        --out bench/results

One ``sightline collector run`` for the whole run. Per round, every level gets a freshly
started ``sightline engine serve`` (levels rotated between rounds), one warm-up burst, then
``--bursts`` bursts of ``--concurrency`` streamed completions from a separate load process
(``bench/burst_load.py``). Reported per level: output tokens/s per burst (median), the
ratio to ``off`` paired by round, the engine's step times (``/debug/steps``: median, steps
over 2x the median), the engine process's and its telemetry process's CPU seconds per
1,000 output tokens, failed requests and telemetry drops from the engine's /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from sightline.deploy.processes import free_ports

from ._common import ROOT, device_name, git_commit, utc_now

CLI = [sys.executable, "-c", "import sys; from sightline.deploy.cli import main; sys.exit(main())"]
LEVELS = {                                 # name -> engine serve flags
    "off": ["--trace-level", "off"],
    "requests": ["--trace-level", "requests"],
    "steps": ["--trace-level", "steps"],
    "kernels": ["--trace-level", "kernels"],
    "kernels@0.05": ["--trace-level", "kernels", "--kernel-sample-ratio", "0.05"],
}


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


def _wait_http(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            _get(url, 2.0)
            return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def run_level(args, level: str, otlp: str, round_: int) -> dict:
    [port] = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    engine = subprocess.Popen(CLI + ["engine", "serve", "--model", args.model, "--device", args.device,
                                     "--port", str(port), "--otlp-endpoint", otlp,
                                     "--max-num-seqs", str(args.concurrency), "--log-level", "warning",
                                     *args.engine_args, *LEVELS[level]])
    try:
        _wait_http(url + "/health", engine, args.start_timeout_s)
        load = [sys.executable, str(ROOT / "bench" / "burst_load.py"), "--url", url,
                "--concurrency", str(args.concurrency), "--prompt", str(args.prompt),
                "--output", str(args.output), "--seed", str(round_)]
        subprocess.run(load + ["--bursts", "1"], check=True, capture_output=True)   # warm-up
        steps_before = len(json.loads(_get(url + "/debug/steps"))["durations_s"])
        telemetry = _children(engine.pid)
        cpu0 = _cpu_s(engine.pid), sum(_cpu_s(c) for c in telemetry)
        out = subprocess.run(load + ["--bursts", str(args.bursts)], check=True, capture_output=True,
                             text=True).stdout
        cpu1 = _cpu_s(engine.pid), sum(_cpu_s(c) for c in telemetry if Path(f"/proc/{c}").exists())
        bursts = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        steps = json.loads(_get(url + "/debug/steps"))["durations_s"][steps_before:]
        metrics = _get(url + "/metrics").decode()
    finally:
        engine.send_signal(signal.SIGTERM)
        try:
            engine.wait(timeout=60)
        except subprocess.TimeoutExpired:
            engine.kill()
    tokens = sum(b["output_tokens"] for b in bursts)
    median_step = statistics.median(steps) if steps else 0.0
    return {
        "level": level, "round": round_,
        "tokens_per_s": [b["output_tokens"] / b["wall_s"] for b in bursts],
        "failed": sum(b["failed"] for b in bursts), "output_tokens": tokens,
        "steps": len(steps), "median_step_s": median_step,
        "steps_over_2x_median": sum(1 for s in steps if s > 2 * median_step),
        "steps_over_100ms": sum(1 for s in steps if s > 0.1),
        "engine_cpu_s_per_1k_tokens": 1000 * (cpu1[0] - cpu0[0]) / max(tokens, 1),
        "telemetry_cpu_s_per_1k_tokens": 1000 * (cpu1[1] - cpu0[1]) / max(tokens, 1),
        "telemetry_dropped": _metric(metrics, "sightline_telemetry_events_dropped_total"),
        "telemetry_restarts": _metric(metrics, "sightline_telemetry_process_restarts_total"),
    }


def summarize(runs: list[dict]) -> dict:
    levels = list(dict.fromkeys(r["level"] for r in runs))
    off = {r["round"]: statistics.median(r["tokens_per_s"]) for r in runs if r["level"] == "off"}
    summary = {}
    for level in levels:
        mine = [r for r in runs if r["level"] == level]
        ratios = [statistics.median(r["tokens_per_s"]) / off[r["round"]] for r in mine if r["round"] in off]
        summary[level] = {
            "tokens_per_s_median": statistics.median(t for r in mine for t in r["tokens_per_s"]),
            "ratio_vs_off_paired_median": statistics.median(ratios) if ratios else None,
            "ratio_vs_off_by_round": ratios,
            "median_step_ms": 1000 * statistics.median(r["median_step_s"] for r in mine),
            "steps_over_2x_median": sum(r["steps_over_2x_median"] for r in mine),
            "steps_over_100ms": sum(r["steps_over_100ms"] for r in mine),
            "steps": sum(r["steps"] for r in mine),
            "engine_cpu_s_per_1k_tokens": statistics.median(r["engine_cpu_s_per_1k_tokens"] for r in mine),
            "telemetry_cpu_s_per_1k_tokens": statistics.median(r["telemetry_cpu_s_per_1k_tokens"] for r in mine),
            "failed": sum(r["failed"] for r in mine),
            "telemetry_dropped": sum(r["telemetry_dropped"] for r in mine),
        }
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--engine-args", nargs="*", default=[])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    levels = args.levels.split(",")
    grpc, http, zipkin, query = free_ports(4)
    collector = subprocess.Popen(CLI + ["collector", "run", "--otlp-grpc", f"127.0.0.1:{grpc}",
                                        "--otlp-http", f"127.0.0.1:{http}", "--zipkin",
                                        f"127.0.0.1:{zipkin}", "--http", f"127.0.0.1:{query}",
                                        "--log-level", "WARNING"])
    runs = []
    try:
        _wait_http(f"http://127.0.0.1:{query}/healthz", collector, 60)
        for round_ in range(args.rounds):
            order = levels[round_ % len(levels):] + levels[:round_ % len(levels)]
            if round_ % 2:
                order = order[::-1]
            for level in order:
                run = run_level(args, level, f"http://127.0.0.1:{grpc}", round_)
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "tokens_per_s"}), flush=True)
        collector_metrics = _get(f"http://127.0.0.1:{query}/metrics").decode()
    finally:
        collector.send_signal(signal.SIGTERM)
        collector.wait(timeout=60)
    summary = summarize(runs)
    record = {"bench": "overhead_http", "commit": git_commit(), "device": device_name(args.device),
              "time": utc_now(), "args": vars(args) | {"out": str(args.out)}, "summary": summary,
              "runs": runs, "collector_kernel_trace_backlog_steps":
                  _metric(collector_metrics, "sightline_steps_kernel_trace_backlog_total")}
    print("| level | tok/s | vs off (paired) | median step ms | steps > 2x median | engine CPU s / 1k tok "
          "| telemetry CPU s / 1k tok | failed | dropped |")
    print("|---|---|---|---|---|---|---|---|---|")
    for level, s in summary.items():
        ratio = s["ratio_vs_off_paired_median"]
        print(f"| {level} | {s['tokens_per_s_median']:,.0f} | {ratio:.3f} | {s['median_step_ms']:.1f} | "
              f"{s['steps_over_2x_median']} / {s['steps']} | {s['engine_cpu_s_per_1k_tokens']:.2f} | "
              f"{s['telemetry_cpu_s_per_1k_tokens']:.2f} | {s['failed']} | {s['telemetry_dropped']:.0f} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"overhead_http-{record['device'].replace(' ', '-').lower()}-{record['commit'][:8]}.json"
        (args.out / name).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
