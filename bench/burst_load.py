"""Bursts of concurrent streamed completions against an OpenAI-compatible server.

    python -m bench.burst_load --url http://127.0.0.1:8000 --bursts 6 --concurrency 64 \
        --prompt 128 --output 64

Each burst sends ``concurrency`` streamed /v1/completions at once (token-id prompts of
``prompt`` tokens, ``output`` tokens with ignore_eos, usage in the last chunk) and waits for
all of them. Prints one JSON line per burst: wall seconds, output tokens (from usage),
failed requests. Runs as its own process, so that the load's CPU is not the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp


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
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    return tokens


async def run(args) -> None:
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(args.url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        for burst in range(args.bursts):
            prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt)]
                       for _ in range(args.concurrency)]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one_request(session, args.url, model, p, args.output)
                                             for p in prompts), return_exceptions=True)
            wall = time.perf_counter() - t0
            failed = [r for r in results if isinstance(r, BaseException)]
            tokens = sum(r for r in results if isinstance(r, int))
            print(json.dumps({"burst": burst, "wall_s": round(wall, 4), "output_tokens": tokens,
                              "failed": len(failed),
                              "errors": sorted({str(e)[:200] for e in failed})}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--bursts", type=int, default=6)
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
