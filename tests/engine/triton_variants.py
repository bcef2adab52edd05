"""A tiny Triton kernel compiled for a named GPU target, so that tests on a machine without
a GPU can make Triton meet new kernel variants (and its compile cache) for real."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")   # a module importing this one is skipped without Triton
tl = pytest.importorskip("triton.language")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def doubler(X, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < N) * 2, mask=offs < N)


def compile_variant(block: int) -> None:
    """One variant of ``doubler`` (its BLOCK), built for an H100/H200."""
    source = ASTSource(doubler, signature={"X": "*fp32", "N": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": block})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
