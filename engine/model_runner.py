"""Runs one ``StepPlan`` on the model: batch tensors in, one sampled token per finished chunk out.

The runner owns the device state: the model, the paged KV cache tensor
``[layers, 2, num_blocks, block_size, Hkv, D]`` (its size decides ``num_blocks`` for the
scheduler's block manager) and the sampler's generators. On CUDA, decode-only steps replay
CUDA graphs captured at start-up (``engine/cuda_graphs.py``; ``EngineConfig.enforce_eager``
turns them off); the others, and every step on the CPU, run eagerly.

Cost per step: the batch is built as Python lists and copied to the device at once (pinned,
non-blocking on CUDA); the only sync is the copy of the sampled tokens into pinned memory,
issued by ``launch`` and awaited by ``LaunchedStep.wait``: in between the engine can launch
the next step, whose unknown inputs are gathered on the device. KV budget: on CUDA,
``gpu_memory_utilization * total`` minus what is in use after the weights and a full-size
step (``_profile_step``); on the CPU, ``kv_cache_gib``; either capped at what ``max_num_seqs``
sequences of ``max_model_len`` tokens can use and at 2**31 elements per layer's K or V.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import torch

from ..instrumentation import semconv as sc
from .config import EngineConfig, ModelConfig
from .cuda_graphs import DecodeGraphs, GraphCapture
from .kv_cache import kv_bytes_per_block
from .model import AttentionMetadata, build_model
from .sampling import SampledTokens, Sampler, SamplingBatch
from .scheduler import ScheduledRequest, StepPlan
from .startup import StartupProgress

__all__ = ["LaunchedStep", "ModelRunner", "StepBatch", "StepExecution", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present; ``cuda`` without a GPU is an error that says so."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch sees no CUDA GPU (torch "
                           f"{torch.__version__}); use --device cpu")
    return torch.device(device)


def default_max_num_batched_tokens(device: torch.device) -> int:
    """New tokens per step when none is given: 8192 on a GPU of >= 70 GiB, else 2048
    (vLLM's API-server defaults for the two classes). On the large GPU a burst of prompts
    then prefills in one step at GEMM sizes near peak, instead of several smaller ones."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_properties(index).total_memory >= 70 * 2**30:
            return 8192
    return 2048


def resolve_dtype(dtype: str, device: torch.device, model: ModelConfig) -> torch.dtype:
    """``auto``: float32 on the CPU (its bf16 matmuls are slow), the checkpoint's half type or
    bfloat16 on CUDA."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if model.torch_dtype == "float16" else torch.bfloat16


@dataclass
class StepBatch:
    """Device tensors of one step plus the host-side map from sampled rows to requests."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64
    sampling: SamplingBatch
    sampled_request_ids: list[str]  # [S]
    num_prefill_seqs: int
    num_decode_seqs: int


@dataclass(frozen=True)
class StepExecution:
    """How the runner ran its last step, for the engine's step record."""

    cuda_graph: bool
    graph_batch_size: int | None = None  # the padded bucket replayed; None when eager

    def attributes(self) -> dict[str, bool | int]:
        """Step span attributes (``semconv.STEP_CUDA_GRAPH``, ``STEP_GRAPH_BATCH_SIZE``)."""
        if self.graph_batch_size is None:
            return {sc.STEP_CUDA_GRAPH: self.cuda_graph}
        return {sc.STEP_CUDA_GRAPH: self.cuda_graph, sc.STEP_GRAPH_BATCH_SIZE: self.graph_batch_size}


_EAGER = StepExecution(cuda_graph=False)


def _untimed(name: str) -> contextlib.AbstractContextManager:
    """Where no start-up progress is kept: phases run untimed."""
    return contextlib.nullcontext()


@dataclass
class LaunchedStep:
    """A step enqueued on the device: ``wait()`` -> request_id -> sampled token."""

    request_ids: list[str]          # the sampled rows, in order
    tokens: SampledTokens | None    # None when no row samples
    execution: StepExecution

    def wait(self) -> dict[str, int]:
        return dict(zip(self.request_ids, self.tokens.wait())) if self.tokens is not None else {}


class ModelRunner:
    """Model + KV cache + sampler on one device. Not thread-safe: the engine loop calls it."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, gpu_telemetry=None,
                 startup: StartupProgress | None = None) -> None:
        """``startup``: times the phases (load weights, size and allocate the KV cache) and
        leaves the CUDA graphs to the warm-up (``engine/warmup.py``), which captures them
        after the eager variants; without it they are captured here."""
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.block_size = config.block_size
        self.gpu_telemetry = gpu_telemetry
        self.backend = config.attention_backend
        self._pin = self.device.type == "cuda"
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
        start = time.monotonic()
        phase = startup.phase if startup is not None else _untimed
        with phase(sc.STARTUP_LOAD_WEIGHTS):
            self.model = build_model(model_config, self.device, self.dtype, seed=config.seed)
        self.sampler = Sampler(self.device, config.seed)
        self.bytes_per_block = kv_bytes_per_block(
            num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim, block_size=self.block_size,
            dtype_bytes=torch.empty((), dtype=self.dtype).element_size())
        with phase(sc.STARTUP_PROFILE_MEMORY) if self.device.type == "cuda" else _untimed(""):
            self.num_blocks = self._kv_blocks()
        with phase(sc.STARTUP_ALLOCATE_KV):
            # One block more than the scheduler manages: padded rows of graph replays and
            # the warm-up's synthetic steps write there.
            self.kv_cache = torch.zeros(  # [L, 2, N + 1, bs, Hkv, D]; block N: scratch
                model_config.num_layers, 2, self.num_blocks + 1, self.block_size,
                model_config.num_kv_heads, model_config.head_dim, dtype=self.dtype,
                device=self.device)
        limit = config.max_model_len or model_config.max_position_embeddings
        self.max_model_len = min(limit, model_config.max_position_embeddings,
                                 self.num_blocks * self.block_size)
        self.graphs: DecodeGraphs | None = None
        self.graph_capture: GraphCapture | None = None
        self.last_execution: StepExecution = _EAGER
        if startup is None and self.uses_graphs:
            self.capture_graphs()
        log.info("model %s on %s (%s): %d blocks of %d tokens (%.2f GiB KV), max_model_len %d, "
                 "ready in %.1f s", model_config.name, self.device, self.dtype, self.num_blocks,
                 self.block_size, self.num_blocks * self.bytes_per_block / 2**30,
                 self.max_model_len, time.monotonic() - start)

    # ---- CUDA graphs -------------------------------------------------------------------------
    def static_decode(self, capture: bool) -> DecodeGraphs:
        """The padded static-input decode path (``capture=False``: without graphs, as the CPU
        tests run it); used by ``execute`` for decode-only steps from now on."""
        probe = getattr(self.gpu_telemetry, "probe", None)
        self.graphs = DecodeGraphs(
            self.model, self.kv_cache, self.config.scheduler.max_num_seqs,
            -(-self.max_model_len // self.block_size), self.num_blocks * self.block_size,
            self.backend, probe, capture=capture)
        return self.graphs

    @property
    def uses_graphs(self) -> bool:
        """Decode-only steps replay CUDA graphs (on CUDA, unless ``enforce_eager``)."""
        return self.device.type == "cuda" and not self.config.enforce_eager

    @property
    def scratch_slot(self) -> int:
        """The first KV slot of the block no request owns (padding and warm-up write there)."""
        return self.num_blocks * self.block_size

    def capture_graphs(self, limit_s: float | None = None) -> GraphCapture:
        """Captures the decode graphs (on the static path ``static_decode`` made, or a new
        one), for at most ``limit_s`` (default: the config's capture limit)."""
        graphs = self.graphs if self.graphs is not None and self.graphs.capture else \
            self.static_decode(capture=True)
        if limit_s is None:
            limit_s = self.config.cuda_graph_capture_limit_s
        self.graph_capture = cap = graphs.capture_all(limit_s)
        log.info("CUDA graphs: captured decode batch sizes %s in %.1f s (%.0f MiB)%s",
                 ",".join(map(str, cap.buckets)), cap.capture_s, cap.pool_bytes / 2**20,
                 f"; skipped {cap.skipped} (capture time limit)" if cap.skipped else "")
        return cap

    @property
    def last_step_graph_bucket(self) -> int | None:
        """The padded batch size of the graph the last step replayed; None when eager."""
        return self.last_execution.graph_batch_size

    # ---- memory ------------------------------------------------------------------------------
    def _kv_blocks(self) -> int:
        if self.device.type != "cuda":
            blocks = int(self.config.kv_cache_gib * 2**30) // self.bytes_per_block
        else:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._profile_step()
            free, total = torch.cuda.mem_get_info(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            current = torch.cuda.memory_allocated(self.device)
            budget = total * self.config.gpu_memory_utilization - (total - free) - (peak - current)
            blocks = int(max(budget, 0)) // self.bytes_per_block
        # Caps: more blocks than max_num_seqs full-length sequences can never be in use (no point
        # zeroing memory for them, for a tiny model on a large GPU), and one layer's K (or V)
        # cache stays under 2**31 elements so kernels may index it in int32.
        mc = self.model_config
        limit = min(self.config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        useful = self.config.scheduler.max_num_seqs * -(-limit // self.block_size)
        int32_cap = (2**31 - 1) // (self.block_size * mc.num_kv_heads * mc.head_dim) - 1  # + scratch
        if blocks > min(useful, int32_cap):
            log.info("KV cache capped at %d blocks (budget allowed %d)", min(useful, int32_cap), blocks)
            blocks = min(useful, int32_cap)
        if blocks < 2:
            raise RuntimeError(f"the KV budget holds {blocks} blocks of {self.bytes_per_block} bytes; "
                               "raise --kv-cache-gib / --gpu-memory-utilization or pick a smaller model")
        return blocks

    @torch.inference_mode()
    def _profile_step(self) -> None:
        """One cache-less prefill at the step token budget, sampled at max_num_seqs rows: its
        peak memory is what activations need (and Triton kernels get compiled here)."""
        sched = self.config.scheduler
        tokens = min(sched.max_num_batched_tokens, self.model_config.max_position_embeddings)
        rows = min(sched.max_num_seqs, tokens)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens, device=self.device)
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(num_prefill_tokens=tokens, slot_mapping=None, cu_seqlens_q=cu,
                                 cu_seqlens_k=cu, max_seqlen_q=tokens, max_seqlen_k=tokens,
                                 backend=self.backend)
        logits = self.model(ids, positions, meta, None, torch.arange(rows, device=self.device))
        batch = SamplingBatch(torch.ones(rows, device=self.device),
                              torch.full((rows,), 0.9, device=self.device), [None] * rows, False, True,
                              top_ks=torch.full((rows,), 50, device=self.device))
        self.sampler.sample(logits, batch)
        torch.cuda.synchronize(self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked blocks (KVCacheManager.take_pending_copies) before a step."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # ---- one step ----------------------------------------------------------------------------
    def prepare(self, plan: StepPlan, previous: SampledTokens | None = None) -> StepBatch:
        """Lists -> device tensors. Prefill chunks go first, then one token per decode. A
        decode whose input is a ``pending_token`` stand-in takes it from ``previous``'s
        sampled ids on the device (one gather; no host sync)."""
        bs = self.block_size
        prefills: list[ScheduledRequest] = []
        decodes: list[ScheduledRequest] = []
        for entry in plan.scheduled:
            # By shape, not by the scheduler's label: one new token after a cached prefix is a
            # decode for the kernels even when it ends a recomputed (preempted) prefill.
            if entry.num_new_tokens == 1 and entry.computed_before > 0:
                decodes.append(entry)
            else:
                prefills.append(entry)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q, cu_k = [0], [0]
        kv_slots: list[int] = []
        max_q = max_k = 0
        gather = any(e.computed_before > 0 for e in prefills)
        logits_indices: list[int] = []
        sampled = []

        def sample_row(entry: ScheduledRequest, index: int) -> None:
            logits_indices.append(index)
            sampled.append(entry.request)

        for entry in prefills:
            req, start, n = entry.request, entry.computed_before, entry.num_new_tokens
            end = start + n
            blocks = req.block_ids
            input_ids += req.token_ids(start, end)
            positions += range(start, end)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            max_q, max_k = max(max_q, n), max(max_k, end)
            if gather:
                kv_slots += [blocks[p // bs] * bs + p % bs for p in range(end)]
            if entry.samples_token:
                sample_row(entry, len(input_ids) - 1)
        num_prefill = len(input_ids)
        max_blocks = max((len(e.request.block_ids) for e in decodes), default=0)
        tables: list[int] = []
        context_lens: list[int] = []
        pending_at: list[int] = []   # input positions of stand-ins, and their rows in previous
        pending_rows: list[int] = []
        for entry in decodes:
            req, pos = entry.request, entry.computed_before
            token = req.token_ids(pos, pos + 1)[0]
            if token < 0:
                pending_at.append(len(input_ids))
                pending_rows.append(-1 - token)
            input_ids.append(token)
            positions.append(pos)
            slots.append(req.block_ids[pos // bs] * bs + pos % bs)
            tables += req.block_ids
            tables += [0] * (max_blocks - len(req.block_ids))  # never read: past the context
            context_lens.append(pos + 1)
            if entry.samples_token:
                sample_row(entry, len(input_ids) - 1)

        # One host buffer, one copy; the views below are slices of it.
        if pending_at and previous is None:
            raise RuntimeError(f"step {plan.step_id}: inputs pending without the step that samples them")
        parts = (input_ids, positions, slots, cu_q, cu_k, kv_slots, tables, context_lens, logits_indices,
                 pending_at, pending_rows)
        flat = [x for part in parts for x in part]
        host = torch.tensor(flat, dtype=torch.long, pin_memory=self._pin)
        dev = host.to(self.device, non_blocking=True)
        views = []
        offset = 0
        for part in parts:
            views.append(dev[offset:offset + len(part)])
            offset += len(part)
        d_ids, d_pos, d_slots, d_cu_q, d_cu_k, d_kv_slots, d_tables, d_ctx, d_logits, d_at, d_rows = views
        if pending_at:
            d_ids[d_at] = previous.device[d_rows]
        meta = AttentionMetadata(
            num_prefill_tokens=num_prefill,
            slot_mapping=d_slots,
            cu_seqlens_q=d_cu_q.int() if prefills else None,
            cu_seqlens_k=d_cu_k.int() if prefills else None,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            prefill_kv_slots=d_kv_slots if gather else None,
            block_tables=d_tables.int().view(len(decodes), max_blocks) if decodes else None,
            context_lens=d_ctx.int() if decodes else None,
            probe=None,  # set by execute() for steps whose GPU data is collected
            backend=self.backend,
        )
        sampling = self.sampler.batch(sampled, self.model_config.vocab_size)
        return StepBatch(d_ids, d_pos, meta, d_logits, sampling, [r.request_id for r in sampled],
                         num_prefill_seqs=len(prefills), num_decode_seqs=len(decodes))

    def execute(self, plan: StepPlan, step_trace=None) -> dict[str, int]:
        """Runs the plan and waits: request_id -> sampled token for every chunk that samples."""
        return self.launch(plan, step_trace).wait()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, step_trace=None,
               previous: SampledTokens | None = None) -> LaunchedStep:
        """Enqueues the plan on the device and the copy of its sampled ids, without waiting
        (``previous``: the step in flight, whose ids stand-in inputs take). A step with
        kernel spans is waited for here only when CUPTI is detached after it
        (``GpuTelemetry.waits_for_traced_steps``)."""
        if plan.is_empty:
            return LaunchedStep([], None, _EAGER)
        batch = self.prepare(plan, previous)
        bucket = None
        if self.graphs is not None and batch.num_prefill_seqs == 0:
            bucket = self.graphs.bucket_for(batch.num_decode_seqs, batch.meta.block_tables.shape[1])
        gpu = self.gpu_telemetry if step_trace is not None else None
        # the usual step (no kernel spans, probe records not read) calls nothing: planned so
        # when the last step ended; its eager kernels probe nothing (a replay's graph writes
        # its probe slots all the same, and the next probed replay overwrites them)
        plain = gpu is not None and gpu.next_step_plain
        if gpu is not None and not plain:
            # The SM probe is drained by end_step: kernels may only write to it between the two.
            batch.meta.probe = gpu.probe
            gpu.begin_step(step_trace)
        tokens = replayed = None
        try:
            if bucket is None:
                execution = _EAGER
                logits = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache,
                                    batch.logits_indices)  # [S, V]
            else:
                execution = StepExecution(cuda_graph=self.graphs.capture, graph_batch_size=bucket)
                logits = self._replay(batch, bucket)
                replayed = (self.graphs, bucket)   # its probed launches are the step's
            if batch.sampled_request_ids:
                tokens = self.sampler.start_copy(self.sampler.sample(logits, batch.sampling))
        finally:
            if gpu is not None and not plain:
                if gpu.tracing and gpu.waits_for_traced_steps and tokens is not None:
                    tokens.wait()
                gpu.end_step(step_trace, tokens.copied if tokens is not None else None, replayed)
        self.last_execution = execution
        return LaunchedStep(batch.sampled_request_ids, tokens, execution)

    def _replay(self, batch: StepBatch, bucket: int) -> torch.Tensor:
        """A decode-only step through the static path; logits [S, V] of the sampled rows."""
        meta = batch.meta
        logits = self.graphs.run(batch.input_ids, batch.positions, meta.slot_mapping,
                                 meta.block_tables, meta.context_lens, bucket)  # [bucket, V]
        n, s = batch.num_decode_seqs, len(batch.sampled_request_ids)
        # decode rows are the packed tokens in order: usually every one samples
        return logits[:n] if s == n else logits[batch.logits_indices]

    def release(self, request_id: str) -> None:
        """The request ended: drop its sampling generator."""
        self.sampler.release(request_id)
