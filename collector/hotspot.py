"""The per-SM hotspot score, computed one way for the exposition, heatmaps and explain.

An SM's score is its P99 CTA duration over the median of all SMs' P99s; a kernel's
hotspot ratio is the largest score, and its hottest SM the SM with that score (ties: the
larger SM label). Exact arithmetic on the P99s it is given; O(SMs log SMs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["HotspotSummary", "hotspots", "hottest_sm"]


@dataclass
class HotspotSummary:
    scores: dict[str, float]  # SM -> P99 / median SM P99
    p99_s: dict[str, float]  # SM -> P99
    median_p99_s: float | None
    ratio: float | None  # the largest score
    hottest_sm: str | None


def hotspots(p99_s: dict[str, float]) -> HotspotSummary:
    """Scores of the SMs in ``p99_s`` (NaN P99s, SMs that ran nothing, are left out)."""
    p99 = {sm: float(v) for sm, v in p99_s.items() if not math.isnan(v)}
    median, ratio, hottest = hottest_sm(list(p99), np.fromiter(p99.values(), float, len(p99)))
    if median is None:
        return HotspotSummary({}, {}, None, None, None)
    if median <= 0:
        return HotspotSummary({sm: math.nan for sm in p99}, p99, median, None, None)
    return HotspotSummary({sm: v / median for sm, v in p99.items()}, p99, median, ratio, hottest)


def hottest_sm(sms: list[str], p99_s: np.ndarray) -> tuple[float | None, float | None, str | None]:
    """(median SM P99, hotspot ratio, hottest SM) of ``p99_s`` [SMs] (NaN: left out), in one
    pass over the array: what :func:`hotspots` answers, without a score per SM."""
    valid = ~np.isnan(p99_s)
    if not valid.any():
        return None, None, None
    p99 = p99_s[valid]
    median = float(np.median(p99))
    if median <= 0:
        return median, None, None
    scores = p99 / median
    ratio = float(scores.max())
    ties = np.flatnonzero(valid)[scores == ratio]
    return median, ratio, max(sms[i] for i in ties.tolist())
