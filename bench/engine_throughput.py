"""Engine output tokens per second at several batch sizes, through the real engine loop.

    python -m bench.engine_throughput --model llama-8b --device cuda    # a few minutes on a GPU
    python -m bench.engine_throughput --model tiny --device cpu --batches 1,8 --output-len 64

For each batch size B: B requests of ``--prompt-len`` seeded random prompt tokens and
exactly ``--output-len`` output tokens (ignore_eos, greedy) go through ``LLMEngine.step()``
(everything but HTTP). Reported: ``output_tokens_per_s`` (B * output_len / wall time from
submission to the last token, prefill included), ``decode_tokens_per_s`` (tokens of
decode-only steps / their summed duration) and the median and p90 ``decode_step_ms`` (each
step ends with the sampled tokens on the host, so on CUDA it includes the device work).
A warm-up generation runs first (Triton compiles there). Writes
``engine_throughput_<model>_<device>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig

from ._common import device_name, git_commit, utc_now


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_batch(engine: LLMEngine, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    rng = random.Random(seed + batch)
    vocab = min(engine.model_config.vocab_size, 32000)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(engine.new_request_id("bench"), prompt, params)
    decode_s: list[float] = []
    decode_tokens = 0
    steps = 0
    start = time.perf_counter()
    while engine.scheduler.has_work:
        engine.step()
        stats = engine.last_step
        steps += 1
        if stats is not None and stats.num_prefill_tokens == 0 and stats.num_decode_tokens:
            decode_s.append(stats.duration_s)
            decode_tokens += stats.num_decode_tokens
    wall = time.perf_counter() - start
    return {
        "batch": batch,
        "steps": steps,
        "wall_s": round(wall, 4),
        "output_tokens": batch * output_len,
        "output_tokens_per_s": round(batch * output_len / wall, 2),
        "decode_tokens_per_s": round(decode_tokens / sum(decode_s), 2) if decode_s else None,
        "decode_step_ms_median": round(statistics.median(decode_s) * 1e3, 3) if decode_s else None,
        "decode_step_ms_p90": round(_quantile(decode_s, 0.9) * 1e3, 3) if decode_s else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="preset or HF-style directory")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "triton", "torch"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)

    batches = [int(b) for b in args.batches.split(",")]
    max_batch = max(batches)
    scheduler = SchedulerConfig(max_num_seqs=max_batch,
                                max_num_batched_tokens=max(2048, max_batch, args.prompt_len),
                                max_waiting=max(1024, max_batch))
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
                          kv_cache_gib=args.kv_cache_gib,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          attention_backend=args.attention_backend, scheduler=scheduler)
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t0
    runner = engine.runner
    needed = max_batch * (args.prompt_len + args.output_len)
    print(f"{args.model} on {runner.device} ({runner.dtype}): {runner.num_blocks} KV blocks "
          f"({runner.num_blocks * runner.block_size} tokens; the largest batch needs {needed}), "
          f"loaded in {load_s:.1f} s", flush=True)
    run_batch(engine, min(2, max_batch), min(args.prompt_len, 32), 8, args.seed + 999)  # warm-up

    results = []
    for batch in batches:
        result = run_batch(engine, batch, args.prompt_len, args.output_len, args.seed)
        results.append(result)
        print(f"batch {batch:4d}: {result['output_tokens_per_s']:10.1f} output tok/s, decode "
              f"{result['decode_tokens_per_s']} tok/s, decode step median "
              f"{result['decode_step_ms_median']} ms (p90 {result['decode_step_ms_p90']})", flush=True)

    report = {
        "benchmark": "engine_throughput",
        "git_commit": git_commit(),
        "date_utc": utc_now(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {"device": str(runner.device), "device_name": device_name(runner.device),
                    "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "python": platform.python_version()},
        "model": args.model,
        "num_params": engine.model_config.num_params,
        "dtype": str(runner.dtype).replace("torch.", ""),
        "attention_backend": args.attention_backend,
        "kv_blocks": runner.num_blocks,
        "block_size": runner.block_size,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "load_s": round(load_s, 2),
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_throughput_{Path(args.model).name}_{runner.device.type}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
