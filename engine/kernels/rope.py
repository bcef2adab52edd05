"""Rotary position embedding applied in place to the q and k heads of one step.

q and k are views into the fused qkv projection's output (``[T, H, D]`` with a row stride
of the whole projection); the rotation uses the HF Llama "rotate half" layout: the pairs are
``(j, j + D/2)``. One Triton program per token rotates every q and k head of that token, so
the ``cat``/cast chain of the torch path (eight ops and two new tensors per layer) becomes one
launch that reads and writes q and k once.

With a ``KvStore`` the same program also writes the rotated k and the v heads of its token
into the paged KV cache at the token's slot (what two ``index_copy_`` launches did), so
k is stored while it is still in registers. Numerics follow the torch path (the reference
below): float32 arithmetic, one rounding to the activation dtype at the end. ``cos``/``sin``
are the float32 rows of the tokens' positions ``[T, D/2]``, gathered once per forward pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .attention import Backend, use_triton

try:  # the CPU path needs only the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

__all__ = ["KERNEL_NAME", "KvStore", "rope_", "rope_ref_", "rope_supported", "rope_triton_"]

KERNEL_NAME = "sightline_rope"


class KvStore(NamedTuple):
    """Where a step's k and v go: the flat caches ``[slots, Hkv, D]`` (contiguous) and each
    token's slot ``[T]`` int64; ``v`` is ``[T, Hkv, D]``, contiguous in D."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2] -> rotated [T, H, D] in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_ref_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              store: KvStore | None = None) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place; then, with ``store``, writes k and v
    into the caches' rows ``store.slots``."""
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
    if store is not None:
        store.k_cache.index_copy_(0, store.slots, k)
        store.v_cache.index_copy_(0, store.slots, store.v)


if triton is not None:
    @triton.jit
    def _rotate_heads(X, row, stride_h, num_heads, c, s, offs_d,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        """Rotates the heads of one token in place; returns them (rounded) and their mask."""
        offs_h = tl.arange(0, BLOCK_H)
        ok = (offs_h < num_heads)[:, None]
        lo = X + row + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(lo, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(lo + HALF, mask=ok, other=0.0).to(tl.float32)
        y1 = (x1 * c - x2 * s).to(X.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(X.dtype.element_ty)
        tl.store(lo, y1, mask=ok)
        tl.store(lo + HALF, y2, mask=ok)
        return y1, y2, offs_h, ok

    @triton.jit
    def sightline_rope(Q, K, COS, SIN, V, KC, VC, SLOTS, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_ct, stride_vt, stride_vh, stride_cs, stride_ch,
                       num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                       BLOCK_HK: tl.constexpr, STORE_KV: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, HALF)
        c = tl.load(COS + t * stride_ct + offs_d)[None, :]
        s = tl.load(SIN + t * stride_ct + offs_d)[None, :]
        _rotate_heads(Q, t * stride_qt, stride_qh, num_q_heads, c, s, offs_d, HALF, BLOCK_HQ)
        k1, k2, offs_h, ok = _rotate_heads(K, t * stride_kt, stride_kh, num_k_heads, c, s,
                                           offs_d, HALF, BLOCK_HK)
        if STORE_KV:
            slot = tl.load(SLOTS + t).to(tl.int64)
            head = offs_h[:, None] * stride_ch + offs_d[None, :]
            kc = KC + slot * stride_cs + head
            tl.store(kc, k1, mask=ok)
            tl.store(kc + HALF, k2, mask=ok)
            vi = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            vc = VC + slot * stride_cs + head
            tl.store(vc, tl.load(vi, mask=ok, other=0.0), mask=ok)
            tl.store(vc + HALF, tl.load(vi + HALF, mask=ok, other=0.0), mask=ok)


def rope_supported(head_dim: int) -> bool:
    """The kernel takes head dims whose half is a power of two (16 .. 256)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and 8 <= half <= 128 and half & (half - 1) == 0


def rope_triton_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 store: KvStore | None = None) -> None:
    """Launches the kernel; same contract as ``rope_ref_``."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q[T, Hq, D], k[T, Hkv, D]; got q{tuple(q.shape)} "
                         f"k{tuple(k.shape)}")
    t, hq, d = q.shape
    if not rope_supported(d):
        raise ValueError(f"head dim {d}; the kernel takes 16, 32, 64, 128 or 256")
    if cos.shape != (t, d // 2) or sin.shape != cos.shape or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32 or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"cos{tuple(cos.shape)} {cos.dtype} / sin{tuple(sin.shape)} {sin.dtype}: "
                         f"need float32 [T={t}, D/2={d // 2}], alike and contiguous in D/2")
    if q.dtype != k.dtype or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype and be contiguous "
                         "in the head dim")
    hk = k.shape[1]
    if store is not None:
        _check_store(store, t, hk, d, k.dtype)
    if t == 0:
        return
    v, kc, vc, slots = store if store is not None else (k, k, k, cos)   # unused without a store
    sightline_rope[(t,)](q, k, cos, sin, v, kc, vc, slots, q.stride(0), q.stride(1), k.stride(0),
                         k.stride(1), cos.stride(0), v.stride(0), v.stride(1),
                         kc.stride(0), kc.stride(1), hq, hk, HALF=d // 2,
                         BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
                         STORE_KV=store is not None, num_warps=4)


def _check_store(store: KvStore, t: int, hk: int, d: int, dtype: torch.dtype) -> None:
    v, kc, vc, slots = store
    if v.shape != (t, hk, d) or v.stride(2) != 1 or v.dtype != dtype:
        raise ValueError(f"v{tuple(v.shape)} {v.dtype}: need [T={t}, Hkv={hk}, D={d}] {dtype}, "
                         "contiguous in D")
    for name, cache in (("k_cache", kc), ("v_cache", vc)):
        if cache.dim() != 3 or cache.shape[1:] != (hk, d) or not cache.is_contiguous() \
                or cache.dtype != dtype:
            raise ValueError(f"{name}{tuple(cache.shape)} {cache.dtype}: need contiguous "
                             f"[slots, Hkv={hk}, D={d}] {dtype}")
    if slots.shape != (t,) or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots{tuple(slots.shape)} {slots.dtype}: need [T={t}] int64 or int32")


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          backend: Backend = "auto", store: KvStore | None = None) -> None:
    """Dispatch like the attention ops; head dims the kernel does not take use the reference."""
    if rope_supported(q.shape[-1]) and use_triton(q.device, backend):
        rope_triton_(q, k, cos, sin, store)
    else:
        rope_ref_(q, k, cos, sin, store)
