"""Before a recording: do FlashAttention-2 CTAs share an SM with the noisy neighbour, and how
much slower do they run there? Measured for a few neighbour variants; the recorder keeps one.

For each variant, the neighbour (bench/noisy_neighbour.py) holds its target SMs while the
engine's FA2 prefill kernel runs ``launches`` times with the SM probe on (Llama-8B heads:
32 query, 8 key/value, head dim 128, bf16, ``batch`` causal sequences of ``seq`` tokens);
the same launches also run once without a neighbour. Reported per run: FA2 CTAs on the SMs
the neighbour held against the others (their share, and the share an even spread would
give), the median over SMs of each SM's P99 and median CTA duration as held/others ratios,
the share of FA2 CTAs that started while the neighbour ran, and the wall time. Guarantee:
every figure comes from the CTAs' own ``%smid`` and ``%globaltimer`` records (fake ones
under ``TRITON_INTERPRET=1``, marked).
Cost: per variant about ``neighbour_s`` seconds plus the neighbour kernel's compilation.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .noisy_neighbour import NeighbourConfig, NoisyNeighbour

__all__ = ["CalibrationRun", "calibrate", "choose", "parse_variants", "split_by_sms"]


@dataclass(frozen=True)
class CalibrationRun:
    """One FA2 measurement, with a neighbour variant (``warps`` > 0) or without (baseline)."""

    warps: int                      # 0: no neighbour
    carveout: str                   # as set on the neighbour kernel (or why not)
    held_sms: tuple[int, ...]       # SMs the neighbour held for at least half its run
    ctas_held: int                  # FA2 CTAs on those SMs
    ctas_other: int
    held_share: float | None        # ctas_held / all FA2 CTAs
    even_share: float               # len(held_sms) / SMs of the device
    p99_ratio: float | None         # median SM P99 on held SMs / on the others
    median_ratio: float | None      # median SM median CTA duration, held / others
    wall_s: float                   # the FA2 launches, first launch to records on the host
    overlap: float | None           # share of FA2 CTAs that started while the neighbour ran
    fake: bool

    def to_dict(self) -> dict:
        return asdict(self)


def parse_variants(text: str) -> list[tuple[int, str]]:
    """``"8:max_shared,4:default"`` as [(warps, carveout)]; ValueError naming a bad one."""
    out = []
    for part in text.split(","):
        try:
            warps, carveout = part.split(":")
            NeighbourConfig((0,), warps=int(warps), carveout=carveout)
        except ValueError as exc:
            raise ValueError(f"neighbour variant {part!r}: expected WARPS:CARVEOUT, "
                             f"e.g. 8:max_shared ({exc})") from None
        out.append((int(warps), carveout))
    return out


def split_by_sms(sm_id: np.ndarray, duration_s: np.ndarray, held: tuple[int, ...], num_sms: int) -> dict:
    """CTA counts and per-SM duration statistics on the ``held`` SMs against the others."""
    held_mask = np.zeros(max(num_sms, int(sm_id.max(initial=0)) + 1), dtype=bool)
    held_mask[list(held)] = True

    def per_sm(select: np.ndarray) -> tuple[int, float | None, float | None]:
        ids, durs = sm_id[select], duration_s[select]
        if ids.size == 0:
            return 0, None, None
        order = np.argsort(ids, kind="stable")
        ids, durs = ids[order], durs[order]
        bounds = np.flatnonzero(np.diff(ids)) + 1
        groups = np.split(durs, bounds)
        return (int(ids.size), float(np.median([np.percentile(g, 99) for g in groups])),
                float(np.median([np.median(g) for g in groups])))

    on_held = held_mask[sm_id]
    n_held, p99_held, med_held = per_sm(on_held)
    n_other, p99_other, med_other = per_sm(~on_held)
    total = n_held + n_other
    return {"ctas_held": n_held, "ctas_other": n_other,
            "held_share": n_held / total if total else None, "even_share": len(held) / num_sms,
            "p99_ratio": p99_held / p99_other if p99_held and p99_other else None,
            "median_ratio": med_held / med_other if med_held and med_other else None}


class _Fa2Workload:
    """The FA2 prefill launches, on tensors allocated once."""

    def __init__(self, device: torch.device, seq: int, batch: int, heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(1)
        tokens = seq * batch
        self.q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(device)   # [T, Hq, D]
        self.k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)  # [T, Hkv, D]
        self.v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        self.cu = torch.arange(0, tokens + 1, seq, dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)
        self.seq, self.scale = seq, head_dim ** -0.5

    def __call__(self, probe) -> None:
        from sightline.engine.kernels.prefill_attention import prefill_attention_triton

        prefill_attention_triton(self.q, self.k, self.v, self.cu, self.cu, self.seq, self.seq, self.scale,
                                 probe=probe, out=self.out)


def _run_fa2(workload: _Fa2Workload, probe, launches: int):
    """The FA2 launches with the probe on: their CTA records and the wall time they took."""
    t0 = time.perf_counter()
    for _ in range(launches):
        workload(probe)
    pending = probe.end_step()
    batch = pending.wait() if pending is not None else None
    if batch is None or batch.num_ctas == 0:
        raise RuntimeError("the FA2 launches recorded no CTAs (probe full or off)")
    return batch, time.perf_counter() - t0


def _result(batch, wall_s: float, held: tuple[int, ...], num_sms: int, warps: int, carveout: str,
            span: tuple[int, int] | None = None) -> CalibrationRun:
    stats = split_by_sms(batch.sm_id, batch.duration_s, held, num_sms)
    overlap = (None if span is None else
               float(np.mean((batch.start_ns >= span[0]) & (batch.start_ns <= span[1]))))
    return CalibrationRun(warps, carveout, tuple(held), wall_s=wall_s, overlap=overlap, fake=batch.fake, **stats)


def calibrate(device: torch.device, target_sms: tuple[int, ...], variants: list[tuple[int, str]],
              launches: int = 200, neighbour_s: float = 1.0, settle_s: float = 0.1, seq: int = 2048,
              batch: int = 2, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
              dtype: torch.dtype = torch.bfloat16, slice_s: float = 0.25) -> list[CalibrationRun]:
    """The baseline run (no neighbour, split by ``target_sms``) then one run per variant,
    each split by the SMs that neighbour really held."""
    from sightline.instrumentation.sm_probe import SmProbe

    workload = _Fa2Workload(device, seq, batch, heads, kv_heads, head_dim, dtype)
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8)
    workload(None)  # compiles FA2 for these shapes before anything is timed
    # Allocated before any neighbour runs: an allocation while it runs may wait for it to end.
    # An upper bound on CTAs per launch: query blocks are at least 16 rows.
    probe = SmProbe(device, capacity_ctas=launches * heads * batch * (seq // 16 + 1))
    cta_batch, wall_s = _run_fa2(workload, probe, launches)
    runs = [_result(cta_batch, wall_s, target_sms, num_sms, 0, "-")]
    for warps, carveout in variants:
        neighbour = NoisyNeighbour(NeighbourConfig(target_sms, warps=warps, carveout=carveout, slice_s=slice_s,
                                                   max_duration_s=max(neighbour_s, slice_s)), device)
        neighbour.run(0.0)  # compiles it (and sets its carveout) before the measurement
        try:
            if neighbour.fake:  # the interpreter is not thread-safe: one after the other (fake figures)
                held = neighbour.run(neighbour_s)
                cta_batch, wall_s = _run_fa2(workload, probe, launches)
            else:
                neighbour.start(neighbour_s)
                time.sleep(settle_s)
                try:
                    cta_batch, wall_s = _run_fa2(workload, probe, launches)
                finally:
                    held = neighbour.join(timeout_s=neighbour_s + 60)
        except RuntimeError as exc:  # e.g. it held no target SM: said in the run, the next variant goes on
            runs.append(CalibrationRun(warps, f"{neighbour.carveout}; failed: {exc}", (), 0, 0, None, 0.0,
                                       None, None, 0.0, None, neighbour.fake))
            continue
        runs.append(_result(cta_batch, wall_s, held.sms, num_sms, warps, neighbour.carveout,
                            (held.start_ns, held.end_ns)))
    return runs


def choose(runs: list[CalibrationRun], min_share_of_even: float = 0.25) -> int | None:
    """Index of the neighbour run that slowed FA2 CTAs most on its SMs while they still ran
    there (held share at least ``min_share_of_even`` of an even spread); None if none did."""
    best, best_ratio = None, 0.0
    for i, run in enumerate(runs):
        if run.warps == 0 or run.held_share is None or run.p99_ratio is None:
            continue
        if run.held_share >= min_share_of_even * run.even_share and run.p99_ratio > best_ratio:
            best, best_ratio = i, run.p99_ratio
    return best
