"""Runs one ``StepPlan`` on the model: batch tensors in, one sampled token per finished chunk out.

The runner owns the device state: the model, the paged KV cache tensor
``[layers, 2, num_blocks, block_size, Hkv, D]`` (its size decides the scheduler's
``num_blocks``) and the sampler's generators. On CUDA (not with ``enforce_eager``) steps
replay CUDA graphs captured at start-up: decode-only ones whole (``engine/cuda_graphs.py``),
others between their attentions (``engine/mixed_graphs.py``). Tensor parallelism (``tp``):
this rank's shard; rank 0 sends each step to the others, samples alone, broadcasts ids.
Cost per step: the batch is built as Python lists and copied to the device at once (pinned,
non-blocking on CUDA); the only sync is the copy of the sampled tokens into pinned memory,
issued by ``launch``, awaited by ``LaunchedStep.wait`` (meanwhile the next step launches,
its unknown inputs gathered on the device). KV budget: on CUDA, ``gpu_memory_utilization *
total`` minus what is in use after the weights and a full-size step (``_profile_step``); on
the CPU, ``kv_cache_gib``; capped at what ``max_num_seqs`` sequences of ``max_model_len``
can use, at 2**31 elements per layer's K or V, and at the smallest tensor-parallel rank's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..instrumentation import semconv as sc
from .config import EngineConfig, ModelConfig
from .cuda_graphs import DecodeGraphs, GraphCapture
from .mixed_graphs import MixedCapture, MixedGraphs
from .kv_cache import kv_bytes_per_block
from .model import AttentionMetadata, Shard, build_model
from .sampling import SampledTokens, Sampler, SamplingBatch
from .scheduler import ScheduledRequest, StepPlan
from .startup import StartupProgress

if TYPE_CHECKING:
    from .tensor_parallel import TpGroup

__all__ = ["HostStep", "LaunchedStep", "ModelRunner", "StepBatch", "StepExecution", "resolve_device",
           "resolve_dtype"]

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


@dataclass(slots=True)
class HostStep:
    """One step's batch on the host: its lists in one int64 tensor (``lengths`` each: input
    ids, positions, slots, cu_seqlens_q, cu_seqlens_k, prefill KV slots, block tables,
    context lengths, logits indices, stand-in positions, their rows in the previous step's
    ids; then, under tensor parallelism, the KV block copies' sources and destinations) and
    the sizes that shape the device batch."""

    flat: torch.Tensor | None   # None: not received yet (a rank's StepMessage header)
    lengths: tuple[int, ...]
    num_prefill_tokens: int
    max_seqlen_q: int
    max_seqlen_k: int
    num_prefill_seqs: int
    num_decode_seqs: int
    max_blocks: int
    gather: bool


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
    host: HostStep | None = None


@dataclass(frozen=True)
class StepExecution:
    """How the runner ran its last step, for the engine's step record."""

    cuda_graph: bool
    graph_batch_size: int | None = None  # the padded bucket replayed; None when eager
    # the padded token count whose graphs ran between eager attentions (engine/mixed_graphs.py)
    graph_tokens: int | None = None

    def attributes(self) -> dict[str, bool | int]:
        """Step span attributes (``semconv.STEP_CUDA_GRAPH``, ``STEP_GRAPH_BATCH_SIZE``,
        ``STEP_GRAPH_TOKENS``)."""
        attrs: dict[str, bool | int] = {sc.STEP_CUDA_GRAPH: self.cuda_graph}
        if self.graph_batch_size is not None:
            attrs[sc.STEP_GRAPH_BATCH_SIZE] = self.graph_batch_size
        if self.graph_tokens is not None:
            attrs[sc.STEP_GRAPH_TOKENS] = self.graph_tokens
        return attrs


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
                 tp: TpGroup | None = None, startup: StartupProgress | None = None) -> None:
        """``startup``: times the phases (load weights, size and allocate the KV cache) and
        leaves the CUDA graphs to the warm-up (``engine/warmup.py``), which captures them
        after the eager variants; without it they are captured here. ``tp``: this rank's
        tensor-parallel group (None: the whole model here)."""
        self.config = config
        self.model_config = model_config
        self.tp = tp
        self.device = resolve_device(config.device) if tp is None else tp.device
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.block_size = config.block_size
        self.gpu_telemetry = gpu_telemetry
        self.backend = config.attention_backend
        self._pin = self.device.type == "cuda"
        if self.device.type == "cpu":
            ranks = tp.size if tp is not None else 1   # the ranks share the cores
            torch.set_num_threads(config.cpu_threads or max(1, ((os.cpu_count() or 2) - 1) // ranks))
        start = time.monotonic()
        shard = Shard() if tp is None else Shard(tp.rank, tp.size, tp.all_reduce, tp.rank == 0)
        phase = startup.phase if startup is not None else _untimed
        with phase(sc.STARTUP_LOAD_WEIGHTS):
            self.model = build_model(model_config, self.device, self.dtype, seed=config.seed,
                                     shard=shard)
        self.sampler = Sampler(self.device, config.seed)
        self.num_kv_heads = model_config.num_kv_heads // shard.size   # this rank's
        self.bytes_per_block = kv_bytes_per_block(
            num_layers=model_config.num_layers, num_kv_heads=self.num_kv_heads,
            head_dim=model_config.head_dim, block_size=self.block_size,
            dtype_bytes=torch.empty((), dtype=self.dtype).element_size())
        with phase(sc.STARTUP_PROFILE_MEMORY) if self.device.type == "cuda" else _untimed(""):
            self.num_blocks = self._kv_blocks()
        with phase(sc.STARTUP_ALLOCATE_KV):
            # One block more than the scheduler manages: padded rows of graph replays and
            # the warm-up's synthetic steps write there.
            self.kv_cache = torch.zeros(  # [L, 2, N + 1, bs, Hkv/ranks, D]; block N: scratch
                model_config.num_layers, 2, self.num_blocks + 1, self.block_size,
                self.num_kv_heads, model_config.head_dim, dtype=self.dtype,
                device=self.device)
        # tensor parallelism on rank 0: where this rank's RankStep events go (set by the core
        # when they are recorded: the CPU's host clock), the KV copies the next step sends
        self.record_rank = None
        self._copies: list[tuple[int, int]] = []
        limit = config.max_model_len or model_config.max_position_embeddings
        self.max_model_len = min(limit, model_config.max_position_embeddings,
                                 self.num_blocks * self.block_size)
        self.graphs: DecodeGraphs | None = None
        self.graph_capture: GraphCapture | None = None
        self.mixed: MixedGraphs | None = None
        self.mixed_capture: MixedCapture | None = None
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

    def static_mixed(self, capture: bool) -> MixedGraphs:
        """The static-input path for steps with prefill tokens (``capture=False``: without
        graphs, as the CPU tests run it); used by ``launch`` for them from now on."""
        self.mixed = MixedGraphs(self.model, self.kv_cache, self.config.scheduler.max_num_batched_tokens,
                                 self.scratch_slot, self.backend, capture=capture)
        return self.mixed

    @property
    def uses_graphs(self) -> bool:
        """Steps replay CUDA graphs (on CUDA, unless ``enforce_eager``)."""
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
        # every rank captures the same buckets in the same order (their warm-up runs meet
        # in all-reduces): rank 0 decides when the time limit has passed
        self.graph_capture = cap = graphs.capture_all(limit_s, None if self.tp is None else self.tp.agree)
        log.info("CUDA graphs: captured decode batch sizes %s in %.1f s (%.0f MiB)%s",
                 ",".join(map(str, cap.buckets)), cap.capture_s, cap.pool_bytes / 2**20,
                 f"; skipped {cap.skipped} (capture time limit)" if cap.skipped else "")
        if self.tp is None:   # tensor-parallel ranks replay decode graphs only
            self._capture_mixed(max(limit_s - cap.capture_s, 0.0))
        return cap

    def _capture_mixed(self, limit_s: float) -> None:
        """Captures the segments between attentions for steps with prefill tokens."""
        mixed = self.mixed if self.mixed is not None and self.mixed.capture else self.static_mixed(True)
        try:
            self.mixed_capture = cap = mixed.capture_all(limit_s)
        except torch.cuda.OutOfMemoryError:
            # the KV cache was sized first: without room for the segments' pool, steps with
            # prefill tokens run eagerly rather than the engine not starting
            self.mixed = None
            torch.cuda.empty_cache()
            log.warning("CUDA graphs: no memory left for the mixed-step segments; steps with "
                        "prefill tokens run eagerly")
            return
        log.info("CUDA graphs: captured the segments between attentions for steps of %s tokens "
                 "in %.1f s (%.0f MiB)%s", ",".join(map(str, cap.buckets)), cap.capture_s,
                 cap.pool_bytes / 2**20,
                 f"; skipped {cap.skipped} (capture time limit)" if cap.skipped else "")

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
        int32_cap = (2**31 - 1) // (self.block_size * self.num_kv_heads * mc.head_dim) - 1  # + scratch
        if blocks > min(useful, int32_cap):
            log.info("KV cache capped at %d blocks (budget allowed %d)", min(useful, int32_cap), blocks)
            blocks = min(useful, int32_cap)
        if self.tp is not None:   # the scheduler's blocks exist on every rank
            blocks = self.tp.min_int(blocks)
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
        if logits is None:   # a rank without the head
            torch.cuda.synchronize(self.device)
            return
        batch = SamplingBatch(torch.ones(rows, device=self.device),
                              torch.full((rows,), 0.9, device=self.device), [None] * rows, False, True,
                              top_ks=torch.full((rows,), 50, device=self.device))
        self.sampler.sample(logits, batch)
        torch.cuda.synchronize(self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked blocks (KVCacheManager.take_pending_copies) before a step
        (under tensor parallelism the other ranks make them with the next step)."""
        if self.tp is not None and self.tp.rank == 0:
            self._copies += copies
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

        if pending_at and previous is None:
            raise RuntimeError(f"step {plan.step_id}: inputs pending without the step that samples them")
        # One host buffer, one copy; the device views are slices of it.
        parts = (input_ids, positions, slots, cu_q, cu_k, kv_slots, tables, context_lens, logits_indices,
                 pending_at, pending_rows)
        flat = [x for part in parts for x in part]
        if self.tp is not None:   # the other ranks make the KV copies first
            flat += [src for src, _ in self._copies] + [dst for _, dst in self._copies]
        host = HostStep(torch.tensor(flat, dtype=torch.long, pin_memory=self._pin),
                        tuple(map(len, parts)), num_prefill, max_q, max_k, len(prefills),
                        len(decodes), max_blocks, gather)
        ids, pos, meta, logits_indices = self.device_batch(
            host, previous.device if previous is not None else None)
        sampling = self.sampler.batch(sampled, self.model_config.vocab_size)
        return StepBatch(ids, pos, meta, logits_indices, sampling, [r.request_id for r in sampled],
                         len(prefills), len(decodes), host)

    def device_batch(self, host: HostStep, previous_ids: torch.Tensor | None):
        """The host batch on the device: (input ids [T], positions [T], attention metadata,
        logits indices [S]); stand-in inputs gathered from ``previous_ids`` [S'] there."""
        dev = host.flat.to(self.device, non_blocking=True)
        views = []
        offset = 0
        for n in host.lengths:
            views.append(dev[offset:offset + n])
            offset += n
        d_ids, d_pos, d_slots, d_cu_q, d_cu_k, d_kv_slots, d_tables, d_ctx, d_logits, d_at, d_rows = views
        if host.lengths[9]:
            d_ids[d_at] = previous_ids[d_rows]
        prefills, decodes = host.num_prefill_seqs, host.num_decode_seqs
        meta = AttentionMetadata(
            num_prefill_tokens=host.num_prefill_tokens,
            slot_mapping=d_slots,
            cu_seqlens_q=d_cu_q.int() if prefills else None,
            cu_seqlens_k=d_cu_k.int() if prefills else None,
            max_seqlen_q=host.max_seqlen_q,
            max_seqlen_k=host.max_seqlen_k,
            prefill_kv_slots=d_kv_slots if host.gather else None,
            block_tables=d_tables.int().view(decodes, host.max_blocks) if decodes else None,
            context_lens=d_ctx.int() if decodes else None,
            probe=None,  # set by execute() for steps whose GPU data is collected
            backend=self.backend,
        )
        return d_ids, d_pos, meta, d_logits

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
        bucket = tokens_bucket = None
        if self.graphs is not None and batch.num_prefill_seqs == 0:
            bucket = self.graphs.bucket_for(batch.num_decode_seqs, batch.meta.block_tables.shape[1])
        if bucket is None and self.mixed is not None:
            tokens_bucket = self.mixed.bucket_for(batch.input_ids.shape[0])
        gpu = self.gpu_telemetry if step_trace is not None else None
        # the usual step (no kernel spans, probe records not read) calls nothing: planned so
        # when the last step ended; its eager kernels probe nothing (a replay's graph writes
        # its probe slots all the same, and the next probed replay overwrites them)
        prefill = batch.num_prefill_seqs > 0
        plain = gpu is not None and gpu.next_step_plain and not (prefill and gpu.prefill_due())
        if gpu is not None and not plain:
            # The SM probe is drained by end_step: kernels may only write to it between the two.
            batch.meta.probe = gpu.probe
            gpu.begin_step(step_trace, prefill)
        tokens = replayed = None
        timed = False
        try:
            if self.tp is not None:
                timed = self._send_step(plan, batch, bucket, step_trace,
                                        gpu if gpu is not None and not plain else None)
            if tokens_bucket is not None:
                execution = StepExecution(cuda_graph=False, graph_tokens=tokens_bucket)
                logits = self.mixed.run(batch.input_ids, batch.positions, batch.meta,
                                        batch.logits_indices, tokens_bucket)  # [S, V]
            elif bucket is None:
                execution = _EAGER
                logits = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache,
                                    batch.logits_indices)  # [S, V]
            else:
                execution = StepExecution(cuda_graph=self.graphs.capture, graph_batch_size=bucket)
                logits = self._replay(batch, bucket)
                replayed = (self.graphs, bucket)   # its probed launches are the step's
            if timed:
                rows = bucket or batch.input_ids.shape[0]
                self.record_rank(self.tp.end_timing(plan.step_id, self.collective_bytes(rows)))
            if batch.sampled_request_ids:
                ids = self.sampler.sample(logits, batch.sampling)
                if self.tp is not None and self.async_ids:   # stand-ins on every rank
                    self.tp.send_ids(ids)
                tokens = self.sampler.start_copy(ids)
        finally:
            if gpu is not None and not plain:
                if gpu.tracing and gpu.waits_for_traced_steps and tokens is not None:
                    tokens.wait()
                gpu.end_step(step_trace, tokens.copied if tokens is not None else None, replayed)
        self.last_execution = execution
        return LaunchedStep(batch.sampled_request_ids, tokens, execution)

    # ---- tensor parallelism (rank 0) -----------------------------------------------------------
    # With overlapped scheduling a step's inputs may be stand-ins for the previous step's ids
    # on the device: every rank then needs those ids (the engine core sets this).
    async_ids = False

    def collective_bytes(self, rows: int) -> int:
        """Bytes of one all-reduce of a forward pass over ``rows`` tokens: ``[T, hidden]``."""
        return rows * self.model_config.hidden_size * torch.empty((), dtype=self.dtype).element_size()

    def _send_step(self, plan: StepPlan, batch: StepBatch, bucket: int | None, step, gpu) -> bool:
        """Sends the step to the other ranks, with the telemetry decided for it here, and
        starts this rank's timing when ranks' timings are recorded (True then)."""
        from .tensor_parallel import StepMessage

        host, tp = batch.host, self.tp
        traced = gpu is not None and gpu.tracing
        probed = gpu is not None and gpu.probing
        if traced or probed:   # the other ranks' records point at the step span
            gpu.recorder.name_step(step)
        timed = self.record_rank is not None and step is not None
        if timed or traced:   # the step span waits for every rank's part
            step.set_attribute(sc.TP_SIZE, tp.size)
        if traced:   # its collective kernels' spans carry their bytes
            step.set_attribute(sc.COLLECTIVE_BYTES, self.collective_bytes(bucket or host.lengths[0]))
        copies, self._copies = self._copies, []
        tp.send_step(StepMessage(plan.step_id, host, bucket, len(copies), traced, probed,
                                 self.async_ids, timed, step.trace_id if step is not None else 0,
                                 step.span_id if step is not None else 0))
        if timed:
            tp.begin_timing()
        return timed

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
