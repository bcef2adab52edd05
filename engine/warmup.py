"""Before ready, run every kernel variant the engine's configuration can reach.

One start-up phase per family: the fused RMSNorm / SwiGLU / RoPE kernels; prefill at every
FA2 tuning bucket up to ``max_num_batched_tokens``; eager decode at every split layout the
paged-decode kernel can choose, and the static decode path at every CUDA graph size; mixed
steps (real plans through a private scheduler and the runner's own path, overlapped, a
chunk continuing a cached prefix among them); the sampler's paths; the CUDA graphs; with
kernel telemetry, the SM-probe variants and one CUPTI-recorded step. Synthetic steps write
K/V to the runner's scratch block only, and the KV cache is zeroed before the graphs are
captured. FA2's tuned configs are kept in the compile cache for the next start.

Guarantee: once ``warm_up`` returns, no step of this configuration meets a kernel variant
for the first time (the compile watch would count it), unless ``warmup_limit_s`` cut it
short (logged, and in the report). Cost: about one forward pass per case; on the CPU,
where nothing compiles, about a second for the tiny model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..instrumentation import semconv as sc
from .cuda_graphs import graph_buckets
from .kernels.attention import use_triton
from .kernels.rmsnorm import rms_norm
from .kernels.rope import KvStore, rope_
from .kernels.swiglu import swiglu
from .kv_cache import KVCacheConfig, KVCacheManager
from .model import AttentionMetadata
from .request import Request, SamplingParams
from .scheduler import Scheduler
from .startup import PhaseRun, StartupProgress, StartupReport

__all__ = ["SAMPLER_CASES", "WarmupPlan", "plan_warmup", "warm_up"]

log = logging.getLogger(__name__)

# Every path of the sampler (engine/sampling.py), alone and all in one batch.
SAMPLER_CASES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k": SamplingParams(temperature=0.8, top_k=20),
    "min_p": SamplingParams(temperature=0.8, min_p=0.05),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5,
                                frequency_penalty=0.5),
    "greedy_penalties": SamplingParams(temperature=0.0, repetition_penalty=1.2),
    "allowed_token_ids": SamplingParams(temperature=0.8, allowed_token_ids=(1, 2, 3)),
    "seeded": SamplingParams(temperature=0.8, seed=1234),
    "everything": SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                                 repetition_penalty=1.1, presence_penalty=0.2,
                                 frequency_penalty=0.2, allowed_token_ids=(1, 2, 3), seed=7),
}


@dataclass(frozen=True)
class WarmupPlan:
    """The cases of one configuration's warm-up (``plan_warmup``)."""

    prefill_lengths: tuple[int, ...]              # one sequence each: every FA2 tuning bucket
    decode_layouts: tuple[tuple[int, int], ...]   # (rows, block-table width) per decode variant
    graph_sizes: tuple[int, ...]                  # the static decode path, per CUDA graph size
    probe: bool                                   # the attention cases again, SM probe on
    cupti: bool                                   # one step recorded by CUPTI


def plan_warmup(runner, config) -> WarmupPlan:
    """What ``warm_up`` runs for this runner and configuration."""
    budget = min(config.scheduler.max_num_batched_tokens, runner.max_model_len)
    width = -(-runner.max_model_len // runner.block_size)   # the graphs' block-table width
    rows = config.scheduler.max_num_seqs
    if use_triton(runner.device, runner.backend):
        from .kernels.prefill_attention import tuning_bucket
        top = tuning_bucket(budget)
        buckets = [64 << i for i in range(top.bit_length()) if 64 << i <= top]
        lengths = tuple(sorted({min(b, budget) for b in buckets}))
        layouts = _decode_layouts(runner, rows, width)
    else:   # the torch paths compile nothing whatever the shape: small ones run them
        lengths = tuple(sorted({1, min(budget, 64)}))
        layouts = ((1, 1), (rows, 1))
    gpu = runner.gpu_telemetry
    return WarmupPlan(lengths, layouts, graph_buckets(rows) if runner.uses_graphs else (),
                      getattr(gpu, "probe", None) is not None,
                      getattr(gpu, "tracer", None) is not None)


def _decode_layouts(runner, max_rows: int, width: int) -> tuple[tuple[int, int], ...]:
    """One (rows, width) per compiled variant of the paged-decode kernels: one split, or
    several with pass 2 at each power of two; the smallest such step for each."""
    from .kernels.paged_decode_attention import (choose_num_splits, launch_config, num_sms,
                                                 split_plan)
    kv_heads, sms = runner.model_config.num_kv_heads, num_sms(runner.device)
    block_n = launch_config()["BLOCK_N"]
    found: dict[int, tuple[int, int]] = {}   # pass 2's power of two (0: one split) -> layout
    for w in range(1, width + 1):
        context = w * runner.block_size
        for rows in range(1, max_rows + 1):
            splits, _ = split_plan(rows, kv_heads, context, sms, block_n)
            found.setdefault(0 if splits == 1 else max(2, 1 << (splits - 1).bit_length()),
                             (rows, w))
            if choose_num_splits(rows, kv_heads, context, sms) == 1:
                break   # more rows never split more
    return tuple(found[key] for key in sorted(found))


class _Cases:
    """Runs a phase's cases until the warm-up's deadline; counts run and left out."""

    def __init__(self, run: PhaseRun, deadline: float, device: torch.device) -> None:
        self.run, self.deadline, self.device = run, deadline, device

    def __call__(self, case: Callable[[], object]) -> None:
        if time.monotonic() > self.deadline:
            self.run.variants_skipped += 1
            return
        with torch.inference_mode():
            case()
        if self.device.type == "cuda":   # the phase's time is its device work too
            torch.cuda.synchronize(self.device)
        self.run.variants_run += 1


class _Synthetic:
    """Forward passes on made-up batches: every token's K/V goes to the scratch block."""

    def __init__(self, runner) -> None:
        self.runner, self.device = runner, runner.device

    def forward(self, prefills: tuple[tuple[int, int], ...] = (), decodes: int = 0,
                width: int = 1, probe=None) -> torch.Tensor:
        """``prefills``: (cached, new) tokens per sequence; ``decodes`` rows of one token
        (context 1) with block tables ``width`` wide. Returns the sampled ids (greedy)."""
        r, dev = self.runner, self.device
        positions, cu_q, cu_k, last = [], [0], [0], []
        for cached, new in prefills:
            positions += range(cached, cached + new)
            cu_q.append(cu_q[-1] + new)
            cu_k.append(cu_k[-1] + cached + new)
            last.append(len(positions) - 1)
        n_pre = len(positions)
        positions += [0] * decodes
        tokens = len(positions)
        i32 = {"dtype": torch.int32, "device": dev}
        meta = AttentionMetadata(
            num_prefill_tokens=n_pre,
            slot_mapping=torch.full((tokens,), r.scratch_slot, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor(cu_q, **i32) if prefills else None,
            cu_seqlens_k=torch.tensor(cu_k, **i32) if prefills else None,
            max_seqlen_q=max((n for _, n in prefills), default=0),
            max_seqlen_k=max((c + n for c, n in prefills), default=0),
            prefill_kv_slots=(torch.full((cu_k[-1],), r.scratch_slot, dtype=torch.long,
                                         device=dev) if any(c for c, _ in prefills) else None),
            block_tables=torch.zeros((decodes, width), **i32) if decodes else None,
            context_lens=torch.ones(decodes, **i32) if decodes else None,
            probe=probe, backend=r.backend)
        rows = torch.tensor(last + list(range(n_pre, tokens)), dtype=torch.long, device=dev)
        logits = r.model(torch.ones(tokens, dtype=torch.long, device=dev),
                         torch.tensor(positions, dtype=torch.long, device=dev), meta,
                         r.kv_cache, rows)
        return r.sampler.sample(logits, self._greedy(logits.shape[0]))

    def _greedy(self, rows: int):
        sampler = self.runner.sampler
        requests = [Request(f"warmup-greedy-{i}", [1], SamplingParams(temperature=0.0))
                    for i in range(rows)]
        return sampler.batch(requests, self.runner.model_config.vocab_size)


def warm_up(runner, config, progress: StartupProgress | None = None, recorder=None,
            cache=None, on_phase=None) -> StartupReport:
    """Runs the warm-up (``config.warmup``; else only the graph capture), captures the CUDA
    graphs, starts kernel tracing, and returns the start-up report (``progress.ready``).
    ``cache``: the ``CompileCache`` whose tuning file keeps FA2's choices."""
    if progress is None:
        progress = StartupProgress(on_phase)
    deadline = time.monotonic() + config.warmup_limit_s
    plan = plan_warmup(runner, config)
    steps = _Synthetic(runner)
    gpu = runner.gpu_telemetry
    probe = getattr(gpu, "probe", None)

    def cases(run: PhaseRun) -> _Cases:
        return _Cases(run, deadline, runner.device)

    # Under tensor parallelism the synthetic passes would meet the other ranks' all-reduces
    # unannounced (they follow step plans only): there the warm-up is the graph capture.
    warm = config.warmup and getattr(runner, "tp", None) is None
    if warm:
        log.info("warm-up: prefill lengths %s, decode layouts %s, graph sizes %s, probe %s, "
                 "CUPTI %s (limit %.0f s)", plan.prefill_lengths, plan.decode_layouts,
                 plan.graph_sizes, plan.probe, plan.cupti, config.warmup_limit_s)
        with progress.phase(sc.STARTUP_WARMUP_FUSED) as run:
            cases(run)(lambda: _fused_kernels(runner))
        with progress.phase(sc.STARTUP_WARMUP_PREFILL) as run:
            tuning = (_TuningFile(cache, runner.device) if runner.device.type == "cuda"
                      and use_triton(runner.device, runner.backend) else None)
            if tuning is not None:
                run.notes.append(tuning.load())
            case = cases(run)
            for n in plan.prefill_lengths:
                case(lambda n=n: steps.forward(((0, n),)))
            if tuning is not None:
                tuning.save()
        with progress.phase(sc.STARTUP_WARMUP_DECODE) as run:
            case = cases(run)
            for rows, width in plan.decode_layouts:
                case(lambda rows=rows, width=width: steps.forward(decodes=rows, width=width))
            if plan.graph_sizes:
                graphs = runner.static_decode(capture=True)
                for size in plan.graph_sizes:
                    case(lambda size=size: graphs.warm(size))
                    if graphs.probe is not None:
                        graphs.probe.discard()
        with progress.phase(sc.STARTUP_WARMUP_MIXED) as run:
            case = cases(run)
            case(lambda: _served_steps(runner, config))
            rows, width = plan.decode_layouts[-1]
            case(lambda: steps.forward(((16, 16), (0, 8)), decodes=rows, width=width))
        with progress.phase(sc.STARTUP_WARMUP_SAMPLER) as run:
            case = cases(run)
            for size in sorted({1, config.scheduler.max_num_seqs}):
                case(lambda size=size: _sampler_paths(runner, size))
        runner.kv_cache.zero_()   # as allocated: no trace of the made-up steps
    if runner.uses_graphs:
        with progress.phase(sc.STARTUP_CUDA_GRAPHS) as run:
            capture = runner.capture_graphs()
            mixed = runner.mixed_capture
            run.variants_run = len(capture.buckets) + (len(mixed.buckets) if mixed else 0)
            run.variants_skipped = len(capture.skipped) + (len(mixed.skipped) if mixed else 0)
            if capture.skipped:
                run.notes.append(f"sizes {capture.skipped} not captured (capture time limit)")
            if mixed is not None and mixed.skipped:
                run.notes.append(f"mixed steps of {mixed.skipped} tokens not captured (capture time limit)")
    if gpu is not None:
        with progress.phase(sc.STARTUP_WARMUP_TELEMETRY) as run:
            gpu.start_kernel_tracing()
            if warm:
                case = cases(run)
                if probe is not None:
                    for n in plan.prefill_lengths:
                        case(lambda n=n: steps.forward(((0, n),), probe=probe))
                        probe.discard()
                    for rows, width in plan.decode_layouts:
                        case(lambda rows=rows, width=width: steps.forward(
                            decodes=rows, width=width, probe=probe))
                        probe.discard()
                if gpu.kernel_spans_available:
                    case(lambda: gpu.warm_up_tracing(lambda: steps.forward(((0, 8),), decodes=1)))
    return progress.ready(recorder)


def _fused_kernels(runner) -> None:
    """RMSNorm (alone and with the residual add), SwiGLU and RoPE (with and without the KV
    store) at the model's shapes and strides (q, k, v as views of one projection)."""
    mc, dev, dtype, backend = runner.model_config, runner.device, runner.dtype, runner.backend
    tokens, hidden, d = 2, mc.hidden_size, mc.head_dim
    x = torch.zeros(tokens, hidden, dtype=dtype, device=dev)
    weight = torch.ones(hidden, dtype=dtype, device=dev)
    rms_norm(x, weight, mc.rms_norm_eps, None, backend)
    rms_norm(x, weight, mc.rms_norm_eps, torch.zeros_like(x), backend)
    swiglu(torch.zeros(tokens, 2 * mc.intermediate_size, dtype=dtype, device=dev), backend)
    q_size, kv_size = mc.num_heads * d, mc.num_kv_heads * d
    qkv = torch.zeros(tokens, q_size + 2 * kv_size, dtype=dtype, device=dev)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (t.view(tokens, -1, d) for t in (q, k, v))
    cos, sin = runner.model.rope_cos[:tokens], runner.model.rope_sin[:tokens]
    caches = runner.kv_cache[0]   # [2, N + 1, bs, Hkv, D] of layer 0
    slots = torch.full((tokens,), runner.scratch_slot, dtype=torch.long, device=dev)
    rope_(q, k, cos, sin, backend, KvStore(v, caches[0].view(-1, mc.num_kv_heads, d),
                                           caches[1].view(-1, mc.num_kv_heads, d), slots))
    rope_(q, k, cos, sin, backend)


def _served_steps(runner, config) -> None:
    """Steps planned by a scheduler over a private block manager and run as the overlapped
    engine loop runs them: a short request decoding beside a long one whose prompt is
    chunked (pure prefill, then prefill continuing a cached prefix beside a decode, then
    decodes), the next step's inputs gathered from the step in flight. The token budget
    is small (the variants are the synthetic cases'; these steps run the serving path)."""
    kv = KVCacheManager(KVCacheConfig(runner.block_size, runner.num_blocks))
    budget = min(32, config.scheduler.max_num_batched_tokens)
    scheduler = Scheduler(dataclasses.replace(config.scheduler, max_num_batched_tokens=budget,
                                              max_num_seqs=min(2, budget)), kv)
    # both requests fit the cache together, however small (prompt + max_tokens each)
    prompt = min(budget + budget // 2, runner.max_model_len - 2,
                 runner.num_blocks * runner.block_size - 8)
    for request_id, length, max_tokens in (("warmup-short", 4, 3), ("warmup-long", prompt, 1)):
        if length >= 1:
            scheduler.add(Request(request_id, [1] * length, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    in_flight = None
    while scheduler.has_work or in_flight is not None:
        plan = scheduler.schedule()
        launched = None
        if not plan.is_empty:
            run = runner.launch(plan, None, in_flight[1].tokens if in_flight else None)
            scheduler.update_pending(plan, {rid: row for row, rid in enumerate(run.request_ids)})
            launched = (plan, run)
        if in_flight is not None:
            scheduler.resolve(in_flight[0], in_flight[1].wait())
        in_flight = launched


def _sampler_paths(runner, rows: int) -> None:
    """Each sampling case alone, then all of them in one batch of ``rows``: through the
    sampler's own batch building, sampling and the copy of the ids to the host."""
    sampler, vocab = runner.sampler, runner.model_config.vocab_size
    names = list(SAMPLER_CASES)
    batches = [[name] * rows for name in names] + [[names[i % len(names)] for i in range(rows)]]
    for batch in batches:
        requests = []
        for i, name in enumerate(batch):
            request = Request(f"warmup-{name}-{i}", [1, 2, 3], SAMPLER_CASES[name])
            request.output_token_ids = [4, 5]   # penalties count these
            requests.append(request)
        logits = torch.randn(rows, vocab, dtype=runner.dtype, device=runner.device)
        sampler.start_copy(sampler.sample(logits, sampler.batch(requests, vocab))).wait()
        for request in requests:
            sampler.release(request.request_id)


class _TuningFile:
    """FA2's tuned configs in the compile cache, per GPU model and Triton version."""

    def __init__(self, cache, device: torch.device) -> None:
        import triton
        self.path: Path | None = cache.tuning_file if cache is not None else None
        self.key = f"{torch.cuda.get_device_name(device)} | triton {triton.__version__}"

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def load(self) -> str:
        from .kernels.prefill_attention import restore_tuned
        if self.path is None:
            return "FA2 tuning: no compile cache"
        entries = self._read().get(self.key)
        taken = restore_tuned(entries) if isinstance(entries, list) else 0
        return f"FA2 tuning: {taken} keys from {self.path.name}"

    def save(self) -> None:
        from .kernels.prefill_attention import tuned_entries
        if self.path is None:
            return
        data = self._read()
        data[self.key] = tuned_entries()
        try:   # written whole, then renamed: a concurrent start reads the old or the new file
            temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
            temporary.replace(self.path)
        except OSError as exc:
            log.warning("FA2 tuning not kept in %s: %s", self.path, exc)
