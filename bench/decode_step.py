"""Where a batch-64 decode step's GPU time goes, part by part, next to each part's floor.

A diagnosis for the engine's decode step (llama-8b shape, bf16): every weight GEMM at the
step's batch (``F.linear``, and the same product on a pre-transposed weight, which makes
cuBLAS pick other kernels), paged decode attention at the step's short contexts over a
sweep of tile configs, and the greedy argmax over the logits (float32, bf16, and a chunked
two-pass bf16 form). Each time is a ``triton.testing.do_bench`` median; each part's floor
is its bytes read at the device-to-device copy bandwidth measured in the same run.
Cost: about a minute on an H200; writes ``decode_step-<device>-<commit>.json`` to ``--out``.

    python -m bench.decode_step --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sightline.engine.kernels import paged_decode_attention as pd

from ._common import device_name, git_commit, utc_now
from .engine_throughput import copy_bandwidth

# llama-8b: hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128, vocab 128256
GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
         "down": (4096, 14336), "lm_head": (128256, 4096)}
DECODE_CONFIGS = [{"BLOCK_N": n, "num_warps": w, "num_stages": s}
                  for n, w, s in ((64, 4, 3), (32, 4, 3), (32, 2, 3), (16, 2, 2), (64, 4, 2),
                                  (32, 4, 2), (128, 4, 2), (64, 2, 3))]


def _us(fn) -> float:
    return do_bench(fn, warmup=25, rep=100) * 1e3


def gemms(batch: int, copy_bps: float) -> list[dict]:
    rows = []
    for name, (n, k) in GEMMS.items():
        x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
        wt = w.t().contiguous()   # [K, N]
        floor_us = n * k * 2 / copy_bps * 1e6
        row = {"gemm": name, "n": n, "k": k, "floor_us": round(floor_us, 2)}
        for variant, fn in (("linear", lambda: F.linear(x, w)), ("transposed", lambda: x @ wt)):
            us = _us(fn)
            row[variant] = {"us": round(us, 2), "x_floor": round(us / floor_us, 3)}
        rows.append(row)
        del x, w, wt
    torch.cuda.empty_cache()
    return rows


def paged_decode(batch: int, contexts: list[int], copy_bps: float) -> list[dict]:
    hq, hkv, d, page = 32, 8, 128, 16
    rows = []
    for ctx in contexts:
        blocks_per_seq = -(-ctx // page)
        kc = torch.randn(batch * blocks_per_seq, page, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(batch * blocks_per_seq, device="cuda", dtype=torch.int32).view(
            batch, blocks_per_seq)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        floor_us = batch * ctx * hkv * d * 2 * 2 / copy_bps * 1e6
        scale = 1.0 / math.sqrt(d)
        row = {"context": ctx, "floor_us": round(floor_us, 2),
               "default_us": round(_us(lambda: pd.paged_decode_attention_triton(
                   q, kc, vc, tables, lens, scale)), 2), "sweep": []}
        for cfg in DECODE_CONFIGS:
            try:
                us = _us(lambda: pd.paged_decode_attention_triton(q, kc, vc, tables, lens, scale,
                                                                  num_splits=1, config=cfg))
                row["sweep"].append({**cfg, "us": round(us, 2)})
            except Exception as exc:   # a config Triton refuses: recorded, not fatal
                row["sweep"].append({**cfg, "error": f"{type(exc).__name__}: {exc}"[:160]})
        rows.append(row)
    return rows


def chunked_argmax(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """First index of each row's maximum, in two passes over ``chunk``-wide pieces."""
    s, v = logits.shape
    values, within = logits.view(s, v // chunk, chunk).max(dim=-1)
    best = values.argmax(dim=-1)
    return best * chunk + within.gather(1, best[:, None]).squeeze(1)


def argmax(batch: int, vocab: int = 128256, chunk: int = 768) -> dict:
    bf16 = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16)
    fp32 = bf16.float()
    same = bool(torch.equal(chunked_argmax(bf16, chunk), fp32.argmax(dim=-1)))
    return {"fp32_argmax_us": round(_us(lambda: fp32.argmax(dim=-1)), 2),
            "cast_then_argmax_us": round(_us(lambda: bf16.float().argmax(dim=-1)), 2),
            "bf16_argmax_us": round(_us(lambda: bf16.argmax(dim=-1)), 2),
            "bf16_chunked_us": round(_us(lambda: chunked_argmax(bf16, chunk)), 2),
            "chunked_equals_argmax": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="128,160,192,256")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decode_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_bps = copy_bandwidth(torch.device("cuda"))
    res = {"bench": "decode_step", "commit": git_commit(), "device": device_name("cuda"),
           "time": utc_now(), "batch": args.batch, "copy_bytes_per_s": round(copy_bps)}
    contexts = [int(c) for c in args.contexts.split(",")]
    for name, part in (("gemms", lambda: gemms(args.batch, copy_bps)),
                       ("paged_decode", lambda: paged_decode(args.batch, contexts, copy_bps)),
                       ("argmax", lambda: argmax(args.batch))):
        try:   # one failing part must not cost the others' device time
            res[name] = part()
        except Exception as exc:
            res.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
    text = json.dumps(res, indent=1)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = res["device"].replace(" ", "-").lower() + "-" + res["commit"][:8]
    (args.out / f"decode_step-{tag}.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
