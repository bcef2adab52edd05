"""The connection table's admission order, exactly, on a clock the test moves.

Every rule of ``ConnectionTable`` (which connection a full table takes back, probation and
promotion, the authentication block, the descriptor bound) against the slots it must pick.
"""

from __future__ import annotations

import pytest

from sightline.collector.connection_table import ConnectionState, ConnectionTable

A, B = "10.0.0.1", "10.0.0.2"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock():
    return Clock()


def _table(clock, capacity=3, probation=2):
    return ConnectionTable(capacity, grace_s=1.0, probation=probation, clock=clock)


def _slot(table, evicted, peer=A, heard=True, name=None):
    name = name or f"c{len(evicted) + table.size}"
    slot = table.admit(peer, lambda state, name=name: evicted.append((name, state)) or True, heard)
    return slot


def test_a_full_table_takes_back_the_idle_connection_that_served_once_first(clock):
    table, evicted = _table(clock), []
    regular = _slot(table, evicted, name="regular")
    once = _slot(table, evicted, name="once")
    busy = _slot(table, evicted, name="busy")
    for _ in range(2):  # "regular" comes back to its connection
        table.set_state(regular, ConnectionState.BUSY)
        table.set_state(regular, ConnectionState.IDLE)
    table.set_state(once, ConnectionState.BUSY)
    table.set_state(once, ConnectionState.IDLE)
    table.set_state(busy, ConnectionState.BUSY)
    assert _slot(table, evicted, name="new1") is not None
    assert evicted == [("once", ConnectionState.IDLE)]
    # "regular" went idle just now: its client's next request would race the close
    assert _slot(table, evicted, name="new2") is None and len(evicted) == 1
    clock.now += 1.0  # grace_s
    assert _slot(table, evicted, name="new2") is not None
    assert evicted[-1] == ("regular", ConnectionState.IDLE)
    assert table.size == 3
    # "new1" has waited grace_s for its request since: taken; then busy and two fresh ones
    assert _slot(table, evicted, name="new3") is not None and evicted[-1] == ("new1", ConnectionState.WAITING)
    assert _slot(table, evicted, name="new4") is None


def test_a_silent_newcomer_takes_nothing_and_a_talking_one_only_what_waited_grace(clock):
    table, evicted = _table(clock), []
    for _ in range(3):
        _slot(table, evicted, heard=False)
    clock.now += 0.5
    assert _slot(table, evicted, heard=True) is None  # silent for less than grace_s
    clock.now += 0.6
    assert _slot(table, evicted, heard=False) is None  # silent newcomers never take
    assert _slot(table, evicted, heard=True) is not None
    assert evicted == [("c0", ConnectionState.WAITING)]


def test_a_connection_that_talked_is_not_taken_as_silent(clock):
    table, evicted = _table(clock, capacity=1), []
    slot = _slot(table, evicted, heard=False)
    table.heard(slot)
    clock.now += 0.5
    assert _slot(table, evicted) is None
    clock.now += 0.6  # waiting (incomplete) for grace_s: taken
    assert _slot(table, evicted) is not None and evicted == [("c0", ConnectionState.WAITING)]


def test_another_peer_takes_back_from_the_busiest_one_at_once(clock):
    table, evicted = _table(clock), []
    for _ in range(3):
        _slot(table, evicted, peer=A)  # talking, incomplete, young
    assert _slot(table, evicted, peer=A) is None  # the same peer: nothing
    assert _slot(table, evicted, peer=B, name="b") is not None
    assert evicted == [("c0", ConnectionState.WAITING)]
    clock.now += 5
    busy = [_slot(table, evicted, peer=B, name=f"b{i}") for i in range(2)]  # B now holds the most
    assert all(s is not None for s in busy)


def test_a_busy_connection_is_never_taken(clock):
    table, evicted = _table(clock, capacity=2), []
    for _ in range(2):
        table.set_state(_slot(table, evicted, peer=A), ConnectionState.BUSY)
    clock.now += 60
    assert _slot(table, evicted, peer=B) is None and evicted == []


def test_probation_promotes_the_oldest_that_talked_when_a_slot_frees_or_goes_idle(clock):
    table, evicted, events = _table(clock, capacity=2, probation=3), [], []
    first, second = _slot(table, evicted), _slot(table, evicted)
    for key, heard in (("p1", False), ("p2", True), ("p3", True)):
        table.enter_probation(key, A, heard, lambda key=key: events.append(("refused", key)),
                              lambda slot, key=key: events.append(("promoted", key)) or setattr(
                                  slot, "evict", lambda state: evicted.append((key, state)) or True))
    table.release(first)
    assert events == [("promoted", "p2")]  # the oldest that talked, not the silent p1
    table.set_state(second, ConnectionState.BUSY)
    table.set_state(second, ConnectionState.IDLE)  # gone idle: taken back for p3
    assert events[-1] == ("promoted", "p3") and table.size == 2
    table.probation_heard("p1")
    assert events[-1] == ("promoted", "p3")  # no slot idle or free: p1 waits


def test_a_full_probation_list_lets_the_oldest_silent_one_go_first(clock):
    table, refused = _table(clock, capacity=1, probation=2), []
    _slot(table, [])
    table.enter_probation("talks", A, True, lambda: refused.append("talks"), lambda slot: None)
    table.enter_probation("silent", A, False, lambda: refused.append("silent"), lambda slot: None)
    table.enter_probation("new", A, False, lambda: refused.append("new"), lambda slot: None)
    assert refused == ["silent"]
    table.enter_probation("newer", A, True, lambda: refused.append("newer"), lambda slot: None)
    assert refused == ["silent", "new"]


def test_room_bounds_the_sockets_a_listener_holds(clock):
    table = _table(clock, capacity=3, probation=2)
    limit = table.room()
    assert limit == 3 + 2 + 8
    slot = _slot(table, [])
    table.enter_probation("p", A, False, lambda: None, lambda s: None)
    table.closing += 1
    assert table.room() == limit - 3
    table.release(slot)
    table.leave_probation("p")
    table.closing -= 1
    assert table.room() == limit


def test_a_peer_failing_authentication_too_often_is_blocked_for_a_while(clock):
    table = _table(clock)
    for _ in range(32):
        table.auth_failed(B)
    assert not table.blocked(B)
    table.auth_failed(B)
    assert table.blocked(B) and not table.blocked(A)
    clock.now += 1.9
    assert table.blocked(B)
    clock.now += 0.2
    assert not table.blocked(B)
    clock.now += 1.0
    for _ in range(33):  # failures spread over more than a second do not add up
        table.auth_failed(A)
        clock.now += 0.05
    assert not table.blocked(A)


def test_an_idle_connection_whose_client_sends_again_declines_and_the_next_is_taken(clock):
    table, evicted = _table(clock, capacity=2), []
    sending = table.admit(A, lambda state: False, True)  # declines: its next request is arriving
    quiet = _slot(table, evicted, name="quiet")
    for slot in (sending, quiet):
        table.set_state(slot, ConnectionState.BUSY)
        table.set_state(slot, ConnectionState.IDLE)
    assert _slot(table, evicted, name="new") is not None
    assert evicted == [("quiet", ConnectionState.IDLE)] and table.size == 2
    assert _slot(table, evicted, name="newer") is None  # only the sending one is left: kept
