"""SwiGLU: ``silu(gate) * up`` over the fused gate/up projection's output ``[T, 2I]``.

Unfused, the torch path writes silu(gate) to a new ``[T, I]`` tensor and reads it back for
the product; the Triton kernel reads gate and up once and writes the product once.
Numerics follow the torch path (the reference below): silu in float32 rounded to the
activation dtype, then the product in float32 rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import Backend, use_triton

try:  # the CPU path needs only the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

__all__ = ["KERNEL_NAME", "swiglu", "swiglu_ref", "swiglu_triton"]

KERNEL_NAME = "sightline_swiglu"
_BLOCK = 1024


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def sightline_swiglu(X, OUT, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (act * up).to(OUT.dtype.element_ty), mask=ok)


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Launches the kernel; same contract as ``swiglu_ref``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"expected gate_up[T, 2I]; got {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be contiguous along its last dim (strides {gate_up.stride()})")
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    sightline_swiglu[(rows, triton.cdiv(cols, _BLOCK))](gate_up, out, gate_up.stride(0),
                                                         out.stride(0), cols, BLOCK=_BLOCK,
                                                         num_warps=4)
    return out


def swiglu(gate_up: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """Dispatch like the attention ops; see ``swiglu_ref``."""
    if use_triton(gate_up.device, backend):
        return swiglu_triton(gate_up)
    return swiglu_ref(gate_up)
