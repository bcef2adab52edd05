"""Start-up and the first requests on a fresh machine: cold (empty compile cache), then warm.

    python -m bench.cold_start --model llama-8b --device cuda --levels requests,kernels

Per trace level: starts ``sightline engine serve`` (the engine-core process and
``--api-server-count`` API servers; the core's phases, step times and compile counter reach
the bench through an API server's endpoints) on an empty ``--compile-cache-dir`` and times
process start to ``/health`` 200 (phases from ``/debug/startup``); one request (its
TTFT); a burst of concurrent requests (the longest engine step it caused, ``/debug/steps``);
the same burst again, warm; sequential requests (the warm median TTFT); a mixed load using
every sampling option, reading ``sightline_engine_jit_compiles_total`` before and after.
Then the server restarts on the same cache: start-up and first TTFT again. The issue's
bounds are checked: first TTFT <= 2x the warm median, the first burst's longest step <=
1.5x the warm burst's, no compile while serving; start-up by phase, cold and warm.
JSON and markdown go to ``--out``; ``--model tiny --device cpu`` is a dry run of the flow.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ._common import ROOT, device_name, git_commit, terminate, utc_now, write_json, write_report

__all__ = ["checks", "format_report", "main", "parse_metric", "run_level"]

MODULE = "cold_start"


def parse_metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text page (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key = line.split(" ", 1)[0]
            if key == name or key.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post_stream(url: str, body: dict, timeout_s: float) -> dict:
    """One streamed completion: seconds to the first token's chunk and to the end."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {**body, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    ttft = None
    finish = None
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if ttft is None:
                    ttft = time.perf_counter() - started
                finish = choice.get("finish_reason") or finish
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - started, "finish_reason": finish}


@dataclass
class Server:
    """One ``sightline engine serve`` process."""

    process: subprocess.Popen
    url: str
    started: float   # time.monotonic() just before the process was made
    log: Path

    def stop(self, timeout_s: float = 120.0) -> None:
        terminate(self.process, timeout_s)


def start(args, level: str, cache_dir: Path, port: int, log: Path) -> Server:
    command = [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", args.model,
               "--device", args.device, "--port", str(port), "--trace-level", level,
               "--compile-cache-dir", str(cache_dir), "--max-num-seqs", str(args.max_num_seqs),
               "--api-server-count", str(args.api_server_count), "--log-level", "info",
               *args.engine_args]
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    # spans are built (the telemetry's cost is the engine's) and dropped: no collector to wait on
    env = dict(os.environ, OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    handle = log.open("w")
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return Server(process, f"http://127.0.0.1:{port}", started, log)


def wait_ready(server: Server, timeout_s: float) -> dict:
    """Polls /live and /health every 50 ms: seconds from process start to each answering."""
    live_s = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}; see {server.log}")
        try:
            if live_s is None and _get(server.url + "/live", 2)[0] == 200:
                live_s = time.monotonic() - server.started
            status, body = _get(server.url + "/health", 2)
            if status == 200:
                return {"live_s": live_s, "ready_s": time.monotonic() - server.started,
                        "health": json.loads(body)}
        except OSError:   # not listening yet
            pass
        time.sleep(0.05)
    raise TimeoutError(f"/health not 200 within {timeout_s} s; see {server.log}")


def startup_phases(server: Server) -> dict:
    """/debug/startup reduced to what the report shows: seconds, status and counts per phase."""
    report = json.loads(_get(server.url + "/debug/startup")[1])
    return {"total_s": report["total_s"], "variants_compiled": report["variants_compiled"],
            "variants_cached": report["variants_cached"],
            "phases": {p["name"]: {"s": p["duration_s"], "status": p["status"],
                                   "compiled": len(p["compiled"]), "cached": len(p["cached"]),
                                   "autotuned": len(p["autotuned"]), "note": p["note"]}
                       for p in report["phases"]}}


def _steps(server: Server) -> tuple[list[float], list[list[int]]]:
    """The engine's recent steps: their wall times and [prefill, decode] tokens, one read."""
    log = json.loads(_get(server.url + "/debug/steps")[1])
    return log["durations_s"], log.get("tokens", [])


def _compiles(server: Server) -> float:
    return parse_metric(_get(server.url + "/metrics")[1].decode(), "sightline_engine_jit_compiles_total")


def burst(server: Server, args, seed: int) -> dict:
    """``args.burst`` concurrent streamed requests; the longest engine step meanwhile."""
    before = len(_steps(server)[0])
    bodies = [{"model": args.model, "prompt": [1 + (seed + i) % 200] * args.burst_prompt,
               "max_tokens": args.burst_output, "ignore_eos": True, "temperature": 0.0}
              for i in range(args.burst)]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.burst) as pool:
        results = list(pool.map(lambda b: _post_stream(server.url, b, args.request_timeout_s), bodies))
    wall = time.perf_counter() - started
    steps, tokens = (column[before:] for column in _steps(server))
    longest = max(range(len(steps)), key=steps.__getitem__, default=None)
    return {"requests": len(results), "wall_s": wall, "steps": len(steps),
            "longest_step_s": max(steps, default=0.0),
            # the longest step's [prefill, decode] tokens, and every step's time: which step it was
            "longest_step_tokens": tokens[longest] if longest is not None and longest < len(tokens) else None,
            "step_durations_s": steps,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in results),
            "ttft_max_s": max(r["ttft_s"] for r in results)}


def mixed_load(server: Server, args) -> dict:
    """Every sampling case of the warm-up, with prompts from 1 token to the burst's size."""
    from sightline.engine.warmup import SAMPLER_CASES
    cases = list(SAMPLER_CASES.items())
    bodies = []
    for i in range(args.mixed):
        name, p = cases[i % len(cases)]
        body = {"model": args.model, "prompt": [1 + i % 200] * (1 + (i * 37) % args.burst_prompt),
                "max_tokens": 1 + i % args.burst_output, "ignore_eos": True,
                "temperature": p.temperature, "top_p": p.top_p, "min_p": p.min_p,
                "repetition_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
                "frequency_penalty": p.frequency_penalty}
        for key in ("top_k", "seed"):
            if getattr(p, key) is not None:
                body[key] = getattr(p, key)
        if p.allowed_token_ids is not None:
            body["allowed_token_ids"] = list(p.allowed_token_ids)
        bodies.append(body)
    before = _compiles(server)
    with concurrent.futures.ThreadPoolExecutor(min(32, len(bodies))) as pool:
        finishes = list(pool.map(lambda b: _post_stream(server.url, b, args.request_timeout_s)["finish_reason"],
                                 bodies))
    return {"requests": len(bodies), "sampling_cases": sorted({n for n, _ in cases}),
            "finished": finishes.count("length"), "jit_compiles": _compiles(server) - before}


def run_level(args, level: str, port: int, logs: Path) -> dict:
    """Cold start, first request, bursts, warm TTFTs, mixed load; then a warm restart."""
    cache = Path(tempfile.mkdtemp(prefix="sightline-cold-start-"))
    prompt = {"model": args.model, "prompt": [1] * args.first_prompt, "max_tokens": args.first_output,
              "ignore_eos": True, "temperature": 0.0}
    result: dict = {"compile_cache_dir": str(cache)}
    try:
        for phase in ("cold", "warm"):
            server = start(args, level, cache, port, logs / f"{MODULE}-{level}-{phase}.log")
            try:
                run = wait_ready(server, args.start_timeout_s)
                run["startup"] = startup_phases(server)
                run["cache_entries_before"] = json.loads(_get(server.url + "/debug/startup")[1])[
                    "cache_entries_before"]
                run["first_request"] = _post_stream(server.url, prompt, args.request_timeout_s)
                if phase == "cold":
                    compiles = _compiles(server)
                    run["first_burst"] = burst(server, args, seed=1)
                    run["warm_burst"] = burst(server, args, seed=2)
                    run["warm_ttft_s"] = [_post_stream(server.url, prompt, args.request_timeout_s)["ttft_s"]
                                          for _ in range(args.warm_requests)]
                    run["mixed"] = mixed_load(server, args)
                    run["jit_compiles_while_serving"] = _compiles(server) - compiles
                result[phase] = run
            finally:
                server.stop()
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    result["checks"] = checks(result)
    return result


def checks(result: dict) -> dict:
    """The issue's bounds on one level's run (None where a number is missing)."""
    cold = result["cold"]
    median = statistics.median(cold["warm_ttft_s"])
    first = cold["first_request"]["ttft_s"]
    longest, warm_longest = cold["first_burst"]["longest_step_s"], cold["warm_burst"]["longest_step_s"]
    return {
        "first_ttft_over_warm_median": first / median if median else None,
        "first_ttft_within_2x": first <= 2 * median,
        "first_burst_longest_over_warm": longest / warm_longest if warm_longest else None,
        "first_burst_within_1_5x": longest <= 1.5 * warm_longest,
        "no_compile_while_serving": cold["jit_compiles_while_serving"] == 0,
        "cold_startup_s": cold["ready_s"], "warm_startup_s": result["warm"]["ready_s"],
        "cold_within_60s": cold["ready_s"] <= 60.0, "warm_within_20s": result["warm"]["ready_s"] <= 20.0,
    }


def format_report(record: dict) -> list[str]:
    lines = [f"# Cold start: {record['model']} on {record['device']} at {record['commit'][:8]}", "",
             f"{record['date']}; `engine serve` with {record['args'].get('api_server_count', 1)} API "
             f"server(s); burst {record['args']['burst']} x {record['args']['burst_prompt']}-token "
             f"prompts, {record['args']['burst_output']} tokens out; first request "
             f"{record['args']['first_prompt']} tokens.", ""]
    for level, result in record["levels"].items():
        cold, warm, check = result["cold"], result["warm"], result["checks"]
        lines += [f"## trace level {level}", "",
                  "| | cold cache | warm cache |", "|---|---|---|",
                  f"| process start to /live 200 | {cold['live_s']:.2f} s | {warm['live_s']:.2f} s |",
                  f"| process start to /health 200 | {cold['ready_s']:.2f} s | {warm['ready_s']:.2f} s |",
                  f"| cache entries at start | {cold['cache_entries_before']} | {warm['cache_entries_before']} |",
                  f"| variants compiled / from cache | {cold['startup']['variants_compiled']} / "
                  f"{cold['startup']['variants_cached']} | {warm['startup']['variants_compiled']} / "
                  f"{warm['startup']['variants_cached']} |",
                  f"| first request TTFT | {cold['first_request']['ttft_s'] * 1e3:.1f} ms | "
                  f"{warm['first_request']['ttft_s'] * 1e3:.1f} ms |", ""]
        lines += ["| phase | cold s | cold status (compiled/cached) | warm s | warm status (compiled/cached) |",
                  "|---|---|---|---|---|"]
        for name, p in cold["startup"]["phases"].items():
            w = warm["startup"]["phases"].get(name)
            warm_cells = (f"{w['s']:.2f} | {w['status']} ({w['compiled']}/{w['cached']})" if w
                          else "- | -")
            lines.append(f"| {name} | {p['s']:.2f} | {p['status']} ({p['compiled']}/{p['cached']}) | "
                         f"{warm_cells} |")
        ratio_ttft = check["first_ttft_over_warm_median"]
        ratio_step = check["first_burst_longest_over_warm"]
        lines += ["", f"- first TTFT {cold['first_request']['ttft_s'] * 1e3:.1f} ms, warm median "
                      f"{statistics.median(cold['warm_ttft_s']) * 1e3:.1f} ms: "
                      f"{ratio_ttft:.2f}x (bound 2x: {'met' if check['first_ttft_within_2x'] else 'MISSED'})",
                  f"- longest step: first burst {cold['first_burst']['longest_step_s'] * 1e3:.1f} ms, warm "
                  f"burst {cold['warm_burst']['longest_step_s'] * 1e3:.1f} ms: "
                  + (f"{ratio_step:.2f}x" if ratio_step is not None else "n/a")
                  + f" (bound 1.5x: {'met' if check['first_burst_within_1_5x'] else 'MISSED'})",
                  f"- kernel variants met while serving (bursts, TTFTs, {cold['mixed']['requests']} mixed "
                  f"requests over {len(cold['mixed']['sampling_cases'])} sampling cases): "
                  f"{cold['jit_compiles_while_serving']:.0f}",
                  f"- start-up cold {cold['ready_s']:.1f} s (goal 60), warm {warm['ready_s']:.1f} s "
                  f"(goal 20)", ""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levels", default="requests,kernels")
    ap.add_argument("--port", type=int, default=18000)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="API server processes of `engine serve` (default: 1)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: the engine's (8192 on an H200)")
    ap.add_argument("--first-prompt", type=int, default=24, help="tokens of the first request")
    ap.add_argument("--first-output", type=int, default=16)
    ap.add_argument("--burst", type=int, default=64, help="concurrent requests per burst")
    ap.add_argument("--burst-prompt", type=int, default=128)
    ap.add_argument("--burst-output", type=int, default=64)
    ap.add_argument("--warm-requests", type=int, default=8, help="sequential, for the warm median TTFT")
    ap.add_argument("--mixed", type=int, default=160, help="requests of the mixed sampling load")
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--engine-args", nargs="*", default=[], help="more `engine serve` flags")
    ap.add_argument("--keep-cache", action="store_true", help="keep each level's compile cache")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--logs", type=Path, default=None, help="the servers' logs (default: a temporary folder)")
    args = ap.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="sightline-cold-start-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    levels = {}
    for level in args.levels.split(","):
        levels[level] = run_level(args, level, args.port, logs)
    record = {"bench": MODULE, "device": device_name(args.device), "commit": git_commit(),
              "date": utc_now(), "model": args.model, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                               for k, v in vars(args).items()},
              "logs": str(logs), "levels": levels}
    path = write_json(args.out, record)
    write_report(path, MODULE, argv, format_report(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
