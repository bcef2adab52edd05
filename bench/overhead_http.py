"""What each telemetry level costs an engine served over HTTP, spans going to a collector.

    python -m bench.overhead_http --model llama-8b --device cuda --rounds 12 --concurrency 64 256

One ``sightline collector run``; one freshly started ``sightline engine serve`` per level (an
engine core, its API server(s) and, when tracing, its telemetry process), all serving at
once (``--max-model-len``, default prompt + output, bounds each KV cache so that they fit on
one GPU). With ``--pin`` each level's core and API servers get CPUs of their own, the
telemetry processes share a pool (one level is under load at a time) and the load and the
collector get the rest. A separate load process (``bench.burst_load``) sends each round one
burst of ``--concurrency`` streamed completions to every server in turn, the order rotating
between rounds, so that drift hits every level alike; a warm-up round is discarded. Per
concurrency and level: output tokens/s (median of bursts), the ratio to ``off`` paired by
round, the core's step times (``/debug/steps``), its loop's share in telemetry, CPU s per
1,000 output tokens of core, API servers and telemetry process, failures, telemetry counters.
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
import tempfile
import time
import urllib.request
from pathlib import Path

from sightline.deploy.processes import free_ports

from ._collector import CollectorProcess
from ._common import ROOT, _children, device_name, git_commit, steps_since_traced, utc_now, wait_http, write_json

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
    "kernels-no-spell": ["--trace-level", "kernels", "--kernel-sample-ratio-slow", "0"],  # no slow spell
}


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def concurrencies(args) -> list[int]:
    """``args.concurrency``: one value or several."""
    return list(args.concurrency) if isinstance(args.concurrency, (list, tuple)) else [args.concurrency]


def start_engine(args, level: str, otlp: str, port: int,
                 cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts one ``engine serve`` (on ``cpus``, which its core, API servers and telemetry
    process inherit); the caller waits for its ``/health`` (engines start in parallel)."""
    max_model_len = getattr(args, "max_model_len", None) or args.prompt + args.output
    engine = subprocess.Popen(CLI + ["engine", "serve", "--model", args.model, "--device", args.device,
                                     "--port", str(port), "--otlp-endpoint", otlp,
                                     "--max-model-len", str(max_model_len),
                                     "--max-num-seqs", str(max(concurrencies(args))),
                                     "--log-level", "warning", *args.engine_args, *LEVELS[level]],
                              preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    return engine, f"http://127.0.0.1:{port}"


def api_server_count(engine_args: list[str]) -> int:
    """``--api-server-count`` among the engines' flags (1 when absent)."""
    for i, flag in enumerate(engine_args):
        if flag == "--api-server-count" and i + 1 < len(engine_args):
            return int(engine_args[i + 1])
        if flag.startswith("--api-server-count="):
            return int(flag.partition("=")[2])
    return 1


def cpu_plan(levels: list[str], cpus: list[int], per_level: int = 2,
             telemetry: int = 2) -> dict[str, set[int]] | None:
    """Disjoint CPU sets: ``per_level`` for each level (its engine core and API servers: one
    CPU each), "telemetry" (``telemetry`` CPUs every level's telemetry process shares: one
    level is under load at a time) and "load" (the load process and the collector) with the
    rest; None when the load would get fewer than two."""
    used = per_level * len(levels) + telemetry
    if len(cpus) - used < 2:
        return None
    plan = {level: set(cpus[i * per_level:(i + 1) * per_level]) for i, level in enumerate(levels)}
    plan["telemetry"] = set(cpus[used - telemetry:used])
    plan["load"] = set(cpus[used:])
    return plan


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        found += children
        todo += children
    return found


def telemetry_pids(pid: int) -> list[int]:
    """The telemetry processes under ``engine serve`` ``pid`` (a child of its engine core)."""
    found = []
    for child in _descendants(pid):
        with contextlib.suppress(OSError):
            if b"sightline.instrumentation.telemetry_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (its threads started before keep their own
    affinity otherwise)."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cpus)


def load(args, urls: list[str], pids: list[int], rounds: int, seed: int,
         cpus: set[int] | None = None, concurrency: int | None = None,
         core_pids: list[int] | None = None) -> list[dict]:
    concurrency = concurrency or max(concurrencies(args))
    command = [sys.executable, "-m", "bench.burst_load", "--rounds", str(rounds),
               "--concurrency", str(concurrency), "--prompt", str(args.prompt),
               "--output", str(args.output), "--seed", str(seed)]
    for url, pid in zip(urls, pids):
        command += ["--url", url, "--pid", str(pid)]
    for core_pid in core_pids or ():
        command += ["--core-pid", str(core_pid)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT,
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@contextlib.contextmanager
def serving(args, levels: list[str], plan: dict[str, set[int]] | None = None):
    """A running collector and one engine per level (on ``plan``'s CPUs, the collector on
    "load"'s), each answering; yields ``{level: (process, url)}`` and stops them all after."""
    with tempfile.TemporaryDirectory(prefix="overhead-http-") as folder:
        # ready, not only live: its byte walks compiled (a cold numba cache takes tens of seconds)
        collector = CollectorProcess(Path(folder) / "collector.log", cpus=plan["load"] if plan else None,
                                     ready_timeout_s=180)
        engines: dict[str, tuple[subprocess.Popen, str]] = {}
        try:
            for level, port in zip(levels, free_ports(len(levels))):
                engines[level] = start_engine(args, level, collector.url("grpc"), port,
                                              plan[level] if plan else None)
            for level, (engine, url) in engines.items():
                wait_http(url + "/health", engine, args.start_timeout_s)
                print(f"{level}: serving on {url}", flush=True)
            if plan and "telemetry" in plan:   # every telemetry process on the shared pool
                for engine, _ in engines.values():
                    for pid in telemetry_pids(engine.pid):
                        pin_process(pid, plan["telemetry"])
            yield engines
        finally:
            for engine, _ in engines.values():
                engine.send_signal(signal.SIGTERM)
            for engine, _ in engines.values():
                try:
                    engine.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    engine.kill()
            collector.stop()
            said = collector.log.read_text(errors="replace").strip()
            if said:   # its warnings, where the run's own output can show them
                print(f"collector log:\n{said[-4000:]}", file=sys.stderr)


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
            # of them, traced in slow spells (a higher ratio after a decode step well over the median)
            "steps_traced_spell": after.get("steps_traced_spell", 0) - before.get("steps_traced_spell", 0),
            # and the first with prefill tokens once none was traced for an interval
            "steps_traced_prefill": after.get("steps_traced_prefill", 0) - before.get("steps_traced_prefill", 0),
            "probed_step": round(1e6 * probed_s / probed, 1) if probed > 0 else None,
            "plain_step": round(1e6 * (total - traced_s - probed_s) / plain, 2)}


TELEMETRY_COUNTERS = {            # summary key -> series on /metrics (the core's, once)
    "telemetry_dropped": "sightline_telemetry_events_dropped_total",
    "telemetry_held": "sightline_telemetry_events_held_total",
    "telemetry_orphaned": "sightline_telemetry_events_orphaned_total",
    "telemetry_restarts": "sightline_telemetry_process_restarts_total",
}


def summarize(levels: list[str], bursts: list[dict], steps: dict[str, list[float]],
              metrics: dict[str, str], metrics_before: dict[str, str] | None = None) -> dict:
    """Per level; the telemetry counters are ``metrics`` less ``metrics_before`` (scrapes)."""
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
            "api_server_cpu_s_per_1k_tokens":
                1000 * sum(b.get("api_server_cpu_s", 0.0) for b in mine) / max(tokens, 1),
            "telemetry_cpu_s_per_1k_tokens": 1000 * sum(b["children_cpu_s"] for b in mine) / max(tokens, 1),
            "failed": sum(b["failed"] for b in mine),
        }
        before = (metrics_before or {}).get(level, "")
        for key, name in TELEMETRY_COUNTERS.items():
            summary[level][key] = _metric(metrics[level], name) - _metric(before, name)
    return summary


def after_traced(durations: list[float], traced: list[int], reach: int = 6) -> dict | None:
    """What a traced step cost the loop around it: the mean loop time (ms) of the traced steps
    and of the steps 1 to ``reach`` after one, beside the steps farther from any (the usual),
    and the excess summed over them (ms per traced step; offsets count from the latest
    traced step). A stall that a trace's close puts on a later launch shows there."""
    if len(traced) != len(durations) or not any(traced):
        return None
    since = steps_since_traced(range(len(traced)), traced)
    far = [d for d, k, t in zip(durations, since, traced) if not t and (k is None or k > reach)]
    if not far:
        return None
    usual = statistics.fmean(far)
    by_offset = {}
    for k in range(reach + 1):
        chosen = [d for d, s, t in zip(durations, since, traced) if (t if k == 0 else (not t and s == k))]
        if chosen:
            by_offset[str(k)] = round(1000 * statistics.fmean(chosen), 3)
    excess = sum(ms - 1000 * usual for ms in by_offset.values())
    return {"usual_ms": round(1000 * usual, 3), "mean_ms": by_offset, "excess_ms_per_traced": round(excess, 3),
            "traced": sum(traced)}


def slow_decode_steps(durations: list[float], tokens: list[list[int]], factor: float = 1.5) -> dict:
    """What a slow spell reads: decode-only steps over ``factor`` x the median decode-only
    step, how many, their median batch beside all decode-only steps', and the steps just
    before them (kinds: ``prefill`` when it had prefill tokens)."""
    decode = [(d, t[1], i) for i, (d, t) in enumerate(zip(durations, tokens)) if t[0] == 0]
    if not decode:
        return {"decode_only": 0}
    limit = factor * statistics.median(d for d, _, _ in decode)
    slow = [(d, batch, i) for d, batch, i in decode if d > limit]
    return {"decode_only": len(decode), "over_limit": len(slow),
            "median_batch": statistics.median(batch for _, batch, _ in decode),
            "median_batch_over_limit": statistics.median(batch for _, batch, _ in slow) if slow else None,
            "after_prefill": sum(1 for *_, i in slow if i > 0 and tokens[i - 1][0] > 0)}


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.3f}"


def format_table(summary: dict) -> str:
    lines = ["| level | bursts | tok/s | vs off (paired, median [range]) | median step ms "
             "| steps > 2x median | steps > 2x off's median | engine CPU s / 1k tok "
             "| API servers CPU s / 1k tok | telemetry CPU s / 1k tok | engine thread in telemetry "
             "| µs / untraced step | µs / plain, probed step | µs / traced step "
             "| slow spells (steps traced in them; slow-step rate, limit per window) "
             "| loop ms a traced step and the 6 after it cost beyond the usual "
             "| CTAs probed / loop s | failed | dropped | held | orphaned |",
             "|---" * 21 + "|"]
    for level, s in summary.items():
        lo, hi = s["ratio_vs_off_paired_range"] or (1.0, 1.0)
        us = s.get("engine_thread_telemetry_us") or {}
        lines.append(
            f"| {level} | {s['bursts']} | {s['tokens_per_s_median']:,.0f} | "
            f"{s['ratio_vs_off_paired_median']:.3f} [{lo:.3f}, {hi:.3f}] | {s['median_step_ms']:.2f} | "
            f"{s['steps_over_2x_median']} / {s['steps']} | {s['steps_over_2x_off_median']} | "
            f"{s['engine_cpu_s_per_1k_tokens']:.3f} | {s.get('api_server_cpu_s_per_1k_tokens', 0.0):.3f} | "
            f"{s['telemetry_cpu_s_per_1k_tokens']:.3f} | "
            f"{100 * s.get('engine_thread_telemetry_share', 0.0):.3f} % | "
            f"{us.get('untraced_step')} | {us.get('plain_step')}, {us.get('probed_step')} | "
            f"{us.get('traced_step')} | {s.get('slow_spells', 0)} ({us.get('steps_traced_spell', 0)}; "
            f"{_rate(s.get('slow_step_rate'))}, {s.get('slow_spell_limit', '-')}) | "
            f"{(s.get('after_traced') or {}).get('excess_ms_per_traced', '-')} | "
            f"{s.get('ctas_probed_per_loop_s', 0):,} | {s['failed']} | "
            f"{s['telemetry_dropped']:.0f} | {s.get('telemetry_held', 0):.0f} | "
            f"{s.get('telemetry_orphaned', 0):.0f} |")
    return "\n".join(lines)


def measure(args, levels: list[str], engines: dict, core_pids: list[int], concurrency: int,
            load_cpus: set[int] | None) -> tuple[dict, list[dict]]:
    """``args.rounds`` interleaved rounds at ``concurrency``: (summary per level, bursts)."""
    urls = [engines[level][1] for level in levels]
    pids = [engines[level][0].pid for level in levels]
    before = {level: json.loads(_get(url + "/debug/steps")) for level, (_, url) in engines.items()}
    scraped = {level: _get(url + "/metrics").decode() for level, (_, url) in engines.items()}
    level_of = {url: level for level, (_, url) in engines.items()}
    bursts = [{**b, "level": level_of[b["url"]], "concurrency": concurrency}
              for b in load(args, urls, pids, args.rounds, concurrency, load_cpus, concurrency, core_pids)]
    after = {level: json.loads(_get(url + "/debug/steps")) for level, (_, url) in engines.items()}
    time.sleep(1.0)   # the telemetry process reports its counters twice a second
    metrics = {level: _get(url + "/metrics").decode() for level, (_, url) in engines.items()}
    # the core keeps its last 65,536 step times: far more than a run's steps
    steps = {level: after[level]["durations_s"][len(before[level]["durations_s"]):] for level in levels}
    tokens = {level: after[level]["tokens"][len(before[level]["tokens"]):] for level in levels}
    summary = summarize(levels, bursts, steps, metrics, scraped)
    for level in levels:
        b, a = before[level], after[level]
        loop_s = max(a["loop_s"] - b["loop_s"], 1e-9)
        s = summary[level]
        s["engine_thread_telemetry_share"] = (a["telemetry_engine_thread_s"]
                                              - b["telemetry_engine_thread_s"]) / loop_s
        # per step: the engine thread's telemetry time on untraced steps, and on traced ones
        s["engine_thread_telemetry_us"] = _per_step_us(b, a, len(steps[level]))
        s["gpu_worker_phase_cpu_s"] = {   # over all the bursts
            phase: cpu_s - b["gpu_telemetry_worker_phases_cpu_s"].get(phase, 0.0)
            for phase, cpu_s in a.get("gpu_telemetry_worker_phases_cpu_s", {}).items()}
        # the worker's wall time per traced step's close, by call (ms)
        traced_n = max(s["engine_thread_telemetry_us"].get("steps_traced") or 0, 1)
        s["gpu_worker_close_ms_per_traced"] = {
            call: round(1000 * (wall_s - b.get("gpu_telemetry_worker_close_wall_s", {}).get(call, 0.0)) / traced_n, 3)
            for call, wall_s in a.get("gpu_telemetry_worker_close_wall_s", {}).items()}
        # what the per-SM histograms got: CTAs of probed steps per second of the engine loop
        s["ctas_probed_per_loop_s"] = round((a.get("ctas_probed", 0) - b.get("ctas_probed", 0)) / loop_s)
        s["slow_spells"] = a.get("slow_spells", 0) - b.get("slow_spells", 0)
        # what the spell rule had learned by the end: its rate of slow steps and its limit
        s["slow_step_rate"], s["slow_spell_limit"] = a.get("slow_step_rate"), a.get("slow_spell_limit")
        s["slow_decode_steps"] = slow_decode_steps(steps[level], tokens[level])
        s["after_traced"] = after_traced(steps[level], after[level].get("traced", [])[len(before[level].get("traced", [])):])
        s["gpu_worker_cpu_s_per_1k_tokens"] = 1000 * (
            a["gpu_telemetry_worker_cpu_s"] - b["gpu_telemetry_worker_cpu_s"]) / max(
            sum(x["output_tokens"] for x in bursts if x["level"] == level), 1)
    return summary, bursts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levels", default="off,off-b,requests,steps,kernels",
                    help=f"comma-separated, off first; known: {','.join(LEVELS)}")
    ap.add_argument("--rounds", type=int, default=12, help="bursts per level and concurrency")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="per engine (default prompt + output): bounds its KV cache, so that "
                         "every level's engine fits at once")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64],
                    help="streams per burst; several values run one after the other on the "
                         "same engines (max-num-seqs is the largest)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--engine-args", nargs="*", default=[])
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="each level's core and API servers, the telemetry processes, and the "
                         "load with the collector, on CPUs of their own")
    ap.add_argument("--telemetry-cpus", type=int, default=2,
                    help="with --pin: the CPUs every level's telemetry process shares")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    levels = args.levels.split(",")
    if levels[0] != "off":
        raise SystemExit("--levels must start with off (the reference)")
    unknown = [level for level in levels if level not in LEVELS]
    if unknown:
        raise SystemExit(f"--levels: unknown {unknown}; known: {','.join(LEVELS)}")
    plan = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        plan = cpu_plan(levels, cpus, 1 + api_server_count(args.engine_args), args.telemetry_cpus)
        if plan is None:
            print(f"--pin: {len(cpus)} CPUs are too few for {len(levels)} levels; not pinned",
                  file=sys.stderr, flush=True)
    load_cpus = plan["load"] if plan else None
    results: dict[int, dict] = {}
    bursts: list[dict] = []
    with serving(args, levels, plan) as engines:
        urls = [engines[level][1] for level in levels]
        pids = [engines[level][0].pid for level in levels]
        core_pids = [json.loads(_get(url + "/health"))["core_pid"] for url in urls]
        load(args, urls, pids, 1, seed=999, cpus=load_cpus)       # warm-up, discarded
        for concurrency in concurrencies(args):
            results[concurrency], mine = measure(args, levels, engines, core_pids, concurrency,
                                                 load_cpus)
            bursts += mine
            print(f"concurrency {concurrency}:\n{format_table(results[concurrency])}", flush=True)
    record = {"bench": "overhead_http", "commit": git_commit(), "device": device_name(args.device),
              "time": utc_now(), "args": vars(args) | {"out": str(args.out)},
              "cpu_plan": {k: sorted(v) for k, v in plan.items()} if plan else None,
              "by_concurrency": {str(c): summary for c, summary in results.items()},
              "bursts": bursts}
    if len(results) == 1:   # the layout readers of one concurrency's runs know
        record["summary"] = next(iter(results.values()))
    if args.out is not None:
        write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
