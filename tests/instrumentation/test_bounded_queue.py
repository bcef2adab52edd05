"""instrumentation/bounded_queue.py: the bound, drops counted by reason and weight, deferred
entries built by the taker, the weighted bound's oversized entry, a waiting taker."""

from __future__ import annotations

import threading
import time

import pytest

from sightline.instrumentation.bounded_queue import BoundedQueue, WaitingQueue, WeightedQueue


def test_a_full_queue_refuses_and_counts_the_weight_by_reason():
    shared = {"process_down": 4}
    q = BoundedQueue(2, full_reason="queue_full", reasons=("build_error",), dropped=shared)
    assert q.offer("a", 3) and q.offer("b", 5)
    assert not q.offer("c", 7) and not q.offer("d")
    assert shared == {"process_down": 4, "queue_full": 8, "build_error": 0}
    assert q.accepted == 8 and len(q) == 2
    assert q.take(1) == ["a"] and q.offer("e") and q.take() == ["b", "e"] and q.take() == []


def test_deferred_entries_are_built_by_the_taker_and_a_failing_builder_is_counted():
    q = BoundedQueue(4)
    q.offer_later(lambda a, b: ("built", a + b), 2, 3)
    q.offer_later(lambda: 1 / 0)
    q.offer(("plain",))
    assert q.take() == [("built", 5), ("plain",)]
    assert q.dropped == {"full": 0, "build_error": 1} and q.accepted == 3


def test_the_capacity_is_range_checked():
    with pytest.raises(ValueError, match="capacity=0"):
        BoundedQueue(0)
    with pytest.raises(ValueError, match="max_bytes=0"):
        WeightedQueue(10, 0)


def test_the_weighted_bound_counts_weight_and_bytes_and_admits_one_heavy_entry_when_empty():
    q = WeightedQueue(10, 100)
    assert q.offer("huge", 50, 1000)                  # alone in an empty queue: taken
    assert not q.offer("small", 1, 1)                 # anything more passes the bound
    assert q.take_one() == "huge" and (q.weight, q.size_bytes) == (0, 0)
    assert q.offer("a", 6, 10) and not q.offer("b", 5, 10) and q.offer("c", 4, 90)
    assert not q.offer("d", 0, 1)                     # bytes full
    assert (q.weight, q.size_bytes, len(q)) == (10, 100, 2) and q.dropped == {"full": 6}
    assert q.take() == ["a", "c"] and (q.weight, q.size_bytes) == (0, 0)
    with pytest.raises(IndexError):
        q.take_one()
    with pytest.raises(TypeError):
        q.offer_later(tuple)


def test_a_waiting_taker_gets_every_entry_in_order_and_a_full_offer_may_wait_for_room():
    q = WaitingQueue(2, full_reason="queue_full")
    got: list = []
    assert q.offer(1) and q.offer(2) and not q.offer(3, 10)   # no wait: refused at once
    assert q.dropped == {"queue_full": 10}

    def take_later():
        time.sleep(0.05)
        got.append(q.wait_take())

    taker = threading.Thread(target=take_later)
    taker.start()
    started = time.monotonic()
    assert q.offer(4, timeout_s=5.0)                          # waits for the taker's room
    assert time.monotonic() - started < 4.0
    taker.join()
    reader = threading.Thread(target=lambda: got.extend(q.wait_take() for _ in range(3)))
    reader.start()
    q.offer(None)
    reader.join(5.0)
    assert got == [1, 2, 4, None] and not reader.is_alive()
    assert q.offer("x") and q.take() == ["x"] and q.accepted == 5
