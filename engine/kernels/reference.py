"""Pure-torch attention: the CPU path of the engine and the oracle of the Triton kernels.

Semantics shared with the kernels: packed varlen prefill (sequence ``b`` owns query rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``),
causal aligned to the END of the key sequence (query ``i`` of a ``q_len`` chunk sees keys
``0 .. k_len - q_len + i``; a row that sees none returns zeros), GQA (query head ``h``
reads KV head ``h // (Hq // Hkv)``). Paged decode: token ``t`` of sequence ``b`` lives in
page ``block_tables[b, t // bs]`` at slot ``t % bs``; only the first ``context_lens[b]``
tokens count (table entries past them are never read); an empty context returns zeros.

Guarantee: computed in float32 (float64 for float64 inputs), returned in the input dtype,
so these are the "higher precision" side of every kernel check. Cost: clarity over speed;
prefill loops over sequences, decode gathers all pages into a dense tensor
(``B * max_blocks * block_size * Hkv * D * 4`` bytes).
"""

from __future__ import annotations

import torch

__all__ = ["paged_decode_attention_ref", "prefill_attention_ref"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types; float64 stays float64 (the tests' exact oracle)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          softmax_scale: float) -> torch.Tensor:
    """Causal packed-varlen GQA attention. q [Tq,Hq,D], k/v [Tk,Hkv,D] -> o [Tq,Hq,D]."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        qb = q[q0:q1].to(acc).transpose(0, 1)                                # [Hq, Lq, D]
        kb = k[k0:k1].to(acc).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Lk, D]
        vb = v[k0:k1].to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(qb, kb.transpose(1, 2)) * softmax_scale       # [Hq, Lq, Lk]
        q_pos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        k_pos = torch.arange(lk, device=q.device)[None, :]
        visible = k_pos <= q_pos                                            # [Lq, Lk]
        scores = scores.masked_fill(~visible, float("-inf"))
        # Rows that see nothing would be NaN after softmax; they are defined as zeros.
        any_visible = visible.any(dim=1)                                    # [Lq]
        scores = torch.where(any_visible[None, :, None], scores, torch.zeros_like(scores))
        probs = torch.softmax(scores, dim=-1) * any_visible[None, :, None]
        out[q0:q1] = torch.matmul(probs, vb).transpose(0, 1)
    return out.to(q.dtype)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               softmax_scale: float) -> torch.Tensor:
    """One query token per sequence over its paged KV. q [B,Hq,D] -> o [B,Hq,D]."""
    batch, hq, dim = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    max_blocks = block_tables.shape[1]
    if batch == 0:
        return torch.empty_like(q)
    # Pages past the context may hold garbage ids: clamp them to a valid page and
    # mask their tokens out below, so the gather never reads out of range.
    acc = _acc_dtype(q.dtype)
    tables = block_tables.long().clamp(0, num_blocks - 1)                    # [B, MB]
    keys = k_cache[tables].to(acc).reshape(batch, max_blocks * block_size, hkv, dim)
    values = v_cache[tables].to(acc).reshape(batch, max_blocks * block_size, hkv, dim)
    keys = keys.repeat_interleave(group, dim=2)                              # [B, T, Hq, D]
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q.to(acc), keys) * softmax_scale  # [B, Hq, T]
    positions = torch.arange(max_blocks * block_size, device=q.device)
    valid = positions[None, :] < context_lens.long()[:, None]               # [B, T]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    nonempty = (context_lens > 0).to(q.device)
    scores = torch.where(nonempty[:, None, None], scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * nonempty[:, None, None]
    out = torch.einsum("bht,bthd->bhd", probs, values)
    return out.to(q.dtype)
