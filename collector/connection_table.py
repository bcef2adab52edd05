"""Fair admission of connections to one listener: a fixed number of slots, shared fairly.

Every open connection holds a slot and is in one of three states: ``WAITING`` (connected,
but no complete request yet: before its first request, mid-headers, or gRPC calls whose
message has not arrived), ``BUSY`` (a request is being handled) or ``IDLE`` (kept alive
between requests). When all slots are taken, a new connection takes one back instead of
being refused, in this order: the longest-idle connection; else, when the newcomer's peer
(IP address) holds fewer slots than the peer holding the most, that peer's longest-waiting
connection; else any connection waiting for longer than ``grace_s``. Only when none
exists is the newcomer refused. So a peer that holds every slot with idle or incomplete
connections cannot keep another peer out, and a flood of idle connections cannot keep
anyone out for longer than ``grace_s``; a connection doing work is never taken.

Cost: O(1) per state change; a full table scans the peers (and, for the busiest peer, the
waiting connections) once per admission.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum

__all__ = ["ConnectionState", "ConnectionTable", "Slot"]


class ConnectionState(Enum):
    WAITING = "waiting"
    BUSY = "busy"
    IDLE = "idle"


class Slot:
    """One admitted connection. ``evict(state)`` closes it (called with the state it was
    taken back in); the owner calls ``ConnectionTable.release`` when it is gone."""

    __slots__ = ("peer", "state", "since", "evict")

    def __init__(self, peer: str, evict: Callable[[ConnectionState], None], now: float) -> None:
        self.peer = peer
        self.state = ConnectionState.WAITING
        self.since = now
        self.evict = evict


class ConnectionTable:
    """The slots of one listener (event-loop thread only: no lock)."""

    def __init__(self, capacity: int, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} is outside the allowed range 1..inf")
        self.capacity = capacity
        self.grace_s = grace_s
        self._clock = clock
        self._peers: dict[str, int] = {}
        self._idle: OrderedDict[Slot, None] = OrderedDict()  # oldest first
        self._waiting: OrderedDict[Slot, None] = OrderedDict()
        self.size = 0

    def peer_slots(self, peer: str) -> int:
        return self._peers.get(peer, 0)

    def admit(self, peer: str, evict: Callable[[ConnectionState], None]) -> Slot | None:
        """A slot for a new connection from ``peer`` (in state WAITING), taking one back if the
        table is full; None when every slot is doing work or is protected (see the module)."""
        now = self._clock()
        if self.size >= self.capacity:
            victim = self._victim(peer, now)
            if victim is None:
                return None
            state = victim.state
            self.release(victim)
            victim.evict(state)
        slot = Slot(peer, evict, now)
        self.size += 1
        self._peers[peer] = self._peers.get(peer, 0) + 1
        self._waiting[slot] = None
        return slot

    def set_state(self, slot: Slot, state: ConnectionState) -> None:
        if slot.state is state or slot.evict is None:
            return
        self._unlist(slot)
        slot.state = state
        slot.since = self._clock()
        if state is ConnectionState.IDLE:
            self._idle[slot] = None
        elif state is ConnectionState.WAITING:
            self._waiting[slot] = None

    def release(self, slot: Slot) -> None:
        """Frees ``slot`` (idempotent)."""
        if slot.evict is None:
            return
        self._unlist(slot)
        slot.evict = None
        self.size -= 1
        left = self._peers[slot.peer] - 1
        if left:
            self._peers[slot.peer] = left
        else:
            del self._peers[slot.peer]

    def _unlist(self, slot: Slot) -> None:
        if slot.state is ConnectionState.IDLE:
            self._idle.pop(slot, None)
        elif slot.state is ConnectionState.WAITING:
            self._waiting.pop(slot, None)

    def _victim(self, peer: str, now: float) -> Slot | None:
        for slot in self._idle:
            return slot
        if not self._waiting:
            return None
        busiest, held = max(self._peers.items(), key=lambda item: item[1])
        if self._peers.get(peer, 0) < held:
            for slot in self._waiting:
                if slot.peer == busiest:
                    return slot
        oldest = next(iter(self._waiting))
        return oldest if now - oldest.since >= self.grace_s else None
