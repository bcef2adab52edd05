"""bench/replay_run.py on the shipped engine-serve control: one segment of a live run, replayed
as its collector saw it. Live (612fb3d8), a read 2 s after its onset showed SMs the collector
had flagged in the slot still open; with closed slots only, no read from its onset to its
tail shows an SM, and its 10 slowest are named no cause of slowness, as live."""

from __future__ import annotations

import pytest

from bench.replay_run import replay_run
from sightline.deploy.demo import CAPTURES_DIR

CONTROL = CAPTURES_DIR / "h100-control.jsonl.gz"
pytestmark = pytest.mark.slow


def test_the_control_replayed_as_it_ran_shows_no_sm_and_names_no_cause():
    if not CONTROL.is_file():
        pytest.skip(f"no {CONTROL.name}")
    [interval] = replay_run([CONTROL])
    assert interval["kind"] == "control" and interval["planted_cause_in_10_slowest"] is None
    assert interval["causes"] == {"unknown": 10}, interval["causes"]
    assert interval["first_planted_sm_read_s"] is None
    assert interval["reads_with_unplanted_sms"] == []
