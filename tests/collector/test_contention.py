"""collector/contention.py: the per-SM contention tests, their small-count behaviour, the
false-flag bound they state, and how the per-SM store feeds them (wide-launch counts)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sightline.collector import contention
from sightline.collector.aggregation_config import ContentionConfig
from sightline.collector.contention import (SlotEvidence, assess, binomial_tail_bound, contended_sms,
                                            slot_evidence)
from sightline.collector.sm_store import GpuKey, SmKey
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.exphist import ExpHistogram, quantiles
from tests.collector.otlp_builders import T0_S, make_aggregator, otlp_attrs, otlp_cta_point, otlp_metrics

SCALE = 6


def exact_tail(k: int, n: int, p: float, upper: bool) -> float:
    terms = range(k, n + 1) if upper else range(0, k + 1)
    return sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in terms)


def test_the_tail_bound_is_never_below_the_exact_binomial_tail():
    for n in (1, 3, 10, 40, 150):
        for p in (0.1, 1 / 132, 0.5):
            for k in range(n + 1):
                for upper in (True, False):
                    bound = float(binomial_tail_bound(k, n, p, upper))
                    assert exact_tail(k, n, p, upper) <= bound * (1 + 1e-9) + 1e-300, (k, n, p, upper)
                    assert bound <= 1.0
    # on the mean's side the bound says nothing; far beyond it, it is small
    assert binomial_tail_bound(1, 10, 0.1, upper=True) == 1.0
    assert float(binomial_tail_bound(10, 10, 0.1, upper=True)) == pytest.approx(1e-10)


def evidence_of(durations: dict[int, np.ndarray]) -> tuple[list[str], SlotEvidence]:
    """A slot's evidence from exact CTA durations per SM (one shared bucket grid)."""
    hists = {sm: ExpHistogram(scale=SCALE) for sm in durations}
    for sm, values in durations.items():
        hists[sm].record(np.asarray(values, dtype=np.float64))
    with_buckets = [h for h in hists.values() if h.counts.size]
    lo = min(h.offset for h in with_buckets)
    hi = max(h.offset + h.counts.size for h in with_buckets)
    counts = np.zeros((len(hists), hi - lo), dtype=np.int64)
    for r, h in enumerate(hists.values()):
        counts[r, h.offset - lo:h.offset - lo + h.counts.size] = h.counts
    zeros = np.array([h.zero_count for h in hists.values()])
    low = np.array([h.min if h.count else np.inf for h in hists.values()])
    high = np.array([h.max if h.count else -np.inf for h in hists.values()])
    own_q = quantiles(SCALE, lo, counts, zeros, low, high, 0.9)
    return [str(sm) for sm in hists], slot_evidence(SCALE, lo, counts, zeros, low, high, own_q)


def test_evidence_counts_the_ctas_above_the_other_sms_p90():
    # SMs 0-2: 10 CTAs each at 1..10 us; SM 3: 4 CTAs at 2, 9, 12 and 20 us. The others of SM 3
    # (30 CTAs) have their P90 (rank 27) at 9 us: 2 of its CTAs (12, 20) lie in buckets above
    # 9 us's bucket; its 9 us CTA shares that bucket (ties count as not above).
    base = np.arange(1, 11) * 1e-6
    sms, ev = evidence_of({0: base, 1: base, 2: base, 3: np.array([2, 9, 12, 20]) * 1e-6})
    assert ev.ctas.tolist() == [10, 10, 10, 4]
    assert ev.exceed[3] == 2
    assert ev.others_q[3] == pytest.approx(9e-6, rel=0.011)
    # SM 0's others (SMs 1-3, 24 CTAs): P90 at rank 22 is 10 us; none of SM 0's CTAs is above it
    assert ev.exceed[0] == 0


def test_a_starved_sm_is_flagged_when_its_deficit_is_significant_not_before():
    cfg = ContentionConfig()
    rng = np.random.default_rng(3)
    durations = {sm: rng.lognormal(math.log(20e-6), 0.2, 400) for sm in range(16)}
    durations[5] = durations[5][:120]  # 30 % of its share: flagged
    durations[9] = durations[9][:300]  # 75 %: above starve_ratio 0.7, not flagged
    sms, ev = evidence_of(durations)
    slot = assess(sms, ev, 16, cfg)
    assert [slot.sms[i] for i in np.flatnonzero(slot.starved)] == ["5"]
    assert slot.expected_ctas == pytest.approx(ev.ctas.sum() / 16)
    assert slot.score[sms.index("5")] == pytest.approx(slot.expected_ctas / 120)
    # the same 30 % with a handful of CTAs per SM is not evidence: 3 CTAs where 8 were expected
    few = {sm: rng.lognormal(math.log(20e-6), 0.2, 10) for sm in range(16)}
    few[5] = few[5][:3]
    sms, ev = evidence_of(few)
    assert not assess(sms, ev, 16, cfg).starved.any()


def test_sms_that_ran_nothing_are_appended_and_starved():
    durations = {sm: np.full(200, 10e-6) for sm in range(6)}
    sms, ev = evidence_of(durations)
    slot = assess(sms, ev, 8, ContentionConfig())  # SMs 6 and 7 ran nothing
    assert slot.sms == [str(i) for i in range(8)]
    assert slot.starved.tolist() == [False] * 6 + [True, True]
    assert slot.expected_ctas == 150.0 and slot.score[6] == 100.0  # expected / max(0, 1), capped
    assert slot.reasons(6) == ["starved"]


def test_a_slow_sm_is_flagged_and_the_threshold_depends_on_its_ctas():
    cfg = ContentionConfig()
    rng = np.random.default_rng(4)
    durations = {sm: rng.uniform(10e-6, 100e-6, 500) for sm in range(12)}
    durations[7] = rng.uniform(10e-6, 100e-6, 500) * 1.5  # about 40 % above the others' P90
    sms, ev = evidence_of(durations)
    slot = assess(sms, ev, 12, cfg)
    assert [slot.sms[i] for i in np.flatnonzero(slot.slow)] == ["7"]
    assert not slot.starved.any()
    assert slot.score[sms.index("7")] == pytest.approx(1.5, rel=0.05)
    # 4 of 8 CTAs above the P90 is a 50 % share, but 8 CTAs cannot tell that from chance at
    # alpha 1e-3 over 12 SMs: the bound on P(Binomial(8, 0.1) >= 4) is about 0.03
    durations[7] = np.array([20, 30, 40, 50, 99.5, 99.6, 99.7, 99.8]) * 1e-6 * 1.5
    sms, ev = evidence_of(durations)
    slot = assess(sms, ev, 12, cfg)
    assert ev.exceed[sms.index("7")] >= 4 and not slot.slow.any()


def test_a_slow_sm_needs_its_p90_a_slow_factor_above_the_others():
    rng = np.random.default_rng(5)
    durations = {sm: rng.uniform(90e-6, 100e-6, 2_000) for sm in range(12)}
    durations[7] = rng.uniform(95e-6, 106e-6, 2_000)  # most CTAs above the others' P90, P90 ~1.06x
    sms, ev = evidence_of(durations)
    assert ev.exceed[sms.index("7")] >= 0.3 * 2_000   # the share alone would flag it
    assert not assess(sms, ev, 12, ContentionConfig()).slow.any()
    assert assess(sms, ev, 12, ContentionConfig(slow_factor=1.0)).slow.tolist() == [i == 7 for i in range(12)]
    with pytest.raises(ValueError, match="slow_factor=0.5"):
        ContentionConfig(slow_factor=0.5)


def test_the_chance_of_a_false_flag_per_slot_is_at_most_alpha():
    """Null slots: every SM draws CTAs from one distribution, CTAs land on SMs uniformly;
    at alpha 0.05 the slots with any flag stay within Binomial(400, 0.05)'s 99.9 % quantile."""
    cfg = ContentionConfig(alpha=0.05)
    rng = np.random.default_rng(5)
    flagged = 0
    for _ in range(400):
        n = int(rng.integers(50, 3000))
        on = rng.integers(0, 16, n)
        values = rng.lognormal(math.log(30e-6), 0.5, n)
        sms, ev = evidence_of({sm: values[on == sm] for sm in range(16)})
        flagged += bool(assess(sms, ev, 16, cfg).flagged.any())
    assert flagged <= 33  # Binomial(400, 0.05): mean 20, 99.9 % quantile 33


def test_narrow_launches_leave_sms_out_and_are_not_held_against_them():
    """Launches narrower than the GPU (128 CTAs on 132 SMs) never reach SMs 128-131: told how
    many CTAs came from wide launches, the share test expects only those to be spread."""
    cfg = ContentionConfig()
    wide_per_sm, narrow_launches = 20, 300
    durations = {}
    for sm in range(132):
        n = wide_per_sm + (narrow_launches if sm < 128 else 0)
        durations[sm] = np.full(n, 10e-6)
    sms, ev = evidence_of(durations)
    told = SlotEvidence(ev.ctas, ev.exceed, ev.own_q, ev.others_q, wide_ctas=132 * wide_per_sm)
    assert not assess(sms, told, 132, cfg).starved.any()
    assert assess(sms, told, 132, cfg).expected_ctas == wide_per_sm
    # without the count every CTA is taken as spread: SMs 128-131 look starved
    unknown = assess(sms, ev, 132, cfg)
    assert [unknown.sms[i] for i in np.flatnonzero(unknown.starved)] == ["128", "129", "130", "131"]


def test_windows_combine_slots_and_config_names_bad_values():
    durations = {sm: np.full(300, 10e-6) for sm in range(8)}
    durations[2] = durations[2][:30]
    sms, ev = evidence_of(durations)
    starved = assess(sms, ev, 8, ContentionConfig())
    sms, ev = evidence_of({sm: np.full(300, 10e-6) for sm in range(8)})
    clean = assess(sms, ev, 8, ContentionConfig())
    found = contended_sms([starved, clean, starved])
    assert list(found) == ["2"]
    assert (found["2"].reasons, found["2"].slots_flagged, found["2"].slots) == (("starved",), 2, 3)
    assert found["2"].score == pytest.approx((7 * 300 + 30) / 8 / 30)  # expected CTAs over its 30
    for bad, match in (({"alpha": 0.0}, "alpha=0.0"), ({"slow_share": 0.05}, "slow_share=0.05"),
                       ({"starve_ratio": 1.0}, "starve_ratio=1.0")):
        with pytest.raises(ValueError, match=match):
            ContentionConfig(**bad)


def wide_metric(gpu, kernel: str, ctas: int, t_s: float, sm_count: int = 8):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    req = ExportMetricsServiceRequest()
    metric = req.resource_metrics.add().scope_metrics.add().metrics.add()
    metric.name = sc.METRIC_CTA_WIDE
    metric.sum.aggregation_temporality = 1
    metric.sum.is_monotonic = True
    point = metric.sum.data_points.add()
    point.attributes.extend(otlp_attrs({sc.ATTR_GPU_ID: gpu, sc.ATTR_KERNEL_NAME: kernel,
                                        sc.ATTR_GPU_SM_COUNT: sm_count}))
    point.time_unix_nano, point.as_int = int(t_s * 1e9), ctas
    return req


@pytest.mark.parametrize("starve_before_usual", [False, True])
def test_the_store_takes_wide_launch_counts_and_the_declared_sm_count(starve_before_usual):
    agg = make_aggregator(contention=ContentionConfig(starve_before_usual=starve_before_usual))
    t = T0_S - 1
    # 6 SMs with CTAs of a kernel on a GPU of 8: SMs 6 and 7 ran none
    agg.consume_metrics(otlp_metrics([otlp_cta_point(0, sm, "k", np.full(100, 1e-5), t) for sm in range(6)]))
    key = SmKey("unknown", "0", "k")
    assert agg.sm.num_sms(GpuKey("unknown", "0")) == 6  # as the data shows it
    [(_, before)] = agg.sm.contention(key, T0_S, 20)
    assert before.sms == [str(i) for i in range(6)] and not before.starved.any()
    agg.consume_metrics(wide_metric(0, "k", 480, t))  # every CTA from wide launches, on 8 SMs
    assert agg.sm.num_sms(GpuKey("unknown", "0")) == 8
    [(_, after)] = agg.sm.contention(key, T0_S, 20)
    # no other slots yet to say what each SM usually gets: no SM is held to the even split,
    # unless asked
    assert after.expected_ctas == 60.0 and after.starved.tolist() == [False] * 6 + [starve_before_usual] * 2
    for back in (30, 40, 50, 60):   # four earlier slots where all 8 SMs ran their even share
        agg.consume_metrics(otlp_metrics([otlp_cta_point(0, sm, "k", np.full(60, 1e-5), t - back)
                                          for sm in range(8)]))
        agg.consume_metrics(wide_metric(0, "k", 480, t - back))
    [(_, after)] = agg.sm.contention(key, T0_S, 20)   # SMs 6 and 7 usually run their share
    assert after.expected_ctas == 60.0 and after.starved.tolist() == [False] * 6 + [True, True]
    agg.consume_metrics(wide_metric(0, "other", 5, t))  # no CTAs of that kernel: nowhere to go
    assert agg.dropped == {"wide_launches_unmatched": 1}


def test_an_sm_is_starved_against_its_own_usual_share_not_the_even_split():
    def store(newest_low_sm_ctas: int):
        # 8 SMs; the block scheduler gives SM 7 a fifth of the others' CTAs in every slot
        agg = make_aggregator()
        for back, low in ((60, 20), (50, 20), (40, 20), (30, 20), (20, 20), (1, newest_low_sm_ctas)):
            agg.consume_metrics(otlp_metrics([otlp_cta_point(0, sm, "k", np.full(100 if sm < 7 else low, 1e-5),
                                                             T0_S - back) for sm in range(8)]))
            agg.consume_metrics(wide_metric(0, "k", 700 + low, T0_S - back))
        return [c for _, c in agg.sm.contention(SmKey("unknown", "0", "k"), T0_S, 70)]

    usual = store(20)
    assert len(usual) == 6 and all(c.expected_ctas == pytest.approx(720 / 8) for c in usual)
    # against the even split SM 7 would be starved in every slot; against its own lowest, in none
    assert not any(c.starved.any() for c in usual)
    newest = store(2)[-1]   # a neighbour takes SM 7: 2 CTAs where it usually runs 20
    assert newest.starved.tolist() == [False] * 7 + [True]
    assert newest.score[7] == pytest.approx(702 * (20 / 720) / 2)   # its lowest share's CTAs over its 2


def test_an_sm_is_held_to_what_the_dispatch_order_deals_it():
    """Launches of 6 CTAs on 8 SMs: the dispatch order deals them to SMs 0-5, and SMs 6 and 7
    get none by the scheduler's choice. Told the deal, nothing is starved; an SM dealt 100
    that ran 20 is."""
    cfg = ContentionConfig()
    durations = {sm: np.full(100, 10e-6) for sm in range(6)}
    sms, ev = evidence_of(durations)
    dealt = np.full(6, 100)
    told = SlotEvidence(ev.ctas, ev.exceed, ev.own_q, ev.others_q, dealt=dealt)
    found = assess(sms, told, 8, cfg)
    assert not found.starved.any() and found.sms[6:] == ["6", "7"]
    # against an even split of the same CTAs, the two SMs the deal leaves out are starved
    assert assess(sms, ev, 8, cfg).starved.tolist() == [False] * 6 + [True, True]
    # SM 2 dealt its 100 but ran 20 (a neighbour there): 80 of them went to SM 3
    durations[2], durations[3] = np.full(20, 10e-6), np.full(180, 10e-6)
    sms, ev = evidence_of(durations)
    found = assess(sms, SlotEvidence(ev.ctas, ev.exceed, ev.own_q, ev.others_q, dealt=dealt), 8, cfg)
    assert found.starved.tolist() == [False, False, True] + [False] * 5
    assert found.score[2] == pytest.approx(100 / 20)


def dealt_metric(gpu, kernel: str, dealt: dict[int, int], t_s: float):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    req = ExportMetricsServiceRequest()
    metric = req.resource_metrics.add().scope_metrics.add().metrics.add()
    metric.name = sc.METRIC_CTA_DEALT
    metric.sum.aggregation_temporality = 1
    metric.sum.is_monotonic = True
    for sm, ctas in dealt.items():
        point = metric.sum.data_points.add()
        point.attributes.extend(otlp_attrs({sc.ATTR_GPU_ID: gpu, sc.ATTR_SM_ID: sm, sc.ATTR_KERNEL_NAME: kernel}))
        point.time_unix_nano, point.as_int = int(t_s * 1e9), ctas
    return req


def test_the_store_takes_the_dealt_counts_and_an_sm_dealt_ctas_that_ran_none_is_starved():
    agg = make_aggregator()
    t = T0_S - 1
    # SMs 0-5 ran 100 CTAs each; the deal gave SMs 0-4 100 each, SM 5 none and SM 6 100
    agg.consume_metrics(otlp_metrics([otlp_cta_point(0, sm, "k", np.full(100, 1e-5), t) for sm in range(6)]))
    agg.consume_metrics(dealt_metric(0, "k", {0: 100, 1: 100, 2: 100, 3: 100, 4: 100, 6: 100}, t))
    [(_, found)] = agg.sm.contention(SmKey("unknown", "0", "k"), T0_S, 20)
    # SM 6 was given a row by its dealt CTAs; no wait for usual slots: the deal is the null
    assert found.sms == ["0", "1", "2", "3", "4", "5", "6"]
    assert found.ctas.tolist() == [100] * 6 + [0]
    assert found.starved.tolist() == [False] * 6 + [True]
    agg.consume_metrics(dealt_metric(0, "other", {0: 5}, t))  # no CTAs of that kernel
    assert agg.dropped == {"dealt_unmatched": 1}


def test_an_sm_that_ran_its_deal_is_not_starved_whatever_others_absorbed(monkeypatch):
    """A quarter neighbour as an H100 ran it: each held SM's CTAs went to one SM (the next in
    the dispatch order), not spread over the free ones. On 16 SMs dealt 1000 each, 4 held ran
    350, 5 absorbed up to 1550 and 7 ran their 1030. The upper quartile of the rates is then an
    absorber's, and the 7 ran 0.66 of it; they ran their deal, so only the 4 are starved."""
    held, absorbers = {0, 4, 8, 12}, {2, 6, 10, 14, 15}
    counts = {sm: 350 if sm in held else 1550 if sm in absorbers else 1030 for sm in range(16)}
    sms, ev = evidence_of({sm: np.full(n, 10e-6) for sm, n in counts.items()})
    evidence = SlotEvidence(ev.ctas, ev.exceed, ev.own_q, ev.others_q, dealt=np.full(16, 1000))
    starved = lambda: sorted(int(sms[i]) for i in np.flatnonzero(assess(sms, evidence, 16, ContentionConfig()).starved))
    assert starved() == sorted(held)
    # against the absorbers' rate alone the 7 would be starved too: the deal is what spares them
    monkeypatch.setattr(contention, "DEAL_KEPT", 2.0)
    assert starved() == sorted(set(range(16)) - absorbers)


def test_an_sm_dealt_few_ctas_is_not_called_slow_for_the_long_launches_that_reached_it():
    """A control slot as an H100 ran it: SM 7, late in the dispatch order, was dealt 32 CTAs
    where the mean SM got 700, all from the slot's largest launches, and all 32 ran longer
    than the others' P90 (1.5x). Its durations speak of those launches: not slow. Dealt its
    mean share, the same CTAs are a slow SM."""
    durations = {sm: np.full(700, 10e-6) for sm in range(16)}
    durations[7] = np.full(32, 15e-6)
    sms, ev = evidence_of(durations)
    dealt = np.array([32 if sm == "7" else 700 for sm in sms])
    late = assess(sms, SlotEvidence(ev.ctas, ev.exceed, ev.own_q, ev.others_q, dealt=dealt), 16, ContentionConfig())
    assert not late.slow.any() and not late.starved.any()
    dealt_mean = np.where(dealt == 32, 700, dealt)
    mean = assess(sms, SlotEvidence(ev.ctas, ev.exceed, ev.own_q, ev.others_q, dealt=dealt_mean), 16,
                  ContentionConfig())
    assert [sms[i] for i in np.flatnonzero(mean.slow)] == ["7"]


def test_with_half_the_sms_held_the_others_rate_is_the_reference():
    """A neighbour on SMs 0-3 of 8: they ran 128 CTAs each where SMs 4-7 ran 200. Against the
    slot's mean (164 each) they ran 0.78 of their due, over the 0.7 line; against what the
    free SMs ran (the upper quartile of the rates) 0.64, and they are starved."""
    cfg = ContentionConfig()
    durations = {sm: np.full(128 if sm < 4 else 200, 10e-6) for sm in range(8)}
    sms, ev = evidence_of(durations)
    held = assess(sms, SlotEvidence(ev.ctas, ev.exceed, ev.own_q, ev.others_q, dealt=np.full(8, 100)), 8, cfg)
    assert held.starved.tolist() == [True] * 4 + [False] * 4
    assert held.score[0] == pytest.approx(200 / 128)
    # a quiet slot's spread (155-165 each) moves no reference: nothing starved
    sms, ev = evidence_of({sm: np.full(155 + sm, 10e-6) for sm in range(8)})
    quiet = assess(sms, SlotEvidence(ev.ctas, ev.exceed, ev.own_q, ev.others_q, dealt=np.full(8, 100)), 8, cfg)
    assert not quiet.starved.any()
