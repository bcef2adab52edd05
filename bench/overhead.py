"""What Sightline's telemetry costs a real engine run, side by side in one process.

    python -m bench.overhead --mode levels   --out bench/results   # GPU: llama-8b shape
    python -m bench.overhead --mode profiler --out bench/results   # torch.profiler reference
    python -m bench.overhead --mode capture  --capture deploy/captures/h200-x.jsonl.gz
    python -m bench.overhead --mode report   --out bench/results   # markdown from the JSONs

``levels``: ONE engine (the llama-8b shape, random weights, bf16) serves the same workload
— ``--requests`` concurrent requests of ``--prompt`` prompt tokens and ``--output`` output
tokens (ignore_eos), offline (no HTTP) — under each configuration, interleaved within each
repeat (in an order that rotates from repeat to repeat) so drift hits all alike:

* ``off``                      tracing off (the branch only)
* ``requests+steps``           request and step spans (level ``steps``)
* ``+sm probe``                level ``kernels`` without kernel spans: the per-CTA SM probe in
                               our FlashAttention-2 kernels and its on-GPU histograms
* ``+kernel spans``            CUPTI kernel spans for the steps the default policy keeps
                               (a sampled 1 %, and the steps after a step slower than the
                               recent P99), probe off
* ``+kernel spans +sm probe``  everything

Spans go to an exporter that discards them (the cost measured is the instrumentation's,
not the network's). Output tokens/s is the median over repeats; each configuration's
ratio to ``off`` is taken within each repeat (adjacent runs, so slow drift cancels) and
the median of those paired ratios is reported with their range. Whole-run ratios cannot
resolve costs below the run-to-run noise (measured on the H200: ±15 % between identical
runs of short workloads), so after the interleaved repeats ``--in-situ-runs`` further
runs per configuration time the costs where they are paid: the engine thread's wall time
inside the span calls (``InSituTimer``), inside GpuTelemetry's begin/end_step, and the
time of CUPTI's buffer callback (another thread, but it holds the GIL the engine needs). Then the engine's throughput with telemetry off at 1, 16 and 64 concurrent
requests.

``profiler``: a separate process (CUPTI allows one activity subscriber), the same engine and
workload with telemetry off, plain vs inside ``torch.profiler.profile(CPU+CUDA)``;
the profiler's post-processing at exit is timed apart.

``capture``: a short real run at level ``kernels`` with the SM probe, written through
instrumentation/capture.py into an OTLP JSONL capture for ``sightline replay``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ._common import DiscardExporter, InSituTimer, device_name, git_commit, utc_now


@dataclass
class RunResult:
    wall_s: float
    steps: int
    output_tokens: int
    cupti_callback_s: float = 0.0   # CUPTI buffer callback time during the run (GIL held)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def _telemetry(level: str, **overrides):
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.tracing import Telemetry
    if level == "off":
        return Telemetry.disabled(), None
    sink = DiscardExporter()
    cfg = TelemetryConfig(level=level, exporter="none", **overrides)
    return Telemetry.start(cfg, span_exporters=[sink]), sink


def _engine(args, telemetry):
    from sightline.engine.config import EngineConfig
    from sightline.engine.llm_engine import LLMEngine
    from sightline.engine.scheduler import SchedulerConfig
    config = EngineConfig(model=args.model, device=args.device,
                          scheduler=SchedulerConfig(max_num_seqs=max(64, args.requests)))
    return LLMEngine(config, telemetry)


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    hi = max(3, min(vocab - 1, 100_000))
    return [[rng.randrange(2, hi) for _ in range(length)] for _ in range(n)]


def run_once(engine, telemetry, n: int, prompt_len: int, output_len: int, seed: int) -> RunResult:
    """Adds n requests at once (traced as the server would), steps until all finish."""
    from sightline.engine.request import SamplingParams
    prompts = _prompts(n, prompt_len, seed, engine.model_config.vocab_size)
    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    traces = []
    t0 = time.perf_counter()
    for prompt in prompts:
        rid = engine.new_request_id("bench")
        trace = telemetry.start_request(route="/v1/completions", headers={}, model=args_model[0],
                                        operation="text_completion", request_id=rid, priority=0)
        engine.add_request(rid, prompt, sampling, trace=trace)
        traces.append(trace)
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    for trace in traces:
        if trace is not None:
            trace.finish(status_code=200, finish_reason="length", input_tokens=prompt_len,
                         output_tokens=output_len, ttft_s=None, tpot_s=None, queue_s=None,
                         e2e_s=wall, preemptions=0)
    return RunResult(wall, steps, n * output_len)


args_model = ["llama-8b"]   # the model name put on request spans


def _sync(device: str) -> None:
    import torch
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def mode_levels(args) -> dict:
    t_start = time.perf_counter()
    tels = {lvl: _telemetry(lvl) for lvl in ("off", "steps", "kernels")}
    engine = _engine(args, tels["kernels"][0])
    print(f"[{time.perf_counter() - t_start:.1f}s] engine ready", flush=True)
    gpu = engine.gpu_telemetry
    probe = gpu.probe if gpu is not None else None
    tracer = gpu.tracer if gpu is not None else None
    cupti_ok = tracer is not None and tracer.available
    print(f"kernel spans: CUPTI {'available' if cupti_ok else 'unavailable'}, sample ratio "
          f"{gpu.config.kernel_sample_ratio if gpu else None}, after a slow step "
          f"{gpu.config.tail_follow_steps if gpu else None} steps", flush=True)
    # name, level, GpuTelemetry on, kernel spans (CUPTI per traced step), SM probe on
    configs = [("off", "off", False, False, False),
               ("requests+steps", "steps", False, False, False),
               ("+sm probe", "kernels", True, False, True),
               ("+kernel spans", "kernels", True, True, False),
               ("+kernel spans +sm probe", "kernels", True, True, True)]

    def apply(level: str, on: bool, kernel_spans: bool, with_probe: bool) -> None:
        engine.telemetry = tels[level][0]
        g = gpu if on else None
        engine.gpu_telemetry = engine.runner.gpu_telemetry = g
        if gpu is not None:
            gpu.probe = probe if with_probe else None
            gpu.tracer = tracer if kernel_spans else None

    def settle() -> None:
        _sync(args.device)
        if gpu is not None:
            gpu.flush(timeout_s=120, export=False)

    out = {"configs": [], "workload": {"requests": args.requests, "prompt": args.prompt,
                                       "output": args.output, "repeats": args.repeats}}
    runs: dict[str, list[RunResult]] = {c[0]: [] for c in configs}
    stats: dict[str, dict] = {}
    for rep in range(args.repeats + 1):                        # repeat 0 is the warm-up
        # the order rotates with the repeat, so no configuration always runs first or after
        # the same neighbour (with a fixed order, "off" ran first every time)
        shift = rep % len(configs)
        for name, level, on, kernel_spans, with_probe in configs[shift:] + configs[:shift]:
            apply(level, on, kernel_spans, with_probe)
            before = dict(gpu.stats.__dict__) if gpu is not None else {}
            cb0 = tracer.callback_s if tracer is not None else 0.0
            r = run_once(engine, tels[level][0], args.requests, args.prompt, args.output,
                         seed=rep)
            settle()
            r.cupti_callback_s = (tracer.callback_s if tracer is not None else 0.0) - cb0
            if gpu is not None and rep > 0:
                delta = {k: v - before.get(k, 0) for k, v in gpu.stats.__dict__.items()}
                acc = stats.setdefault(name, {})
                for k, v in delta.items():
                    acc[k] = acc.get(k, 0) + v
            if rep > 0:
                runs[name].append(r)
            extra = ""
            if gpu is not None and on:
                st = gpu.stats
                extra = (f" | engine-thread {1000 * (st.engine_thread_s - before['engine_thread_s']):.0f} ms,"
                         f" worker probe/match/settle {1000 * (st.worker_probe_s - before['worker_probe_s']):.0f}/"
                         f"{1000 * (st.worker_match_s - before['worker_match_s']):.0f}/"
                         f"{1000 * (st.worker_settle_s - before['worker_settle_s']):.0f} ms")
                if tracer is not None:
                    extra += f", cupti cb {tracer.callback_s:.2f} s total, {tracer.records_seen} records"
            print(f"[{time.perf_counter() - t_start:.1f}s] rep {rep} {name}: "
                  f"{r.tokens_per_s:.0f} tok/s, {r.steps} steps, "
                  f"{1000 * r.wall_s / r.steps:.1f} ms/step{extra}", flush=True)
    base = statistics.median(r.tokens_per_s for r in runs["off"])
    in_situ = _in_situ_runs(args, engine, tels, configs, apply, settle, gpu, tracer) \
        if args.in_situ_runs else {}
    for name, *_ in configs:
        tps = [r.tokens_per_s for r in runs[name]]
        med = statistics.median(tps)
        paired = [r.tokens_per_s / o.tokens_per_s for r, o in zip(runs[name], runs["off"])]
        out["configs"].append({"config": name, "tokens_per_s_median": med, "tokens_per_s_runs": tps,
                               "ratio_vs_off": med / base,
                               "paired_ratio_vs_off_median": statistics.median(paired),
                               "paired_ratio_vs_off_runs": paired,
                               "steps": runs[name][0].steps,
                               "ms_per_step_median": 1000 * statistics.median(
                                   r.wall_s / r.steps for r in runs[name]),
                               "cupti_callback_share_median": statistics.median(
                                   r.cupti_callback_s / r.wall_s for r in runs[name]),
                               "in_situ": in_situ.get(name),
                               "in_situ_every_step": in_situ.get("every step traced")
                               if name == "+kernel spans" else None,
                               "gpu_telemetry_stats": stats.get(name)})
    if gpu is not None:
        out["cupti"] = {"available": cupti_ok,
                        "reason": tracer.unavailable_reason if tracer is not None else "off",
                        "records_seen": getattr(tracer, "records_seen", None),
                        "callback_s": getattr(tracer, "callback_s", None),
                        "buffers": getattr(tracer, "buffers_completed", None),
                        "api_cbids_disabled": getattr(tracer, "api_cbids_disabled", None)}
    out["spans_exported"] = {lvl: (sink.spans if sink else 0) for lvl, (_, sink) in tels.items()}
    apply("off", False, False, False)
    out["throughput_off"] = []
    for n in args.batches:
        res = [run_once(engine, tels["off"][0], n, args.prompt, args.output, seed=100 + n)
               for _ in range(2)]
        best = statistics.median(r.tokens_per_s for r in res)
        out["throughput_off"].append({"concurrency": n, "tokens_per_s_median": best,
                                      "runs": [r.tokens_per_s for r in res],
                                      "ms_per_step_median": 1000 * statistics.median(
                                          r.wall_s / r.steps for r in res)})
        print(f"[{time.perf_counter() - t_start:.1f}s] throughput off, {n} concurrent: "
              f"{best:.0f} tok/s", flush=True)
    apply("kernels", True, True, True)
    engine.shutdown()
    for tel, _ in tels.values():
        tel.shutdown()
    return out


def _in_situ_runs(args, engine, tels, configs, apply, settle, gpu, tracer) -> dict:
    """Per configuration, ``args.in_situ_runs`` more runs with the costs timed where they are
    paid, as shares of the run's wall time (medians over the runs):

    * ``span_calls``: the engine thread inside the span calls (``InSituTimer``);
    * ``gpu_engine_thread``: the engine thread inside GpuTelemetry's begin/end_step;
    * ``gpu_worker_cpu``: CPU time of GpuTelemetry's worker (kernel spans, probe reduction);
    * ``cupti_callback_cpu``: CPU time of CUPTI's buffer callback (its thread);
    * ``other_threads_cpu``: CPU time of every thread but the engine's (span export with
      its OTLP encoding, the two above, torch's own threads); ``off`` gives the baseline.

    The last two run on other threads but hold the GIL the engine thread needs, so for this
    launch-bound engine their CPU time is an estimate of the engine time they take.
    Then one more run of ``+kernel spans`` with EVERY step traced gives the CPU cost of one
    traced step, from which the default policy's expected cost follows."""
    out = {}

    def one_run(level: str, on: bool, seed: int) -> tuple[RunResult, dict]:
        g0 = dict(gpu.stats.__dict__) if gpu is not None else {}
        cb0 = tracer.callback_cpu_s if tracer is not None else 0.0
        p0, t0 = time.process_time(), time.thread_time()
        with InSituTimer() as timer:
            r = run_once(engine, tels[level][0], args.requests, args.prompt, args.output, seed)
        # every other thread's CPU during the run: span export (encoding included), the GPU
        # telemetry worker, CUPTI's callback, and whatever torch runs on its own threads
        other_cpu = (time.process_time() - p0) - (time.thread_time() - t0)
        settle()
        d = {k: v - g0.get(k, 0) for k, v in gpu.stats.__dict__.items()} \
            if (gpu is not None and on) else {}
        cost = {"span_calls": timer.ns * 1e-9,
                "gpu_engine_thread": d.get("engine_thread_s", 0.0),
                "gpu_worker_cpu": d.get("worker_cpu_s", 0.0),
                "cupti_callback_cpu": (tracer.callback_cpu_s - cb0) if tracer is not None else 0.0,
                "other_threads_cpu": other_cpu}
        return r, {**{k: v / r.wall_s for k, v in cost.items()},
                   "traced_steps": d.get("steps_traced_sampled", 0) + d.get("steps_traced_tail", 0),
                   "kernel_spans": d.get("kernel_spans", 0), "cost_s": cost}

    for name, level, on, kernel_spans, with_probe in configs:
        apply(level, on, kernel_spans, with_probe)
        runs = [one_run(level, on, 50 + i)[1] for i in range(args.in_situ_runs)]
        keys = ("span_calls", "gpu_engine_thread", "gpu_worker_cpu", "cupti_callback_cpu",
                "other_threads_cpu")
        out[name] = {k: statistics.median(r[k] for r in runs) for k in keys}
        out[name]["runs"] = args.in_situ_runs
        out[name]["traced_steps"] = [r["traced_steps"] for r in runs]
        print(f"in situ {name}: " + ", ".join(f"{k} {100 * out[name][k]:.3f} %" for k in keys)
              + f", traced steps {out[name]['traced_steps']}", flush=True)
    if gpu is not None and tracer is not None and tracer.available:
        apply("kernels", True, True, False)
        ratio, gpu.policy.ratio = gpu.policy.ratio, 1.0
        try:
            r, c = one_run("kernels", True, 99)
        finally:
            gpu.policy.ratio = ratio
        per_step = (c["cost_s"]["gpu_worker_cpu"] + c["cost_s"]["cupti_callback_cpu"]) \
            / max(1, c["traced_steps"])
        step_s = r.wall_s / r.steps
        out["every step traced"] = {
            "tokens_per_s": r.tokens_per_s, "ms_per_step": 1000 * step_s,
            "traced_steps": c["traced_steps"], "kernel_spans": c["kernel_spans"],
            "cpu_ms_per_traced_step": 1000 * per_step,
            "kernel_spans_per_traced_step": c["kernel_spans"] / max(1, c["traced_steps"]),
            # expected share for the default policy: sampled + (1 - quantile) x follow steps
            "expected_share_at_defaults": (gpu.config.kernel_sample_ratio
                                           + (1 - gpu.config.tail_quantile)
                                           * gpu.config.tail_follow_steps) * per_step / step_s}
        e = out["every step traced"]
        print(f"every step traced: {e['tokens_per_s']:.0f} tok/s, {e['ms_per_step']:.1f} ms/step, "
              f"{e['cpu_ms_per_traced_step']:.1f} ms CPU per traced step "
              f"({e['kernel_spans_per_traced_step']:.0f} kernel spans); default policy "
              f"expected {100 * e['expected_share_at_defaults']:.3f} % of engine time", flush=True)
    return out


def mode_profiler(args) -> dict:
    import torch
    tel, _ = _telemetry("off")
    engine = _engine(args, tel)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device != "cpu" and torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    plain, prof, exit_s, events = [], [], [], []
    run_once(engine, tel, args.requests, args.prompt, args.output, seed=0)      # warm-up
    for rep in range(args.repeats):
        _sync(args.device)
        plain.append(run_once(engine, tel, args.requests, args.prompt, args.output, seed=rep + 1))
        _sync(args.device)
        p = torch.profiler.profile(activities=acts)
        p.__enter__()
        r = run_once(engine, tel, args.requests, args.prompt, args.output, seed=rep + 1)
        _sync(args.device)
        r.wall_s = r.wall_s  # the engine loop only; the profiler's exit is timed apart
        t = time.perf_counter()
        p.__exit__(None, None, None)
        exit_s.append(time.perf_counter() - t)
        try:
            events.append(sum(1 for e in p.events() if e.device_type.name == "CUDA"))
        except Exception:
            events.append(-1)
        prof.append(r)
        print(f"rep {rep}: plain {plain[-1].tokens_per_s:.0f} tok/s, profiled "
              f"{r.tokens_per_s:.0f} tok/s, profiler exit {exit_s[-1]:.1f} s", flush=True)
    engine.shutdown()
    base = statistics.median(r.tokens_per_s for r in plain)
    med = statistics.median(r.tokens_per_s for r in prof)
    return {"workload": {"requests": args.requests, "prompt": args.prompt, "output": args.output,
                         "repeats": args.repeats},
            "plain_tokens_per_s_median": base, "profiled_tokens_per_s_median": med,
            "ratio_vs_plain": med / base, "profiler_exit_s": exit_s,
            "cuda_events_recorded": events}


def mode_capture(args) -> dict:
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.tracing import Telemetry
    path = Path(args.capture)
    path.parent.mkdir(parents=True, exist_ok=True)
    tel = Telemetry.start(TelemetryConfig(level="kernels", exporter="none", capture_path=str(path),
                                          kernel_sample_ratio=args.capture_ratio,
                                          service_name="sightline-engine",
                                          resource_attributes={"host.name": "lent-h200",
                                                               "sightline.capture": "bench/overhead.py"}))
    t_start = time.perf_counter()
    engine = _engine(args, tel)
    print(f"[{time.perf_counter() - t_start:.1f}s] engine ready", flush=True)
    gpu = engine.gpu_telemetry
    results = []
    for s in range(args.repeats):
        results.append(run_once(engine, tel, args.requests, args.prompt, args.output, seed=s))
        print(f"[{time.perf_counter() - t_start:.1f}s] run {s}: {results[-1].tokens_per_s:.0f} "
              f"tok/s, {results[-1].steps} steps", flush=True)
    stats = dict(gpu.stats.__dict__) if gpu is not None else None
    engine.shutdown()          # flushes kernel spans and the per-SM histograms
    tel.shutdown()
    print(f"[{time.perf_counter() - t_start:.1f}s] capture closed", flush=True)
    return {"capture": str(path), "bytes": path.stat().st_size if path.exists() else 0,
            "runs": [r.tokens_per_s for r in results], "gpu_telemetry_stats": stats,
            "cupti": None if gpu is None else gpu.kernel_spans_available}


def report(out_dir: Path) -> str:
    lines = ["# Telemetry overhead on a real engine run", ""]
    for f in sorted(out_dir.glob("overhead-*.json")):
        r = json.loads(f.read_text())
        lines += [f"## {f.name}", "", f"device {r['device']}, commit `{r['commit']}`, "
                  f"{r['time_utc']}, command `{r['command']}`", ""]
        body = r["result"]
        if r["mode"] == "levels":
            w = body["workload"]
            lines += [f"{w['requests']} concurrent requests, prompt {w['prompt']}, output "
                      f"{w['output']} tokens, median of {w['repeats']} interleaved repeats.", "",
                      "| config | output tok/s | vs off | paired vs off (range) | ms/step "
                      "| in situ, % of wall: span calls / GPU telemetry (engine thread) / its worker CPU / CUPTI callback CPU / all other threads' CPU |",
                      "|---|---|---|---|---|---|"]
            for c in body["configs"]:
                paired = ""
                if "paired_ratio_vs_off_median" in c:
                    runs_ = c["paired_ratio_vs_off_runs"]
                    paired = (f"{c['paired_ratio_vs_off_median']:.3f} "
                              f"({min(runs_):.3f}-{max(runs_):.3f})")
                situ = c.get("in_situ") or {}
                situ_s = " / ".join(f"{100 * situ[k]:.2f}" for k in
                                    ("span_calls", "gpu_engine_thread", "gpu_worker_cpu",
                                     "cupti_callback_cpu", "other_threads_cpu") if k in situ)
                lines.append(f"| {c['config']} | {c['tokens_per_s_median']:.0f} | "
                             f"{c['ratio_vs_off']:.3f} | {paired} | "
                             f"{c['ms_per_step_median']:.2f} | {situ_s} |")
            every = next((c.get("in_situ_every_step") for c in body["configs"]
                          if c.get("in_situ_every_step")), None)
            if every:
                lines += ["", f"Every step traced (one run): {every['tokens_per_s']:.0f} tok/s, "
                          f"{every['ms_per_step']:.1f} ms/step, {every['cpu_ms_per_traced_step']:.1f}"
                          f" ms of CPU per traced step ({every['kernel_spans_per_traced_step']:.0f}"
                          f" kernel spans); expected cost of the default policy: "
                          f"{100 * every['expected_share_at_defaults']:.3f} % of engine time."]
            if "cupti" in body:
                lines += ["", f"CUPTI: {body['cupti']}; GPU telemetry totals: "
                          f"{body.get('gpu_telemetry_stats_total')}"]
            lines += ["", "| concurrency (telemetry off) | output tok/s | ms/step |", "|---|---|---|"]
            for t in body["throughput_off"]:
                lines.append(f"| {t['concurrency']} | {t['tokens_per_s_median']:.0f} | "
                             f"{t['ms_per_step_median']:.2f} |")
        elif r["mode"] == "profiler":
            lines += [f"torch.profiler (CPU+CUDA) vs plain: {body['profiled_tokens_per_s_median']:.0f}"
                      f" vs {body['plain_tokens_per_s_median']:.0f} tok/s = "
                      f"{body['ratio_vs_plain']:.3f}; profiler exit (post-processing) "
                      f"{', '.join(f'{x:.1f}' for x in body['profiler_exit_s'])} s; CUDA events "
                      f"{body['cuda_events_recorded']}."]
        elif r["mode"] == "capture":
            lines += [f"capture {body['capture']}: {body['bytes']} bytes; runs tok/s "
                      f"{[round(x) for x in body['runs']]}; CUPTI {body['cupti']}; stats "
                      f"{body['gpu_telemetry_stats']}"]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("levels", "profiler", "capture", "report"), required=True)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--capture", default=None)
    ap.add_argument("--capture-ratio", type=float, default=0.05)
    ap.add_argument("--in-situ-runs", type=int, default=3,
                    help="levels: runs per configuration with the costs timed in place")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.mode == "report":
        md = report(out)
        (out / "overhead.md").write_text(md)
        print(md)
        return 0
    args_model[0] = args.model
    t0 = time.time()
    result = {"levels": mode_levels, "profiler": mode_profiler, "capture": mode_capture}[args.mode](args)
    rec = {"mode": args.mode, "commit": git_commit(), "device": device_name(args.device, cpu_fallback="cpu"),
           "time_utc": utc_now(),
           "command": "python -m bench.overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
           "wall_s": time.time() - t0, "result": result}
    out.mkdir(parents=True, exist_ok=True)
    name = f"overhead-{args.mode}-{rec['device'].replace(' ', '-').lower()}-{rec['commit'][:8]}.json"
    (out / name).write_text(json.dumps(rec, indent=1, default=str))
    print(json.dumps({k: v for k, v in rec.items() if k != "result"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
