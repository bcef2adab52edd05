"""deploy/incident.py: planted SMs against flagged SMs, on heatmaps whose answer is known."""

from __future__ import annotations

import pytest

from sightline.collector.replay import TimeMap
from sightline.deploy.incident import Incident, PlantedInterval, find, flag_hot_sms, flag_starved_sms, interval_s

SLOT_S = 10.0


def heatmap(columns: int, hot: dict[int, set[int]], sms: int = 12) -> dict:
    """A time_sm heatmap JSON: every SM at 10 us, SM s at 30 us in the columns hot[s];
    SM 11 runs nothing in column 0."""
    p99 = [[(30e-6 if c in hot.get(sm, ()) else 10e-6 + sm * 1e-8) for c in range(columns)] for sm in range(sms)]
    p99[11][0] = None
    return {"gpu": "0", "kernel": "sightline_fa2_prefill", "slot_s": SLOT_S,
            "times_unix_s": [1000.0 + SLOT_S * c for c in range(columns)], "sms": [str(s) for s in range(sms)],
            "p99_s": p99}


def test_flags_exactly_the_sms_hot_in_most_of_the_interval_slots():
    # interval 1015..1045: columns 2, 3 fully inside, 1 (1010-1020) and 4 (1040-1050) half inside
    hm = heatmap(6, {3: {1, 2, 3, 4}, 5: {2, 3}, 7: {3}, 9: {0, 5}})
    flagged, slots = flag_hot_sms(hm, 1015.0, 1045.0, 1.5)
    assert slots == 4
    assert list(flagged) == [3, 5]  # SM 5 hot in 2 of 4 slots: median score is (1 + 3) / 2 ~ 2
    # per-slot medians: 10.065 us (columns 1, 4: SM 3 hot), 10.075 (2: SMs 3, 5), 10.085 (3: 3, 5, 7)
    assert flagged[3] == pytest.approx((30 / 10.065 + 30 / 10.075) / 2, rel=1e-9)
    assert flagged[5] == pytest.approx((10.05 / 10.065 + 30 / 10.085) / 2, rel=1e-9)


def test_precision_and_recall_over_intervals_through_the_time_map():
    hm = heatmap(6, {1: {2, 3}, 2: {2, 3}, 4: {2, 3}})
    shift = TimeMap(first_ns=0, origin_ns=1000 * 10**9)  # capture second s is replayed at 1000 + s
    incident = Incident(False, "test", "t", "cpu", 12,
                        (PlantedInterval(20 * 10**9, 40 * 10**9, (1, 2, 3)),))
    [f] = find(incident, [hm], shift, 1.5)
    assert (f.start_unix_s, f.end_unix_s, f.slots) == (1020.0, 1040.0, 2)
    assert sorted(f.flagged) == [1, 2, 4]
    assert (f.true_positives, f.precision, f.recall) == (2, 2 / 3, 2 / 3)
    assert f.to_dict()["flagged"].keys() == {"1", "2", "4"}


def test_metadata_round_trip_and_bad_records():
    incident = Incident(True, "synthetic", "bench/x.py", "NVIDIA H200", 132,
                        (PlantedInterval(5, 9, (3, 1)), PlantedInterval(11, 20, (7,), gpu="1")), {"seed": 1})
    assert Incident.from_meta(incident.to_meta()) == incident
    assert Incident.from_meta({"format": "other"}) is None and Incident.from_meta(None) is None
    with pytest.raises(ValueError, match="not a sightline.incident/1 record"):
        Incident.from_meta({"format": "sightline.incident/1", "synthetic": True})
    with pytest.raises(ValueError, match="exceed num_sms=8"):
        Incident(False, "", "", "", 8, (PlantedInterval(1, 2, (8,)),))
    with pytest.raises(ValueError, match="0 < start < end"):
        PlantedInterval(5, 5, (1,))
    with pytest.raises(ValueError, match="threshold=1.0"):
        flag_hot_sms(heatmap(1, {}), 0, 1, 1.0)
    assert interval_s("60,95") == (60.0, 95.0)
    with pytest.raises(ValueError, match="'9,3'"):
        interval_s("9,3")


def test_starved_sms_ran_under_the_ratio_of_the_median_sms_ctas_in_the_interval():
    # 6 SMs (num_sms 6; SM 5 absent: ran nothing); interval 1015..1045 reads columns 1-4
    hm = dict(heatmap(6, {}), sms=[str(s) for s in range(5)])
    hm["p99_s"] = hm["p99_s"][:5]
    hm["counts"] = [[100] * 6, [100] * 6, [0, 5, 5, 5, 5, 100], [0, 30, 30, 30, 30, 0], [50] * 6]
    starved = flag_starved_sms(hm, 1015.0, 1045.0, 0.25, num_sms=6)
    # per SM over columns 1-4: 400, 400, 20, 120, 200, 0 -> median 160; under 40: SMs 2 and 5
    assert starved == {2: 20 / 160, 5: 0.0}
    incident = Incident(False, "test", "t", "cpu", 6, (PlantedInterval(1015 * 10**9, 1045 * 10**9, (2, 3, 5)),))
    [f] = find(incident, [hm], TimeMap(), 1.5, starve_ratio=0.25)
    assert f.starved == starved and (f.starved_precision, f.starved_recall) == (1.0, 2 / 3)
    assert f.to_dict()["starved"] == {"2": 0.125, "5": 0.0} and f.flagged == {}
    [plain] = find(incident, [hm], TimeMap(), 1.5)  # without the ratio: nothing said about starving
    assert plain.starved == {} and plain.starved_recall is None
    with pytest.raises(ValueError, match="starve_ratio=1.0"):
        flag_starved_sms(hm, 1015.0, 1045.0, 1.0, num_sms=6)
