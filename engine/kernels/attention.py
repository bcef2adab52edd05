"""The two attention ops the model calls, dispatching to Triton or to pure torch.

``prefill_attention`` (packed varlen, causal aligned to the end of each key sequence, GQA)
and ``paged_decode_attention`` (one new token per sequence over its paged KV); their
shapes are in their docstrings and reference.py states the semantics both paths share.

``backend``: ``"auto"`` runs Triton when the tensors are on CUDA and Triton imports, the
torch reference otherwise; ``"triton"`` forces the kernel (on CUDA, or on the CPU when
``TRITON_INTERPRET=1`` is set before Triton is imported, as the tests do); ``"torch"``
forces the reference. ``probe`` is an instrumentation ``SmProbe`` (or None): the Triton
kernels then write one (SM id, start, end) record per CTA; the torch path ignores it.

Cost of the dispatch: a few attribute reads and comparisons per call; no device sync.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from ...instrumentation import check_range
from .reference import paged_decode_attention_ref, prefill_attention_ref

__all__ = ["Backend", "paged_decode_attention", "prefill_attention", "triton_available",
           "use_triton"]

Backend = Literal["auto", "triton", "torch"]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_triton_ok: bool | None = None


def triton_available() -> bool:
    """True when ``import triton`` works (cached)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            _triton_ok = True
        except Exception:  # ImportError, or a broken install raising anything else
            _triton_ok = False
    return _triton_ok


def use_triton(device: torch.device, backend: str) -> bool:
    """Whether an op with this backend runs its Triton kernel on tensors of this device
    (the rule above; the fused ops in this folder share it)."""
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda" and triton_available()
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' but triton cannot be imported")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors (got {device.type}) "
                             "or TRITON_INTERPRET=1 set before triton is imported")
        return True
    raise ValueError(f"backend={backend!r}; allowed: 'auto', 'triton', 'torch'")


def _check_scale(softmax_scale: float) -> None:
    check_range("softmax_scale", softmax_scale, 0.0, lo_open=True)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                      probe=None, backend: Backend = "auto") -> torch.Tensor:
    """Causal varlen GQA attention over packed sequences: ``q[Tq,Hq,D]``, ``k/v[Tk,Hkv,D]``,
    ``cu_seqlens_q/k[B+1]`` -> ``o[Tq,Hq,D]``."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"expected q[Tq,Hq,D], k/v[Tk,Hkv,D]; got q{tuple(q.shape)} "
                         f"k{tuple(k.shape)} v{tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dim of q ({q.shape[2]}) != head dim of k ({k.shape[2]})")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"dtypes q={q.dtype} k={k.dtype} v={v.dtype}; need one of "
                         f"{_FLOAT_DTYPES} for all three")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError(f"cu_seqlens_q{tuple(cu_seqlens_q.shape)} and "
                         f"cu_seqlens_k{tuple(cu_seqlens_k.shape)} must both be [B+1]")
    _check_scale(softmax_scale)
    if use_triton(q.device, backend):
        from .prefill_attention import prefill_attention_triton
        return prefill_attention_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, softmax_scale, probe=probe)
    return prefill_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           softmax_scale: float, probe=None,
                           backend: Backend = "auto") -> torch.Tensor:
    """One new token per sequence attending to its paged KV: ``q[B,Hq,D]``,
    ``k/v_cache[N,bs,Hkv,D]``, ``block_tables[B,max_blocks]``, ``context_lens[B]`` -> ``o[B,Hq,D]``."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q[B,Hq,D], k/v_cache[N,bs,Hkv,D]; got q{tuple(q.shape)} "
                         f"k_cache{tuple(k_cache.shape)} v_cache{tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head dim of q ({q.shape[2]}) != head dim of the cache "
                         f"({k_cache.shape[3]})")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={k_cache.shape[2]}")
    if q.dtype not in _FLOAT_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtypes q={q.dtype} k_cache={k_cache.dtype} v_cache={v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables{tuple(block_tables.shape)} must be [B={q.shape[0]}, "
                         "max_blocks]")
    if context_lens.shape != (q.shape[0],):
        raise ValueError(f"context_lens{tuple(context_lens.shape)} must be [B={q.shape[0]}]")
    _check_scale(softmax_scale)
    if use_triton(q.device, backend):
        from .paged_decode_attention import paged_decode_attention_triton
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                             softmax_scale, probe=probe)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens,
                                      softmax_scale)
