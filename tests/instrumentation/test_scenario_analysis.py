"""bench/scenario_analysis.py on a run recorded by hand: scrapes whose alert conditions are
known second by second, findings and explanations of planted intervals, the runs pooled."""

from __future__ import annotations

import pytest

from bench.scenario_analysis import (ALERT_OF, AlertClock, AlertRules, format_summary, pool, score_interval,
                                     summarize)
from sightline.deploy.prometheus_rules import SM_CONTENTION_ALERT
from sightline.instrumentation import semconv as sc

HOST, DEVICE = "SightlineHostStall", "SightlineDeviceContention"


def scrape(t: float) -> str:
    """SMs 3 and 7 flagged from t = 60 to 100; host-stall explanations counted at one per 2 s
    from t = 120 to 160; two queueing ones at t = 10."""
    lines = [f"# HELP {sc.COLLECTOR_SM_CONTENTION_SCORE} x", f"# TYPE {sc.COLLECTOR_SM_CONTENTION_SCORE} gauge"]
    if 60 <= t < 100:
        lines += [f'{sc.COLLECTOR_SM_CONTENTION_SCORE}{{gpu="0",kernel="k",sm="{sm}"}} 4.0' for sm in (3, 7)]
    host = 0 if t < 120 else min(20, (t - 120) // 2)
    counts = {**dict.fromkeys(sc.CAUSES, 0), sc.CAUSE_HOST_STALL: host, sc.CAUSE_QUEUEING: 2 if t >= 10 else 0}
    counter = sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED + "_total"  # as prometheus_client's text format names it
    lines += [f"# HELP {counter} x", f"# TYPE {counter} counter"]
    lines += [f'{sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED}_total{{cause="{c}"}} {n}' for c, n in counts.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def episodes():
    clock = AlertClock(AlertRules(for_s=5.0, cause_window_s=60.0))
    for t in range(0, 202, 2):
        clock.observe(float(t), scrape(t))
    return clock.episodes()


def test_alerts_fire_after_their_condition_held_for_the_wait(episodes):
    # contention from 60: pending at 60, held 6 s at 66 (the first scrape past 5 s); gone at 100
    assert episodes[SM_CONTENTION_ALERT] == [[66.0, 100.0]]
    # host stalls: 3 within the last 60 s at t = 126 (and 3 of 3 explained then): firing from 132,
    # still at 200 (20 - 10 = 10 counted since t = 140)
    assert episodes[HOST] == [[132.0, None]]
    assert episodes[DEVICE] == []


def test_an_interval_scored_against_what_was_planted(episodes):
    findings = [{"kernel": "k", "planted": [3, 7, 11], "flagged": {"3": 4.0, "7": 4.0}, "slots": 3,
                 "precision": 1.0, "recall": 2 / 3},
                {"kernel": "j", "planted": [3, 7, 11], "flagged": {}, "slots": 3, "precision": None, "recall": 0.0}]
    slowest = [{"cause": {"name": sc.CAUSE_SM_CONTENTION}}] * 9 + [{"cause": {"name": sc.CAUSE_QUEUEING}}]
    row = score_interval({"kind": "sm_neighbour", "start_unix_s": 60.0, "end_unix_s": 95.0, "sms": [3, 7, 11]},
                         findings, slowest, episodes)
    assert row["kernels"]["k"] == {"planted": 3, "flagged": 2, "true_positives": 2, "precision": 1.0,
                                   "recall": 2 / 3, "slots": 3}
    assert row["causes"] == {sc.CAUSE_SM_CONTENTION: 9, sc.CAUSE_QUEUEING: 1} and row["cause_share"] == 0.9
    assert (row["alert"], row["onset_to_alert_s"], row["alert_how"]) == (SM_CONTENTION_ALERT, 6.0, "fired")
    assert row["alerts_fired"] == [SM_CONTENTION_ALERT]
    # a control interval while the host-stall alert still fires: it counts against the control
    # when it began in the control's segment, and as carried when it began before and still
    # fired at the onset
    control = score_interval({"kind": "control", "start_unix_s": 170.0, "end_unix_s": 200.0},
                             [dict(findings[1], planted=[], recall=None)], [], episodes, since_unix_s=130.0)
    assert control["alerts_fired"] == [HOST] and control["alert"] is None and control["cause_share"] is None
    assert control["alerts_carried"] == []
    later = score_interval({"kind": "control", "start_unix_s": 170.0, "end_unix_s": 200.0}, [], [], episodes,
                           since_unix_s=140.0)
    assert (later["alerts_fired"], later["alerts_carried"]) == ([], [HOST])
    # one that had ended by the onset is neither (the SM alert: 66 to 100 s)
    after = score_interval({"kind": "control", "start_unix_s": 101.0, "end_unix_s": 120.0}, [], [], episodes,
                           since_unix_s=90.0)
    assert (after["alerts_fired"], after["alerts_carried"]) == ([], [])
    # an alert already firing when the interval starts counts 0 s, and says so
    again = score_interval({"kind": "host_stall", "start_unix_s": 150.0, "end_unix_s": 180.0}, [], [], episodes)
    assert (again["onset_to_alert_s"], again["alert_how"]) == (0.0, "already firing at the onset")
    late = score_interval({"kind": "hbm_hog", "start_unix_s": 0.0, "end_unix_s": 30.0}, [], [], episodes)
    assert (late["onset_to_alert_s"], late["alert_how"]) == (None, "did not fire")
    assert set(ALERT_OF) == {"sm_neighbour", "hbm_hog", "host_stall", "priority_burst", "load_surge", "control"}


def test_runs_pooled_per_scenario_with_the_bounds_checked(episodes):
    def neighbour(precision: float, recall: float, onset: float) -> dict:
        findings = [{"kernel": "k", "planted": list(range(10)), "flagged": dict.fromkeys(map(str, range(9)), 2.0),
                     "slots": 3, "precision": precision, "recall": recall}]
        row = score_interval({"kind": "sm_neighbour", "start_unix_s": onset, "end_unix_s": onset + 30,
                              "sms": list(range(10))}, findings,
                             [{"cause": {"name": sc.CAUSE_SM_CONTENTION}}] * 10, episodes)
        return dict(row, scenario="sm_quarter")

    runs = [neighbour(1.0, 0.9, 60.0), neighbour(0.95, 1.0, 58.0), neighbour(1.0, 0.8, 60.0)]
    control = dict(score_interval({"kind": "control", "start_unix_s": 0.0, "end_unix_s": 50.0},
                                  [{"kernel": "k", "planted": [], "flagged": {}, "slots": 5, "precision": None,
                                    "recall": None}], [], episodes), scenario="control")
    summary = summarize(runs + [control])
    quarter = summary["sm_quarter"]
    assert quarter["runs"] == 3 and quarter["kernels"]["k"]["recall"] == {"min": 0.8, "median": 0.9, "max": 1.0,
                                                                          "runs": 3}
    assert quarter["onset_to_alert_s"] == {"min": 6.0, "median": 6.0, "max": 8.0, "runs": 3}
    # one run's recall 0.8 breaks "every interval of every run"
    assert quarter["checks"] == {"sms_found": {"k": False}, "cause": True, "onset_to_alert": True}
    assert summary["control"]["checks"] == {"no_sm_flagged": True, "no_alert": True}
    table = format_summary(summary)
    assert "| sm_quarter | 3 | k | 1.00 [0.95, 1.00] | 0.90 [0.80, 1.00] | 9 | 1.00 | 6.0 [6.0, 8.0] |" in table
    assert "sms_found {'k': False}" in table
    # result files of separate calls pooled: their runs numbered on
    pooled = pool([{"scored": [dict(runs[0], run=1), dict(control, run=1)]},
                   {"scored": [dict(runs[1], run=1), dict(runs[2], run=2)]}])
    assert pooled == summary


def test_a_load_surge_fires_no_alert_and_is_not_called_slowed(episodes):
    """A surge of the usual load makes the engine busier, not slower: queueing, others' prefill
    or no cause are right for its slowest requests; a slowness cause or an alert is not."""
    def surge(start: float, causes: list[str]) -> dict:
        return dict(score_interval({"kind": "load_surge", "start_unix_s": start, "end_unix_s": start + 40},
                                   [{"kernel": "k", "planted": [], "flagged": {}, "slots": 4, "precision": None,
                                     "recall": None}], [{"cause": {"name": c}} for c in causes], episodes),
                    scenario="load_surge")

    quiet = surge(0.0, [sc.CAUSE_UNKNOWN] * 6 + [sc.CAUSE_PREFILL_INTERFERENCE, sc.CAUSE_QUEUEING] * 2)
    assert quiet["expected_cause"] is None and quiet["cause_share"] is None and quiet["alerts_fired"] == []
    assert summarize([quiet])["load_surge"]["checks"] == {"no_sm_flagged": True, "no_alert": True,
                                                          "no_slowness_named": True}
    # one run's slowest called a device contention, while the host-stall alert fired (t = 120 on)
    misread = surge(120.0, [sc.CAUSE_DEVICE_CONTENTION] + [sc.CAUSE_UNKNOWN] * 9)
    assert misread["alerts_fired"] == ["SightlineHostStall"]
    assert summarize([quiet, misread])["load_surge"]["checks"] == {"no_sm_flagged": True, "no_alert": False,
                                                                   "no_slowness_named": False}


def test_a_priority_burst_fires_no_alert(episodes):
    """A burst of more urgent requests makes others wait: queueing, which no alert covers. An
    alert that fires in its segment (the host stall's, from t = 132) fails its check."""
    def burst(start: float) -> dict:
        return dict(score_interval({"kind": "priority_burst", "start_unix_s": start, "end_unix_s": start + 30},
                                   [], [{"cause": {"name": sc.CAUSE_QUEUEING}}] * 10, episodes),
                    scenario="priority_burst")

    assert summarize([burst(0.0)])["priority_burst"]["checks"] == {"no_sm_flagged": True, "cause": True,
                                                                  "no_alert": True}
    assert summarize([burst(0.0), burst(120.0)])["priority_burst"]["checks"]["no_alert"] is False


def test_the_cause_counters_are_kept_where_they_changed():
    clock = AlertClock(AlertRules(for_s=5.0, cause_window_s=60.0))
    for t in range(0, 202, 2):
        clock.observe(float(t), scrape(t))
    kept = clock.cause_counts()
    # the first scrape, the two queueing ones at 10, then one more host stall every 2 s to 160
    assert [t for t, _ in kept] == [0.0, 10.0] + [float(t) for t in range(122, 162, 2)]
    assert kept[-1][1] == {**dict.fromkeys(sc.CAUSES, 0.0), sc.CAUSE_HOST_STALL: 20.0, sc.CAUSE_QUEUEING: 2.0}


def test_slow_requests_left_unknown_do_not_outvote_a_named_cause():
    """Host stalls counted beside three times as many unknowns: of the requests given a
    cause they are all, and the alert fires as the rule says (cause!="unknown")."""
    def scrape_with_unknowns(t: float) -> str:
        host = 0 if t < 20 else min(10, (t - 20) // 2)
        counts = {**dict.fromkeys(sc.CAUSES, 0), sc.CAUSE_HOST_STALL: host, sc.CAUSE_UNKNOWN: 3 * host}
        counter = sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED + "_total"
        return "\n".join([f"# HELP {counter} x", f"# TYPE {counter} counter"]
                         + [f'{counter}{{cause="{c}"}} {n}' for c, n in counts.items()]) + "\n"
    clock = AlertClock(AlertRules(for_s=5.0, cause_window_s=30.0))
    for t in range(0, 62, 2):
        clock.observe(float(t), scrape_with_unknowns(t))
    # 3 host stalls at t = 26, held 6 s at 32
    assert clock.episodes()[HOST] == [[32.0, None]]


def test_reclassify_names_recorded_evidence_by_todays_rules():
    """bench/reclassify.py: a burst request's recorded evidence (the H200 run's, unknown live)
    and a GIL hog's are named by today's rules; the counts per interval follow."""
    from bench.reclassify import reclassify

    burst = {"e2e_s": 13.26, "priority": 0, "cause": {"name": "unknown", "evidence": {
        "engine_slowdown": 2.318, "steps": 251, "idle_excess_s": 0.0, "long_steps_s": 0.242, "batch": 24.171,
        "usual_batch": 1.0, "queue_s": 11.083, "traced_steps": 10, "traced_near": 0, "gpu_slowdown": 1.164,
        "host_slowdown": 1.076, "cta_slowdown": 3.828}}}
    gil = {"e2e_s": 1.2, "priority": 1, "cause": {"name": "host_stall", "evidence": {
        "engine_slowdown": 2.1, "steps": 60, "idle_excess_s": 0.5, "long_steps_s": 0.0, "batch": 1.0,
        "usual_batch": 1.0, "gpu_slowdown": 1.0, "host_slowdown": 2.5, "cta_slowdown": 1.0, "traced_steps": 4,
        "traced_near": 0}}}
    run = {"segments": [
        {"scenario": "priority_burst", "run": 1, "interval": {"kind": "priority_burst"}, "slowest": [burst] * 2},
        {"scenario": "host_stall", "run": 1, "interval": {"kind": "host_stall"}, "slowest": [gil, burst]}]}
    [b, h] = reclassify(run)
    assert (b["live"], b["now"], b["planted_live"], b["planted_now"]) == (
        ["unknown"] * 2, [sc.CAUSE_QUEUEING] * 2, 0, 2)
    assert (h["now"], h["planted_live"], h["planted_now"]) == ([sc.CAUSE_HOST_STALL, sc.CAUSE_QUEUEING], 1, 1)


def test_reclassify_rebuilds_the_sm_flags_a_request_kept_or_its_interval_found():
    """An SM neighbour's request recorded as device contention (the H200's sm_half run 3):
    rebuilt from the SMs flagged per kernel, kept by the suite as counts (bench/scenarios.py)
    or, in runs recorded before that, read from the interval's findings, today's rules name
    the neighbour. The kept counts are the distinct SMs of each kernel with its strongest score."""
    from bench.reclassify import reclassify
    from bench.scenarios import _evidence_kept

    flags = [{"gpu": "g", "kernel": k, "sm": str(sm), "score": 2.5 + sm / 100, "reasons": ["starved"]}
             for k in ("sightline_fa2_prefill", "sightline_paged_decode") for sm in range(0, 132, 2) for _ in range(2)]
    figures = {"engine_slowdown": 1.55, "steps": 63, "idle_excess_s": 0.059, "long_steps_s": 0.36, "batch": 2.05,
               "usual_batch": 1.0, "gpu_slowdown": 2.67, "cta_slowdown": 1.36, "cta_spread": 1.29,
               "host_slowdown": 1.40, "traced_steps": 6, "traced_near": 0, "flagged_sms": 132, "sm_count": 132}
    kept = _evidence_kept({**figures, "contended_sms": flags})
    assert kept["contended_sms_flags"] == 264 and kept["strongest_sm"]["sm"] == "130"
    assert kept["flagged_sms_by_kernel"] == [
        {"gpu": "g", "kernel": k, "sms": 66, "max_score": 3.8, "reasons": ["starved"]}
        for k in ("sightline_fa2_prefill", "sightline_paged_decode")]
    findings = [{"gpu": "0", "kernel": k, "flagged": {str(sm): 6.9 for sm in range(0, 132, 2)},
                 "reasons": {str(sm): "starved" for sm in range(0, 132, 2)}}
                for k in ("sightline_fa2_prefill", "sightline_paged_decode")]

    def request(evidence):
        return {"e2e_s": 0.737, "priority": 2, "cause": {"name": "device_contention", "evidence": evidence}}
    run = {"segments": [
        {"scenario": "sm_half", "run": 3, "interval": {"kind": "sm_neighbour"}, "findings": [],
         "slowest": [request(kept)]},
        {"scenario": "sm_half", "run": 3, "interval": {"kind": "sm_neighbour"}, "findings": findings,
         "slowest": [request(figures)]},
        {"scenario": "sm_half", "run": 3, "interval": {"kind": "sm_neighbour"}, "findings": [],
         "slowest": [request(figures)]}]}
    assert [r["now"] for r in reclassify(run)] == [[sc.CAUSE_SM_CONTENTION]] * 2 + [[sc.CAUSE_DEVICE_CONTENTION]]

