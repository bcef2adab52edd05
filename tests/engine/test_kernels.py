"""Attention ops: the torch references against independent answers, the Triton kernels
against the references (CPU interpreter at small sizes, the GPU at real sizes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sightline.engine.kernels.attention import paged_decode_attention, prefill_attention
from sightline.engine.kernels.reference import (paged_decode_attention_ref,
                                                 prefill_attention_ref)


def _packed(lens_q, lens_k, hq, hkv, d, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(tk, hkv, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(tk, hkv, d, generator=gen).to(device=device, dtype=dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32,
                        device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32,
                        device=device)
    return q, k, v, cu_q, cu_k


def _paged(batch, ctx_lens, hq, hkv, d, block_size=16, spare_blocks=3, dtype=torch.float32,
           device="cpu", seed=0):
    """A shuffled page pool; tables padded with an out-of-range id to prove pads are unread."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    max_blocks = max(1, max(math.ceil(c / block_size) for c in ctx_lens))
    num_blocks = batch * max_blocks + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((batch, max_blocks), 10**6, dtype=torch.int32)
    for b, c in enumerate(ctx_lens):
        n = math.ceil(c / block_size)
        tables[b, :n] = perm[b * max_blocks:b * max_blocks + n].to(torch.int32)
    q = torch.randn(batch, hq, d, generator=gen).to(device, dtype)
    return (q, k_cache, v_cache, tables.to(device),
            torch.tensor(ctx_lens, dtype=torch.int32, device=device))


# -- references against independent answers -----------------------------------------

@pytest.mark.parametrize("lens_q,lens_k", [([5, 1, 9], [5, 7, 9]), ([3], [3]), ([4, 2], [10, 2])])
def test_prefill_reference_matches_sdpa_with_explicit_mask(lens_q, lens_k):
    hq, hkv, d = 4, 2, 8
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq, hkv, d, dtype=torch.float64)
    scale = 0.3
    out = prefill_attention_ref(q, k, v, cu_q, cu_k, scale)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        kb = k[cu_k[b]:cu_k[b + 1]].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vb = v[cu_k[b]:cu_k[b + 1]].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        # bottom-right causal: query i sees keys j <= lk - lq + i
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        expect = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], expect.transpose(0, 1),
                                   rtol=1e-10, atol=1e-10)


def test_prefill_reference_rows_without_keys_are_zero():
    q, k, v, cu_q, cu_k = _packed([4], [2], 2, 1, 8)
    out = prefill_attention_ref(q, k, v, cu_q, cu_k, 1.0)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))   # positions -2, -1: no keys
    assert torch.isfinite(out).all() and out[2:].abs().sum() > 0


def test_decode_reference_equals_prefill_of_one_token():
    ctx = [1, 17, 40, 0]
    q, kc, vc, tables, lens = _paged(4, ctx, 8, 2, 16, dtype=torch.float64)
    out = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.25)
    for b, c in enumerate(ctx):
        if c == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        pages = tables[b, :math.ceil(c / 16)].long()
        kb = kc[pages].reshape(-1, 2, 16)[:c]
        vb = vc[pages].reshape(-1, 2, 16)[:c]
        cu_q = torch.tensor([0, 1], dtype=torch.int32)
        cu_k = torch.tensor([0, c], dtype=torch.int32)
        expect = prefill_attention_ref(q[b:b + 1], kb, vb, cu_q, cu_k, 0.25)
        torch.testing.assert_close(out[b:b + 1], expect, rtol=1e-12, atol=1e-12)


def test_dispatch_validates_inputs_and_names_the_bad_value():
    q, k, v, cu_q, cu_k = _packed([3], [3], 3, 2, 8)
    with pytest.raises(ValueError, match="Hq=3"):
        prefill_attention(q, k, v, cu_q, cu_k, 3, 3, 1.0)
    q, k, v, cu_q, cu_k = _packed([3], [3], 4, 2, 8)
    with pytest.raises(ValueError, match="softmax_scale=-1"):
        prefill_attention(q, k, v, cu_q, cu_k, 3, 3, -1.0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        prefill_attention(q, k, v, cu_q, cu_k, 3, 3, 1.0, backend="cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            prefill_attention(q, k, v, cu_q, cu_k, 3, 3, 1.0, backend="triton")
    qd, kc, vc, tables, lens = _paged(2, [3, 5], 4, 2, 8)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(qd, kc, vc, tables, lens[:1], 1.0)
    out = paged_decode_attention(qd, kc, vc, tables, lens, 0.5)   # CPU -> torch path
    torch.testing.assert_close(out, paged_decode_attention_ref(qd, kc, vc, tables, lens, 0.5))
