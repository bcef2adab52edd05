"""Fused RMSNorm(+residual), RoPE and SwiGLU: the Triton kernels against their torch
references (CPU interpreter at small sizes, the GPU at real sizes), the references against
independent answers, and the dispatch's validation."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from sightline.engine.kernels.rmsnorm import rms_norm, rms_norm_ref
from sightline.engine.kernels.rope import rope_ref_, rope_supported
from sightline.engine.kernels.swiglu import swiglu, swiglu_ref
from tests.engine.interpreter import run_interpreted


def _inputs(t, hidden, hq, hkv, d, dtype=torch.float32, device="cpu", seed=0):
    """Random activations, a weight, a strided qkv projection (q/k are views) and RoPE rows."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen).to(device, dtype)
    res = torch.randn(t, hidden, generator=gen).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
    angles = torch.rand(t, d // 2, generator=gen) * 50
    gate_up = (3 * torch.randn(t, 2 * hidden, generator=gen)).to(device, dtype)
    return x, res, w, qkv, angles.cos().to(device), angles.sin().to(device), gate_up


def _store(qkv, hq, hkv, d, slots):
    """A copy of the projection and a KvStore into caches of ``slots`` rows (NaN-filled, so
    a row written wrongly shows), each token at a distinct shuffled slot."""
    from sightline.engine.kernels.rope import KvStore
    qkv = qkv.clone()
    t = qkv.shape[0]
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    gen = torch.Generator().manual_seed(t)
    where = torch.randperm(slots, generator=gen)[:t].to(qkv.device)
    caches = [torch.full((slots, hkv, d), float("nan"), dtype=qkv.dtype, device=qkv.device)
              for _ in range(2)]
    return qkv, KvStore(v, caches[0], caches[1], where)


def _qk(qkv, hq, hkv, d):
    t = qkv.shape[0]
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d)


# -- references against independent answers -----------------------------------------

def test_rms_norm_reference_is_the_llama_formula_and_updates_the_residual():
    x, res, w, *_ = _inputs(5, 24, 2, 1, 8, dtype=torch.float64)
    stream = x + res
    expect = w * stream / torch.sqrt((stream * stream).mean(-1, keepdim=True) + 1e-5)
    res_before = res.clone()
    out, new_res = rms_norm_ref(x, w, 1e-5, res)
    assert new_res is res and torch.equal(res, res_before + x)   # in place
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)   # normalized in float32
    out2, same = rms_norm_ref(x, w, 1e-5)
    assert same is x
    torch.testing.assert_close(out2, w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5),
                               rtol=1e-6, atol=1e-6)


def test_rope_reference_rotates_pairs_as_complex_numbers():
    hq, hkv, d = 4, 2, 16
    *_, qkv, cos, sin, _ = _inputs(6, 8, hq, hkv, d, dtype=torch.float64)
    cos, sin = cos.double(), sin.double()
    q, k = _qk(qkv, hq, hkv, d)
    expect = []
    for x in (q, k):
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.complex(cos, sin)[:, None, :]
        expect.append(torch.cat((z.real, z.imag), dim=-1))
    rope_ref_(q, k, cos, sin)
    torch.testing.assert_close(q, expect[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, expect[1], rtol=1e-12, atol=1e-12)
    # the views wrote through to the projection; v untouched
    assert torch.equal(_qk(qkv, hq, hkv, d)[0], q)


def test_swiglu_reference():
    *_, gate_up = _inputs(3, 10, 1, 1, 8, dtype=torch.float64)
    gate, up = gate_up[:, :10], gate_up[:, 10:]
    torch.testing.assert_close(swiglu_ref(gate_up), gate / (1 + torch.exp(-gate)) * up)


def test_dispatch_validates_and_falls_back():
    x, res, w, qkv, cos, sin, gate_up = _inputs(3, 16, 2, 1, 8)
    assert rope_supported(128) and rope_supported(32) and not rope_supported(80)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            rms_norm(x, w, 1e-5, backend="triton")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            swiglu(gate_up, backend="triton")
    with pytest.raises(ValueError, match="backend='gpu'"):
        swiglu(gate_up, backend="gpu")
    out, _ = rms_norm(x, w, 1e-5)  # CPU -> the reference
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-5)[0])


# -- Triton kernels under the CPU interpreter --------------------------------------
# fp32 and fp16 only: the interpreter's bf16 tl.dot/arith is not the hardware's (see
# test_kernels.py); bf16 is checked on the GPU below.

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, os.getcwd())
    from tests.engine.test_fused_kernels import _inputs, _qk, _store
    from sightline.engine.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
    from sightline.engine.kernels.rope import rope_ref_, rope_triton_
    from sightline.engine.kernels.swiglu import swiglu_ref, swiglu_triton
    results = {}
    def diff(a, b):
        return (a.double() - b.double()).abs().max().item()
    for name, t, hidden, hq, hkv, d, dt in [("fp32", 7, 48, 4, 2, 16, torch.float32),
                                            ("fp16", 5, 256, 8, 2, 32, torch.float16)]:
        x, res, w, qkv, cos, sin, gate_up = _inputs(t, hidden, hq, hkv, d, dtype=dt, seed=t)
        r1, r2 = res.clone(), res.clone()
        out_k, s_k = rms_norm_triton(x, w, 1e-5, r1)
        out_r, s_r = rms_norm_ref(x, w, 1e-5, r2)
        plain_k, _ = rms_norm_triton(x, w, 1e-5)
        plain_r, _ = rms_norm_ref(x, w, 1e-5)
        q1, k1 = _qk(qkv.clone(), hq, hkv, d)
        q2, k2 = _qk(qkv.clone(), hq, hkv, d)
        rope_triton_(q1, k1, cos, sin)
        rope_ref_(q2, k2, cos, sin)
        stores = [_store(qkv, hq, hkv, d, slots=16) for _ in range(2)]
        (q3, k3), (q4, k4) = _qk(stores[0][0], hq, hkv, d), _qk(stores[1][0], hq, hkv, d)
        rope_triton_(q3, k3, cos, sin, stores[0][1])
        rope_ref_(q4, k4, cos, sin, stores[1][1])
        results[name] = {"norm": diff(out_k, out_r), "stream": diff(s_k, s_r),
                         "stream_in_place": s_k.data_ptr() == r1.data_ptr(),
                         "plain": diff(plain_k, plain_r), "q": diff(q1, q2), "k": diff(k1, k2),
                         "swiglu": diff(swiglu_triton(gate_up), swiglu_ref(gate_up)),
                         "stored_q": diff(q3, q4), "stored_k": diff(k3, k4),
                         "k_cache": diff(stores[0][1].k_cache[stores[0][1].slots],
                                         stores[1][1].k_cache[stores[1][1].slots]),
                         "v_cache_equal": torch.equal(stores[0][1].v_cache.nan_to_num(),
                                                      stores[1][1].v_cache.nan_to_num()),
                         "rows_untouched": [int(st.k_cache.isnan().all(-1).all(-1).sum())
                                            for _, st in stores],
                         "k_cache_is_k": torch.equal(stores[0][1].k_cache[stores[0][1].slots], k3),
                         "scale": max(out_r.abs().max().item(), q2.abs().max().item())}
    print("RESULTS" + json.dumps(results))
""")


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_INTERPRETER_SCRIPT)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fused_kernels_interpreted_match_references(interpreted, dtype):
    r = interpreted[dtype]
    tol = 2e-6 if dtype == "fp32" else 2e-3   # fp16: one rounding step apart at most
    assert r["stream"] == 0.0 and r["stream_in_place"]          # the sum is the same sum
    for key in ("norm", "plain", "q", "k", "swiglu", "stored_q", "stored_k", "k_cache"):
        assert r[key] <= tol * max(1.0, r["scale"]), (key, r)
    assert r["v_cache_equal"] and r["k_cache_is_k"]     # v copied as is; k stored as rotated
    assert r["rows_untouched"] == [16 - {"fp32": 7, "fp16": 5}[dtype]] * 2   # only the slots


# -- on a GPU at real sizes -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_kernels_on_gpu_match_references(dtype):
    from sightline.engine.kernels.rmsnorm import rms_norm_triton
    from sightline.engine.kernels.rope import rope_triton_
    from sightline.engine.kernels.swiglu import swiglu_triton
    hq, hkv, d, hidden = 32, 8, 128, 4096
    x, res, w, qkv, cos, sin, gate_up = _inputs(67, hidden, hq, hkv, d, dtype=dtype, device="cuda")
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -20}[dtype]
    r1, r2 = res.clone(), res.clone()
    out_k, _ = rms_norm_triton(x, w, 1e-5, r1)
    out_r, _ = rms_norm_ref(x, w, 1e-5, r2)
    assert torch.equal(r1, r2)
    torch.testing.assert_close(out_k, out_r, rtol=2 * ulp, atol=2 * ulp)
    q1, k1 = _qk(qkv.clone(), hq, hkv, d)
    q2, k2 = _qk(qkv.clone(), hq, hkv, d)
    rope_triton_(q1, k1, cos, sin)
    rope_ref_(q2, k2, cos, sin)
    torch.testing.assert_close(q1, q2, rtol=2 * ulp, atol=2 * ulp)
    torch.testing.assert_close(k1, k2, rtol=2 * ulp, atol=2 * ulp)
    (qkv3, s3), (qkv4, s4) = _store(qkv, hq, hkv, d, 4096), _store(qkv, hq, hkv, d, 4096)
    (q3, k3), (q4, k4) = _qk(qkv3, hq, hkv, d), _qk(qkv4, hq, hkv, d)
    rope_triton_(q3, k3, cos, sin, s3)
    rope_ref_(q4, k4, cos, sin, s4)
    torch.testing.assert_close(s3.k_cache, s4.k_cache, rtol=2 * ulp, atol=2 * ulp, equal_nan=True)
    assert torch.equal(s3.v_cache.nan_to_num(), s4.v_cache.nan_to_num())
    assert torch.equal(s3.k_cache[s3.slots], k3)
    torch.testing.assert_close(swiglu_triton(gate_up), swiglu_ref(gate_up), rtol=2 * ulp,
                               atol=2 * ulp)
