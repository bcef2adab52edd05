"""A Triton kernel whose variants the tests compile for real on the CPU (no GPU needed).

``triton.compile`` builds a kernel for a named target (Hopper, sm_90) without a device,
through the same compilation listener a JIT cache miss goes through: each ``compile_variant``
call with a new BLOCK is a new variant (compiled, or loaded from the on-disk cache).
Cost: a compile is ~0.1-1 s here.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

__all__ = ["compile_variant", "doubler"]


@triton.jit
def doubler(X, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < N) * 2, mask=offs < N)


def compile_variant(block: int) -> None:
    """One variant of ``doubler`` (its BLOCK), built for an H100/H200."""
    source = ASTSource(doubler, signature={"X": "*fp32", "N": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": block})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
