"""The Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

One forward pass serves one engine step: the new tokens of every scheduled sequence are packed
into a single ``[T]`` batch, prefill chunks first, then one token per decoding sequence. Each
layer writes its new K/V into the paged cache ``[layers, 2, num_blocks, block_size, Hkv, D]``
at the slots the runner computed, then attends through ``engine/kernels/attention.py``
(packed-varlen causal for prefill, paged for decode). Only the positions that yield a token
go through the vocabulary projection; each layer's residual add fuses into the next RMSNorm;
RMSNorm, RoPE and SwiGLU run as Triton kernels wherever attention does (``engine/kernels``).
Weights are random (seeded, made on the target device: no host copy of ``llama-8b``'s 16 GB)
or read from a local HF-style directory's ``*.safetensors``. Tensor parallelism (``Shard``):
a rank holds its query/KV heads and MLP columns (Megatron column / row splits) and sums the
attention and MLP outputs over the ranks; its random weights are slices of the unsharded
model's. Costs: activations ``O(T * hidden)``; no host-device sync inside (a decode forward
can be captured in a CUDA graph: ``engine/cuda_graphs.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kernels.attention import paged_decode_attention, prefill_attention
from .kernels.rmsnorm import rms_norm
from .kernels.rope import KvStore, rope_
from .kernels.swiglu import swiglu

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "Shard", "build_model", "rope_cos_sin"]


@dataclass(frozen=True)
class Shard:
    """The part of the model one tensor-parallel rank holds (``size`` 1: all of it).

    ``all_reduce`` sums a tensor over the ranks in place (the process group's, timed by the
    caller); ``head``: this rank computes the final norm and the vocabulary projection (the
    rank that samples)."""

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], object] | None = None
    head: bool = True


_WHOLE = Shard()


# Megatron splits of the fused weights, by name suffix: (dim, segments of the unsharded
# weight [out, in] along dim). Each segment is cut in ``size`` equal parts and each rank keeps
# its part of every segment: q, k and v heads (and gate and up columns) stay aligned.
def _splits(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    q, kv, i = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    return {"attn.qkv_proj.weight": (0, (q, kv, kv)), "attn.o_proj.weight": (1, (q,)),
            "mlp.gate_up_proj.weight": (0, (i, i)), "mlp.down_proj.weight": (1, (i,))}


def _shard_of(full: torch.Tensor, dim: int, segments: tuple[int, ...], shard: Shard) -> torch.Tensor:
    """Rank ``shard.rank``'s part of ``full`` (a view when one segment, else a copy)."""
    parts = [segment.chunk(shard.size, dim)[shard.rank] for segment in full.split(segments, dim)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


@dataclass
class AttentionMetadata:
    """Layout of one step's packed tokens, shared by every layer.

    Tokens ``[0, num_prefill_tokens)`` belong to prefill chunks (``cu_seqlens_q`` delimits
    them); tokens ``[num_prefill_tokens, T)`` are one new token per decoding sequence.
    """

    num_prefill_tokens: int
    slot_mapping: torch.Tensor | None  # [T] int64: cache slot (block * block_size + offset) per token
    cu_seqlens_q: torch.Tensor | None = None  # [Bp+1] int32
    cu_seqlens_k: torch.Tensor | None = None  # [Bp+1] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # When a prefill chunk continues a cached prefix its keys are gathered back from the cache:
    # the slot of every key of every prefill sequence, packed like cu_seqlens_k. None: the keys
    # are exactly this step's new tokens.
    prefill_kv_slots: torch.Tensor | None = None  # [Tk] int64
    block_tables: torch.Tensor | None = None  # [Bd, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [Bd] int32, including the new token
    probe: object | None = None  # SM probe for the Triton kernels (None = off)
    backend: str = "auto"

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.context_lens is None else int(self.context_lens.shape[0])


def rope_cos_sin(config: ModelConfig, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_positions, head_dim / 2]`` in float32 (Llama-3 scaling applied)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_llama3_scaling is not None:
        factor, low_ff, high_ff, original = config.rope_llama3_scaling
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = original / low_ff, original / high_ff
        smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        inv_freq = scaled
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)  # [P, D/2]
    return angles.cos().float().to(device), angles.sin().float().to(device)


class Linear(nn.Module):
    """``y = x W^T`` (no bias). ``weight`` has the checkpoint's shape ``[out, in]`` but is
    stored ``[in, out]`` (a transposed view): cuBLAS then reads it as ``x @ W`` and picks the
    kernels that stream weights faster at decode batch sizes (``bench.decode_step``). The
    weight is left uninitialized: ``build_model`` fills it, so no throw-away default init runs
    (that costs seconds for llama-8b, and imports torch._refs on the meta device)."""

    def __init__(self, in_features: int, out_features: int, dev: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features, **dev).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dev: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, **dev))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dev: dict) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, **dev))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (normed [T, hidden], stream): the stream is ``residual += x`` (in
        place) when a residual is given, else x."""
        return rms_norm(x, self.weight, self.eps, residual, backend)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dev: dict, shard: Shard = _WHOLE) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads // shard.size, config.num_kv_heads // shard.size
        self.head_dim = config.head_dim
        self.all_reduce = shard.all_reduce
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # q, k, v as one matmul: rows [q | k | v] (HF's three matrices are concatenated at load).
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, dev)
        self.o_proj = Linear(self.q_size, config.hidden_size, dev)  # [hidden, local q] (row split)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin, meta, kv_cache)
        return self.output(self.attend(q, k, v, meta, kv_cache))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor | None):
        """x [T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D] (views into one projection), RoPE
        applied and the new K/V stored at ``meta.slot_mapping``. No attention: a CUDA graph can
        hold it (``engine/mixed_graphs.py``)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D], views into the projection
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        store = None
        if kv_cache is not None:  # [2, num_blocks, block_size, Hkv, D]
            store = KvStore(v, kv_cache[0].view(-1, self.num_kv_heads, self.head_dim),  # [slots, Hkv, D]
                            kv_cache[1].view(-1, self.num_kv_heads, self.head_dim), meta.slot_mapping)
        rope_(q, k, cos, sin, meta.backend, store)  # q, k in place; k, v into the cache
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               kv_cache: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's attention over its packed tokens -> [T, Hq, D]; with ``out`` ([T, Hq * D]
        or wider), written into its first T rows instead of a new tensor."""
        t, n_pre = q.shape[0], meta.num_prefill_tokens
        k_cache, v_cache = (None, None) if kv_cache is None else (kv_cache[0], kv_cache[1])
        parts = []   # (first row, [rows, Hq, D]): the prefill chunks', then the decodes'
        if n_pre:
            parts.append((0, self._prefill(q[:n_pre], k[:n_pre], v[:n_pre], meta, k_cache, v_cache)))
        if n_pre < t:
            parts.append((n_pre, self._decode(q[n_pre:], meta, k_cache, v_cache)))
        if out is None:
            return parts[0][1] if len(parts) == 1 else torch.cat([o for _, o in parts], dim=0)
        for first, o in parts:
            out[first:first + o.shape[0]].copy_(o.reshape(o.shape[0], -1))
        return out[:t].view(t, self.num_heads, self.head_dim)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output [T, Hq, D] (or [T, Hq * D]) -> [T, hidden], summed over the ranks."""
        out = self.o_proj(o.reshape(o.shape[0], self.q_size))  # [T, hidden]: this rank's heads' part
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out

    def _prefill(self, q, k, v, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        if meta.prefill_kv_slots is not None:  # some chunk continues a cached prefix
            k = k_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.prefill_kv_slots]  # [Tk, Hkv, D]
            v = v_cache.view(-1, self.num_kv_heads, self.head_dim)[meta.prefill_kv_slots]
        return prefill_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                 meta.max_seqlen_k, self.scale, probe=meta.probe,
                                 backend=meta.backend)  # [Tp, Hq, D]

    def _decode(self, q, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      self.scale, probe=meta.probe, backend=meta.backend)  # [Bd, Hq, D]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dev: dict, shard: Shard = _WHOLE) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size // shard.size
        self.all_reduce = shard.all_reduce
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, dev)
        self.down_proj = Linear(self.intermediate, config.hidden_size, dev)

    def forward(self, x: torch.Tensor, backend: str = "auto") -> torch.Tensor:  # [T, hidden]
        out = self.down_proj(swiglu(self.gate_up_proj(x), backend))  # gate_up [T, 2I/N]
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dev: dict, shard: Shard = _WHOLE) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dev)
        self.attn = Attention(config, dev, shard)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dev)
        self.mlp = MLP(config, dev, shard)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin,
                meta: AttentionMetadata, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden]: the previous layer's output (the embedding for the first layer, whose
        residual is None) -> (this layer's MLP output, the residual stream before it)."""
        q, k, v, residual = self.before_attention(x, residual, cos, sin, meta, kv_cache)
        return self.after_attention(self.attn.attend(q, k, v, meta, kv_cache), residual, meta.backend)

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin,
                         meta: AttentionMetadata, kv_cache):
        """The layer up to its attention: (q, k, v, the residual stream)."""
        h, residual = self.input_norm(x, residual, meta.backend)
        return (*self.attn.project(h, cos, sin, meta, kv_cache), residual)

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor, backend: str = "auto"):
        """The layer from its attention's output [T, Hq, D] on: (MLP output, residual stream)."""
        h, residual = self.post_attn_norm(self.attn.output(o), residual, backend)
        return self.mlp(h, backend), residual


class LlamaForCausalLM(nn.Module):
    """Token ids in, next-token logits (in the model's dtype) out, for the positions that sample.
    A shard without the head (``Shard.head``) returns None: its rank's work ends with the
    last layer's all-reduce."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, shard: Shard = _WHOLE) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        dev = {"device": device, "dtype": dtype}
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dev)
        self.layers = nn.ModuleList(DecoderLayer(config, dev, shard) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dev)
        self.lm_head = None if config.tie_word_embeddings or not shard.head else Linear(
            config.hidden_size, config.vocab_size, dev)
        # RoPE tables: plain attributes set by ``build_model``, float32 whatever the weights'
        # dtype (bf16 angles would lose position precision past a few hundred tokens).
        self.rope_cos: torch.Tensor | None = None  # [P, D/2] float32
        self.rope_sin: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor | None = None,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor | None:
        """input_ids/positions [T]; kv_cache [L, 2, N, bs, Hkv/ranks, D] or None (prefill
        without a cache: keys are the new tokens); logits_indices [S] (None: every position)
        -> [S, V]."""
        x, cos, sin = self.embed(input_ids, positions)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, meta, None if kv_cache is None else kv_cache[i])
        return self.logits(x, residual, logits_indices, meta.backend)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """input_ids/positions [T] -> (embeddings [T, hidden], RoPE cos, sin [T, D/2])."""
        return self.embed_tokens(input_ids), self.rope_cos[positions], self.rope_sin[positions]

    def logits(self, x: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor | None,
               backend: str = "auto") -> torch.Tensor | None:
        """The last layer's output and residual stream [T, hidden] -> logits [S, V] of the rows
        ``logits_indices`` (None: every row); None on a rank without the head."""
        if not self.shard.head:
            return None
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]  # [S, hidden]
        x, _ = self.norm(x, residual, backend)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # left in the model's dtype: greedy argmax needs no float32 copy of [S, V], and the
        # sampler's float32 paths cast exactly (every bf16/fp16 value is a float32)
        return F.linear(x, weight)  # [S, V]


@torch.no_grad()
def _init_random(model: LlamaForCausalLM, std: float, seed: int, device: torch.device) -> None:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shard = model.shard
    splits = _splits(model.config) if shard.size > 1 else {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        split = splits.get(name.split(".", 2)[-1]) if name.startswith("layers.") else None
        if split is None:
            param.normal_(0.0, std, generator=gen)
            continue
        # the unsharded weight, drawn as the unsharded model draws it (the same [in, out]
        # storage, the same generator state), then this rank's slice of it: one layer's
        # weight at a time on the device
        dim, segments = split
        rows, cols = param.shape
        full_shape = (sum(segments), cols) if dim == 0 else (rows, sum(segments))
        full = torch.empty(full_shape[1], full_shape[0], device=device, dtype=param.dtype).t()
        full.normal_(0.0, std, generator=gen)
        param.copy_(_shard_of(full, dim, segments, shard))


_HF_PREFIX = "model."


@torch.no_grad()
def _load_hf_weights(model: LlamaForCausalLM, directory: Path, device: torch.device) -> None:
    """Copies HF Llama tensors into the fused layout; every parameter must be covered."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise RuntimeError("loading a checkpoint needs the 'safetensors' package "
                           "(pip install 'sightline[engine]')") from exc
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model path {str(directory)!r} has no *.safetensors files")
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    params = dict(model.named_parameters())
    # HF name suffix -> (our name suffix, first row, rows, the dim a tensor-parallel rank
    # takes its part along: 0 for column splits, 1 for row splits, None when replicated)
    fused = {
        "self_attn.q_proj.weight": ("attn.qkv_proj.weight", 0, q_size, 0),
        "self_attn.k_proj.weight": ("attn.qkv_proj.weight", q_size, kv_size, 0),
        "self_attn.v_proj.weight": ("attn.qkv_proj.weight", q_size + kv_size, kv_size, 0),
        "self_attn.o_proj.weight": ("attn.o_proj.weight", 0, None, 1),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, cfg.intermediate_size, 0),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", cfg.intermediate_size, cfg.intermediate_size, 0),
        "mlp.down_proj.weight": ("mlp.down_proj.weight", 0, None, 1),
        "input_layernorm.weight": ("input_norm.weight", 0, None, None),
        "post_attention_layernorm.weight": ("post_attn_norm.weight", 0, None, None),
    }
    shard = model.shard
    rows_filled: dict[str, int] = {name: 0 for name in params}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                name = key[len(_HF_PREFIX):] if key.startswith(_HF_PREFIX) else key
                start, rows, dim = 0, None, None
                if name.startswith("layers."):
                    _, index, suffix = name.split(".", 2)
                    if suffix not in fused:
                        continue  # e.g. rotary_emb.inv_freq in old checkpoints
                    ours, start, rows, dim = fused[suffix]
                    name = f"layers.{index}.{ours}"
                elif name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied, or a rank without the head
                if name not in params:
                    continue
                tensor = handle.get_tensor(key)
                if shard.size > 1 and dim is not None:   # this rank's heads / columns
                    tensor = tensor.chunk(shard.size, dim)[shard.rank]
                    if rows is not None:
                        start, rows = start // shard.size, rows // shard.size
                target = params[name]
                target = target if rows is None else target[start:start + rows]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{file.name}: {key} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(target.shape)}")
                target.copy_(tensor.to(device=device, dtype=target.dtype))
                rows_filled[name] += tensor.shape[0]
    missing = [n for n, p in params.items() if rows_filled[n] != p.shape[0]]
    if missing:
        raise ValueError(f"checkpoint {str(directory)!r} lacks {len(missing)} tensors, "
                         f"e.g. {missing[:3]}")


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                seed: int = 0, shard: Shard = _WHOLE) -> LlamaForCausalLM:
    """Creates the model straight on ``device`` (meta first: no CPU copy), then fills weights:
    from ``config.path`` when set, else random normal(0, init_std) from ``seed``; with a
    ``shard``, this rank's part of them."""
    device = torch.device(device)
    if shard.size > 1:
        config.check_shardable(shard.size)
    model = LlamaForCausalLM(config, device, dtype, shard)  # uninitialized memory, filled below
    if config.path:
        _load_hf_weights(model, Path(config.path), device)
    else:
        _init_random(model, config.init_std, seed, device)
    model.rope_cos, model.rope_sin = rope_cos_sin(config, device)
    return model.eval().requires_grad_(False)
