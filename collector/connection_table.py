"""Fair admission of connections to one listener: a fixed number of slots, shared fairly.

A connection holds a slot while it is ``WAITING`` (no complete request yet), ``BUSY`` or
``IDLE`` (kept alive). A full table takes a slot back for a newcomer that has sent bytes:
from an idle connection (one that served a single request first), a connection silent or
incomplete for ``grace_s``, or the busiest peer's incomplete one when the newcomer's peer
holds fewer; never from one doing work. Other newcomers wait briefly on a probation list
and take the first slot freed. A peer that fails authentication too often is refused at
accept for a while. Guarantee: idle, silent or incomplete connections keep a client that
talks out for at most ``grace_s`` (another peer's: not at all), and the sockets a listener
holds stay within ``room()``'s bound. Cost: O(1) per state change; a full table scans its
peers once per admission. The exact order is ``ConnectionTable``'s docstring.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum

from ..instrumentation import check_range

__all__ = ["PROBATION_BYTES", "PROBATION_S", "ConnectionState", "ConnectionTable", "Slot"]

PROBATION_S = 0.25  # how long a newcomer at a full listener waits on probation for a slot
PROBATION_BYTES = 64 * 1024  # what it may send meanwhile (kept until it gets one)

_CLOSING_MARGIN = 8
_AUTH_FAILURES = 32  # refusals of authentication per peer and second before it is blocked
_AUTH_BLOCK_S = 2.0
_AUTH_PEERS = 4096  # peers remembered (the table forgets them all when more come)


class ConnectionState(Enum):
    WAITING = "waiting"
    BUSY = "busy"
    IDLE = "idle"


class Slot:
    """One admitted connection. ``evict(state)`` closes it (called with the state it was
    taken back in) and returns True, or declines with False (an idle connection whose client
    is sending again); the owner calls ``ConnectionTable.release`` when it is gone."""

    __slots__ = ("peer", "state", "since", "evict", "admitted", "served")

    def __init__(self, peer: str, evict: Callable[[ConnectionState], bool], now: float) -> None:
        self.peer = peer
        self.state = ConnectionState.WAITING
        self.since = now
        self.admitted = now
        self.served = 0  # times it went idle after a request
        self.evict = evict


class _Probationer:
    __slots__ = ("peer", "heard", "refuse", "promote")

    def __init__(self, peer: str, heard: bool, refuse: Callable[[], None],
                 promote: Callable[[Slot], None]) -> None:
        self.peer, self.heard, self.refuse, self.promote = peer, heard, refuse, promote


class ConnectionTable:
    """The slots of one listener and its probation list (event-loop thread only: no lock).

    A slot is *silent* until its connection sends a first byte. When every slot is taken, a
    newcomer that has sent bytes takes one back, in this order: the longest-idle connection
    that has served one request, then the longest-idle of the rest, if idle for ``grace_s``
    (a client that comes back to its connection is kept longest); the longest-silent one, if silent for
    ``grace_s``; when its peer holds fewer slots than the busiest peer, that peer's
    longest-waiting connection; any connection waiting for ``grace_s``. A silent newcomer
    takes nothing. A newcomer without a slot waits on probation (at most ``probation``;
    when full, the oldest silent one leaves first); once it has sent bytes, the first slot
    freed or gone idle is its. A peer refused authentication more than ``_AUTH_FAILURES``
    times in a second is ``blocked`` for ``_AUTH_BLOCK_S``."""

    def __init__(self, capacity: int, grace_s: float, probation: int = 8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_range("capacity", capacity, 1, integer=True)
        self.capacity = capacity
        self.grace_s = grace_s
        self.probation_capacity = probation
        self._clock = clock
        self._peers: dict[str, int] = {}
        self._idle_once: OrderedDict[Slot, None] = OrderedDict()  # oldest first
        self._idle: OrderedDict[Slot, None] = OrderedDict()
        self._waiting: OrderedDict[Slot, None] = OrderedDict()
        self._silent: OrderedDict[Slot, None] = OrderedDict()
        self._probation: OrderedDict[object, _Probationer] = OrderedDict()
        self._offering = False
        self._auth: dict[str, list[float]] = {}  # peer -> [window start, failures, blocked until]
        self.size = 0
        self.closing = 0  # connections taken back or refused whose sockets are not closed yet

    def admit(self, peer: str, evict: Callable[[ConnectionState], bool], heard: bool) -> Slot | None:
        """A slot (state WAITING) for a new connection from ``peer``, taking one back if the
        table is full and the newcomer has ``heard`` (sent bytes); None otherwise."""
        now = self._clock()
        if self.size >= self.capacity:
            if not heard or not self._take_back(peer, now):
                return None
        slot = Slot(peer, evict, now)
        self.size += 1
        self._peers[peer] = self._peers.get(peer, 0) + 1
        self._waiting[slot] = None
        if not heard:
            self._silent[slot] = None
        return slot

    def heard(self, slot: Slot) -> None:
        """``slot``'s connection sent its first bytes."""
        self._silent.pop(slot, None)

    def set_state(self, slot: Slot, state: ConnectionState) -> None:
        if slot.state is state or slot.evict is None:
            return
        self._unlist(slot)
        slot.state = state
        slot.since = self._clock()
        if state is ConnectionState.IDLE:
            slot.served += 1
            (self._idle_once if slot.served <= 1 else self._idle)[slot] = None
            self._offer()
        elif state is ConnectionState.WAITING:
            self._waiting[slot] = None

    def release(self, slot: Slot) -> None:
        """Frees ``slot`` (idempotent); the oldest talking connection on probation may take it."""
        if slot.evict is not None:
            self._free(slot)
            self._offer()

    # -- probation: newcomers refused for now ----------------------------------------------
    def enter_probation(self, key: object, peer: str, heard: bool, refuse: Callable[[], None],
                        promote: Callable[[Slot], None]) -> None:
        """Puts ``key`` on probation: ``promote(slot)`` if a slot comes its way while it has
        sent bytes, else ``refuse()`` (at once for the oldest, silent first, when full)."""
        if len(self._probation) >= self.probation_capacity:
            out = next((k for k, p in self._probation.items() if not p.heard), next(iter(self._probation)))
            self._probation.pop(out).refuse()
        self._probation[key] = _Probationer(peer, heard, refuse, promote)
        if heard:
            self._offer()

    def probation_heard(self, key: object) -> None:
        """``key``, on probation, sent its first bytes: it may take a slot back now."""
        probationer = self._probation.get(key)
        if probationer is not None and not probationer.heard:
            probationer.heard = True
            self._offer()

    def leave_probation(self, key: object) -> None:
        self._probation.pop(key, None)

    def auth_failed(self, peer: str) -> None:
        """``peer`` was refused authentication once more."""
        now = self._clock()
        entry = self._auth.get(peer)
        if entry is None or now - entry[0] >= 1.0:
            if entry is None and len(self._auth) >= _AUTH_PEERS:
                self._auth.clear()
            entry = self._auth[peer] = [now, 0, entry[2] if entry is not None else 0.0]
        entry[1] += 1
        if entry[1] > _AUTH_FAILURES:
            entry[2] = now + _AUTH_BLOCK_S

    def blocked(self, peer: str) -> bool:
        """Whether ``peer``'s new connections are refused for failing authentication."""
        entry = self._auth.get(peer)
        return entry is not None and self._clock() < entry[2]

    def room(self) -> int:
        """How many more sockets the listener may open: the slots, the probation list and a
        margin for those being closed, less what is open."""
        limit = self.capacity + self.probation_capacity + _CLOSING_MARGIN
        return limit - self.size - len(self._probation) - self.closing

    def _offer(self) -> None:
        """Hands free (or idle) slots to the talking connections on probation, oldest first."""
        if self._offering or not self._probation:
            return
        self._offering = True
        try:
            for key in [k for k, p in self._probation.items() if p.heard]:
                probationer = self._probation.get(key)
                if probationer is None:  # refused meanwhile
                    continue
                slot = self.admit(probationer.peer, _unset, heard=True)
                if slot is None:
                    return
                del self._probation[key]
                probationer.promote(slot)  # sets slot.evict
        finally:
            self._offering = False

    def _free(self, slot: Slot) -> None:
        self._unlist(slot)
        self._silent.pop(slot, None)
        slot.evict = None
        self.size -= 1
        left = self._peers[slot.peer] - 1
        if left:
            self._peers[slot.peer] = left
        else:
            del self._peers[slot.peer]

    def _unlist(self, slot: Slot) -> None:
        if slot.state is ConnectionState.IDLE:
            self._idle_once.pop(slot, None)
            self._idle.pop(slot, None)
        elif slot.state is ConnectionState.WAITING:
            self._waiting.pop(slot, None)

    def _take_back(self, peer: str, now: float) -> bool:
        """Frees one slot for a newcomer from ``peer`` (the class docstring's order)."""
        for slot in self._candidates(peer, now):
            state, evict = slot.state, slot.evict
            self._free(slot)
            if evict(state):
                return True
            self._relist(slot, evict)  # its client is sending again: it stays
        return False

    def _candidates(self, peer: str, now: float):
        yield from list(self._idle_once)
        # a client that came back to its connection and went idle under ``grace_s`` ago is
        # mid-conversation: closed now, its next request would race the close and find the
        # connection ended without a response
        yield from [slot for slot in self._idle if now - slot.since >= self.grace_s]
        for slot in self._silent:
            if now - slot.admitted >= self.grace_s:
                yield slot
            break
        if not self._waiting:
            return
        busiest, held = max(self._peers.items(), key=lambda item: item[1])
        if self._peers.get(peer, 0) < held:
            for slot in self._waiting:
                if slot.peer == busiest:
                    yield slot
                    return
        oldest = next(iter(self._waiting))
        if now - oldest.since >= self.grace_s:
            yield oldest

    def _relist(self, slot: Slot, evict: Callable[[ConnectionState], bool]) -> None:
        """Puts back a slot that declined to be taken (as the most recent of its state)."""
        slot.evict = evict
        self.size += 1
        self._peers[slot.peer] = self._peers.get(slot.peer, 0) + 1
        if slot.state is ConnectionState.IDLE:
            (self._idle_once if slot.served <= 1 else self._idle)[slot] = None
        elif slot.state is ConnectionState.WAITING:
            self._waiting[slot] = None


def _unset(state: ConnectionState) -> bool:
    raise AssertionError("a promoted slot's owner sets its evict callback")
