"""Split-KV paged decode attention in Triton (two passes), GQA-grouped.

Decode reads every cached key and value once per step at ~2 FLOP per byte, so it is bound
by memory bandwidth: one CTA computes all query heads of a KV group (each K/V byte is
loaded once per group), and the context is split across CTAs so that small batches still
fill the GPU; a small second pass merges the splits.

Guarantees: tokens ``>= context_lens[b]`` are never read (their table entries may hold
any value); an empty context yields zeros; float32 accumulation. The number of splits
is chosen from shapes only (no device sync): ``max_blocks * block_size`` bounds the
context.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...instrumentation import PROBE_OFF, probe_begin, probe_cta_index, probe_end

__all__ = ["KERNEL_NAME", "choose_num_splits", "launch_config", "num_sms",
           "paged_decode_attention_triton", "split_plan"]

KERNEL_NAME = "sightline_paged_decode"  # the jit function name: CUPTI reports it
_LOG2E = 1.4426950408889634


# Design, for a memory-bound op:
# * GQA grouping: one CTA owns one (sequence, KV head, split) and computes all Hq / Hkv query
#   heads of the group at once (padded to 16 rows for the matrix unit).
# * Split-KV: the context is cut into num_splits ranges handled by separate CTAs (pass 1
#   writes each split's normalized partial output and log-sum-exp; pass 2 merges them), so
#   that there are enough CTAs to fill every SM even at small batch; at large batch the
#   heuristic picks one split and pass 1 writes the output directly.
# * Pages are gathered per token through the block table (BLOCK_N tokens per tile, 16-byte
#   loads along the head dim); offsets are int64 (caches exceed 2**31 elements).
# Arguments that follow the step's shape (the block table's width, the split count, the
# probe slot) are not specialized: each value class (1, a multiple of 16, other) would be
# another compiled variant, met for the first time while serving (engine/warmup.py).
@triton.jit(do_not_specialize=["stride_tb", "num_splits", "probe_base"])
def sightline_paged_decode(
    Q, K, V, O, TABLES, LENS, PART_O, PART_LSE,
    stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_tb, stride_ob, stride_oh, qk_scale, split_len, num_splits,
    probe_ptr, probe_base,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PROBE: tl.constexpr,
):
    if PROBE != 0:
        t0 = probe_begin(PROBE)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    ctx = tl.load(LENS + seq)
    # The context grows by one token a step, so the split a CTA takes moves along each step
    # (a graph replay too): the splits that carry keys land on other SMs from step to step,
    # and a CTA's duration says something of its SM, not only of its split.
    split = (tl.program_id(0) + ctx) % num_splits
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    head_ok = offs_h < GROUP
    q = tl.load(Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    table = TABLES + seq.to(tl.int64) * stride_tb
    k_head = K + kv_head * stride_kh
    v_head = V + kv_head * stride_vh

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        ok = tok < end
        page = tl.load(table + tok // PAGE, mask=ok, other=0).to(tl.int64)
        slot = tok % PAGE
        k = tl.load(k_head + page[:, None] * stride_kn + slot[:, None] * stride_ks
                    + offs_d[None, :], mask=ok[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + page[:, None] * stride_vn + slot[:, None] * stride_vs
                    + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if not SPLIT:
        tl.store(O + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=head_ok[:, None])
    else:
        # partials laid out [B, Hq, num_splits, D] and [B, Hq, num_splits], contiguous
        row = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(PART_O + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        tl.store(PART_LSE + row, lse, mask=head_ok)
    if PROBE != 0:
        probe_end(probe_ptr, probe_base + probe_cta_index(), t0, PROBE)


@triton.jit(do_not_specialize=["num_splits"])
def sightline_paged_decode_reduce(O, PART_O, PART_LSE, stride_ob, stride_oh, num_splits,
                                  HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(0) + head
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse = tl.load(PART_LSE + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)   # empty context: all weights 0
    w = tl.math.exp2(lse - top)
    parts = tl.load(PART_O + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             out.to(O.dtype.element_ty))


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int = 132,
                      min_tokens_per_split: int = 512) -> int:
    """Splits so that pass 1 has about 4 CTAs per SM (no split once (sequence, KV head)
    pairs alone give that: a second split would cost the merge pass and, under a CUDA graph
    sized for ``max_model_len``, mostly run empty), each split >= min_tokens_per_split."""
    base = max(1, batch * num_kv_heads)
    want = max(1, (4 * num_sms) // base)
    cap = max(1, triton.cdiv(max_context, min_tokens_per_split))
    return int(max(1, min(want, cap, 64)))


def launch_config(interpret: bool | None = None) -> dict:
    """Pass 1's {BLOCK_N, num_warps, num_stages} when the caller gives none."""
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return ({"BLOCK_N": 16, "num_warps": 4, "num_stages": 1} if interpret else
            {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3})


def split_plan(batch: int, num_kv_heads: int, max_context: int, num_sms: int, block_n: int,
               num_splits: int | None = None) -> tuple[int, int]:
    """(splits, tokens per split) of a launch: ``choose_num_splits`` (or ``num_splits``),
    each split a whole number of ``block_n`` tiles, empty trailing splits dropped. The
    compiled variants follow it: one split or several (and pass 2 per power of two)."""
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, num_sms)
    split_len = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), block_n) * block_n
    return max(1, triton.cdiv(max(max_context, 1), split_len)), split_len


_num_sms_cache: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """SMs of the device (132, an H200's, for the CPU interpreter)."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms_cache:
        _num_sms_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms_cache[idx]


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  softmax_scale: float, probe=None, num_splits: int | None = None,
                                  config: dict | None = None,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Launches pass 1 (and pass 2 when split). ``num_splits``/``config`` ({BLOCK_N,
    num_warps, num_stages}) override the heuristics (benchmarks use them); ``out`` receives
    the result."""
    batch, hq, d = q.shape
    num_blocks, page, hkv, _ = k_cache.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {q.dtype}; the kernel takes float16, bfloat16 or float32")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim {d}; the kernel takes 16, 32, 64, 128 or 256")
    if page & (page - 1):
        raise ValueError(f"block_size={page} must be a power of two")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous in the head dim")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(f"block_tables {block_tables.dtype} / context_lens "
                         f"{context_lens.dtype}: need torch.int32")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous along max_blocks")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out{tuple(out.shape)} {out.dtype} must match q{tuple(q.shape)} {q.dtype}")
    o = torch.empty_like(q) if out is None else out
    if batch == 0:
        return o
    group = hq // hkv
    max_context = block_tables.shape[1] * page
    if config is None:
        config = launch_config()
    block_n = config["BLOCK_N"]
    num_splits, split_len = split_plan(batch, hkv, max_context, num_sms(q.device), block_n,
                                       num_splits)
    if num_splits > 1:
        part_o = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = o   # unused
    grid = (num_splits, hkv, batch)
    probe_ptr, base, mode = o, 0, PROBE_OFF
    if probe is not None:
        reserved = probe.reserve(KERNEL_NAME, num_splits * hkv * batch, rotates=True)
        if reserved is not None:
            probe_ptr, base, mode = probe.buffer, reserved, probe.mode
    sightline_paged_decode[grid](
        q, k_cache, v_cache, o, block_tables, context_lens, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        o.stride(0), o.stride(1), softmax_scale * _LOG2E, split_len, num_splits, probe_ptr, base,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, PAGE=page,
        BLOCK_N=block_n, SPLIT=num_splits > 1, PROBE=mode,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if num_splits > 1:
        sightline_paged_decode_reduce[(hq, batch)](
            o, part_o, part_lse, o.stride(0), o.stride(1), num_splits, HEAD_DIM=d,
            SPLITS_P2=max(2, triton.next_power_of_2(num_splits)), num_warps=4)
    return o
