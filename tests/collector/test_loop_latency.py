"""What ``collector run`` does to the interpreter once started: a short GIL switch interval, and
the start's objects out of the cycle collector's way (full collections skip them)."""

from __future__ import annotations

import gc
import sys

from sightline.collector.loop_latency import SWITCH_INTERVAL_S, settle


def test_settle_shortens_the_switch_interval_and_freezes_what_exists():
    interval = sys.getswitchinterval()
    try:
        kept = [[i] for i in range(20_000)]  # alive at the freeze: never walked again
        frozen = settle()
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
        assert frozen == gc.get_freeze_count() >= 20_000
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert not any(id(k) in walked for k in kept)
        later = [[i] for i in range(100)]
        walked = {id(o) for o in gc.get_objects()}
        assert all(id(x) in walked for x in later)
    finally:
        gc.unfreeze()
        sys.setswitchinterval(interval)
