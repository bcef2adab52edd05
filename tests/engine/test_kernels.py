"""Attention ops: the torch references against independent answers, the Triton kernels
against the references (CPU interpreter at small sizes, the GPU at real sizes)."""

from __future__ import annotations

import math
import os
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sightline.engine.kernels.attention import paged_decode_attention, prefill_attention
from sightline.engine.kernels.reference import (paged_decode_attention_ref,
                                                 prefill_attention_ref)
from tests.engine.interpreter import run_interpreted


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


# -- Triton kernels under the CPU interpreter --------------------------------------
# TRITON_INTERPRET must be set before triton is imported, so the kernels run in one
# subprocess that reports every case as JSON. bfloat16 is left to the GPU tests: the
# interpreter stores bf16 as uint16 and its tl.dot multiplies those integers (seen with
# triton 3.9), so a bf16 interpreter run checks the interpreter, not our kernel.

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, os.getcwd())
    from tests.engine.test_kernels import _packed, _paged
    from sightline.engine.kernels.attention import prefill_attention, paged_decode_attention
    from sightline.engine.kernels.paged_decode_attention import paged_decode_attention_triton
    from sightline.engine.kernels.reference import (prefill_attention_ref,
                                                     paged_decode_attention_ref)
    from sightline.instrumentation.sm_probe import SmProbe
    results = {}
    def rel(o, r):
        return ((o.double() - r.double()).norm() / r.double().norm()).item()
    cases = [("fp32_varlen_gqa", [5, 1, 37], [5, 20, 37], 4, 2, 16, torch.float32),
             ("fp16_single_hd32", [40], [40], 2, 1, 32, torch.float16),
             ("fp32_q_longer_than_k", [3, 6], [1, 9], 2, 2, 16, torch.float32)]
    for name, lq, lk, hq, hkv, d, dt in cases:
        q, k, v, cq, ck = _packed(lq, lk, hq, hkv, d, dtype=dt, seed=len(name))
        o = torch.full_like(q, float("nan"))   # poison: every row must be written
        o = prefill_attention(q, k, v, cq, ck, max(lq), max(lk), 0.37, backend="triton")
        r = prefill_attention_ref(q, k, v, cq, ck, 0.37)
        results["prefill_" + name] = {"rel": rel(o, r), "finite": bool(torch.isfinite(o).all()),
                                      "zero_rows_exact": bool((o.float()[r.float().abs().sum((1, 2)) == 0] == 0).all())}
    # a narrow launch moves its tiles to other CTAs every launch: the same answer each time
    q, k, v, cq, ck = _packed([5, 1, 37], [5, 20, 37], 4, 2, 16, seed=3)
    outs = [prefill_attention(q, k, v, cq, ck, 37, 37, 0.37, backend="triton") for _ in range(3)]
    results["prefill_rotated_equal"] = all(torch.equal(outs[0], o) for o in outs[1:])
    dcases = [("fp32_auto_splits", [1, 17, 40, 0], 8, 2, 16, 16, None, torch.float32),
              ("fp16_three_splits", [100, 33], 4, 4, 32, 8, 3, torch.float16),
              ("fp32_group8_one_split", [64, 5, 77], 8, 1, 16, 16, 1, torch.float32),
              ("fp32_five_splits_empty", [0, 90, 3], 4, 2, 16, 16, 5, torch.float32)]
    for name, ctx, hq, hkv, d, bs, ns, dt in dcases:
        q, kc, vc, t, l = _paged(len(ctx), ctx, hq, hkv, d, block_size=bs, dtype=dt, seed=len(name))
        o = paged_decode_attention_triton(q, kc, vc, t, l, 0.41, num_splits=ns)
        r = paged_decode_attention_ref(q, kc, vc, t, l, 0.41)
        empty = torch.tensor(ctx) == 0
        results["decode_" + name] = {"rel": rel(o, r), "finite": bool(torch.isfinite(o).all()),
                                     "empty_zero": bool((o[empty] == 0).all())}
    probe = SmProbe("cpu", capacity_ctas=40)
    q, k, v, cq, ck = _packed([5, 40], [5, 40], 2, 1, 16)
    prefill_attention(q, k, v, cq, ck, 40, 40, 0.5, probe=probe, backend="triton")
    q, kc, vc, t, l = _paged(2, [20, 70], 4, 2, 16)
    paged_decode_attention_triton(q, kc, vc, t, l, 0.5, probe=probe, num_splits=2)
    big = _packed([64], [64], 8, 8, 16)   # 4 x 8 CTAs: over the remaining capacity
    prefill_attention(*big, 64, 64, 0.5, probe=probe, backend="triton")
    batch = probe.end_step(trace_id=5, span_id=7).wait()
    results["probe"] = {"mode": probe.mode, "fake": batch.fake, "names": list(batch.launch_names),
                        "ctas": batch.launch_ctas.tolist(), "idle": batch.idle_ctas,
                        "sm": batch.sm_id.tolist(), "start": batch.start_ns.tolist(),
                        "end": batch.end_ns.tolist(), "dropped": probe.dropped_launches,
                        "after_reset": probe.pending_ctas}
    print("RESULTS" + json.dumps(results))
""")


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_INTERPRETER_SCRIPT)


@pytest.mark.parametrize("case", ["fp32_varlen_gqa", "fp16_single_hd32", "fp32_q_longer_than_k"])
def test_prefill_kernel_interpreted_matches_reference(interpreted, case):
    r = interpreted["prefill_" + case]
    assert r["finite"]
    assert r["rel"] < (1e-5 if case.startswith("fp32") else 2e-3), r
    assert r["zero_rows_exact"]


def test_a_rotated_prefill_launch_gives_the_same_answer_bit_for_bit(interpreted):
    assert interpreted["prefill_rotated_equal"] is True


@pytest.mark.parametrize("case", ["fp32_auto_splits", "fp16_three_splits",
                                  "fp32_group8_one_split", "fp32_five_splits_empty"])
def test_decode_kernel_interpreted_matches_reference(interpreted, case):
    r = interpreted["decode_" + case]
    assert r["finite"] and r["empty_zero"]
    assert r["rel"] < (1e-5 if case.startswith("fp32") else 2e-3), r


def test_probe_slots_interpreted(interpreted):
    """Fake-mode records (interpreter): each CTA wrote its own slot, idle CTAs marked,
    an overflowing launch ran unprobed. SM ids and times here are FAKE by design."""
    p = interpreted["probe"]
    assert p["mode"] == 2 and p["fake"] is True
    assert p["names"] == ["sightline_fa2_prefill", "sightline_paged_decode"]
    # prefill grid 3 m-tiles x 2 heads x 2 seqs = 12; seq 0 (5 rows) idles 2 tiles per head
    assert p["ctas"] == [8, 8] and p["idle"] == 4
    assert p["dropped"] == 1 and p["after_reset"] == 0
    # fake start = slot x 1000: each record names its own slot. Which 4 of the prefill's 12
    # slots idle depends on how far its tiles were rotated; the decode's 8 follow from 12
    slots = [start // 1000 for start in p["start"]]
    assert len(set(slots[:8])) == 8 and set(slots[:8]) <= set(range(12)) and slots[8:] == list(range(12, 20))
    assert p["sm"] == [s % 8 for s in slots]
    assert p["end"] == [s * 1000 + 500 + s for s in slots]


# -- Triton kernels on a GPU at real sizes --------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv", [(torch.bfloat16, 128, 32, 8), (torch.float16, 64, 16, 4),
                                            (torch.bfloat16, 128, 32, 32)])
def test_prefill_kernel_on_gpu_matches_reference(dtype, d, hq, hkv):
    from sightline.engine.kernels.prefill_attention import prefill_attention_triton
    lens_q, lens_k = [1000, 37, 2048, 1, 300], [1000, 37, 2048, 513, 1300]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq, hkv, d, dtype=dtype, device="cuda", seed=d)
    out = torch.full_like(q, float("nan"))
    prefill_attention_triton(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), d ** -0.5, out=out)
    ref = prefill_attention_ref(q, k, v, cu_q, cu_k, d ** -0.5)
    assert torch.isfinite(out).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel
    # one wave (two 100-token prompts: 2 x hq CTAs): its tiles move to other CTAs every
    # launch, and the answer stays the same bit for bit
    q, k, v, cu_q, cu_k = _packed([100, 60], [100, 60], hq, hkv, d, dtype=dtype, device="cuda", seed=d + 1)
    outs = [prefill_attention_triton(q, k, v, cu_q, cu_k, 100, 100, d ** -0.5) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = prefill_attention_ref(q, k, v, cu_q, cu_k, d ** -0.5)
    rel = ((outs[0].float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3, 16])
def test_decode_kernel_on_gpu_matches_reference(splits):
    from sightline.engine.kernels.paged_decode_attention import paged_decode_attention_triton
    ctx = [4096, 1, 777, 0, 2500, 16, 8191, 33]
    q, kc, vc, tables, lens = _paged(len(ctx), ctx, 32, 8, 128, dtype=torch.bfloat16, device="cuda",
                                     seed=3)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention_triton(q, kc, vc, tables, lens, 0.088, num_splits=splits, out=out)
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.088)
    assert torch.isfinite(out).all() and (out[3] == 0).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.gpu
def test_auto_dispatch_uses_triton_on_cuda():
    q, k, v, cu_q, cu_k = _packed([300], [300], 8, 2, 64, dtype=torch.float16, device="cuda")
    out = prefill_attention(q, k, v, cu_q, cu_k, 300, 300, 0.125)
    ref = prefill_attention(q, k, v, cu_q, cu_k, 300, 300, 0.125, backend="torch")
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_decode_splits_only_while_pairs_leave_the_sms_short_of_work():
    from sightline.engine.kernels.paged_decode_attention import choose_num_splits
    # 64 x 8 (sequence, KV head) pairs = 3.9 CTAs per SM on 132 SMs: no merge pass
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 1
    assert choose_num_splits(48, 8, 4096, num_sms=132) == 1
    assert choose_num_splits(32, 8, 4096, num_sms=132) == 2      # 528 // 256
    assert choose_num_splits(1, 8, 4096, num_sms=132) == 8       # capped: 512 tokens a split
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1        # a short context is not split
