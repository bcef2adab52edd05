"""What each telemetry level costs an engine served over HTTP, spans going to a collector.

    python -m bench.overhead_http --model llama-8b --device cuda --rounds 12 --out bench/results

One ``sightline collector run``; one freshly started ``sightline engine serve`` per level,
all serving at once (``--max-model-len`` bounds each KV cache so that they fit on one GPU),
each on CPUs of its own with ``--pin`` (the load and the collector on the rest). A separate
load process (``bench.burst_load``) sends each round one burst of ``--concurrency`` streamed
completions to every server in turn, the order rotating between rounds, so that drift of the
machine hits every level alike; a warm-up round is discarded. Per level: output tokens/s
(median of bursts), the ratio to ``off`` paired by round, the engine's step times
(``/debug/steps``: median, steps over 2x the median), the share of the engine loop its
thread spent recording telemetry, the engine's and its telemetry process's CPU seconds per
1,000 output tokens, failures and telemetry drops.
"""

from __future__ import annotations

import argparse
import contextlib
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

from ._common import ROOT, device_name, git_commit, utc_now, write_json

CLI = [sys.executable, "-c", "import sys; from sightline.deploy.cli import main; sys.exit(main())"]
LEVELS = {                                 # name -> engine serve flags
    "off": ["--trace-level", "off"],
    "off-b": ["--trace-level", "off"],      # a second off engine: the method's own spread
    "off-sync": ["--trace-level", "off", "--no-async-scheduling"],   # each step waited for
    "kernels-sync": ["--trace-level", "kernels", "--no-async-scheduling"],
    "requests": ["--trace-level", "requests"],
    "steps": ["--trace-level", "steps"],
    "steps-nice0": ["--trace-level", "steps", "--telemetry-nice", "0"],   # telemetry process at the engine's priority
    "kernels-nice0": ["--trace-level", "kernels", "--telemetry-nice", "0"],
    "kernels": ["--trace-level", "kernels"],
    "kernels-probe16": ["--trace-level", "kernels", "--sm-probe-every", "16"],   # twice the CTAs
    "kernels@0.05": ["--trace-level", "kernels", "--kernel-sample-ratio", "0.05"],
    "kernels@0": ["--trace-level", "kernels", "--kernel-sample-ratio", "0"],          # probe only
    "kernels-no-probe": ["--trace-level", "kernels", "--no-sm-probe"],              # CUPTI only
    "kernels-probe-all": ["--trace-level", "kernels", "--sm-probe-every", "1"],     # every step's CTAs
    "kernels-detached": ["--trace-level", "kernels", "--cupti-detach"],             # CUPTI detached between traced steps
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


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def start_engine(args, level: str, otlp: str, port: int,
                 cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts one engine (on ``cpus``, which its threads and telemetry process inherit); the
    caller waits for its ``/health`` (engines start in parallel)."""
    engine = subprocess.Popen(CLI + ["engine", "serve", "--model", args.model, "--device", args.device,
                                     "--port", str(port), "--otlp-endpoint", otlp,
                                     "--max-model-len", str(args.max_model_len),
                                     "--max-num-seqs", str(args.concurrency), "--log-level", "warning",
                                     *args.engine_args, *LEVELS[level]],
                              preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    return engine, f"http://127.0.0.1:{port}"


def cpu_plan(levels: list[str], cpus: list[int]) -> dict[str, set[int]] | None:
    """Disjoint CPU sets: one per level, as even as the CPUs allow, and "load" (the load
    process and the collector) with the rest; None when a set would have fewer than two."""
    per = len(cpus) // (len(levels) + 1)
    if per < 2:
        return None
    plan = {level: set(cpus[i * per:(i + 1) * per]) for i, level in enumerate(levels)}
    plan["load"] = set(cpus[len(levels) * per:])
    return plan


def load(args, urls: list[str], pids: list[int], rounds: int, seed: int,
         cpus: set[int] | None = None) -> list[dict]:
    command = [sys.executable, "-m", "bench.burst_load", "--rounds", str(rounds),
               "--concurrency", str(args.concurrency), "--prompt", str(args.prompt),
               "--output", str(args.output), "--seed", str(seed)]
    for url, pid in zip(urls, pids):
        command += ["--url", url, "--pid", str(pid)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT,
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@contextlib.contextmanager
def serving(args, levels: list[str], plan: dict[str, set[int]] | None = None):
    """A running collector and one engine per level (on ``plan``'s CPUs, the collector on
    "load"'s), each answering; yields ``{level: (process, url)}`` and stops them all after."""
    grpc, http, zipkin, query = free_ports(4)
    collector = subprocess.Popen(CLI + ["collector", "run", "--otlp-grpc", f"127.0.0.1:{grpc}",
                                        "--otlp-http", f"127.0.0.1:{http}", "--zipkin",
                                        f"127.0.0.1:{zipkin}", "--http", f"127.0.0.1:{query}",
                                        "--log-level", "WARNING"])
    if plan:
        os.sched_setaffinity(collector.pid, plan["load"])
    engines: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        _wait_http(f"http://127.0.0.1:{query}/healthz", collector, 60)
        for level, port in zip(levels, free_ports(len(levels))):
            engines[level] = start_engine(args, level, f"http://127.0.0.1:{grpc}", port,
                                          plan[level] if plan else None)
        for level, (engine, url) in engines.items():
            _wait_http(url + "/health", engine, args.start_timeout_s)
            print(f"{level}: serving on {url}", flush=True)
        yield engines
    finally:
        for engine, _ in engines.values():
            engine.send_signal(signal.SIGTERM)
        for engine, _ in engines.values():
            try:
                engine.wait(timeout=60)
            except subprocess.TimeoutExpired:
                engine.kill()
        collector.send_signal(signal.SIGTERM)
        collector.wait(timeout=60)


def _per_step_us(before: dict, after: dict, steps: int) -> dict:
    """The engine thread's telemetry µs per untraced step and per traced step, between two
    ``/debug/steps`` reads (older engines lack the traced split: then all counts untraced)."""
    total = after["telemetry_engine_thread_s"] - before["telemetry_engine_thread_s"]
    traced_s = after.get("telemetry_traced_steps_s", 0.0) - before.get("telemetry_traced_steps_s", 0.0)
    traced = after.get("steps_traced", 0) - before.get("steps_traced", 0)
    untraced = max(steps - traced, 1)
    # untraced steps whose probe records were read (traced steps are probed too)
    probed_s = after.get("telemetry_probed_steps_s", 0.0) - before.get("telemetry_probed_steps_s", 0.0)
    probed = after.get("steps_probed", 0) - before.get("steps_probed", 0) - traced
    plain = max(untraced - max(probed, 0), 1)
    return {"untraced_step": round(1e6 * (total - traced_s) / untraced, 2),
            "traced_step": round(1e6 * traced_s / traced, 1) if traced else None,
            "steps_traced": traced,
            "probed_step": round(1e6 * probed_s / probed, 1) if probed > 0 else None,
            "plain_step": round(1e6 * (total - traced_s - probed_s) / plain, 2)}


def summarize(levels: list[str], bursts: list[dict], steps: dict[str, list[float]],
              metrics: dict[str, str]) -> dict:
    by_round: dict[int, dict[str, float]] = {}
    for b in bursts:
        by_round.setdefault(b["round"], {})[b["level"]] = b["output_tokens"] / b["wall_s"]
    summary = {}
    off_median = statistics.median(steps["off"] or [0.0])
    for level in levels:
        mine = [b for b in bursts if b["level"] == level]
        tokens = sum(b["output_tokens"] for b in mine)
        ratios = [r[level] / r["off"] for r in by_round.values() if "off" in r and level in r]
        durations = steps[level]
        median_step = statistics.median(durations) if durations else 0.0
        summary[level] = {
            "bursts": len(mine),
            "tokens_per_s_median": statistics.median(b["output_tokens"] / b["wall_s"] for b in mine),
            "ratio_vs_off_paired_median": statistics.median(ratios) if ratios else None,
            "ratio_vs_off_paired_range": [min(ratios), max(ratios)] if ratios else None,
            "median_step_ms": 1000 * median_step,
            "steps": len(durations),
            "steps_over_2x_median": sum(1 for d in durations if d > 2 * median_step),
            "steps_over_2x_off_median": sum(1 for d in durations if d > 2 * off_median),
            "engine_cpu_s_per_1k_tokens": 1000 * sum(b["server_cpu_s"] for b in mine) / max(tokens, 1),
            "telemetry_cpu_s_per_1k_tokens": 1000 * sum(b["children_cpu_s"] for b in mine) / max(tokens, 1),
            "failed": sum(b["failed"] for b in mine),
            "telemetry_dropped": _metric(metrics[level], "sightline_telemetry_events_dropped_total"),
            "telemetry_restarts": _metric(metrics[level], "sightline_telemetry_process_restarts_total"),
        }
    return summary


def format_table(summary: dict) -> str:
    lines = ["| level | bursts | tok/s | vs off (paired, median [range]) | median step ms "
             "| steps > 2x median | steps > 2x off's median | engine CPU s / 1k tok "
             "| telemetry CPU s / 1k tok | engine thread in telemetry | µs / untraced step "
             "| µs / plain, probed step | µs / traced step | CTAs probed / loop s | failed "
             "| dropped |",
             "|---" * 16 + "|"]
    for level, s in summary.items():
        lo, hi = s["ratio_vs_off_paired_range"] or (1.0, 1.0)
        us = s.get("engine_thread_telemetry_us") or {}
        lines.append(
            f"| {level} | {s['bursts']} | {s['tokens_per_s_median']:,.0f} | "
            f"{s['ratio_vs_off_paired_median']:.3f} [{lo:.3f}, {hi:.3f}] | {s['median_step_ms']:.2f} | "
            f"{s['steps_over_2x_median']} / {s['steps']} | {s['steps_over_2x_off_median']} | "
            f"{s['engine_cpu_s_per_1k_tokens']:.3f} | {s['telemetry_cpu_s_per_1k_tokens']:.3f} | "
            f"{100 * s.get('engine_thread_telemetry_share', 0.0):.3f} % | "
            f"{us.get('untraced_step')} | {us.get('plain_step')}, {us.get('probed_step')} | "
            f"{us.get('traced_step')} | {s.get('ctas_probed_per_loop_s', 0):,} | {s['failed']} | "
            f"{s['telemetry_dropped']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levels", default="off,off-b,steps,kernels,kernels-detached,kernels@0.05",
                    help=f"comma-separated, off first; known: {','.join(LEVELS)}")
    ap.add_argument("--rounds", type=int, default=12, help="bursts per level")
    ap.add_argument("--max-model-len", type=int, default=512,
                    help="per engine: bounds its KV cache, so that every level's engine fits at once")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--engine-args", nargs="*", default=[])
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="each engine, and the load with the collector, on CPUs of their own")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    levels = args.levels.split(",")
    if levels[0] != "off":
        raise SystemExit("--levels must start with off (the reference)")
    unknown = [level for level in levels if level not in LEVELS]
    if unknown:
        raise SystemExit(f"--levels: unknown {unknown}; known: {','.join(LEVELS)}")
    plan = cpu_plan(levels, sorted(os.sched_getaffinity(0))) if args.pin else None
    with serving(args, levels, plan) as engines:
        urls = [engines[level][1] for level in levels]
        pids = [engines[level][0].pid for level in levels]
        load_cpus = plan["load"] if plan else None
        load(args, urls, pids, 1, seed=999, cpus=load_cpus)       # warm-up, discarded
        before = {level: json.loads(_get(url + "/debug/steps")) for level, (_, url) in engines.items()}
        level_of = {url: level for level, (_, url) in engines.items()}
        bursts = [{**b, "level": level_of[b["url"]]} for b in load(args, urls, pids, args.rounds, 0, load_cpus)]
        after = {level: json.loads(_get(url + "/debug/steps")) for level, (_, url) in engines.items()}
        steps = {level: after[level]["durations_s"][len(before[level]["durations_s"]):]
                 for level in levels}
        in_situ = {level: (after[level]["telemetry_engine_thread_s"]
                           - before[level]["telemetry_engine_thread_s"])
                   / max(after[level]["loop_s"] - before[level]["loop_s"], 1e-9) for level in levels}
        # per step: the engine thread's telemetry time on untraced steps, and on traced ones
        per_step = {level: _per_step_us(before[level], after[level], len(steps[level]))
                    for level in levels}
        phases = {level: {phase: cpu_s - before[level]["gpu_telemetry_worker_phases_cpu_s"][phase]
                          for phase, cpu_s in after[level].get("gpu_telemetry_worker_phases_cpu_s",
                                                               {}).items()} for level in levels}
        gpu_worker_cpu = {level: after[level]["gpu_telemetry_worker_cpu_s"]
                          - before[level]["gpu_telemetry_worker_cpu_s"] for level in levels}
        metrics = {level: _get(url + "/metrics").decode() for level, (_, url) in engines.items()}
    summary = summarize(levels, bursts, steps, metrics)
    for level in levels:
        summary[level]["engine_thread_telemetry_share"] = in_situ[level]
        summary[level]["engine_thread_telemetry_us"] = per_step[level]
        summary[level]["gpu_worker_phase_cpu_s"] = phases[level]   # over all the bursts
        # what the per-SM histograms got: CTAs of probed steps per second of the engine loop
        summary[level]["ctas_probed_per_loop_s"] = round(
            (after[level].get("ctas_probed", 0) - before[level].get("ctas_probed", 0))
            / max(after[level]["loop_s"] - before[level]["loop_s"], 1e-9))
        summary[level]["gpu_worker_cpu_s_per_1k_tokens"] = 1000 * gpu_worker_cpu[level] / max(
            sum(b["output_tokens"] for b in bursts if b["level"] == level), 1)
    record = {"bench": "overhead_http", "commit": git_commit(), "device": device_name(args.device),
              "time": utc_now(), "args": vars(args) | {"out": str(args.out)},
              "cpu_plan": {k: sorted(v) for k, v in plan.items()} if plan else None,
              "summary": summary, "bursts": bursts}
    print(format_table(summary))
    if args.out is not None:
        write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
