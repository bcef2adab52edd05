"""FlashAttention-2 forward in Triton: packed variable-length, causal, GQA, bf16/fp16.

One CTA computes a ``BLOCK_M`` tile of query rows of one (sequence, query head) and
streams that sequence's keys/values in ``BLOCK_N`` tiles with the online softmax (FA2:
the running max and sum stay in registers, the output is normalized once at the end).
Block shapes, warps and pipeline depth are autotuned per head dim and sequence-length
bucket on first use (about a second per new key, recorded as an ``autotune`` compile event;
the engine's warm-up tunes every reachable key and keeps the choices in its compile cache);
the interpreter runs one small shape.

Guarantees: every output row of every sequence is written; a row that sees no key (only
when ``q_len > k_len``) is zero; accumulation in float32. The launcher checks layouts
and dtypes; the math is checked against ``reference.prefill_attention_ref``.
"""

from __future__ import annotations

import itertools
import os
import time

import torch
import triton
import triton.language as tl

from ...instrumentation import PROBE_OFF, check_range, probe_begin, probe_cta_index, probe_end
from ..compile_watch import compile_watch
from .paged_decode_attention import num_sms

__all__ = ["KERNEL_NAME", "prefill_attention_triton", "restore_tuned", "tuned_configs",
           "tuned_entries", "tuning_bucket"]

KERNEL_NAME = "sightline_fa2_prefill"  # the jit function name: CUPTI reports it
_launches = itertools.count()  # moves the rotation of one-wave launches every launch
_LOG2E = 1.4426950408889634


@triton.jit
def _probe_idle(probe_ptr, slot, PROBE: tl.constexpr):
    """An exiting CTA with no work marks its record idle (SM id -1)."""
    if PROBE != 0:
        slot64 = slot.to(tl.int64)
        tl.store(probe_ptr + slot64 * 3, slot64 * 0 - 1)
        tl.store(probe_ptr + slot64 * 3 + 1, slot64 * 0)
        tl.store(probe_ptr + slot64 * 3 + 2, slot64 * 0)


# Choices that matter on Hopper:
# * Causal block skipping: a query tile stops at the last key tile it can see; the key tiles
#   wholly below the diagonal run a mask-free loop, only the diagonal tiles pay for masks
#   (bottom-right alignment: row i sits at key position Lk - Lq + i).
# * The softmax scale is folded into one multiply by scale * log2(e) and exp2.
# * Query tiles are visited last-first inside each head: the longest causal tiles start first
#   and the short ones fill the tail of the grid; consecutive CTAs share a head's K/V in L2.
# * A launch of at most one wave takes its tiles ``rotate`` places along (the launcher moves
#   it every launch): its CTAs all start at once, so the order costs nothing there, and the
#   same tile no longer lands on the same SM launch after launch (the SM probe's slow test
#   needs that). Wider launches keep the heaviest-first order (rotate 0).
# Arguments that follow the step's shape are not specialized (see paged_decode_attention).
@triton.jit(do_not_specialize=["num_m_blocks", "seq_bucket", "rotate", "probe_base"])
def sightline_fa2_prefill(
    Q, K, V, O, cu_seqlens_q, cu_seqlens_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, num_m_blocks, seq_bucket, rotate,
    probe_ptr, probe_base,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PROBE: tl.constexpr,
):
    if PROBE != 0:
        t0 = probe_begin(PROBE)
    heads = tl.num_programs(1)
    tile = (probe_cta_index() + rotate) % (num_m_blocks * heads * tl.num_programs(2))
    # heaviest (last) query tile of each head first
    start_m = num_m_blocks - 1 - tile % num_m_blocks
    head = (tile // num_m_blocks) % heads
    seq = tile // (num_m_blocks * heads)
    kv_head = head // GROUP
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    k_start = tl.load(cu_seqlens_k + seq)
    k_len = tl.load(cu_seqlens_k + seq + 1) - k_start
    if start_m * BLOCK_M >= q_len:
        if PROBE != 0:
            _probe_idle(probe_ptr, probe_base + probe_cta_index(), PROBE)
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = (Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh
              + offs_d[None, :])
    q = tl.load(q_ptrs, mask=offs_m[:, None] < q_len, other=0.0)
    k_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh

    # A finite floor instead of -inf keeps fully masked rows NaN-free without a branch.
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    shift = k_len - q_len                 # key position of query row 0
    lowest = shift + start_m * BLOCK_M    # key position of the tile's first row
    # keys [0, full_end) are visible to every row of the tile: no masks there
    full_end = tl.minimum(((lowest + 1) // BLOCK_N) * BLOCK_N, (k_len // BLOCK_N) * BLOCK_N)
    full_end = tl.maximum(full_end, 0)
    hi = tl.minimum(k_len, shift + (start_m + 1) * BLOCK_M)

    for start_n in range(0, full_end, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij

    for start_n in range(full_end, hi, BLOCK_N):
        cols = start_n + offs_n
        in_seq = cols < k_len
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :],
                    mask=in_seq[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k))
        visible = (cols[None, :] <= (shift + offs_m)[:, None]) & in_seq[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :],
                    mask=in_seq[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)   # rows that saw no key stay zero
    out = acc / l_safe[:, None]
    o_ptrs = (O + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < q_len)
    if PROBE != 0:
        probe_end(probe_ptr, probe_base + probe_cta_index(), t0, PROBE)


def _configs() -> list[dict]:
    """Candidate (BLOCK_M, BLOCK_N, warps, stages) for Hopper; 8 warps = 2 warpgroups."""
    shapes = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4),
              (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 4)]
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
            for bm, bn, w, s in shapes]


# The interpreter (TRITON_INTERPRET=1) cannot time configs: it runs one small shape.
_INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
# (seq bucket, head dim, group, dtype) -> chosen config; filled on first use per key.
_tuned: dict[tuple, dict] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fixed_config() -> dict | None:
    """``SIGHTLINE_FA2_PREFILL_CONFIG=BLOCK_M,BLOCK_N,warps,stages`` skips tuning (saves
    ~7 compiles at start-up); a malformed value is an error that names it."""
    raw = os.environ.get("SIGHTLINE_FA2_PREFILL_CONFIG")
    if not raw:
        return None
    try:
        bm, bn, w, st = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"SIGHTLINE_FA2_PREFILL_CONFIG={raw!r}; expected "
                         "BLOCK_M,BLOCK_N,num_warps,num_stages e.g. 128,64,8,3") from None
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}


def tuning_bucket(max_seqlen_q: int) -> int:
    """The sequence-length bucket a launch is tuned for: the next power of two, 64..16384."""
    return min(1 << max(6, (max_seqlen_q - 1).bit_length()), 16384)


def tuned_configs() -> dict[tuple, dict]:
    """The configs chosen so far (for benchmark reports)."""
    return dict(_tuned)


def tuned_entries() -> list[dict]:
    """The configs chosen so far as JSON-ready records (kept across restarts)."""
    return [{"seq_bucket": b, "head_dim": d, "group": g, "dtype": str(dt).removeprefix("torch."),
             "config": dict(cfg)} for (b, d, g, dt), cfg in sorted(_tuned.items(), key=str)]


def restore_tuned(entries: list[dict]) -> int:
    """Takes configs chosen by an earlier process (``tuned_entries``) for keys not tuned
    yet; malformed records are skipped. Returns how many were taken."""
    taken = 0
    for entry in entries:
        try:
            dtype = getattr(torch, entry["dtype"])
            key = (int(entry["seq_bucket"]), int(entry["head_dim"]), int(entry["group"]), dtype)
            config = {name: int(entry["config"][name])
                      for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if not isinstance(dtype, torch.dtype) or key in _tuned:
            continue
        _tuned[key] = config
        taken += 1
    return taken


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                             probe=None, config: dict | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Launches the kernel. ``config`` ({BLOCK_M, BLOCK_N, num_warps, num_stages}) skips
    tuning (benchmarks use it); ``probe`` is an ``SmProbe`` or None; ``out`` (shaped and
    typed like q) receives the result (tests poison it to prove every row is written).

    Tuning: the first call for a (sequence bucket, head dim, group, dtype) key times every
    candidate with ``triton.testing.do_bench`` on the call's own inputs, probe off, and
    keeps the fastest (about 1 s, once per key per process)."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {q.dtype}; the kernel takes float16, bfloat16 or float32")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim {d}; the kernel takes 16, 32, 64, 128 or 256")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in the head dim (stride {t.stride()})")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise ValueError(f"cu_seqlens dtypes {cu_seqlens_q.dtype}/{cu_seqlens_k.dtype}; "
                         "need torch.int32")
    check_range("max_seqlen_q", max_seqlen_q, 0, integer=True)
    check_range("max_seqlen_k", max_seqlen_k, 0, integer=True)
    batch = cu_seqlens_q.shape[0] - 1
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out{tuple(out.shape)} {out.dtype} must match q{tuple(q.shape)} {q.dtype}")
    o = torch.empty_like(q) if out is None else out
    if tq == 0 or batch == 0 or max_seqlen_q == 0:
        return o
    seq_bucket = tuning_bucket(max_seqlen_q)
    group = hq // hkv
    qk_scale = softmax_scale * _LOG2E

    def launch(cfg: dict, use_probe) -> None:
        num_m = triton.cdiv(max_seqlen_q, cfg["BLOCK_M"])
        ctas = num_m * hq * batch
        rotate = next(_launches) % ctas if ctas <= num_sms(q.device) else 0
        probe_ptr, base, mode = o, 0, PROBE_OFF
        if use_probe is not None:
            reserved = use_probe.reserve(KERNEL_NAME, ctas, rotates=True)
            if reserved is not None:
                probe_ptr, base, mode = use_probe.buffer, reserved, use_probe.mode
        sightline_fa2_prefill[(num_m, hq, batch)](
            q, k, v, o, cu_seqlens_q, cu_seqlens_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            o.stride(0), o.stride(1), qk_scale, num_m, seq_bucket, rotate, probe_ptr, base,
            GROUP=group, HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            PROBE=mode, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    if config is None:
        if _interpreting():
            config = _INTERPRET_CONFIG
        elif _fixed_config() is not None:
            config = _fixed_config()
        else:
            key = (seq_bucket, d, group, q.dtype)
            config = _tuned.get(key)
            if config is None:
                started = time.perf_counter()
                config = _tune(launch)
                _tuned[key] = config
                compile_watch().record(KERNEL_NAME, "autotune", time.perf_counter() - started,
                                       f"{KERNEL_NAME} tuned for {key}: {config}")
    launch(config, probe)
    return o


def _tune(launch) -> dict:
    best, best_ms = None, float("inf")
    for cfg in _configs():
        try:
            ms = triton.testing.do_bench(lambda: launch(cfg, None), warmup=5, rep=20,
                                         return_mode="median")
        except Exception:  # e.g. out of shared memory for this shape: not a candidate
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError("no prefill attention config compiled on this device")
    return best
