"""Per-SM contention: which SMs of one kernel ran slower, or fewer CTAs, than their peers.

Two tests per (kernel, slot), each SM against the kernel's other SMs in that slot:
* slow: its CTAs above the others' P90 number at most Binomial(n, p) if nothing is wrong (p:
  0.1 or its own usual rate); flagged when the bound is under ``alpha / SMs``, >= ``slow_share``
  (x p / 0.1) exceeded, its P90 >= ``slow_factor`` x the others', 90 % are wide CTAs and it was
  dealt ``SLOW_MIN_DEALT`` of the mean or more.
* starved: its CTAs against the GPU's deal (semconv.METRIC_CTA_DEALT) at the free SMs' rate
  (upper quartile, if >= 1.1x the mean), else 1/S of wide launches' CTAs; flagged when the lower
  tail's bound is under ``alpha / SMs`` and it ran under ``starve_ratio`` of that (and under
  ``DEAL_KEPT`` of the deal's own). Without the deal, an SM under that line in most quiet slots
  is held to ``usual_starve_ratio`` of its lowest share; none is tested before 4 such slots exist.
Guarantee: tails are Chernoff bounds (>= the exact binomial tail): a slot flags an SM by
chance with probability <= alpha. Score: max(own P90 / others' P90, expected / own CTAs, at
most 100). Cost: a cumulative sum over [SMs, buckets], then O(SMs); usual shares O(slots x SMs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..instrumentation import bucket_point
from .aggregation_config import REFERENCE_QUANTILE, ContentionConfig

# a score says at most "ran 1/100 of its share": beyond that the number means nothing more
MAX_STARVE_FACTOR = 100.0
# the slow test runs on slots whose CTAs came at least this much from wide launches
WIDE_SHARE_FOR_SLOW = 0.9
# the starved test's reference rate: this quantile of the SMs' CTAs over their dealt share
# (a neighbour on up to half the SMs leaves it at the others' rate)
UNCONTENDED_RATE_QUANTILE = 0.75
UNCONTENDED_RATE_MIN = 1.1   # under it the slot's own mean stands (a quiet slot's spread)
# the slow test reads an SM the deal gives at least this share of the SMs' mean: one dealt
# fewer gets CTAs from the slot's largest launches only (the end of the dispatch order), the
# same long work launch after launch, so its durations speak of those launches, not of it
SLOW_MIN_DEALT = 0.25
# an SM that ran at least this share of what the deal alone gives it lost nothing to a
# neighbour, whatever the free SMs' rate: the dispatch hands a held SM's CTAs to some SMs
# only (the next in its order), and those set the upper quartile above the rest
DEAL_KEPT = 0.9

__all__ = ["REFERENCE_QUANTILE", "ContentionConfig", "HotspotSummary", "SlotContention", "SlotEvidence",
           "ContendedSm", "assess", "binomial_tail_bound", "contended_sms", "hotspots", "hottest_sm",
           "slot_evidence"]


def _kl(a: np.ndarray, p: float | np.ndarray) -> np.ndarray:
    """KL(Bernoulli(a) || Bernoulli(p)) elementwise, with 0 log 0 = 0."""
    a = np.clip(a, 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        left = np.where(a > 0, a * np.log(a / p), 0.0)
        right = np.where(a < 1, (1 - a) * np.log((1 - a) / (1 - p)), 0.0)
    return left + right


def binomial_tail_bound(k, n, p: float, upper: bool) -> np.ndarray:
    """Upper bound on P(X >= k) (``upper``) or P(X <= k) of X ~ Binomial(n, p): the
    Chernoff-Hoeffding bound exp(-n KL(k/n || p)) beyond the mean, 1 on the mean's side."""
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(n > 0, k / np.maximum(n, 1), p)
    beyond = a > p if upper else a < p
    return np.where(beyond & (n > 0), np.exp(-n * _kl(a, p)), 1.0)


@dataclass
class SlotEvidence:
    """What the tests read of one slot, per SM row: kept for slots whose buckets are let go."""

    ctas: np.ndarray  # int64
    exceed: np.ndarray  # int64: CTAs above the other SMs' reference quantile
    own_q: np.ndarray  # its own reference quantile (NaN: no CTAs)
    others_q: np.ndarray  # the other SMs' (NaN: they ran none)
    # the slot's CTAs from launches wide enough to cover every SM (semconv.METRIC_CTA_WIDE);
    # None: the producer did not say, and every launch is taken to be wide
    wide_ctas: int | None = None
    # [3, SMs], over other quiet slots (collector/sm_blocks.py): each SM's median and lowest
    # share of the kernel's CTAs, and its median share above the others' P90; None: not known
    usual_shares: np.ndarray | None = None
    # per SM: the CTAs the GPU's dispatch order dealt it (semconv.METRIC_CTA_DEALT); None:
    # the producer did not say
    dealt: np.ndarray | None = None

def _leave_one_out(values: np.ndarray, reduce) -> np.ndarray:
    """Per row: ``reduce`` (np.minimum or np.maximum) over every other row's value."""
    n = values.size
    if n < 2:
        return np.full(n, np.inf if reduce is np.minimum else -np.inf)
    before = reduce.accumulate(values)
    after = reduce.accumulate(values[::-1])[::-1]
    out = np.empty(n)
    out[0], out[-1] = after[1], before[-2]
    out[1:-1] = reduce(before[:-2], after[2:])
    return out


def slot_evidence(scale: int, offset: int, counts: np.ndarray, zeros: np.ndarray, minimum: np.ndarray,
                  maximum: np.ndarray, own_q: np.ndarray, q: float = REFERENCE_QUANTILE) -> SlotEvidence:
    """Per row of ``counts`` [SMs, buckets] (bucket ``offset + j`` at ``scale``; ``zeros``:
    CTAs of duration 0; ``minimum``/``maximum``: each row's extremes): the CTAs above the other
    rows' ``q``-quantile bucket (ties, CTAs in that bucket, count as not above: the test stays
    conservative), and that quantile as ``quantiles`` would estimate it (kept within the other
    rows' extremes). ``own_q``: each row's own quantile, as the caller estimates it."""
    counts = counts.astype(np.int64, copy=False)
    zeros = zeros.astype(np.int64, copy=False)
    own = counts.sum(axis=1) + zeros
    rows, width = counts.shape
    others_q = np.full(rows, np.nan)
    exceed = np.zeros(rows, dtype=np.int64)
    if width and rows:
        others = counts.sum(axis=0)[None, :] - counts  # [SMs, buckets]: every other SM's CTAs
        others_zero = zeros.sum() - zeros
        others_n = own.sum() - own
        cumulative = np.cumsum(others, axis=1) + others_zero[:, None]
        rank = np.maximum(1, np.ceil(q * others_n)).astype(np.int64)
        at = np.minimum(np.argmax(cumulative >= rank[:, None], axis=1), width - 1)
        in_zero = rank <= others_zero  # the reference is a zero duration: every non-zero CTA exceeds it
        above = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1]  # CTAs in bucket j or above
        exceed = np.where(at + 1 < width, above[np.arange(rows), np.minimum(at + 1, width - 1)], 0)
        exceed = np.where(in_zero, own - zeros, exceed)
        estimate = np.clip(bucket_point(scale, offset + at), _leave_one_out(np.asarray(minimum, float), np.minimum),
                           _leave_one_out(np.asarray(maximum, float), np.maximum))
        others_q = np.where(others_n > 0, np.where(in_zero, 0.0, estimate), np.nan)
    return SlotEvidence(own, exceed.astype(np.int64), np.asarray(own_q, dtype=np.float64), others_q)


@dataclass
class SlotContention:
    """The tests' answers for one (kernel, slot), per SM (``sms``, in the evidence's order
    plus the GPU's SMs that ran none, appended)."""

    sms: list[str]
    ctas: np.ndarray
    expected_ctas: float | None  # per SM: the slot's wide-launch CTAs over the SM count (None: not tested)
    exceed_share: np.ndarray  # share of its CTAs above the others' P90 (NaN: none)
    slow_bound: np.ndarray  # bound on the chance of so many exceeding with nothing wrong
    starve_bound: np.ndarray
    slow: np.ndarray  # bool
    starved: np.ndarray  # bool
    score: np.ndarray  # max(own P90 / others' P90, expected / own CTAs <= 100); NaN when neither is known
    p90_s: np.ndarray  # its own CTA P90 (NaN: no CTAs)

    @property
    def flagged(self) -> np.ndarray:
        return self.slow | self.starved

    def reasons(self, i: int) -> list[str]:
        return [name for name, hit in (("slow", self.slow[i]), ("starved", self.starved[i])) if hit]


def assess(sms: list[str], evidence: SlotEvidence, num_sms: int, config: ContentionConfig) -> SlotContention:
    """Both tests over one slot's ``evidence`` (rows named ``sms``). SMs ``0..num_sms-1``
    missing from ``sms`` ran no CTA: they are appended with zero counts."""
    names = list(sms)
    known = set(names)
    missing = [str(i) for i in range(num_sms) if str(i) not in known]
    pad = len(missing)
    ctas = np.concatenate([evidence.ctas, np.zeros(pad, dtype=np.int64)])
    exceed = np.concatenate([evidence.exceed, np.zeros(pad, dtype=np.int64)])
    own_q = np.concatenate([evidence.own_q, np.full(pad, np.nan)])
    others_q = np.concatenate([evidence.others_q, np.full(pad, np.nan)])
    names += missing
    level = config.alpha / max(len(names), 1)
    total = int(ctas.sum())
    # CTAs the block scheduler had to spread over every SM: only these give an SM a share
    # it should get (launches narrower than the GPU leave SMs out by the scheduler's choice)
    wide = total if evidence.wide_ctas is None else min(total, evidence.wide_ctas)
    null_share = 1.0 - REFERENCE_QUANTILE
    with np.errstate(divide="ignore", invalid="ignore"):
        exceed_share = np.where(ctas > 0, exceed / np.maximum(ctas, 1), np.nan)
        # an SM whose CTAs usually run long (the same work on it launch after launch) is held
        # to its own usual rate, and its effect floor rises with it
        null = np.full(len(names), null_share)
        if evidence.usual_shares is not None:
            usual_exceed = np.concatenate([evidence.usual_shares[2], np.full(pad, np.nan)])
            null = np.fmax(null, np.minimum(usual_exceed, 0.99))
        slow_bound = binomial_tail_bound(exceed, ctas, null, upper=True)
        slow_factor = np.where((others_q > 0) & (own_q > 0), own_q / others_q, np.nan)
        # narrow launches place the same CTA (a long sequence's, say) on the same SMs launch
        # after launch: their durations say nothing of the SM, so the test needs wide ones
        slow = ((slow_bound <= level) & (exceed_share >= config.slow_share * null / null_share)
                & ~np.isnan(others_q) & (wide >= WIDE_SHARE_FOR_SLOW * total)
                & ~(slow_factor < config.slow_factor))
    expected = wide / num_sms if num_sms >= 2 and wide > 0 else None
    dealt = None if evidence.dealt is None else np.concatenate([evidence.dealt, np.zeros(pad, dtype=np.int64)])
    if dealt is not None and dealt.sum() > 0:
        # likewise an SM late in the dispatch order, dealt CTAs only by the slot's largest launches
        slow &= dealt >= SLOW_MIN_DEALT * dealt.sum() / len(names)
    learning = (evidence.usual_shares is not None and np.isnan(evidence.usual_shares[0]).all()
                and not config.starve_before_usual)
    if dealt is not None and dealt.sum() > 0 and total > 0:
        # the scheduler's own deal of these CTAs: SMs it leaves short, launch after launch,
        # are held to that, and every CTA counts, whatever its launch's size
        share = dealt_share = dealt / dealt.sum()
        # what an SM runs with nothing on it: the upper quartile of the SMs' rates against the
        # deal (SMs a neighbour holds pull the slot's mean down, and every SM's due with it)
        dealt_to = dealt > 0
        rate = float(np.quantile(ctas[dealt_to] / (total * share[dealt_to]), UNCONTENDED_RATE_QUANTILE))
        share = np.minimum(share * (rate if rate >= UNCONTENDED_RATE_MIN else 1.0), 1.0)
        due = total * share
        expected = total / max(num_sms, 1)
        starve_bound = binomial_tail_bound(ctas, total, share, upper=False)
        starved = ((starve_bound <= level) & (ctas < config.starve_ratio * due)
                   & (ctas < DEAL_KEPT * total * dealt_share))
        with np.errstate(divide="ignore", invalid="ignore"):
            starve_factor = np.where(due > 0, np.minimum(due / np.maximum(ctas, 1), MAX_STARVE_FACTOR), np.nan)
    elif expected is not None and not learning:
        share = np.full(len(names), 1.0 / num_sms)
        ratio = np.full(len(names), config.starve_ratio)
        if evidence.usual_shares is not None and not np.isnan(evidence.usual_shares[0]).all():
            # an SM the block scheduler gives fewer CTAs in most slots (its median share under
            # the starved line; how the GPU's SMs sit in its clusters, launch after launch) is
            # held to its own lowest share instead: what it always does is not contention
            median, lowest = (np.concatenate([row, np.zeros(pad)]) for row in evidence.usual_shares[:2])
            structural = median < config.starve_ratio / num_sms
            share = np.where(structural, np.minimum(lowest, share), share)
            ratio = np.where(structural, config.usual_starve_ratio, config.starve_ratio)
        # its CTAs are at least its wide ones: P(ctas <= k) <= P(Binomial(wide, share) <= k)
        starve_bound = binomial_tail_bound(ctas, wide, share, upper=False)
        starved = (starve_bound <= level) & (ctas < ratio * wide * share)
        starve_factor = np.minimum(wide * share / np.maximum(ctas, 1), MAX_STARVE_FACTOR)
    else:
        starve_bound = np.ones(len(names))
        starved = np.zeros(len(names), dtype=bool)
        starve_factor = np.full(len(names), np.nan)
    score = np.fmax(slow_factor, starve_factor)
    return SlotContention(names, ctas, expected, exceed_share, slow_bound, starve_bound, slow, starved, score, own_q)


@dataclass
class ContendedSm:
    """An SM flagged in at least one slot of a window."""

    sm: str
    score: float | None  # the largest score of the slots it was flagged in
    reasons: tuple[str, ...]  # "slow" and/or "starved", over those slots
    slots_flagged: int
    slots: int  # slots of the window with CTAs of the kernel


def contended_sms(slots: list[SlotContention]) -> dict[str, ContendedSm]:
    """Per SM flagged in any of ``slots``: its largest score, reasons and how many slots
    flagged it. Each slot keeps its own bound (alpha), so over k slots at most k * alpha."""
    out: dict[str, ContendedSm] = {}
    for slot in slots:
        for i in np.flatnonzero(slot.flagged).tolist():
            sm, score = slot.sms[i], float(slot.score[i])
            score = score if math.isfinite(score) else None
            found = out.get(sm)
            if found is None:
                out[sm] = ContendedSm(sm, score, tuple(slot.reasons(i)), 1, len(slots))
            else:
                found.slots_flagged += 1
                found.reasons = tuple(r for r in ("slow", "starved") if r in found.reasons or r in slot.reasons(i))
                if score is not None and (found.score is None or score > found.score):
                    found.score = score
    return dict(sorted(out.items(), key=lambda kv: (-(kv[1].score or 0.0), kv[0])))


# -- the P99 hotspot ratio ------------------------------------------------------------------
@dataclass
class HotspotSummary:
    """An SM's hotspot score is its P99 CTA duration over the median of all SMs' P99s; the
    ratio is the largest score, the hottest SM the one with it (ties: the larger label)."""

    scores: dict[str, float]
    p99_s: dict[str, float]
    median_p99_s: float | None
    ratio: float | None
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
