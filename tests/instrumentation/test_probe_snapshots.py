"""SnapshotRing: ranges are never handed out twice before they are retired, and wrap."""

import torch

from sightline.instrumentation.probe_snapshots import SnapshotRing


def _ring(words=10):
    return SnapshotRing(torch.arange(1, 11, dtype=torch.int64), torch.zeros(words, dtype=torch.int64))


def test_ranges_are_copied_in_order_and_never_overlap_a_live_one():
    ring = _ring()
    assert ring.place(4) == 0 and ring.place(4) == 4
    assert ring.place(4) is None            # only [8, 10) is free
    assert ring.view(4, 4).tolist() == [1, 2, 3, 4]
    ring.retire_through(0, 4)                       # [0, 4) is back: the copy wraps there
    assert ring.place(3) == 0
    assert ring.place(2) is None            # [3, 4) is too small, [8, 10) is behind
    ring.retire_through(4, 4)
    assert ring.place(2) == 3               # after the newest, before the oldest


def test_retiring_a_range_retires_every_older_one_and_an_empty_ring_restarts_at_zero():
    ring = _ring()
    starts = [ring.place(3) for _ in range(3)]
    assert starts == [0, 3, 6]
    ring.retire_through(3, 3)                        # the one at 0 was lost: retired too
    assert ring.place(4) == 0                # [9, 10) is too small: wraps to [0, 6)
    assert ring.place(3) is None             # [4, 6) is too small
    ring.retire_through(0, 4)                        # the one at 6 is older: retired too
    assert ring.place(10) == 0               # empty: the whole ring


def test_a_range_that_never_reached_the_reader_is_given_back_at_once():
    ring = _ring()
    assert ring.place(6) == 0
    ring.release_newest()
    assert ring.place(8) == 0
