"""The Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

One forward pass serves one engine step: the new tokens of every scheduled sequence are packed
into a single ``[T]`` batch, prefill chunks first, then one token per decoding sequence. Each
layer writes its new K/V into the paged cache ``[layers, 2, num_blocks, block_size, Hkv, D]``
at the slots the runner computed, then attends through ``engine/kernels/attention.py``:
packed-varlen causal attention for the prefill part, paged attention for the decode part.
Only the positions that yield a token go through the vocabulary projection. The residual
stream is carried beside each layer's output so that its add fuses into the next RMSNorm;
RMSNorm, RoPE and SwiGLU run as Triton kernels wherever attention does (``engine/kernels``).

Weights are either random (seeded, created directly on the target device: no host copy of
the 16 GB of ``llama-8b``) or read from a local HF-style directory's ``*.safetensors``.
Costs: the forward allocates activations ``O(T * hidden)``; no host-device sync happens inside
(a decode forward can be captured in a CUDA graph: ``engine/cuda_graphs.py``).
"""

from __future__ import annotations

import math
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

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "build_model", "rope_cos_sin"]


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
    def __init__(self, config: ModelConfig, dev: dict) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # q, k, v as one matmul: rows [q | k | v] (HF's three matrices are concatenated at load).
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, dev)
        self.o_proj = Linear(self.q_size, config.hidden_size, dev)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor | None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D], views into the projection
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache = v_cache = store = None
        if kv_cache is not None:  # [2, num_blocks, block_size, Hkv, D]
            k_cache, v_cache = kv_cache[0], kv_cache[1]
            store = KvStore(v, k_cache.view(-1, self.num_kv_heads, self.head_dim),  # [slots, Hkv, D]
                            v_cache.view(-1, self.num_kv_heads, self.head_dim), meta.slot_mapping)
        rope_(q, k, cos, sin, meta.backend, store)  # q, k in place; k, v into the cache
        n_pre = meta.num_prefill_tokens
        if n_pre == t:
            o = self._prefill(q, k, v, meta, k_cache, v_cache)
        elif n_pre == 0:
            o = self._decode(q, meta, k_cache, v_cache)
        else:
            o = torch.cat((self._prefill(q[:n_pre], k[:n_pre], v[:n_pre], meta, k_cache, v_cache),
                           self._decode(q[n_pre:], meta, k_cache, v_cache)), dim=0)
        return self.o_proj(o.reshape(t, self.q_size))

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
    def __init__(self, config: ModelConfig, dev: dict) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, dev)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dev)

    def forward(self, x: torch.Tensor, backend: str = "auto") -> torch.Tensor:  # [T, hidden]
        return self.down_proj(swiglu(self.gate_up_proj(x), backend))  # gate_up [T, 2I]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dev: dict) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dev)
        self.attn = Attention(config, dev)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dev)
        self.mlp = MLP(config, dev)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin,
                meta: AttentionMetadata, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden]: the previous layer's output (the embedding for the first layer, whose
        residual is None) -> (this layer's MLP output, the residual stream before it)."""
        h, residual = self.input_norm(x, residual, meta.backend)
        h = self.attn(h, cos, sin, meta, kv_cache)
        h, residual = self.post_attn_norm(h, residual, meta.backend)
        return self.mlp(h, meta.backend), residual


class LlamaForCausalLM(nn.Module):
    """Token ids in, next-token logits (in the model's dtype) out, for the positions that sample."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        dev = {"device": device, "dtype": dtype}
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dev)
        self.layers = nn.ModuleList(DecoderLayer(config, dev) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dev)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, dev)
        # RoPE tables: plain attributes set by ``build_model``, float32 whatever the weights'
        # dtype (bf16 angles would lose position precision past a few hundred tokens).
        self.rope_cos: torch.Tensor | None = None  # [P, D/2] float32
        self.rope_sin: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor | None = None,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions [T]; kv_cache [L, 2, N, bs, Hkv, D] or None (prefill without a
        cache: keys are the new tokens); logits_indices [S] (None: every position) -> [S, V]."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, D/2]
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, meta, None if kv_cache is None else kv_cache[i])
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]  # [S, hidden]
        x, _ = self.norm(x, residual, meta.backend)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # left in the model's dtype: greedy argmax needs no float32 copy of [S, V], and the
        # sampler's float32 paths cast exactly (every bf16/fp16 value is a float32)
        return F.linear(x, weight)  # [S, V]


@torch.no_grad()
def _init_random(model: LlamaForCausalLM, std: float, seed: int, device: torch.device) -> None:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=gen)


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
    # HF name suffix -> (our name suffix, first row, rows)
    fused = {
        "self_attn.q_proj.weight": ("attn.qkv_proj.weight", 0, q_size),
        "self_attn.k_proj.weight": ("attn.qkv_proj.weight", q_size, kv_size),
        "self_attn.v_proj.weight": ("attn.qkv_proj.weight", q_size + kv_size, kv_size),
        "self_attn.o_proj.weight": ("attn.o_proj.weight", 0, None),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, cfg.intermediate_size),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", cfg.intermediate_size, cfg.intermediate_size),
        "mlp.down_proj.weight": ("mlp.down_proj.weight", 0, None),
        "input_layernorm.weight": ("input_norm.weight", 0, None),
        "post_attention_layernorm.weight": ("post_attn_norm.weight", 0, None),
    }
    rows_filled: dict[str, int] = {name: 0 for name in params}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                name = key[len(_HF_PREFIX):] if key.startswith(_HF_PREFIX) else key
                start, rows = 0, None
                if name.startswith("layers."):
                    _, index, suffix = name.split(".", 2)
                    if suffix not in fused:
                        continue  # e.g. rotary_emb.inv_freq in old checkpoints
                    ours, start, rows = fused[suffix]
                    name = f"layers.{index}.{ours}"
                elif name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: the embedding is the head
                if name not in params:
                    continue
                tensor = handle.get_tensor(key)
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
                seed: int = 0) -> LlamaForCausalLM:
    """Creates the model straight on ``device`` (meta first: no CPU copy), then fills weights:
    from ``config.path`` when set, else random normal(0, init_std) from ``seed``."""
    device = torch.device(device)
    model = LlamaForCausalLM(config, device, dtype)  # uninitialized memory, filled below
    if config.path:
        _load_hf_weights(model, Path(config.path), device)
    else:
        _init_random(model, config.init_std, seed, device)
    model.rope_cos, model.rope_sin = rope_cos_sin(config, device)
    return model.eval().requires_grad_(False)
