"""Several ``bench.overhead_http`` runs pooled: each level's paired burst ratios against
``off`` from every run, their median and a 95 % interval for that median.

    python -m bench.overhead_pool bench/results/overhead_http-nvidia-h200-{a,b,c}.json

One run's median of 36 paired bursts moves by a percent or two from run to run (the bursts
are half a second each); pooling runs of the same method narrows that. The interval is the
distribution-free one for a median (order statistics of a binomial(n, 1/2) count, normal
approximation), so it assumes nothing about the shape of the ratios. Runs are pooled as
given: pass runs of one commit, or of commits whose telemetry code is the same.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def paired_ratios(run: dict, concurrency: int | None = None) -> dict[str, list[float]]:
    """Per level: each round's burst tokens/s over ``off``'s burst tokens/s in that round
    (at ``concurrency``, for runs of several; rounds of different ones are never paired)."""
    rate: dict[tuple, dict[str, float]] = {}
    for burst in run["bursts"]:
        if concurrency is not None and burst.get("concurrency") != concurrency:
            continue
        rate.setdefault((burst.get("concurrency"), burst["round"]), {})[burst["level"]] = (
            burst["output_tokens"] / burst["wall_s"])
    ratios: dict[str, list[float]] = {}
    for levels in rate.values():
        for level, value in levels.items():
            if "off" in levels:
                ratios.setdefault(level, []).append(value / levels["off"])
    return ratios


def median_interval(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """The distribution-free ~95 % interval for the median of ``values``."""
    ordered = sorted(values)
    n = len(ordered)
    half_width = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half_width) - 1)
    hi = min(n - 1, math.ceil(n / 2 + half_width))
    return ordered[lo], ordered[hi]


def pool(runs: list[dict], concurrency: int | None = None) -> dict[str, dict]:
    pooled: dict[str, list[float]] = {}
    for run in runs:
        for level, ratios in paired_ratios(run, concurrency).items():
            pooled.setdefault(level, []).extend(ratios)
    return {level: {"bursts": len(r), "median": statistics.median(r), "interval_95": median_interval(r)}
            for level, r in pooled.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="overhead_http JSON files")
    args = ap.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.runs]
    print(f"{len(runs)} runs: " + ", ".join(f"{r['commit'][:8]}" for r in runs))
    found = sorted({b.get("concurrency") for r in runs for b in r["bursts"]}, key=lambda c: c or 0)
    for concurrency in found:
        if len(found) > 1:
            print(f"\nconcurrency {concurrency}:")
        print("| level | paired bursts | median vs off | 95 % interval of the median |")
        print("|---|---|---|---|")
        for level, s in pool(runs, concurrency).items():
            lo, hi = s["interval_95"]
            print(f"| {level} | {s['bursts']} | {s['median']:.3f} | [{lo:.3f}, {hi:.3f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
