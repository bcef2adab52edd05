"""Served output tok/s and TTFT over HTTP, beside the offline engine and the weight-read floor.

    python -m bench.served_throughput --model llama-8b --device cuda      # the H200 run
    python -m bench.served_throughput --device cpu --concurrency 1 4 --rounds 1 --output-len 8

Starts ``sightline engine serve`` (engine core and ``--api-server-count`` API servers, tracing
off), then per concurrency C: one warm-up burst and ``--rounds`` bursts of C streamed
/v1/completions (token-id prompts of ``--prompt-len``, ``--output-len`` tokens, ignore_eos)
sent at one instant by client processes of their own (aiohttp: not the server's CPU). Per
burst: output tokens / (last end - first start); TTFT (first token's chunk); CPU ms per output
token of the API servers and the engine core. Then, the server stopped, ``bench.engine_throughput``
on the same machine (its default mode) and the weight-read floor: the rate if every decode step
took the time to read every weight once. Cost: start-up, (rounds + 1) bursts per concurrency,
an offline run per concurrency above 1. Writes
``served_throughput-<device>-<commit>.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sightline.instrumentation import semconv as sc

from ._common import ROOT, git_commit, serve_cpu_s, utc_now, write_json, write_report

_CLIENT_STREAMS = 32   # streams per client process (at most; C / this processes, rounded up)
# A closed loop's streams start spread over about one request's time, as users arrive: started
# together, streams of equal lengths would stay in step and every request would meet a burst.
_STAGGER_S = 0.5


# ---- a client process ---------------------------------------------------------------------------
async def _stream(session, url: str, model: str, prompt: list[int], output: int,
                  start_at: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    await asyncio.sleep(max(0.0, start_at - time.time()))
    started, first, tokens, error = time.time(), None, 0, None
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message"))
                if first is None and chunk.get("choices"):
                    first = time.time()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:   # counted by the parent: a failed request is a result too
        error = f"{type(exc).__name__}: {exc}"
    return {"start": started, "first": first, "end": time.time(), "tokens": tokens, "error": error}


async def _loop(session, url: str, model: str, prompt: list[int], output: int, start_at: float,
                until: float, rng: random.Random, vocab: int) -> list[dict]:
    """One stream of a sustained run: a new request as soon as the last one ends, until ``until``;
    its first one ``start_at`` plus a random share of the stagger (``_STAGGER_S``)."""
    results = [await _stream(session, url, model, prompt, output, start_at + rng.uniform(0, _STAGGER_S))]
    while time.time() < until:
        prompt = [rng.randrange(1, vocab) for _ in range(len(prompt))]
        results.append(await _stream(session, url, model, prompt, output, 0.0))
    return results


async def _client(url: str, model: str, prompts: list[list[int]], output: int, start_at: float,
                  until: float | None = None, vocab: int = 0, seed: int = 0) -> list:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if until is None:
            return await asyncio.gather(*(_stream(session, url, model, p, output, start_at) for p in prompts))
        loops = await asyncio.gather(*(_loop(session, url, model, p, output, start_at, until,
                                             random.Random(seed * 1000 + i), vocab)
                                       for i, p in enumerate(prompts)))
        return [r for loop in loops for r in loop]


def client_main(args: argparse.Namespace) -> int:
    prompts = json.loads(Path(args.client_prompts).read_text())
    results = asyncio.run(_client(args.url, args.model_name, prompts, args.output_len, args.start_at,
                                  args.sustain_until, args.client_vocab, args.client_seed))
    print(json.dumps(results))
    return 0


# ---- the parent ---------------------------------------------------------------------------------
def _run_clients(url: str, model: str, prompts: list[list[int]], output: int, workdir: Path,
                 sustain_s: float | None = None, vocab: int = 0) -> tuple[float, list[dict]]:
    """len(prompts) streams from client processes, started at one instant (returned): one
    request each, or (``sustain_s``) each stream sending its next request as the last ends."""
    groups = [prompts[i:i + _CLIENT_STREAMS] for i in range(0, len(prompts), _CLIENT_STREAMS)]
    start_at = time.time() + 2.0 + 0.1 * len(groups)   # every client has started by then
    clients = []
    for i, group in enumerate(groups):
        path = workdir / f"prompts-{i}.json"
        path.write_text(json.dumps(group))
        extra = ([] if sustain_s is None else
                 ["--sustain-until", repr(start_at + sustain_s), "--client-vocab", str(vocab),
                  "--client-seed", str(i)])
        clients.append(subprocess.Popen(
            [sys.executable, "-m", "bench.served_throughput", "--client-prompts", str(path),
             "--url", url, "--model-name", model, "--output-len", str(output),
             "--start-at", repr(start_at), *extra], cwd=ROOT, stdout=subprocess.PIPE, text=True))
    requests = []
    for client in clients:
        out, _ = client.communicate(timeout=3600)
        requests += json.loads(out)
    return start_at, requests


def _sustained(url: str, model: str, prompts: list[list[int]], output: int, workdir: Path,
               sustain_s: float, vocab: int) -> dict:
    """Closed-loop load (len(prompts) requests always in flight, as benchmark tools' concurrency
    mode keeps them, their first requests spread over ``_STAGGER_S``) for ``sustain_s``: output
    tokens of the requests ending in the window after the first quarter, over that window;
    TTFT of the requests starting in it."""
    start_at, requests = _run_clients(url, model, prompts, output, workdir, sustain_s, vocab)
    lo, hi = start_at + sustain_s / 4, start_at + sustain_s
    ok = [r for r in requests if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok if lo <= r["end"] <= hi)
    ttft = sorted(r["first"] - r["start"] for r in ok if r["first"] is not None and lo <= r["start"] <= hi)
    return {"output_tokens_per_s": round(tokens / (hi - lo), 1), "requests": len(requests),
            "output_tokens": sum(r["tokens"] for r in ok),
            "ttft_p50_ms": _p50_ms(ttft), "ttft_p99_ms": round(ttft[int(0.99 * (len(ttft) - 1))] * 1e3, 2)
            if ttft else None, "failed": len(requests) - len(ok),
            "errors": sorted({r["error"] for r in requests if r["error"]})[:3]}


def _burst(url: str, model: str, prompts: list[list[int]], output: int, workdir: Path) -> dict:
    """One burst: len(prompts) streams from client processes, started at one instant."""
    _, requests = _run_clients(url, model, prompts, output, workdir)
    ok = [r for r in requests if r["error"] is None]
    wall = max(r["end"] for r in requests) - min(r["start"] for r in requests)
    tokens = sum(r["tokens"] for r in ok)
    return {"wall_s": round(wall, 4), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
            "failed": len(requests) - len(ok),
            "errors": sorted({r["error"] for r in requests if r["error"]})[:3],
            "ttft_s": sorted(r["first"] - r["start"] for r in ok if r["first"] is not None)}


def _serve(args: argparse.Namespace, port: int) -> subprocess.Popen:
    max_seqs = max(args.concurrency)
    command = [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", args.model,
               "--device", args.device, "--dtype", args.dtype, "--port", str(port),
               "--trace-level", "off", "--api-server-count", str(args.api_server_count),
               "--max-num-seqs", str(max_seqs), "--max-waiting", str(max(1024, max_seqs)),
               "--kv-cache-gib", str(args.kv_cache_gib), "--log-level", "warning"]
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, SIGHTLINE_TRACE_LEVEL="off"))


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"engine serve exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s} s")


def _offline(args: argparse.Namespace, concurrency: int, workdir: Path) -> dict:
    """``bench.engine_throughput`` at ``concurrency``: (figures of the engine's default mode, floor)."""
    out = workdir / f"offline-{concurrency}"
    command = [sys.executable, "-m", "bench.engine_throughput", "--model", args.model, "--device",
               args.device, "--dtype", args.dtype, "--prompt-len", str(args.prompt_len),
               "--output-len", str(args.output_len), "--single-output-len", str(args.output_len),
               "--concurrency", str(max(concurrency, 1)), "--repeats", str(args.offline_repeats),
               "--kv-cache-gib", str(args.kv_cache_gib), "--no-profile", "--out", str(out)]
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    subprocess.run(command, cwd=ROOT, check=True)
    [path] = out.glob("engine_throughput_*.json")
    report = json.loads(path.read_text())
    # the mode engine serve runs by default: graphs and overlap on CUDA, eager on the CPU
    on_cuda = report["machine"]["device"].startswith("cuda")
    mode = next(m for m in (("overlap", "graphs", "eager") if on_cuda else ("eager",))
                if m in report["results"])
    return {"mode": mode, "results": report["results"][mode], "floor": report["floor"],
            "machine": report["machine"]}


# the engine's own latency series, read from /metrics around a closed loop: where its TTFT went
_SERVER_SERIES = {"ttft": sc.ENGINE_TTFT_SECONDS, "queue": sc.ENGINE_QUEUE_SECONDS,
                  "prefill": sc.ENGINE_PREFILL_SECONDS, "step": sc.ENGINE_STEP_SECONDS,
                  "step_tokens": sc.ENGINE_STEP_TOKENS}


def _server_series(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each ``_SERVER_SERIES`` histogram on ``url``'s /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for suffix, slot in (("_sum", 0), ("_count", 1)):
                if sample.name.endswith(suffix):
                    sums.setdefault(sample.name[:-len(suffix)], [0.0, 0.0])[slot] += sample.value
    return {key: tuple(sums.get(name, (0.0, 0.0))) for key, name in _SERVER_SERIES.items()}


def _server_means(before: dict, after: dict, window_s: float) -> dict[str, float | None]:
    """The engine's mean TTFT, queue and prefill times (ms; arrival is when the core read the
    request, so a client's TTFT beyond them was spent in HTTP, the API server and the hops),
    its mean step (ms), tokens per step and steps per second, between two ``_server_series``."""
    out: dict[str, float | None] = {}
    for key in _SERVER_SERIES:
        total, count = (a - b for a, b in zip(after[key], before[key]))
        scale = 1.0 if key == "step_tokens" else 1e3
        out[key if key == "step_tokens" else f"{key}_mean_ms"] = (
            round(total / count * scale, 2) if count else None)
    out["steps_per_s"] = round((after["step"][1] - before["step"][1]) / window_s, 1)
    return out


def _cpu_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU milliseconds per output token of each ``engine serve`` role between two readings."""
    return {role: round((after[role] - before[role]) * 1e3 / tokens, 4) if tokens else None for role in before}


def _p50_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 2) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="measured bursts per concurrency")
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV cache on the CPU")
    parser.add_argument("--offline-repeats", type=int, default=3)
    parser.add_argument("--no-offline", action="store_true", help="served figures only")
    parser.add_argument("--sustain-s", type=float, default=0.0,
                        help="also a closed-loop run of this many seconds per concurrency (0: none)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    # a client process's arguments (internal)
    parser.add_argument("--client-prompts", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model-name", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--sustain-until", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--client-vocab", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--client-seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client_prompts:
        return client_main(args)

    from sightline.deploy.processes import free_ports
    from sightline.engine.config import resolve_model_config

    vocab = min(resolve_model_config(args.model).vocab_size, 32000)
    rng = random.Random(args.seed)
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    served: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="served-throughput-") as tmp:
        workdir = Path(tmp)
        server = _serve(args, port)
        try:
            t0 = time.monotonic()
            _wait_healthy(url, server, args.start_timeout)
            start_s = time.monotonic() - t0
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
                model_name = json.loads(response.read())["data"][0]["id"]
            for c in args.concurrency:
                def prompts() -> list[list[int]]:
                    return [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(c)]
                _burst(url, model_name, prompts(), args.output_len, workdir)   # warm-up
                cpu = serve_cpu_s(server.pid, port)
                bursts = [_burst(url, model_name, prompts(), args.output_len, workdir)
                          for _ in range(args.rounds)]
                burst_cpu = _cpu_per_token(cpu, serve_cpu_s(server.pid, port),
                                           sum(b["output_tokens"] for b in bursts))
                rates = [b["output_tokens_per_s"] for b in bursts]
                served[c] = {"output_tokens_per_s": statistics.median(rates), "rounds": rates,
                             "ttft_p50_ms": _p50_ms([t for b in bursts for t in b["ttft_s"]]),
                             "failed": sum(b["failed"] for b in bursts),
                             "errors": sorted({e for b in bursts for e in b["errors"]}),
                             "cpu_ms_per_output_token": burst_cpu}
                print(f"served, {c} concurrent: {served[c]['output_tokens_per_s']} output tok/s, "
                      f"TTFT p50 {served[c]['ttft_p50_ms']} ms, {served[c]['failed']} failed", flush=True)
                if args.sustain_s > 0:
                    cpu, series = serve_cpu_s(server.pid, port), _server_series(url)
                    loop = _sustained(url, model_name, prompts(), args.output_len, workdir, args.sustain_s, vocab)
                    after = serve_cpu_s(server.pid, port)
                    # over the whole loop (its streams' start and drain included): a diagnosis
                    loop["engine"] = _server_means(series, _server_series(url), args.sustain_s)
                    loop["cpu_ms_per_output_token"] = _cpu_per_token(cpu, after, loop["output_tokens"])
                    # CPU seconds per second of the closed loop: 1.0 is one core always busy
                    loop["cpu_busy"] = {role: round((after[role] - cpu[role]) / args.sustain_s, 3) for role in cpu}
                    served[c]["sustained"] = loop
                    print(f"served, {c} concurrent, closed loop for {args.sustain_s} s: "
                          f"{served[c]['sustained']}", flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
        offline = {} if args.no_offline else {c: _offline(args, c, workdir)
                                              for c in args.concurrency if c > 1}
        if not args.no_offline and 1 in args.concurrency and not offline:
            offline[1] = _offline(args, 1, workdir)

    any_offline = next(iter(offline.values()), None)
    floor_ms = any_offline["floor"]["step_ms"] if any_offline else None
    rows, lines = {}, []
    for c in args.concurrency:
        row = dict(served[c])
        if any_offline:
            figures = offline.get(c, any_offline)["results"]
            row["offline_output_tokens_per_s"] = (figures["single"]["decode_tokens_per_s"] if c == 1
                                                  else figures["concurrent"]["output_tokens_per_s"])
            row["served_over_offline"] = round(row["output_tokens_per_s"]
                                               / row["offline_output_tokens_per_s"], 3)
            # every request's token each floor-long step: the weights read once per step
            row["floor_output_tokens_per_s"] = round(c / (floor_ms / 1e3), 1)
        rows[c] = row
    device = any_offline["machine"]["device_name"] if any_offline else args.device
    record = {"bench": "served_throughput", "device": device, "commit": git_commit(),
              "date_utc": utc_now(), "model": args.model, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "api_server_count": args.api_server_count,
              "rounds": args.rounds, "server_start_s": round(start_s, 1),
              "offline_mode": any_offline["mode"] if any_offline else None,
              "floor_step_ms": floor_ms, "concurrency": rows}
    path = write_json(Path(args.out), record)
    lines = [f"# served throughput: {args.model} on {device} at {record['commit'][:8]}", "",
             f"{args.prompt_len}-token prompts, {args.output_len} output tokens, tracing off, "
             f"{args.api_server_count} API server(s); medians of {args.rounds} bursts; offline: "
             f"bench.engine_throughput ({record['offline_mode']}), floor {floor_ms} ms/step", "",
             "Burst: every request sent at one instant. Closed loop: the concurrency kept in flight "
             "(each stream sends its next request as the last ends, the streams' first requests "
             f"spread over {_STAGGER_S} s), as benchmark tools' concurrency mode does.", "",
             "CPU: milliseconds per output token of the API server(s) / the engine core (bursts), and "
             "in the closed loop the CPU seconds each spent per second (1.0: one core always busy).", "",
             "| concurrency | burst tok/s | burst TTFT p50 ms | closed-loop tok/s | closed-loop TTFT p50 / p99 ms "
             "| offline tok/s | burst / offline | floor tok/s | CPU ms/token API / core | closed-loop CPU busy "
             "API / core | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, row in rows.items():
        loop = row.get("sustained") or {}
        lines.append(f"| {c} | {row['output_tokens_per_s']} | {row['ttft_p50_ms']} | "
                     f"{loop.get('output_tokens_per_s', '-')} | {loop.get('ttft_p50_ms', '-')} / "
                     f"{loop.get('ttft_p99_ms', '-')} | "
                     f"{row.get('offline_output_tokens_per_s')} | {row.get('served_over_offline')} | "
                     f"{row.get('floor_output_tokens_per_s')} | "
                     f"{row['cpu_ms_per_output_token']['api_servers']} / {row['cpu_ms_per_output_token']['engine_core']} | "
                     f"{(loop.get('cpu_busy') or {}).get('api_servers', '-')} / "
                     f"{(loop.get('cpu_busy') or {}).get('engine_core', '-')} | {row['failed'] + loop.get('failed', 0)} |")
    for c, row in rows.items():
        engine = (row.get("sustained") or {}).get("engine")
        if engine:
            lines.append(
                f"\nClosed loop at {c}, the engine's own view (means over the loop, from /metrics; "
                f"arrival is when the core read the request): TTFT {engine['ttft_mean_ms']} ms = "
                f"queue {engine['queue_mean_ms']} + prefill {engine['prefill_mean_ms']}; steps "
                f"{engine['step_mean_ms']} ms with {engine['step_tokens']} tokens, "
                f"{engine['steps_per_s']} a second. The clients' TTFT beyond it went to HTTP, "
                "the API server and the hops to and from the core.")
    write_report(path, "served_throughput", argv, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
