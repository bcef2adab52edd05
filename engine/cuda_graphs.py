"""Decode-only steps as CUDA graph replays: one graph per padded batch-size bucket.

At start-up the runner captures the model's decode forward pass for each bucket (1, 2, 4, 8,
16, 32, 48, 64, 96, 128, 192, 256, ... up to ``max_num_seqs``), largest first, all sharing one
memory pool: graphs never run concurrently and a replay's logits are read before the next
replay. Inputs live in static buffers; a step with ``n`` decodes copies its rows in and replays
the smallest bucket ``B >= n``. Padded rows have context length 0 (the paged-attention kernel
reads no page and returns zeros) and write their K/V to a scratch slot no request owns.

SM probe: with kernel telemetry on, the graphs are captured with the probe, writing from slot
0 of its buffer; after a replay the step's records are snapshotted as the captured launches'
(``SmProbe.end_replay``), like an eager step's. CUPTI needs nothing: the step's external
correlation id is pushed around the graph launch, and its kernel nodes carry that launch's id.
Cost per step: ~7 small device copies and one graph launch. Memory: the pool (about the
largest bucket's activations) plus each bucket's logits ``[B, vocab]`` in the model's dtype.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..instrumentation import ProbedLaunches, check_range
from .model import AttentionMetadata, LlamaForCausalLM

__all__ = ["DecodeGraphs", "GraphCapture", "graph_buckets"]

log = logging.getLogger(__name__)

_BASE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes: the fixed ladder, then steps of 128, ending at ``max_num_seqs``."""
    check_range("max_num_seqs", max_num_seqs, 1, integer=True)
    ladder = list(_BASE_BUCKETS)
    while ladder[-1] < max_num_seqs:
        ladder.append(ladder[-1] + 128)
    sizes = [b for b in ladder if b < max_num_seqs]
    return tuple(sizes + [max_num_seqs])


@dataclass(frozen=True)
class GraphCapture:
    """What start-up captured (logged, and kept on the runner for benchmarks)."""

    buckets: tuple[int, ...]  # captured, ascending
    skipped: tuple[int, ...]  # not captured: the time limit ran out (steps pad further up)
    capture_s: float
    pool_bytes: int  # device memory the graphs took (allocator growth during capture)


class DecodeGraphs:
    """Static decode inputs and one captured forward pass per bucket.

    ``capture=False`` builds the same padded static path without graphs (the CPU tests run
    it: it is what the graphs replay, minus the capture), and without the probe."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_batch: int,
                 max_blocks_per_seq: int, pad_slot: int, backend: str, probe=None,
                 capture: bool = True) -> None:
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {kv_cache.device}")
        self.model, self.kv_cache = model, kv_cache
        self.backend, self.capture = backend, capture
        self.probe = probe if capture else None
        self.pad_slot = pad_slot
        dev = kv_cache.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)  # [Bmax]
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)  # [Bmax]
        self.slot_mapping = torch.full((max_batch,), pad_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32,
                                        device=dev)  # [Bmax, W]
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)  # [Bmax]
        self.all_buckets = graph_buckets(max_batch)
        self.buckets: tuple[int, ...] = () if capture else self.all_buckets
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # bucket -> [B, V] (graph output)
        self._launches: dict[int, ProbedLaunches] = {}  # bucket -> the graph's probed launches

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(num_prefill_tokens=0, slot_mapping=self.slot_mapping[:b],
                                 block_tables=self.block_tables[:b],
                                 context_lens=self.context_lens[:b], probe=self.probe,
                                 backend=self.backend)

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self._meta(b), self.kv_cache)

    @torch.inference_mode()
    def warm(self, b: int) -> torch.Tensor:
        """One eager forward of bucket ``b`` on the static inputs as they stand (all padding
        before capture: only the scratch slot is written); the warm-up runs it so that
        ``capture_all`` meets no kernel variant for the first time."""
        return self._forward(b)

    @torch.inference_mode()
    def capture_all(self, limit_s: float, agree=None) -> GraphCapture:
        """Captures every bucket, largest first, until ``limit_s`` has passed (the buckets
        left are skipped: their steps replay the next larger graph). The static inputs are
        all padding meanwhile, so capture writes only the scratch slot. ``agree``: under
        tensor parallelism, turns this rank's "go on" into rank 0's, so that every rank
        captures the same buckets (their warm-up runs meet in all-reduces)."""
        start = time.monotonic()
        device = self.kv_cache.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        pool = None
        captured, skipped = [], []
        for b in sorted(self.all_buckets, reverse=True):
            stop = bool(captured) and time.monotonic() - start > limit_s
            if agree is not None:
                stop = not agree(not stop)
            if stop:
                skipped.append(b)
                continue
            # One eager run first, on a side stream: Triton compiles and loads its kernels and
            # cuBLAS picks its algorithms outside the capture.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._forward(b)
            torch.cuda.current_stream(device).wait_stream(side)
            if self.probe is not None:
                self.probe.discard()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the telemetry's threads may use CUDA meanwhile (their own streams)
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(b)
            if pool is None:
                pool = graph.pool()
            self._graphs[b], self._logits[b] = graph, logits
            self._launches[b] = (self.probe.take_reservations() if self.probe is not None
                                 else ProbedLaunches())
            captured.append(b)
        torch.cuda.synchronize(device)
        self.buckets = tuple(sorted(captured))
        return GraphCapture(self.buckets, tuple(sorted(skipped)), time.monotonic() - start,
                            torch.cuda.memory_reserved(device) - before)

    def bucket_for(self, n: int, max_blocks: int = 0) -> int | None:
        """The smallest bucket holding ``n`` rows whose block tables are at most
        ``max_blocks`` wide, or None (the step runs eagerly)."""
        if max_blocks > self.block_tables.shape[1]:
            return None
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, bucket: int) -> torch.Tensor:
        """One decode step of ``n = len(input_ids)`` rows in ``bucket``: device inputs
        ([n], [n], [n], [n, mb] int32, [n] int32) -> logits [bucket, V]; rows >= n are padding.
        Stream-ordered, no host sync."""
        n, mb = block_tables.shape
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.context_lens[:n].copy_(context_lens)
        # Columns past mb keep older rows' pages: they lie past every context, never read.
        self.block_tables[:n, :mb].copy_(block_tables)
        if bucket > n:
            self.slot_mapping[n:bucket].fill_(self.pad_slot)
            self.context_lens[n:bucket].zero_()
        if not self.capture:
            with torch.inference_mode():
                return self._forward(bucket)
        return self.replay(bucket)

    def replay(self, bucket: int) -> torch.Tensor:
        """Replays ``bucket``'s graph on the static inputs as they stand (for timing it alone)."""
        self._graphs[bucket].replay()
        return self._logits[bucket]

    def launches(self, bucket: int) -> ProbedLaunches:
        """The probed launches captured in ``bucket``'s graph (for ``SmProbe.end_replay``)."""
        return self._launches.get(bucket) or ProbedLaunches()
