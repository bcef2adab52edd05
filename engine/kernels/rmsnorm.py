"""RMSNorm with the residual add fused in: ``residual += x; out = weight * norm(residual)``.

The decoder calls it twice per layer; unfused that is an add, a cast, a square, a mean, an
rsqrt, two multiplies and two casts, each reading and writing the ``[T, hidden]`` stream.
The Triton kernel reads x, the residual and the weight once and writes the residual and the
output once: one program per token row, the whole row in registers.

Numerics follow the torch path step for step (the reference below is that path): the sum
is rounded to the activation dtype before it is normalized, the normalized row is rounded
before the weight multiplies it, all arithmetic in float32. The residual is updated in
place on both paths (the caller's tensor holds the new stream afterwards).
"""

from __future__ import annotations

import torch

from ...instrumentation import check_range
from .attention import Backend, use_triton

try:  # the CPU path needs only the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

__all__ = ["KERNEL_NAME", "rms_norm", "rms_norm_ref", "rms_norm_triton"]

KERNEL_NAME = "sightline_rms_norm"


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (and residual [T, H], updated in place to ``residual + x``) ->
    (``weight * rmsnorm(stream)`` [T, H], the stream), where the stream is x or the sum."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


if triton is not None:
    @triton.jit
    def sightline_rms_norm(X, RES, W, OUT, stride_x, stride_r, stride_o, n_cols, eps,
                           HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            x = x + tl.load(RES + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            x_low = x.to(RES.dtype.element_ty)
            tl.store(RES + row * stride_r + cols, x_low, mask=ok)
            x = x_low.to(tl.float32)
        mean_sq = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.math.rsqrt(mean_sq + eps)).to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (normed * w).to(OUT.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel; same contract as ``rms_norm_ref``."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"expected x[T, H] and weight[H]; got x{tuple(x.shape)} "
                         f"weight{tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual{tuple(residual.shape)} {residual.dtype} must match "
                         f"x{tuple(x.shape)} {x.dtype}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along the hidden dim (strides {t.stride()})")
    check_range("eps", eps, 0.0, lo_open=True)
    out = torch.empty_like(x)
    rows, cols = x.shape
    if rows == 0:
        return out, (x if residual is None else residual)
    block = triton.next_power_of_2(cols)
    res = x if residual is None else residual
    sightline_rms_norm[(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0),
                                cols, eps, HAS_RES=residual is not None, BLOCK=block,
                                num_warps=min(16, max(1, block // 512)))
    return out, res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch like the attention ops (``attention.use_triton``); see ``rms_norm_ref``."""
    if use_triton(x.device, backend):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
