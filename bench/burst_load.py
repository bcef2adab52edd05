"""Bursts of concurrent streamed completions against OpenAI-compatible servers, interleaved.

    python -m bench.burst_load --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 \
        --rounds 12 --concurrency 64 --prompt 128 --output 64 [--pid 123 --pid 456]

Each round sends one burst to every server in turn (the order rotates between rounds, so
that drift hits every server alike): ``concurrency`` streamed /v1/completions at once
(token-id prompts of ``prompt`` tokens, ``output`` tokens with ignore_eos, usage in the
last chunk), waiting for all of them. Prints one JSON line per burst: server, wall seconds,
output tokens (from usage), failed requests, and with ``--pid`` the CPU seconds that
server's process and its children used during the burst (with ``--core-pid``: the engine
core, its telemetry process and the API servers, each apart).
Runs as its own process, so that the load's CPU is not the servers'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp

from ._common import children_cpu_s
from ._common import process_cpu_s as own_cpu_s


def process_cpu_s(pid: int, core_pid: int | None = None) -> tuple[float, float, float]:
    """CPU seconds of a server and its descendants: (the process's own, its live children's,
    0). With ``core_pid`` (``engine serve``'s engine core, a child of ``pid``): (the core's
    own, the core's children's: its telemetry process, the rest of ``pid``'s: its API servers)."""
    if core_pid is None:
        return own_cpu_s(pid), children_cpu_s(pid), 0.0
    core, telemetry = own_cpu_s(core_pid), children_cpu_s(core_pid)
    return core, telemetry, own_cpu_s(pid) + children_cpu_s(pid) - core - telemetry


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                      output: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    return tokens


async def burst(session, url: str, model: str, prompts: list[list[int]], output: int,
                pid: int | None, core_pid: int | None = None) -> dict:
    cpu0 = process_cpu_s(pid, core_pid) if pid else (0.0, 0.0, 0.0)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(session, url, model, p, output) for p in prompts),
                                   return_exceptions=True)
    wall = time.perf_counter() - t0
    cpu1 = process_cpu_s(pid, core_pid) if pid else (0.0, 0.0, 0.0)
    failed = [r for r in results if isinstance(r, BaseException)]
    return {"url": url, "wall_s": round(wall, 4),
            "output_tokens": sum(r for r in results if isinstance(r, int)),
            "failed": len(failed), "errors": sorted({str(e)[:200] for e in failed}),
            "server_cpu_s": round(cpu1[0] - cpu0[0], 3),
            "children_cpu_s": round(cpu1[1] - cpu0[1], 3),
            "api_server_cpu_s": round(cpu1[2] - cpu0[2], 3)}


async def run(args) -> None:
    rng = random.Random(args.seed)
    pids = dict(zip(args.url, args.pid or []))
    core_pids = dict(zip(args.url, args.core_pid or []))
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        models = {}
        for url in args.url:
            async with session.get(url + "/v1/models") as response:
                models[url] = (await response.json())["data"][0]["id"]
        for round_ in range(args.rounds):
            shift = round_ % len(args.url)
            order = args.url[shift:] + args.url[:shift]
            if round_ % 2:
                order = order[::-1]
            prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt)]
                       for _ in range(args.concurrency)]
            for url in order:
                record = await burst(session, url, models[url], prompts, args.output, pids.get(url),
                                     core_pids.get(url))
                print(json.dumps({"round": round_, **record}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", action="append", required=True, help="a server; repeat for several")
    ap.add_argument("--pid", action="append", type=int, help="the server's pid, same order as --url")
    ap.add_argument("--core-pid", action="append", type=int,
                    help="engine serve's engine-core pid, same order as --url: the CPU of the "
                         "core, its telemetry process and the API servers apart")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    asyncio.run(run(ap.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
