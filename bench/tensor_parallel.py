"""Tensor parallelism on N GPUs (gloo on the CPU): tokens, throughput, all-reduce, a planted straggler.

    python -m bench.tensor_parallel --model llama-8b --device cuda --tp 2                # H200 x2
    python -m bench.tensor_parallel --device cpu --concurrency 4 --output-len 16 --phase-s 16 --slot-s 2

1. Greedy tokens of the offline engine at TP=1 and TP=N (a process each): identical or not.
2. ``engine serve`` at TP=1 then TP=N, tracing off: output tok/s (``bench.served_throughput``).
3. N processes of one ``TpGroup``: ``all_reduce`` of the decode step's ``[C, hidden]`` and the
   link's bandwidth (rank 0 -> 1) in the same run; per step 2 x layers all-reduces beside the
   ring's floor, 2(N-1)/N x bytes / bandwidth each.
4. TP=N serving rank timings to a collector (``--slot-s`` slots) under steady load: a control
   phase, then a neighbour on the last rank's device (``bench.noisy_neighbour`` on its GPU's
   SMs; on the CPU a busy process on its core, ranks pinned to a core each). From
   ``/api/v1/stragglers``: planted slots naming that rank, control slots naming any. Writes
``tensor_parallel-<device>-<commit>.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from ._collector import CollectorProcess
from ._common import ROOT, git_commit, utc_now, write_json, write_report
from .served_throughput import _burst, _wait_healthy

_INSTANCE = "tp-bench"


# ---- 1. tokens (a child process per TP size) ---------------------------------------------------
def _prompts(args: argparse.Namespace) -> list[list[int]]:
    from sightline.engine.config import resolve_model_config

    vocab = min(resolve_model_config(args.model).vocab_size, 32000)
    rng = random.Random(args.seed)
    return [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.token_prompts)]


def tokens_main(args: argparse.Namespace) -> int:
    from sightline.engine.config import EngineConfig
    from sightline.engine.llm_engine import LLMEngine
    from sightline.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    kv_cache_gib=args.kv_cache_gib, tensor_parallel_size=args.tp_size))
    try:
        done = engine.generate(_prompts(args), SamplingParams(max_tokens=args.token_len, temperature=0.0,
                                                              ignore_eos=True))
        Path(args.tokens_out).write_text(json.dumps([r.output_token_ids for r in done]))
    finally:
        engine.shutdown()
    return 0


def _tokens(args: argparse.Namespace, tp: int, workdir: Path) -> list[list[int]]:
    out = workdir / f"tokens-{tp}.json"
    subprocess.run([sys.executable, "-m", "bench.tensor_parallel", "--tokens-out", str(out),
                    "--tp-size", str(tp), *_model_args(args), "--prompt-len", str(args.prompt_len),
                    "--token-prompts", str(args.token_prompts), "--token-len", str(args.token_len),
                    "--seed", str(args.seed)], cwd=ROOT, check=True)
    return json.loads(out.read_text())


def _compare(one: list[list[int]], many: list[list[int]]) -> dict:
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else
                  min(len(x), len(y))) for x, y in zip(one, many)]
    return {"sequences": len(one), "identical": sum(f is None for f in first),
            "first_difference": first}


# ---- 3. all-reduce and bandwidth (N processes of one group) ------------------------------------
def _collective_rank(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from sightline.engine.config import resolve_model_config
    from sightline.engine.model_runner import resolve_dtype
    from sightline.engine.tensor_parallel import TpGroup, tp_device

    device = tp_device(args.device, rank)
    group = TpGroup.join(rank, args.tp, init, device)
    model = resolve_model_config(args.model)
    dtype = resolve_dtype(args.dtype, device, model)

    def timed(fn, reps: int) -> float:
        fn()
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t) / reps

    payload = torch.empty(args.bandwidth_mib << 20, dtype=torch.uint8, device=device)
    # rank 0 -> rank 1 over the group's link (NVLink between H200s), one direction
    send = (lambda: dist.send(payload, 1)) if rank == 0 else (
        (lambda: dist.recv(payload, 0)) if rank == 1 else (lambda: None))
    seconds = timed(send, 10)
    bandwidth = payload.numel() / seconds
    sizes = {}
    for rows in args.concurrency:
        x = torch.ones(rows, model.hidden_size, dtype=dtype, device=device)
        call_s = timed(lambda: dist.all_reduce(x), args.allreduce_reps)
        nbytes = x.numel() * x.element_size()
        floor_s = 2 * (args.tp - 1) / args.tp * nbytes / bandwidth
        sizes[rows] = {"bytes": nbytes, "call_us": round(call_s * 1e6, 2), "floor_us": round(floor_s * 1e6, 2),
                       "step_us": round(2 * model.num_layers * call_s * 1e6, 1),
                       "step_floor_us": round(2 * model.num_layers * floor_s * 1e6, 1)}
    if rank == 0:
        Path(out).write_text(json.dumps({"bandwidth_gb_s": round(bandwidth / 1e9, 2), "by_rows": sizes,
                                         "backend": dist.get_backend()}))
    group.close()


def _collectives(args: argparse.Namespace, workdir: Path) -> dict:
    import torch.multiprocessing as mp

    out = workdir / "collectives.json"
    init = f"file://{workdir / 'collectives-rendezvous'}"
    mp.start_processes(_collective_rank, args=(args, init, str(out)), nprocs=args.tp, start_method="spawn")
    return json.loads(out.read_text())


# ---- 2 and 4: served ------------------------------------------------------------------------------
def _model_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
            "--kv-cache-gib", str(args.kv_cache_gib)]


def _serve(args: argparse.Namespace, port: int, tp: int, trace: list[str], env: dict) -> subprocess.Popen:
    max_seqs = max(args.concurrency)
    command = [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", *_model_args(args),
               "--port", str(port), "--tensor-parallel-size", str(tp), "--max-num-seqs", str(max_seqs),
               "--max-waiting", str(max(1024, max_seqs)), "--log-level", "warning", *trace]
    return subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, **env))


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()


def _throughput(args: argparse.Namespace, tp: int, workdir: Path) -> dict:
    from sightline.deploy.processes import free_ports

    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    from sightline.engine.config import resolve_model_config

    rng = random.Random(args.seed)
    vocab = min(resolve_model_config(args.model).vocab_size, 32000)
    server = _serve(args, port, tp, ["--trace-level", "off"], {"SIGHTLINE_TRACE_LEVEL": "off"})
    out = {}
    try:
        _wait_healthy(url, server, args.start_timeout)
        name = _model_name(url)
        for c in args.concurrency:
            def prompts() -> list[list[int]]:
                return [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(c)]
            _burst(url, name, prompts(), args.output_len, workdir)   # warm-up
            bursts = [_burst(url, name, prompts(), args.output_len, workdir) for _ in range(args.rounds)]
            out[c] = {"output_tokens_per_s": statistics.median(b["output_tokens_per_s"] for b in bursts),
                      "rounds": [b["output_tokens_per_s"] for b in bursts],
                      "failed": sum(b["failed"] for b in bursts)}
            print(f"TP={tp}, {c} concurrent: {out[c]['output_tokens_per_s']} output tok/s", flush=True)
    finally:
        _stop(server)
    return out


def _model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _pin(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` onto ``cores`` (sched_setaffinity binds one thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass   # a thread that just exited


class _Neighbour:
    """The planted straggler on the last rank's device, for ``seconds``: ``bench.noisy_neighbour``
    on every SM of its GPU, or on the CPU a busy process on the core its threads are pinned to."""

    def __init__(self, args: argparse.Namespace, health: dict) -> None:
        self.args, self.health = args, health
        self.cpu = args.device == "cpu"
        if self.cpu:   # each rank on a core of its own (the API server and collector float)
            cores = sorted(os.sched_getaffinity(0))
            if len(cores) < args.tp:
                raise RuntimeError(f"pinning {args.tp} ranks needs {args.tp} cores; {len(cores)} usable")
            self.core = cores[args.tp - 1]
            for rank, pid in enumerate([health["core_pid"], *health["tp_worker_pids"]]):
                _pin(pid, {cores[rank]})

    def run(self, seconds: float) -> dict:
        if self.cpu:
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                _pin(hog.pid, {self.core})
                time.sleep(seconds)
            finally:
                hog.kill()
                hog.wait()
            return {"kind": "busy process", "core": self.core}
        import torch

        from .noisy_neighbour import NeighbourConfig, NoisyNeighbour
        device = torch.device("cuda", self.args.tp - 1)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        neighbour = NoisyNeighbour(NeighbourConfig(tuple(range(sms)), max_duration_s=seconds + 5), device)
        neighbour.start(seconds)
        done = neighbour.join(seconds + 60)
        return {"kind": "noisy_neighbour", "gpu": device.index, "sms_held": len(done.sms)}


def _load(url: str, args: argparse.Namespace, stop: threading.Event) -> None:
    from sightline.deploy.load import LoadConfig, run_load_sync

    c = max(args.concurrency)
    while not stop.is_set():
        run_load_sync(LoadConfig(url=url, requests=2 * c, concurrency=c, priorities=(0,),
                                 max_tokens=args.output_len, seed=random.randrange(1 << 30)), progress=None)


def _straggler(args: argparse.Namespace, workdir: Path) -> dict:
    from sightline.deploy.processes import free_port

    port = free_port()
    collector = CollectorProcess(workdir / "collector.log",
                                 ["--window-slot-s", str(args.slot_s), "--window-slots", "360"])
    trace = (["--trace-level", "steps"] if args.device == "cpu" else
             ["--trace-level", "kernels", "--kernel-sample-ratio", str(args.kernel_sample_ratio)])
    url = f"http://127.0.0.1:{port}"
    server = None
    try:
        server = _serve(args, port, args.tp, [*trace, "--otlp-endpoint", collector.url("grpc")],
                        {"OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={_INSTANCE}",
                         "OTEL_BSP_SCHEDULE_DELAY": "200"})
        _wait_healthy(url, server, args.start_timeout)
        neighbour = _Neighbour(args, _get(url + "/health"))
        stop = threading.Event()
        loader = threading.Thread(target=_load, args=(url, args, stop), daemon=True)
        loader.start()
        time.sleep(2 * args.slot_s)                       # warm-up
        control = (time.time(), None)
        time.sleep(args.phase_s)
        control = (control[0], time.time())
        time.sleep(args.slot_s)
        planted_start = time.time()
        planted_by = neighbour.run(args.phase_s)
        planted = (planted_start, time.time())
        time.sleep(args.slot_s)
        stop.set()
        loader.join(600)
        time.sleep(2 * args.slot_s + 1.0)                  # the last spans exported and a slot closed
        slots = _get(collector.url("query", f"/api/v1/stragglers?instance_id={_INSTANCE}"))["instances"]
        with urllib.request.urlopen(collector.url("query", "/metrics"), timeout=10) as response:
            metrics = response.read().decode()
    finally:
        if server is not None:
            _stop(server)
        collector.stop()
    verdicts = slots.get(_INSTANCE, [])
    last = args.tp - 1

    def inside(phase: tuple[float, float]) -> list[dict]:
        return [s for s in verdicts if s["start_s"] >= phase[0] and s["start_s"] + args.slot_s <= phase[1]]

    control_slots, planted_slots = inside(control), inside(planted)
    return {"slot_s": args.slot_s, "planted_by": planted_by,
            "planted_slots": len(planted_slots),
            "planted_named_last_rank": sum(s["straggler"] == last for s in planted_slots),
            "control_slots": len(control_slots),
            "control_named_any": sum(s["straggler"] is not None for s in control_slots),
            "wait_per_step_s": _per_step(metrics), "slots": verdicts}


def _per_step(metrics: str) -> dict[str, float]:
    """Each rank's collective wait per step over the whole run, from the collector's counters."""
    from sightline.instrumentation import semconv as sc

    values: dict[str, float] = {}
    steps = None
    for line in metrics.splitlines():
        if line.startswith(f'{sc.COLLECTOR_TP_STEPS_TOTAL}_total{{instance_id="{_INSTANCE}"}}'):
            steps = float(line.rsplit(" ", 1)[1])
        prefix = f'{sc.COLLECTOR_TP_COLLECTIVE_WAIT_SECONDS_TOTAL}_total{{instance_id="{_INSTANCE}",rank="'
        if line.startswith(prefix):
            values[line[len(prefix):line.index('"', len(prefix))]] = float(line.rsplit(" ", 1)[1])
    return {rank: round(v / steps, 6) for rank, v in values.items()} if steps else {}


# ---- the parent ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--tp", type=int, default=2, help="ranks of the parallel runs (TP=1 beside them)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="measured bursts per concurrency")
    parser.add_argument("--token-prompts", type=int, default=8)
    parser.add_argument("--token-len", type=int, default=64, help="greedy tokens compared per prompt")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV cache on the CPU")
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="default: 1024 on CUDA, 64 on the CPU")
    parser.add_argument("--allreduce-reps", type=int, default=200)
    parser.add_argument("--phase-s", type=float, default=120.0, help="control and planted phases, each")
    parser.add_argument("--slot-s", type=float, default=5.0, help="the collector's window slot")
    parser.add_argument("--kernel-sample-ratio", type=float, default=0.2, help="traced steps (CUDA)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("tokens", "throughput", "allreduce", "straggler"))
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--tokens-out", help=argparse.SUPPRESS)   # a tokens child's arguments
    parser.add_argument("--tp-size", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "auto":
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tokens_out:
        return tokens_main(args)
    if args.bandwidth_mib is None:
        args.bandwidth_mib = 1024 if args.device == "cuda" else 64

    record: dict = {"bench": "tensor_parallel", "device": args.device, "commit": git_commit(),
                    "date_utc": utc_now(), "model": args.model, "tp": args.tp,
                    "concurrency": args.concurrency, "prompt_len": args.prompt_len,
                    "output_len": args.output_len}
    if args.device == "cuda":
        import torch
        record["device"] = f"{args.tp}x {torch.cuda.get_device_name(0)}"
    with tempfile.TemporaryDirectory(prefix="tensor-parallel-") as tmp:
        workdir = Path(tmp)
        if "tokens" not in args.skip:
            record["tokens"] = _compare(_tokens(args, 1, workdir), _tokens(args, args.tp, workdir))
            print(f"tokens: {record['tokens']['identical']}/{record['tokens']['sequences']} identical", flush=True)
        if "throughput" not in args.skip:
            record["throughput"] = {tp: _throughput(args, tp, workdir) for tp in (1, args.tp)}
        if "allreduce" not in args.skip:
            record["allreduce"] = _collectives(args, workdir)
        if "straggler" not in args.skip:
            record["straggler"] = _straggler(args, workdir)
    path = write_json(Path(args.out), record)
    write_report(path, "tensor_parallel", argv, _report(record, args))
    return 0


def _report(record: dict, args: argparse.Namespace) -> list[str]:
    lines = [f"# tensor parallelism: {record['model']} on {record['device']} at {record['commit'][:8]}", ""]
    if "tokens" in record:
        t = record["tokens"]
        lines += [f"Greedy tokens, TP=1 vs TP={args.tp}: {t['identical']} of {t['sequences']} sequences of "
                  f"{args.token_len} tokens identical (first difference per sequence: {t['first_difference']}).", ""]
    if "throughput" in record:
        lines += [f"| concurrency | TP=1 output tok/s | TP={args.tp} output tok/s | ratio |", "|---|---|---|---|"]
        one, many = record["throughput"][1], record["throughput"][args.tp]
        for c in args.concurrency:
            a, b = one[c]["output_tokens_per_s"], many[c]["output_tokens_per_s"]
            lines.append(f"| {c} | {a} | {b} | {round(b / a, 3) if a else None} |")
        lines.append("")
    if "allreduce" in record:
        a = record["allreduce"]
        lines += [f"All-reduce ({a['backend']}), link bandwidth rank 0 -> 1 measured: {a['bandwidth_gb_s']} GB/s.",
                  "", "| rows | bytes | per call us | floor us | per step us | step floor us |",
                  "|---|---|---|---|---|---|"]
        for rows, r in a["by_rows"].items():
            lines.append(f"| {rows} | {r['bytes']} | {r['call_us']} | {r['floor_us']} | {r['step_us']} | "
                         f"{r['step_floor_us']} |")
        lines.append("")
    if "straggler" in record:
        s = record["straggler"]
        lines += [f"Planted straggler ({s['planted_by']}) on rank {args.tp - 1}: named in "
                  f"{s['planted_named_last_rank']} of {s['planted_slots']} slots of {s['slot_s']} s; control: "
                  f"a straggler named in {s['control_named_any']} of {s['control_slots']} slots. Collective "
                  f"wait per step by rank (whole run, in situ): {s['wait_per_step_s']}.", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
