"""bench/plants.py's GIL hog on the CPU: while it searches, the other Python threads of the
process stand still (checked by their timestamps, whatever the machine's load)."""

from __future__ import annotations

import threading
import time

import pytest

from bench.plants import GilHog


def test_other_threads_stand_still_while_the_gil_hog_holds_the_lock():
    hog = GilHog(hold_s=0.03, period_s=0.04)
    assert set(hog.text) == {"x"} and len(hog.text) > 100
    stop, stamps = threading.Event(), []

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    holds = []
    try:
        time.sleep(0.02)
        for _ in range(5):
            start = time.perf_counter()
            hog._hold(hog.text)
            holds.append((start, time.perf_counter()))
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    # the other thread stood still for a whole search, once per hold: its longest gap between
    # two turns there is about the search's time (calibrated to 30 ms; a busy machine moves
    # it either way), where a lock let go every 5 ms switch interval would leave short gaps
    gaps = list(zip(stamps, stamps[1:]))
    for a, b in holds:
        longest = max((y - x for x, y in gaps if x < b and y > a), default=0.0)
        assert longest >= 0.35 * hog.hold_s, (b - a, longest)
    assert [t for t in stamps for (_, b), (a, _) in zip(holds, holds[1:]) if b < t < a]  # it ran in between
    run = hog.run(0.2)
    assert run.details["holds"] >= 3 and run.end_ns - run.start_ns >= 0.2e9 and run.details["held_s"] > 0
    with pytest.raises(ValueError, match="hold_s=0.1"):
        GilHog(hold_s=0.1, period_s=0.05)
