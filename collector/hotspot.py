"""The per-SM hotspot score, computed one way for the exposition, heatmaps and explain.

An SM's score is its P99 CTA duration over the median of all SMs' P99s; a kernel's
hotspot ratio is the largest score, and its hottest SM the SM with that score (ties: the
larger SM label). Exact arithmetic on the P99s it is given; O(SMs log SMs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["HotspotSummary", "hotspots"]


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
    if not p99:
        return HotspotSummary({}, {}, None, None, None)
    median = float(np.median(list(p99.values())))
    if median <= 0:
        return HotspotSummary({sm: math.nan for sm in p99}, p99, median, None, None)
    scores = {sm: v / median for sm, v in p99.items()}
    hottest = max(scores, key=lambda sm: (scores[sm], sm))
    return HotspotSummary(scores, p99, median, scores[hottest], hottest)
