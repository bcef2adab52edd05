"""Steps with prefill tokens as CUDA graph replays of everything but attention.

A decode-only step replays one whole-forward graph (``engine/cuda_graphs.py``); a step with
prefill chunks cannot, as its attention's grid follows the chunks' lengths. Per padded
token-count bucket (16 ... 1024, capped at ``max_num_batched_tokens``) this path captures the
layers' other work as ``num_layers + 1`` graphs, split at each attention; between replays the
attention kernels run eagerly on the step's real tokens (so the SM probe sees them as in an
eager step) into a static buffer the next graph reads; the final norm and vocabulary
projection run eagerly on the sampled rows. Padded rows sit at position 0 and write their K/V
to the scratch slot. All buckets share one memory pool and replay in capture order.
Cost per step: a few small copies, ``num_layers + 1`` graph launches, and per layer the
attention launches and one copy of their output. Memory: each bucket keeps its layers' q/k/v
projections (``T x (Hq + 2 Hkv) x D`` each).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .model import AttentionMetadata, LlamaForCausalLM

__all__ = ["MixedCapture", "MixedGraphs", "mixed_buckets"]

_LADDER = (16, 32, 64, 128, 256, 384, 512, 768, 1024)


def mixed_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Padded token counts: the ladder up to ``max_num_batched_tokens`` (then it, when under
    1024); steps with more tokens run eagerly (their GPU time dwarfs the launches)."""
    cap = min(max_num_batched_tokens, _LADDER[-1])
    return tuple(b for b in _LADDER if b < cap) + (cap,)


@dataclass(frozen=True)
class MixedCapture:
    """What start-up captured."""

    buckets: tuple[int, ...]  # captured, ascending
    skipped: tuple[int, ...]  # not captured (time limit): their steps run eagerly
    capture_s: float
    pool_bytes: int


@dataclass
class _Bucket:
    """One bucket's segments and the tensors that cross from one segment to the next."""

    graphs: list = field(default_factory=list)   # num_layers + 1 (empty when not captured)
    qkv: list = field(default_factory=list)      # per layer: (q, k, v) views [T, H, D]
    rope: tuple = ()                              # (cos, sin) [T, D/2]
    out: tuple = ()                               # (last layer's output, residual) [T, hidden]


class MixedGraphs:
    """Static inputs and, per bucket, the captured segments between the attentions.

    ``capture=False`` runs the same segments on the same static buffers without graphs
    (the CPU tests run it: what the graphs replay, minus the capture)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_num_batched_tokens: int,
                 pad_slot: int, backend: str, capture: bool = True) -> None:
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {kv_cache.device}")
        self.model, self.kv_cache, self.backend, self.capture = model, kv_cache, backend, capture
        self.pad_slot = pad_slot
        self.all_buckets = mixed_buckets(max_num_batched_tokens)
        top, dev = self.all_buckets[-1], kv_cache.device
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)   # [Tmax]
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)   # [Tmax]
        self.slot_mapping = torch.full((top,), pad_slot, dtype=torch.long, device=dev)
        attn = model.layers[0].attn
        # the attention's output, read by the next segment; padded rows keep what an earlier
        # step left there (finite: zeros at first), which only padded rows read
        self.attn_out = torch.zeros(top, attn.q_size, dtype=model.embed_tokens.weight.dtype,
                                    device=dev)   # [Tmax, Hq * D]
        self.buckets: tuple[int, ...] = () if capture else self.all_buckets
        self._buckets: dict[int, _Bucket] = {}

    def _meta(self, t: int) -> AttentionMetadata:
        return AttentionMetadata(num_prefill_tokens=t, slot_mapping=self.slot_mapping[:t],
                                 backend=self.backend)

    def _segment(self, bucket: _Bucket, t: int, i: int) -> None:
        """Segment ``i`` of ``t`` static rows: layer i-1 after its attention (none for i = 0),
        then layer i up to its attention (none for i = num_layers)."""
        layers, kv = self.model.layers, self.kv_cache
        if i == 0:
            x, cos, sin = self.model.embed(self.input_ids[:t], self.positions[:t])
            bucket.rope, residual = (cos, sin), None
        else:
            o = self.attn_out[:t].view(t, layers[i - 1].attn.num_heads, -1)
            x, residual = layers[i - 1].after_attention(o, bucket.out[1], self.backend)
        if i == len(layers):
            bucket.out = (x, residual)
            return
        q, k, v, residual = layers[i].before_attention(x, residual, *bucket.rope, self._meta(t), kv[i])
        bucket.out = (None, residual)
        if len(bucket.qkv) > i:
            bucket.qkv[i] = (q, k, v)
        else:
            bucket.qkv.append((q, k, v))

    @torch.inference_mode()
    def capture_all(self, limit_s: float) -> MixedCapture:
        """Captures every bucket's segments, largest first, until ``limit_s`` has passed. One
        eager pass per bucket first, on a side stream (Triton compiles, cuBLAS picks its
        algorithms outside the capture); the static inputs are padding meanwhile."""
        start = time.monotonic()
        device = self.kv_cache.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        captured, skipped = [], []
        for t in sorted(self.all_buckets, reverse=True):
            if captured and time.monotonic() - start > limit_s:
                skipped.append(t)
                continue
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                warm = _Bucket()
                for i in range(len(self.model.layers) + 1):
                    self._segment(warm, t, i)
            torch.cuda.current_stream(device).wait_stream(side)
            del warm
            bucket = _Bucket()
            for i in range(len(self.model.layers) + 1):
                graph = torch.cuda.CUDAGraph()
                # thread_local: the telemetry's threads may use CUDA meanwhile (their own streams)
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._segment(bucket, t, i)
                bucket.graphs.append(graph)
            self._buckets[t] = bucket
            captured.append(t)
        torch.cuda.synchronize(device)
        self.buckets = tuple(sorted(captured))
        return MixedCapture(self.buckets, tuple(sorted(skipped)), time.monotonic() - start,
                            torch.cuda.memory_reserved(device) - before)

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest captured bucket holding ``tokens`` rows, or None (the step runs eagerly)."""
        for b in self.buckets:
            if b >= tokens:
                return b
        return None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor, bucket: int) -> torch.Tensor | None:
        """One step of ``t = len(input_ids)`` packed tokens (prefill chunks first, as the eager
        forward takes them) in ``bucket`` -> logits [S, V] of ``logits_indices``.
        Stream-ordered, no host sync."""
        t = input_ids.shape[0]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        if bucket > t:
            self.slot_mapping[t:bucket].fill_(self.pad_slot)
            self.positions[t:bucket].zero_()
        state = self._buckets.setdefault(bucket, _Bucket())
        layers = self.model.layers
        for i in range(len(layers) + 1):
            if self.capture:
                state.graphs[i].replay()
            else:
                self._segment(state, bucket, i)
            if i < len(layers):
                q, k, v = state.qkv[i]
                layers[i].attn.attend(q[:t], k[:t], v[:t], meta, self.kv_cache[i], out=self.attn_out)
        x, residual = state.out
        return self.model.logits(x, residual, logits_indices, self.backend)
