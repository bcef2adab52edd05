"""What automatic prefix caching buys an engine served over HTTP, cache on and off side by side.

    python -m bench.prefix_cache --model llama-8b --device cuda --out bench/results

A collector and two ``engine serve`` at once, alike but for ``--[no-]enable-prefix-caching``,
each KV cache bounded (``--max-model-len``: ``--kv-headroom`` x a request) so both fit on one
GPU. Each round sends every engine, in rotating order, two bursts of ``--concurrency``
streamed ``/v1/completions`` (token ids, ``--output`` tokens, ignore_eos): *unique*, fresh
prompts with nothing in common, then *shared*, chats of one ``--system``-token system prompt
and a fresh ``--user``-token turn each. A warm-up round is dropped (kernels compile, the
system prompt becomes warm). Reported: client TTFT P50/P90/P99, output tok/s per burst, on
over off paired by round; and each request's ``usage`` cached tokens, the engines' /metrics
hits and queries, and each request's span ``cache_read.input_tokens`` read back from the
collector (requests carry their own trace ids), which must all agree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from sightline.deploy.processes import HealthCheck, ProcessSpec, Supervisor, free_ports
from sightline.engine.config import resolve_model_config
from sightline.instrumentation import semconv as sc

from ._common import device_name, git_commit, utc_now, write_json, write_report
from .overhead_http import CLI, _get, _metric

ENGINES = {"on": ["--enable-prefix-caching"], "off": ["--no-enable-prefix-caching"]}
WORKLOADS = ("shared", "unique")   # as reported; each round runs unique first


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                      output: int, trace_id: str) -> dict:
    """One streamed completion: client TTFT, output and cached tokens from its usage chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": output, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    headers = {"traceparent": f"00-{trace_id}-{random.getrandbits(64):016x}-01"}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return {"trace_id": trace_id, "ttft_s": ttft, "output_tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def burst(url: str, model: str, prompts: list[list[int]], output: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        requests = await asyncio.gather(*(one_request(session, url, model, p, output, f"{random.getrandbits(128):032x}")
                                          for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": sum(r["output_tokens"] for r in requests), "requests": requests}


def workload_prompts(kind: str, rng: random.Random, system: list[int], args) -> list[list[int]]:
    """``concurrency`` prompts: the system prompt and a fresh user turn each (shared), or
    fresh prompts of the same length (unique)."""
    def fresh(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    if kind == "shared":
        return [system + fresh(args.user) for _ in range(args.concurrency)]
    return [fresh(args.system + args.user) for _ in range(args.concurrency)]


@contextlib.contextmanager
def serving(args):
    """A collector and the two engines (cache on, off), healthy, under one supervisor (logs
    in ``--log-dir``, else a temporary folder); yields ``({name: url}, collector query url)``
    and stops the engines, then the collector (their last spans reach it)."""
    grpc, http, zipkin, query = free_ports(4)
    collector = f"http://127.0.0.1:{query}"
    with tempfile.TemporaryDirectory(prefix="prefix-cache-") as temporary, \
            Supervisor(args.log_dir or temporary) as supervisor:
        supervisor.start(ProcessSpec("collector", tuple(CLI + [
            "collector", "run", "--otlp-grpc", f"127.0.0.1:{grpc}", "--otlp-http", f"127.0.0.1:{http}",
            "--zipkin", f"127.0.0.1:{zipkin}", "--http", f"127.0.0.1:{query}", "--log-level", "WARNING"]),
            health=HealthCheck(http_url=collector + "/healthz", timeout_s=60)))
        urls = {}
        for name, port in zip(ENGINES, free_ports(len(ENGINES))):
            urls[name] = f"http://127.0.0.1:{port}"
            # spans leave every 0.5 s (not 5): the counts are read back right after the load
            supervisor.start(ProcessSpec(f"engine-{name}", tuple(CLI + [
                "engine", "serve", "--model", args.model, "--device", args.device, "--port", str(port),
                "--max-model-len", str(args.kv_headroom * (args.system + args.user + args.output)),
                "--max-num-seqs", str(args.concurrency), "--trace-level", args.trace_level,
                "--otlp-endpoint", f"http://127.0.0.1:{grpc}", "--log-level", "warning",
                *args.engine_args, *ENGINES[name]]), env={"OTEL_BSP_SCHEDULE_DELAY": "500"},
                health=HealthCheck(http_url=urls[name] + "/health", timeout_s=args.start_timeout_s),
                stop_timeout_s=60),
                wait=args.device == "cuda")   # on a GPU one at a time: each sizes its KV from what is free
        for name, url in urls.items():
            supervisor[f"engine-{name}"].wait_healthy()
            print(f"prefix caching {name}: serving on {url}", flush=True)
        yield urls, collector


def cache_counters(url: str) -> dict[str, float]:
    text = _get(url + "/metrics").decode()
    return {"hits": _metric(text, sc.ENGINE_PREFIX_CACHE_HITS_TOTAL + "_total"),
            "queries": _metric(text, sc.ENGINE_PREFIX_CACHE_QUERIES_TOTAL + "_total"),
            "evictions": _metric(text, sc.ENGINE_PREFIX_CACHE_EVICTIONS_TOTAL + "_total")}


def span_cached_tokens(collector: str, trace_ids: list[str], timeout_s: float) -> dict[str, int | None]:
    """Each request's server-span ``cache_read.input_tokens`` from the collector's trace
    store (None: not arrived within ``timeout_s``, or the attribute absent)."""
    found: dict[str, int | None] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for trace_id in trace_ids:
            if trace_id in found:
                continue
            try:
                spans = json.loads(_get(f"{collector}/api/v1/traces/{trace_id}"))["spans"]
            except (OSError, ValueError):   # not there yet (404)
                continue
            server = [s for s in spans if s["name"].startswith("POST /v1/")]
            if server:
                value = server[0]["attributes"].get(sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)
                found[trace_id] = None if value is None else int(value)
        if len(found) == len(trace_ids) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {t: found.get(t) for t in trace_ids}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(bursts: list[dict]) -> dict:
    """Per workload: per engine TTFT quantiles and tok/s, and on/off ratios paired by round."""
    out: dict = {}
    for workload in WORKLOADS:
        mine = [b for b in bursts if b["workload"] == workload]
        per: dict = {}
        for name in ENGINES:
            runs = [b for b in mine if b["engine"] == name]
            ttfts = [r["ttft_s"] for b in runs for r in b["requests"]]
            requests = [r for b in runs for r in b["requests"]]
            per[name] = {
                "bursts": len(runs),
                "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p90_s": _quantile(ttfts, 0.9),
                "ttft_p99_s": _quantile(ttfts, 0.99),
                "output_tokens_per_s_median": statistics.median(b["output_tokens"] / b["wall_s"] for b in runs),
                "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in requests),
                "cached_tokens_mean": statistics.fmean(r["cached_tokens"] for r in requests),
            }
        rounds = sorted({b["round"] for b in mine})
        by = {(b["round"], b["engine"]): b for b in mine}

        def paired(value) -> list[float]:
            return [value(by[(r, "on")]) / value(by[(r, "off")]) for r in rounds]

        tps = paired(lambda b: b["output_tokens"] / b["wall_s"])
        ttft = paired(lambda b: _quantile([r["ttft_s"] for r in b["requests"]], 0.5))
        out[workload] = {**per, "on_over_off": {
            "ttft_p50_paired_median": statistics.median(ttft), "ttft_p50_paired": ttft,
            "output_tokens_per_s_paired_median": statistics.median(tps), "output_tokens_per_s_paired": tps,
            "ttft_p50_pooled": per["on"]["ttft_p50_s"] / per["off"]["ttft_p50_s"],
        }}
    return out


def format_report(record: dict) -> list[str]:
    s = record["summary"]
    a = record["args"]
    lines = [f"# Prefix caching on vs off, served over HTTP: {record['model']} on {record['device']} "
             f"at {record['commit'][:8]}", "",
             f"{a['concurrency']} concurrent streamed completions per burst, {a['rounds']} measured rounds "
             f"(+1 warm-up); shared: a {a['system']}-token system prompt + a fresh {a['user']}-token turn; "
             f"unique: {a['system'] + a['user']} fresh tokens; {a['output']} output tokens each; "
             f"KV cache of each engine: {a['kv_headroom']}x a burst's tokens. {record['utc']}.", "",
             "| workload | prefix cache | TTFT P50 ms | TTFT P90 ms | TTFT P99 ms | output tok/s (median) "
             "| cached tokens / request |", "|---" * 7 + "|"]
    for workload in WORKLOADS:
        for name in ENGINES:
            e = s[workload][name]
            lines.append(f"| {workload} | {name} | {1e3 * e['ttft_p50_s']:.1f} | {1e3 * e['ttft_p90_s']:.1f} | "
                         f"{1e3 * e['ttft_p99_s']:.1f} | {e['output_tokens_per_s_median']:,.0f} | "
                         f"{e['cached_tokens_mean']:.0f} of {e['prompt_tokens_mean']:.0f} |")
    sh, un = s["shared"]["on_over_off"], s["unique"]["on_over_off"]
    lines += ["", "On over off, paired by round (median):", "",
              f"- shared: TTFT P50 {sh['ttft_p50_paired_median']:.3f} (target <= 0.25), output tok/s "
              f"{sh['output_tokens_per_s_paired_median']:.3f} (target >= 1.5)",
              f"- unique: output tok/s {un['output_tokens_per_s_paired_median']:.3f} (target >= 0.98)", ""]
    c = record["counts"]
    lines += ["Cached-token counts over the measured rounds (usage blocks, the engine's /metrics, the spans):", "",
              "| prefix cache | usage cached_tokens | /metrics hits | /metrics queries | prompt tokens sent "
              "| span cache_read tokens (of requests found) | evictions | agree |", "|---" * 8 + "|"]
    for name in ENGINES:
        n = c[name]
        lines.append(f"| {name} | {n['usage_cached_tokens']} | {n['metrics_hits']:.0f} | {n['metrics_queries']:.0f} "
                     f"| {n['prompt_tokens']} | {n['span_cached_tokens']} ({n['spans_found']} of {n['requests']}) "
                     f"| {n['metrics_evictions']:.0f} | {n['agree']} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (a warm-up round is added)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--system", type=int, default=2048, help="shared system prompt tokens")
    ap.add_argument("--user", type=int, default=128, help="tokens of each request's own turn")
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--kv-headroom", type=int, default=2,
                    help="each engine's KV cache holds this many times a burst's tokens")
    ap.add_argument("--trace-level", default="requests", choices=("requests", "steps"))
    ap.add_argument("--span-timeout-s", type=float, default=60.0)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-args", nargs="*", default=[], help="more engine serve flags, for both")
    ap.add_argument("--log-dir", type=Path, default=None, help="the servers' logs (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.vocab = resolve_model_config(args.model).vocab_size   # prompt ids: [0, vocab)
    rng = random.Random(args.seed)
    random.seed(args.seed + 1)   # trace and span ids
    system = [rng.randrange(args.vocab) for _ in range(args.system)]
    bursts: list[dict] = []
    with serving(args) as (urls, collector):
        names = list(ENGINES)
        for round_ in range(args.rounds + 1):   # round 0: warm-up, discarded
            if round_ == 1:
                before = {name: cache_counters(url) for name, url in urls.items()}
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for workload in reversed(WORKLOADS):
                prompts = workload_prompts(workload, rng, system, args)
                for name in order:
                    b = asyncio.run(burst(urls[name], args.model, prompts, args.output))
                    if round_:
                        bursts.append({**b, "round": round_, "engine": name, "workload": workload})
                    print(f"round {round_} {workload} cache {name}: {b['output_tokens'] / b['wall_s']:,.0f} "
                          f"tok/s, TTFT P50 {1e3 * _quantile([r['ttft_s'] for r in b['requests']], 0.5):.1f} ms",
                          flush=True)
        after = {name: cache_counters(url) for name, url in urls.items()}
        counts = {}
        for name in ENGINES:
            requests = [r for b in bursts if b["engine"] == name for r in b["requests"]]
            spans = span_cached_tokens(collector, [r["trace_id"] for r in requests], args.span_timeout_s)
            usage = sum(r["cached_tokens"] for r in requests)
            found = [v for v in spans.values() if v is not None]
            delta = {k: after[name][k] - before[name][k] for k in after[name]}
            counts[name] = {
                "requests": len(requests), "prompt_tokens": sum(r["prompt_tokens"] for r in requests),
                "usage_cached_tokens": usage, "metrics_hits": delta["hits"], "metrics_queries": delta["queries"],
                "metrics_evictions": delta["evictions"], "spans_found": len(found), "span_cached_tokens": sum(found),
                "agree": (usage == delta["hits"] and len(found) == len(requests) and sum(found) == usage
                          and all(spans[r["trace_id"]] == r["cached_tokens"] for r in requests)),
            }
    record = {"bench": "prefix_cache", "commit": git_commit(), "utc": utc_now(), "model": args.model,
              "device": device_name(args.device),
              "args": vars(args) | {"out": str(args.out), "log_dir": str(args.log_dir)},
              "summary": summarize(bursts), "counts": counts,
              "bursts": [{k: v for k, v in b.items() if k != "requests"}
                         | {"ttft_s": [r["ttft_s"] for r in b["requests"]],
                            "cached_tokens": [r["cached_tokens"] for r in b["requests"]]} for b in bursts]}
    lines = format_report(record)
    if args.out is not None:
        path = write_json(args.out, record)
        write_report(path, "prefix_cache", argv, lines)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
