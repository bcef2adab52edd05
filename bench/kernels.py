"""Attention kernels on the GPU: correctness, then speed side by side, in one run.

    python -m bench.kernels --out bench/results        # needs CUDA; a few minutes
    python -m bench.kernels --only probe --out bench/results

1. Correctness against the float32 torch reference, outputs poisoned with NaN first so an
   unwritten row fails: varlen GQA prefill (incl. chunked, q_len < k_len) and paged decode.
2. The ceiling, in the same run: a device-to-device copy (bytes read + written).
3. Prefill TFLOP/s (causal FLOPs = 2 * 2 * B * H * S^2 * D / 2), bf16 hd128, 32 heads, at
   1K x16, 4K x4, 16K x1: our block configs, the tuned choice, SDPA flash and cuDNN.
4. Paged decode GB/s, batch 64, Hq 32, Hkv 8, page 16, contexts 4K..32K, as a fraction of
   the copy bandwidth; a small sweep of splits and tile configs.
5. SM-probe overhead (probe on vs off) on both kernels, and what the probe saw.

Timing: ``triton.testing.do_bench`` medians. Writes ``kernels-<device>-<commit>.json/.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from sightline.engine.kernels import paged_decode_attention as pd
from sightline.engine.kernels import prefill_attention as pf
from sightline.engine.kernels.reference import (paged_decode_attention_ref,
                                                 prefill_attention_ref)
from sightline.instrumentation.sm_probe import SmProbe, launch_facts

from ._common import git_commit, utc_now

SCALE = 1.0 / math.sqrt(128)


def _rel(o: torch.Tensor, r: torch.Tensor) -> float:
    return ((o.float() - r.float()).norm() / r.float().norm()).item()


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _packed(lens_q, lens_k, hq, hkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, generator=g)
    cq = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    return q, k, v, cq, ck


def _paged(batch, ctx_lens, hq, hkv, d, page, dtype, seed, spare=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_blocks = max(1, max(math.ceil(c / page) for c in ctx_lens))
    num_blocks = batch * max_blocks + spare
    kc = torch.randn(num_blocks, page, hkv, d, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(num_blocks, page, hkv, d, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    tables = perm[: batch * max_blocks].view(batch, max_blocks).clone()
    for b, c in enumerate(ctx_lens):                    # pads past the context: garbage ids
        tables[b, math.ceil(c / page):] = 2**30
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    return q, kc, vc, tables, lens


# -- 1. correctness ------------------------------------------------------------------------

def check_correctness() -> list[dict]:
    out = []
    cases = [("prefill varlen GQA bf16 hd128", [1000, 37, 2048, 513], None, 32, 8, 128,
              torch.bfloat16, 1e-2),
             ("prefill varlen GQA fp16 hd64", [700, 1, 1500], None, 16, 4, 64, torch.float16, 2e-3),
             ("prefill chunked q<k bf16 hd128", [100, 1, 300], [1100, 513, 300], 32, 8, 128,
              torch.bfloat16, 1e-2)]
    for name, lq, lk, hq, hkv, d, dt, tol in cases:
        lk = lk or lq
        q, k, v, cq, ck = _packed(lq, lk, hq, hkv, d, dt, seed=len(name))
        o = torch.full_like(q, float("nan"))
        pf.prefill_attention_triton(q, k, v, cq, ck, max(lq), max(lk), SCALE, out=o)
        r = prefill_attention_ref(q, k, v, cq, ck, SCALE)
        e = _rel(o, r)
        out.append({"case": name, "rel_err": e, "tol": tol, "all_written": bool(torch.isfinite(o).all()),
                    "ok": bool(torch.isfinite(o).all()) and e < tol})
    dcases = [("decode bf16 hd128 auto splits", [4096, 1, 777, 0, 2500, 16], None),
              ("decode bf16 hd128 splits=7", [4096, 1, 777, 0, 2500, 16], 7),
              ("decode bf16 hd128 splits=1", [3000, 5, 64], 1)]
    for name, ctx, ns in dcases:
        q, kc, vc, t, lens = _paged(len(ctx), ctx, 32, 8, 128, 16, torch.bfloat16, seed=len(name))
        o = torch.full_like(q, float("nan"))
        pd.paged_decode_attention_triton(q, kc, vc, t, lens, SCALE, num_splits=ns, out=o)
        r = paged_decode_attention_ref(q, kc, vc, t, lens, SCALE)
        empty = lens == 0
        e = _rel(o, r)
        written = bool(torch.isfinite(o).all())
        out.append({"case": name, "rel_err": e, "tol": 1e-2, "all_written": written,
                    "empty_zero": bool((o[empty] == 0).all()),
                    "ok": written and e < 1e-2 and bool((o[empty] == 0).all())})
    return out


# -- 2. ceilings ----------------------------------------------------------------------------

def copy_bandwidth() -> dict:
    n = 1 << 30                                          # 2 GiB of bf16
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = _ms(lambda: y.copy_(x))
    moved = 2 * x.numel() * x.element_size()
    return {"bytes_read_plus_written": moved, "ms": ms, "GB_s": moved / ms / 1e6}


# -- 3. prefill -----------------------------------------------------------------------------

def bench_prefill(shapes) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for seq, batch in shapes:
        h, d = 32, 128
        q, k, v, cu, _ = _packed([seq] * batch, [seq] * batch, h, h, d, torch.bfloat16, seed=seq)
        flops = 4.0 * batch * h * seq * seq * d / 2.0
        tf = lambda ms: flops / ms / 1e9                  # noqa: E731
        row = {"seq": seq, "batch": batch, "heads": h, "head_dim": d, "flops": flops,
               "configs": []}
        for cfg in pf._configs():
            try:
                ms = _ms(lambda: pf.prefill_attention_triton(q, k, v, cu, cu, seq, seq, SCALE,
                                                             config=cfg))
                row["configs"].append({**cfg, "ms": ms, "TFLOPs": tf(ms)})
            except Exception as exc:
                row["configs"].append({**cfg, "error": f"{type(exc).__name__}: {exc}"[:200]})
        pf._tuned.clear()
        o_auto = pf.prefill_attention_triton(q, k, v, cu, cu, seq, seq, SCALE)   # tunes
        row["auto_config"] = next(iter(pf.tuned_configs().values()))
        ms = _ms(lambda: pf.prefill_attention_triton(q, k, v, cu, cu, seq, seq, SCALE))
        row["ours_ms"], row["ours_TFLOPs"] = ms, tf(ms)
        qb, kb, vb = (t.view(batch, seq, h, d).transpose(1, 2) for t in (q, k, v))
        for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                               ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=SCALE)
                    ms = _ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                                    scale=SCALE))
                row[f"{label}_ms"], row[f"{label}_TFLOPs"] = ms, tf(ms)
                if label == "sdpa_flash":
                    row["rel_diff_vs_sdpa_flash"] = _rel(
                        o_auto.view(batch, seq, h, d), ref.transpose(1, 2))
            except Exception as exc:
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if "sdpa_flash_TFLOPs" in row:
            row["ours_over_sdpa_flash"] = row["ours_TFLOPs"] / row["sdpa_flash_TFLOPs"]
        rows.append(row)
        print(f"prefill {seq}x{batch}: ours {row['ours_TFLOPs']:.0f} TFLOP/s "
              f"({row['auto_config']}), flash {row.get('sdpa_flash_TFLOPs', float('nan')):.0f}, "
              f"cudnn {row.get('sdpa_cudnn_TFLOPs', float('nan')):.0f}", flush=True)
        del q, k, v, qb, kb, vb, o_auto
        torch.cuda.empty_cache()
    return rows


# -- 4. decode ------------------------------------------------------------------------------

def bench_decode(contexts, batch=64, copy_gbs=None) -> list[dict]:
    rows = []
    hq, hkv, d, page = 32, 8, 128, 16
    sweep_cfgs = [{"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                  {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
                  {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
                  {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
                  {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}]
    for ctx in contexts:
        q, kc, vc, t, lens = _paged(batch, [ctx] * batch, hq, hkv, d, page, torch.bfloat16,
                                    seed=ctx, spare=0)
        moved = batch * ctx * hkv * d * 2 * 2 + 2 * q.numel() * 2 + t.numel() * 4
        gbs = lambda ms: moved / ms / 1e6                  # noqa: E731
        ms = _ms(lambda: pd.paged_decode_attention_triton(q, kc, vc, t, lens, SCALE))
        splits = pd.choose_num_splits(batch, hkv, ctx, torch.cuda.get_device_properties(0).multi_processor_count)
        row = {"context": ctx, "batch": batch, "bytes": moved, "default_splits": splits,
               "default_ms": ms, "default_GB_s": gbs(ms), "sweep": []}
        for ns in sorted({1, 2, 4, splits}):
            for cfg in sweep_cfgs:
                try:
                    ms = _ms(lambda: pd.paged_decode_attention_triton(q, kc, vc, t, lens, SCALE,
                                                                      num_splits=ns, config=cfg))
                    row["sweep"].append({"splits": ns, **cfg, "ms": ms, "GB_s": gbs(ms)})
                except Exception as exc:
                    row["sweep"].append({"splits": ns, **cfg,
                                         "error": f"{type(exc).__name__}: {exc}"[:200]})
        ok = [s for s in row["sweep"] if "GB_s" in s]
        if ok:
            best = max(ok, key=lambda s: s["GB_s"])
            row["best"] = best
        if copy_gbs:
            row["default_fraction_of_copy"] = row["default_GB_s"] / copy_gbs
            if ok:
                row["best_fraction_of_copy"] = best["GB_s"] / copy_gbs
        sub = slice(0, 4)
        o = pd.paged_decode_attention_triton(q, kc, vc, t, lens, SCALE)
        r = paged_decode_attention_ref(q[sub], kc, vc, t[sub], lens[sub], SCALE)
        row["rel_err_first4_vs_ref"] = _rel(o[sub], r)
        rows.append(row)
        print(f"decode ctx {ctx} b{batch}: default {row['default_GB_s']:.0f} GB/s "
              f"({row.get('default_fraction_of_copy', 0):.2f} of copy), best "
              f"{row.get('best', {}).get('GB_s', float('nan')):.0f}", flush=True)
        del q, kc, vc, t, lens
        torch.cuda.empty_cache()
    return rows


# -- 5. probe --------------------------------------------------------------------------------

def _probe_cost(launch, probe, rounds: int) -> dict:
    """Probe on vs off for one launch: ``rounds`` alternating ``do_bench`` medians of each
    (adjacent, so clock drift hits both), the overhead as the median of paired ratios."""
    def run(p):
        launch(p)
        if p is not None:
            p.discard()          # keep the slots from filling up: every launch is probed
    offs, ons = [], []
    for _ in range(rounds):
        offs.append(_ms(lambda: run(None)))
        ons.append(_ms(lambda: run(probe)))
    ratios = sorted(on / off for on, off in zip(ons, offs))
    return {"off_ms": statistics.median(offs), "on_ms": statistics.median(ons),
            "overhead": statistics.median(ratios) - 1.0, "overhead_min": ratios[0] - 1.0,
            "overhead_max": ratios[-1] - 1.0, "off_ms_runs": offs, "on_ms_runs": ons,
            "rounds": rounds}


def bench_probe(prefill_cfg: dict, rounds: int = 7) -> dict:
    """The probe's cost on our FlashAttention-2 kernels, at a long-context shape and at the
    shapes of the llama-8b overhead run (short prompts, batch-64 decode)."""
    out = {}
    probe = SmProbe("cuda", capacity_ctas=1 << 20)
    for seq, batch in ((4096, 4), (128, 64)):
        q, k, v, cu, _ = _packed([seq] * batch, [seq] * batch, 32, 8, 128, torch.bfloat16,
                                 seed=3)
        out[f"prefill_{seq}x{batch}"] = _probe_cost(
            lambda p: pf.prefill_attention_triton(q, k, v, cu, cu, seq, seq, SCALE, probe=p,
                                                  config=prefill_cfg), probe, rounds)
    for ctx in (16384, 1024):
        qd, kc, vc, t, lens = _paged(64, [ctx] * 64, 32, 8, 128, 16, torch.bfloat16, seed=5,
                                     spare=0)
        out[f"decode_{ctx}_b64"] = _probe_cost(
            lambda p: pd.paged_decode_attention_triton(qd, kc, vc, t, lens, SCALE, probe=p),
            probe, rounds)
    for key, x in out.items():
        print(f"probe {key}: off {x['off_ms']:.4f} ms, on {x['on_ms']:.4f} ms, "
              f"{100 * x['overhead']:+.2f} % ({100 * x['overhead_min']:+.2f} .. "
              f"{100 * x['overhead_max']:+.2f})", flush=True)
    seq, batch = 4096, 4
    q, k, v, cu, _ = _packed([seq] * batch, [seq] * batch, 32, 32, 128, torch.bfloat16, seed=3)
    qd, kc, vc, t, lens = _paged(64, [16384] * 64, 32, 8, 128, 16, torch.bfloat16, seed=5, spare=0)
    # what the probe saw on one probed prefill + one decode
    host_before = time.time_ns()
    pf.prefill_attention_triton(q, k, v, cu, cu, seq, seq, SCALE, probe=probe, config=prefill_cfg)
    pd.paged_decode_attention_triton(qd, kc, vc, t, lens, SCALE, probe=probe)
    batch_ = probe.end_step(1, 1).wait()
    host_after = time.time_ns()
    facts = launch_facts(batch_)
    dur = batch_.duration_s
    per_sm = {}
    for li, f in enumerate(facts):
        sel = batch_.launch_index == li
        sms = batch_.sm_id[sel]
        p99 = [float(torch.tensor(dur[sel][sms == s]).quantile(0.99)) for s in sorted(set(sms.tolist()))]
        per_sm[f.kernel_name] = {"sm_p99_min_s": min(p99), "sm_p99_median_s": sorted(p99)[len(p99) // 2],
                                 "sm_p99_max_s": max(p99)}
    out["seen"] = {
        "launches": [f.__dict__ for f in facts],
        "sm_id_min": int(batch_.sm_id.min()), "sm_id_max": int(batch_.sm_id.max()),
        "globaltimer_minus_host_ns_at_start": int(batch_.start_ns.min()) - host_before,
        "host_window_ns": host_after - host_before,
        "timer_step_ns_min_nonzero": int(min(x for x in
                                             (batch_.end_ns - batch_.start_ns).tolist() if x > 0)),
        "per_sm_p99": per_sm,
    }
    return out


def _markdown(res: dict) -> str:
    lines = [f"# Attention kernels on {res['device']['name']}", "",
             f"commit `{res['commit']}`, torch {res['device']['torch']}, triton "
             f"{res['device']['triton']}, {res['time_utc']}; medians of triton.testing.do_bench."]
    if "correctness" in res:   # sections left out with --only are left out here too
        lines += ["", "## Correctness (vs float32 torch reference; outputs poisoned with NaN "
                  "first)", "", "| case | rel err | tol | ok |", "|---|---|---|---|"]
        for c in res["correctness"]:
            lines.append(f"| {c['case']} | {c['rel_err']:.2e} | {c['tol']:.0e} | {c['ok']} |")
    if "copy" in res:
        lines += ["", f"Device-to-device copy: **{res['copy']['GB_s']:.0f} GB/s** (read + written)."]
    if "prefill" in res:
        lines += ["", "## Prefill, causal, bf16, hd128, 32 heads (TFLOP/s)", "",
                  "| seq x batch | ours (auto) | SDPA flash | SDPA cuDNN | ours / flash | config |",
                  "|---|---|---|---|---|---|"]
    for r in res.get("prefill", []):
        c = r["auto_config"]
        lines.append(f"| {r['seq']} x {r['batch']} | {r['ours_TFLOPs']:.0f} | "
                     f"{r.get('sdpa_flash_TFLOPs', float('nan')):.0f} | "
                     f"{r.get('sdpa_cudnn_TFLOPs', float('nan')):.0f} | "
                     f"{r.get('ours_over_sdpa_flash', float('nan')):.2f} | "
                     f"M{c['BLOCK_M']} N{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} |")
    if "decode" in res:
        lines += ["", "## Paged decode, batch 64, Hq 32 / Hkv 8, hd128, bf16, page 16 (GB/s)", "",
                  "| context | default | splits | of copy | best sweep | best config |",
                  "|---|---|---|---|---|---|"]
    for r in res.get("decode", []):
        b = r.get("best", {})
        lines.append(f"| {r['context']} | {r['default_GB_s']:.0f} | {r['default_splits']} | "
                     f"{r.get('default_fraction_of_copy', float('nan')):.2f} | "
                     f"{b.get('GB_s', float('nan')):.0f} ({r.get('best_fraction_of_copy', float('nan')):.2f}) | "
                     f"splits {b.get('splits')} N{b.get('BLOCK_N')} w{b.get('num_warps')} "
                     f"s{b.get('num_stages')} |")
    if "probe" in res:
        p = res["probe"]
        lines += ["", "## SM probe overhead (probe on vs off)", "",
                  "| kernel | off ms | on ms | overhead (median of paired rounds) | range |",
                  "|---|---|---|---|---|"]
        for key, x in p.items():
            if key == "seen":
                continue
            rng = (f"{100 * x['overhead_min']:+.2f} .. {100 * x['overhead_max']:+.2f} %"
                   if "overhead_min" in x else "")
            lines.append(f"| {key} | {x['off_ms']:.4f} | {x['on_ms']:.4f} | "
                         f"{100 * x['overhead']:+.2f} % | {rng} |")
        s = p["seen"]
        lines += ["", f"Probe saw SM ids {s['sm_id_min']}..{s['sm_id_max']}; smallest non-zero CTA "
                  f"duration {s['timer_step_ns_min_nonzero']} ns; %globaltimer - host clock at "
                  f"start: {s['globaltimer_minus_host_ns_at_start']} ns."]
        for f in s["launches"]:
            lines.append(f"- {f['kernel_name']}: {f['ctas']} CTAs on {f['sms_used']} SMs, "
                         f"waves {f['waves']}, slowest SM {f['slowest_sm']}, spread "
                         f"{f['cta_spread']:.2f}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--only", choices=("correctness", "copy", "prefill", "decode", "probe"),
                    nargs="*", help="run these sections only (default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    res = {"commit": git_commit(), "time_utc": utc_now(),
           "device": {"name": props.name, "sms": props.multi_processor_count,
                      "torch": torch.__version__, "triton": triton.__version__,
                      "python": platform.python_version()}}
    t0 = time.time()

    def section(name, fn):
        if args.only and name not in args.only:
            return
        # one failing section must not cost the others' device time
        try:
            res[name] = fn()
        except Exception as exc:
            import traceback
            traceback.print_exc()
            res.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:500]

    section("correctness", check_correctness)
    print("correctness:", [(c["case"], round(c["rel_err"], 5), c["ok"])
                           for c in res.get("correctness", [])], flush=True)
    section("copy", copy_bandwidth)
    copy_gbs = res.get("copy", {}).get("GB_s")
    print(f"copy {copy_gbs} GB/s", flush=True)
    shapes = [(64, 2)] if args.quick else [(1024, 16), (4096, 4), (16384, 1)]
    section("prefill", lambda: bench_prefill(shapes))
    contexts = [4096] if args.quick else [4096, 8192, 16384, 32768]
    section("decode", lambda: bench_decode(contexts, batch=8 if args.quick else 64,
                                           copy_gbs=copy_gbs))
    prefill_rows = res.get("prefill") or [{"seq": 0, "auto_config": pf._configs()[0]}]
    best_cfg = next((r["auto_config"] for r in prefill_rows if r["seq"] == 4096),
                    prefill_rows[0]["auto_config"])
    section("probe", lambda: bench_probe(best_cfg))
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = props.name.replace(" ", "-").lower() + "-" + res["commit"][:8]
    if args.only:
        tag += "-" + "-".join(args.only)
    (out / f"kernels-{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    try:
        md = _markdown(res)
    except Exception as exc:   # a missing section: the JSON still has everything else
        md = f"markdown failed: {exc}; errors: {res.get('errors')}"
    (out / f"kernels-{tag}.md").write_text(md)
    print(md)
    ok = all(c["ok"] for c in res.get("correctness", [])) and not res.get("errors")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
