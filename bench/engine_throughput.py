"""Engine decode speed next to the weight-read floor: CUDA graphs with overlapped
scheduling, graphs without it, and eager, side by side.

Requests go through ``LLMEngine.step()`` / ``step_overlapped()`` (everything but HTTP),
greedy with ignore_eos, seeded random prompts, on one engine in one process. Each repeat
runs every mode in turn (medians over repeats): one request (decode step ms, tok/s,
end-to-end output tok/s) and ``--concurrency`` requests together (output tok/s, full-batch
decode step ms). Guarantee: each step time is also given as a multiple of the floor, the
time to read every weight once at a device-to-device copy's bandwidth measured in the same
run; ``agreement`` counts requests whose greedy tokens are identical to the eager mode's.
Cost: one warm-up and ``--repeats`` runs of each mode; writes
``engine_throughput_<model>_<device>.json`` into ``--out``.

    python -m bench.engine_throughput --model llama-8b --device cuda
    python -m bench.engine_throughput --device cpu --concurrency 4 --repeats 1   # smoke run
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
from sightline.engine.model_runner import default_max_num_batched_tokens, resolve_device
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig

from ._common import device_name, git_commit, utc_now


def copy_bandwidth(device: torch.device, repeats: int = 9) -> float:
    """Bytes read + written per second by a device-to-device copy (median of repeats)."""
    nbytes = 1 << 30 if device.type == "cuda" else 1 << 26
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[1:])


def generate(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    """Runs the prompts together; wall time, decode-only step times at full batch and at any
    batch, and every request's tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for prompt in prompts:
        tokens[engine.new_request_id("bench")] = []
        engine.add_request(list(tokens)[-1], prompt, params)
    full, decode, prefill, graph_steps = [], [], [], 0
    step = engine.step_overlapped if engine.async_scheduling else engine.step
    start = time.perf_counter()
    while engine.has_work:
        for _, output in step():
            tokens[output.request_id] += output.token_ids
        stats = engine.last_step
        if stats is not None and stats.num_prefill_tokens:
            prefill.append((stats.num_prefill_tokens, stats.duration_s))
        if stats is not None and stats.num_prefill_tokens == 0 and stats.num_decode_tokens:
            decode.append(stats.duration_s)
            graph_steps += engine.runner.last_step_graph_bucket is not None
            if stats.num_decode_tokens == len(prompts):
                full.append(stats.duration_s)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "full_batch_step_s": full, "decode_step_s": decode,
            "prefill_steps": prefill, "graph_steps": graph_steps, "tokens": list(tokens.values())}


def random_prompts(rng: random.Random, vocab: int, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn from [1, vocab)."""
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def _median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 3) if values else None


def run(engine: LLMEngine, args: argparse.Namespace, floor_s: float) -> dict:
    runner = engine.runner
    rng = random.Random(args.seed)
    vocab = min(engine.model_config.vocab_size, 32000)

    single_prompt = random_prompts(rng, vocab, 1, args.prompt_len)
    batch_prompts = random_prompts(rng, vocab, args.concurrency, args.prompt_len)
    graphs = runner.graphs
    # graphs: decode steps replay CUDA graphs (on the CPU the same padded static path, without
    # capture); eager: every step runs the model directly; overlap: graphs, and the next step
    # planned and launched while the device runs this one. Side by side on one engine, in turn.
    modes = ["overlap", "graphs", "eager"] if graphs is not None else ["eager"]

    def use(mode: str) -> None:
        runner.graphs = graphs if mode != "eager" else None
        engine.async_scheduling = mode == "overlap"

    raw: dict[str, dict[str, list]] = {m: {"single": [], "concurrent": []} for m in modes}
    for mode in modes:  # warm-up: Triton compiles each mode's kernel variants
        use(mode)
        generate(engine, single_prompt, 4)
        generate(engine, batch_prompts, 4)
    # single: one request (--prompt-len prompt, --single-output-len output): median decode step
    # and end-to-end output tok/s. concurrent: --concurrency requests submitted together
    # (--output-len each): end-to-end output tok/s (prefill included), median full-batch step.
    for _ in range(args.repeats):
        for mode in modes:
            use(mode)
            raw[mode]["single"].append(generate(engine, single_prompt, args.single_output_len))
            raw[mode]["concurrent"].append(generate(engine, batch_prompts, args.output_len))
    use(modes[0])
    floor_ms = floor_s * 1e3
    out = {}
    for mode in modes:
        single, conc = raw[mode]["single"], raw[mode]["concurrent"]
        step_ms = _median_ms([s for r in single for s in r["decode_step_s"]])
        full_ms = _median_ms([s for r in conc for s in r["full_batch_step_s"]])
        e2e_single = statistics.median(args.single_output_len / r["wall_s"] for r in single)
        e2e_conc = statistics.median(args.concurrency * args.output_len / r["wall_s"] for r in conc)
        out[mode] = {
            "single": {
                "decode_step_ms": step_ms,
                "decode_tokens_per_s": round(1e3 / step_ms, 1) if step_ms else None,
                "step_x_floor": round(step_ms / floor_ms, 2) if step_ms else None,
                "output_tokens_per_s": round(e2e_single, 1),
                "graph_steps": single[-1]["graph_steps"],
            },
            "concurrent": {
                "requests": args.concurrency,
                "output_tokens_per_s": round(e2e_conc, 1),
                # tokens/s if every one of the requests' output tokens took one floor-long step
                "output_x_floor_rate": round(e2e_conc / (args.concurrency / floor_s), 3),
                "full_batch_decode_step_ms": full_ms,
                "step_x_floor": round(full_ms / floor_ms, 2) if full_ms else None,
                "wall_s": [round(r["wall_s"], 4) for r in conc],
                # steps with prompt tokens (prefill and mixed): their share of the wall time,
                # and the rate of 2 x params FLOPs per prompt token they reached
                "prefill_steps": len(conc[-1]["prefill_steps"]),
                "prefill_s": round(statistics.median(sum(d for _, d in r["prefill_steps"])
                                                     for r in conc), 4),
                "prefill_tflop_per_s": round(statistics.median(
                    2 * engine.model_config.num_params * sum(n for n, _ in r["prefill_steps"])
                    / max(sum(d for _, d in r["prefill_steps"]), 1e-9) for r in conc) / 1e12, 1),
                "graph_steps": conc[-1]["graph_steps"],
            },
        }
    if len(modes) > 1:
        def last_tokens(mode: str) -> list:
            return raw[mode]["concurrent"][-1]["tokens"] + raw[mode]["single"][-1]["tokens"][:1]
        want = last_tokens("eager")
        out["agreement"] = {mode: {"identical_requests": sum(x == y for x, y in zip(last_tokens(mode), want)),
                                   "requests": len(want)} for mode in modes if mode != "eager"}
        e = out["eager"]
        out["speedup_over_eager"] = {
            mode: {"single_step": round(e["single"]["decode_step_ms"] / out[mode]["single"]["decode_step_ms"], 2),
                   "concurrent_output": round(out[mode]["concurrent"]["output_tokens_per_s"]
                                              / e["concurrent"]["output_tokens_per_s"], 2)}
            for mode in modes if mode != "eager" and out[mode]["single"]["decode_step_ms"]}
    return out


def gpu_time_breakdown(engine: LLMEngine, prompts: list[list[int]], output_len: int,
                       top: int = 15) -> dict:
    """Where a concurrent run's GPU time goes: kernels by total device time (torch.profiler,
    so only where no other CUPTI subscriber runs), and one full-batch decode graph's replay
    timed alone with events, next to the step time the engine saw."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(engine, prompts, output_len)
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in rows)
    kernels = [{"name": e.key[:120], "calls": e.count, "total_ms": round(e.self_device_time_total / 1e3, 3),
                "share": round(e.self_device_time_total / total_us, 4)} for e in rows[:top]]
    out = {"device_ms_total": round(total_us / 1e3, 3), "kernels": kernels}
    graphs = engine.runner.graphs
    if graphs is not None and graphs.buckets:
        bucket = max(graphs.buckets)
        times = []
        for _ in range(21):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.replay(bucket)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out["graph_replay_ms"] = {"bucket": bucket, "median_ms": round(statistics.median(times[1:]), 4)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="preset or HF-style directory")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--single-output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: the engine's for the device (engine serve's default)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true", help="eager mode only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the GPU-time breakdown (torch.profiler) after the runs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)

    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = default_max_num_batched_tokens(resolve_device(args.device))
    scheduler = SchedulerConfig(max_num_seqs=args.concurrency,
                                max_num_batched_tokens=max(args.max_num_batched_tokens,
                                                           args.concurrency, args.prompt_len),
                                max_waiting=max(1024, args.concurrency))
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
                          kv_cache_gib=args.kv_cache_gib, enforce_eager=args.enforce_eager,
                          gpu_memory_utilization=args.gpu_memory_utilization, scheduler=scheduler,
                          max_model_len=args.max_model_len,
                          # every mode and repeat runs the same prompts: a prefix cache would
                          # turn their prefills into hits and measure something else
                          enable_prefix_caching=False)
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t0
    runner = engine.runner
    if runner.graphs is None and runner.device.type == "cpu" and not args.enforce_eager:
        runner.static_decode(capture=False)  # the graphs' padded path, minus capture
    cap = runner.graph_capture
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    # The floor: the time to read every weight once, at the bandwidth of a device-to-device
    # copy (bytes read + written per second) measured here; decode reads all weights per step.
    bandwidth = copy_bandwidth(runner.device)
    floor_s = weight_bytes / bandwidth
    print(f"{args.model} on {runner.device} ({runner.dtype}): loaded in {load_s:.1f} s; weights "
          f"{weight_bytes / 1e9:.2f} GB, copy {bandwidth / 1e12:.2f} TB/s, floor "
          f"{floor_s * 1e3:.3f} ms/step", flush=True)
    results = run(engine, args, floor_s)
    if runner.device.type == "cuda" and not args.no_profile:
        prompts = random_prompts(random.Random(args.seed + 1),
                                 min(engine.model_config.vocab_size, 32000), args.concurrency,
                                 args.prompt_len)
        try:   # a diagnosis: its failure must not cost the figures above
            results["gpu_breakdown"] = gpu_time_breakdown(engine, prompts, args.output_len)
            for k in results["gpu_breakdown"]["kernels"]:
                print(f"  {k['total_ms']:9.3f} ms {k['calls']:6d}x {k['share']:.3f}  {k['name']}")
            print("  graph replay alone:", results["gpu_breakdown"].get("graph_replay_ms"), flush=True)
        except Exception as exc:
            print(f"GPU-time breakdown failed: {type(exc).__name__}: {exc}", flush=True)
    for mode in ("overlap", "graphs", "eager"):
        if mode in results:
            s, c = results[mode]["single"], results[mode]["concurrent"]
            print(f"{mode:7s}: batch 1 {s['decode_step_ms']} ms/step ({s['step_x_floor']}x floor, "
                  f"{s['decode_tokens_per_s']} tok/s); {args.concurrency} concurrent "
                  f"{c['output_tokens_per_s']} output tok/s, full-batch step "
                  f"{c['full_batch_decode_step_ms']} ms ({c['step_x_floor']}x floor)", flush=True)

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
        "prompt_len": args.prompt_len,
        "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
        "load_s": round(load_s, 2),
        "cuda_graphs": None if cap is None else {
            "buckets": list(cap.buckets), "skipped": list(cap.skipped),
            "capture_s": round(cap.capture_s, 2), "pool_mib": round(cap.pool_bytes / 2**20, 1)},
        "mixed_graphs": None if runner.mixed_capture is None else {
            "token_buckets": list(runner.mixed_capture.buckets),
            "skipped": list(runner.mixed_capture.skipped),
            "capture_s": round(runner.mixed_capture.capture_s, 2),
            "pool_mib": round(runner.mixed_capture.pool_bytes / 2**20, 1)},
        "floor": {"weight_bytes": weight_bytes, "copy_bytes_per_s": round(bandwidth),
                  "step_ms": round(floor_s * 1e3, 4)},
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
