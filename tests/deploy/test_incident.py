"""deploy/incident.py: planted SMs against the SMs the collector's contention tests flagged,
on heatmaps whose answer is known; the metadata of every kind of planted interval."""

from __future__ import annotations

import pytest

from sightline.collector.replay import TimeMap
from sightline.deploy.incident import (EXPECTED_CAUSE, Incident, PlantedInterval, find, flag_contended_sms,
                                       interval_columns, interval_s)

SLOT_S = 10.0


def heatmap(columns: int, marks: dict[int, dict[int, str]], sms: int = 12) -> dict:
    """A time_sm heatmap JSON: every cell tested (score 1.0); ``marks[sm][column]`` names what
    flagged that cell (score 3.0); column 5 of SM 11 has no test (no CTAs there)."""
    rows = [[marks.get(sm, {}).get(c) for c in range(columns)] for sm in range(sms)]
    scores = [[3.0 if rows[sm][c] else 1.0 for c in range(columns)] for sm in range(sms)]
    scores[11][columns - 1] = None
    return {"gpu": "0", "kernel": "sightline_fa2_prefill", "slot_s": SLOT_S,
            "times_unix_s": [1000.0 + SLOT_S * c for c in range(columns)], "sms": [str(s) for s in range(sms)],
            "contention": rows, "contention_score": scores}


def test_flags_the_sms_flagged_in_at_least_half_of_the_interval_slots():
    # interval 1015..1045: columns 2, 3 fully inside, 1 (1010-1020) and 4 (1040-1050) half inside
    hm = heatmap(6, {3: dict.fromkeys((1, 2, 3, 4), "starved"), 5: {2: "slow", 3: "slow+starved"},
                     7: {3: "slow"}, 9: {0: "slow", 5: "slow"}})
    assert interval_columns(hm, 1015.0, 1045.0) == [1, 2, 3, 4]
    flagged, reasons, counted, slots = flag_contended_sms(hm, 1015.0, 1045.0)
    assert slots == 4
    assert flagged == {3: 3.0, 5: 3.0}  # SM 5 in 2 of 4 slots: half is enough; SM 7 in 1 is not
    assert reasons == {3: "starved", 5: "slow+starved"} and counted == {3: 4, 5: 2}


def test_precision_and_recall_over_intervals_through_the_time_map():
    hm = heatmap(6, {1: {2: "starved", 3: "starved"}, 2: {2: "slow", 3: "slow"}, 4: {2: "slow", 3: "slow"}})
    shift = TimeMap(first_ns=0, origin_ns=1000 * 10**9)  # capture second s is replayed at 1000 + s
    incident = Incident(False, "test", "t", "cpu", 12,
                        (PlantedInterval(20 * 10**9, 40 * 10**9, (1, 2, 3)),))
    [f] = find(incident, [hm], shift)
    assert (f.start_unix_s, f.end_unix_s, f.slots) == (1020.0, 1040.0, 2)
    assert sorted(f.flagged) == [1, 2, 4]
    assert (f.true_positives, f.precision, f.recall) == (2, 2 / 3, 2 / 3)
    assert f.to_dict()["flagged"] == {"1": 3.0, "2": 3.0, "4": 3.0}
    assert f.to_dict()["reasons"] == {"1": "starved", "2": "slow", "4": "slow"}


def test_slots_without_ctas_do_not_count_against_an_sm():
    # the interval's last column (5) has no test for any SM: SM 0 flagged in 1 of the 1 tested
    hm = heatmap(6, {0: {4: "starved"}})
    for row in hm["contention_score"]:
        row[5] = None
    flagged, _, _, slots = flag_contended_sms(hm, 1040.0, 1060.0)
    assert slots == 2 and flagged == {0: 3.0}


def test_metadata_round_trip_kinds_and_bad_records():
    incident = Incident(True, "synthetic", "bench/x.py", "NVIDIA H200", 132,
                        (PlantedInterval(5, 9, (3, 1)), PlantedInterval(11, 20, (7,), gpu="1"),
                         PlantedInterval(21, 30, (), kind="hbm_hog"), PlantedInterval(31, 40, (), kind="control")),
                        {"seed": 1})
    assert Incident.from_meta(incident.to_meta()) == incident
    assert [i.expected_cause for i in incident.intervals] == ["sm_contention", "sm_contention",
                                                             "device_contention", None]
    assert set(EXPECTED_CAUSE) == {"sm_neighbour", "hbm_hog", "host_stall", "priority_burst", "load_surge", "control"}
    assert PlantedInterval(1, 2, (), kind="load_surge").expected_cause is None   # busier, not slower
    old = incident.to_meta()  # a capture written before intervals had a kind: SM neighbours
    for i in old["intervals"][:2]:
        del i["kind"]
    old["intervals"] = old["intervals"][:2]
    assert [i.kind for i in Incident.from_meta(old).intervals] == ["sm_neighbour", "sm_neighbour"]
    assert Incident.from_meta({"format": "other"}) is None and Incident.from_meta(None) is None
    with pytest.raises(ValueError, match="not a sightline.incident/1 record"):
        Incident.from_meta({"format": "sightline.incident/1", "synthetic": True})
    with pytest.raises(ValueError, match="exceed num_sms=8"):
        Incident(False, "", "", "", 8, (PlantedInterval(1, 2, (8,)),))
    with pytest.raises(ValueError, match="0 < start < end"):
        PlantedInterval(5, 5, (1,))
    with pytest.raises(ValueError, match="kind='gpu_fire'"):
        PlantedInterval(1, 2, (), kind="gpu_fire")
    with pytest.raises(ValueError, match="a host_stall interval none"):
        PlantedInterval(1, 2, (3,), kind="host_stall")
    assert interval_s("60,95") == (60.0, 95.0)
    with pytest.raises(ValueError, match="'9,3'"):
        interval_s("9,3")
