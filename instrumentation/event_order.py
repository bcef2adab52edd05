"""One order out of several producers: events held by request key, and producers' watermarks.

Each producer (an API server, the engine core) ships its own batches, so a request's events
reach the telemetry process out of their recording order: the core's ``Queued`` before the
API server's ``RequestStart``, or its last ``Step`` after the request's ``RequestEnd``.
:class:`HeldEvents` keeps events per request key, in arrival order, until released or until
``hold_s`` passes (then they are handed back as expired); :class:`Watermarks` knows how far
every producer has shipped (a frame's watermark: everything recorded before it has arrived;
a producer's last frame: everything it will ever record has arrived).

Guarantees: at most ``max_events`` items are held (beyond it the oldest expire early);
each item is returned exactly once, by ``take``, ``pop_head`` or ``expire``.
Cost: O(1) per held item, amortised; ``caught_up`` is O(producers).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from .config_checks import check_range

__all__ = ["HeldEvents", "Watermarks"]

_DONE = 1 << 63      # the watermark of a producer that sent its last frame: past every time


class HeldEvents:
    """Items (opaque to this class) held per request key, oldest first."""

    def __init__(self, hold_s: float, max_events: int) -> None:
        check_range("hold_s", hold_s, 0.0, 3600.0)
        check_range("max_events", max_events, 1, 1 << 24, integer=True)
        self.hold_s = hold_s
        self.max_events = max_events
        self._by_key: dict[int, deque] = {}     # key -> deque of (item_id, item)
        self._order: deque = deque()            # (deadline, key, item_id), oldest first
        self._ids = itertools.count()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: int) -> bool:
        return key in self._by_key

    def keys(self) -> list[int]:
        return list(self._by_key)

    def add(self, key: int, item, now: float) -> list:
        """Holds ``item`` for ``key``; returns the items expired early to stay in bound."""
        item_id = next(self._ids)
        self._by_key.setdefault(key, deque()).append((item_id, item))
        self._order.append((now + self.hold_s, key, item_id))
        self._count += 1
        return self._expire(lambda deadline: self._count > self.max_events)

    def head(self, key: int):
        return self._by_key[key][0][1]

    def pop_head(self, key: int):
        items = self._by_key[key]
        _, item = items.popleft()
        self._count -= 1
        if not items:
            del self._by_key[key]
        return item

    def take(self, key: int) -> list:
        """Every item held for ``key``, in arrival order (none left held)."""
        items = self._by_key.pop(key, None)
        if items is None:
            return []
        self._count -= len(items)
        return [item for _, item in items]

    def expire(self, now: float) -> list:
        """Items held longer than ``hold_s``, oldest first."""
        return self._expire(lambda deadline: deadline <= now)

    def expire_all(self) -> list:
        return self._expire(lambda deadline: True)

    def _expire(self, due) -> list:
        out, order, by_key = [], self._order, self._by_key
        while order and due(order[0][0]):
            _, key, item_id = order.popleft()
            items = by_key.get(key)
            # an entry whose item was taken or released already is stale: skip it. Items of
            # a key leave from its head, and keys' items arrive in global order.
            if items is None or items[0][0] != item_id:
                continue
            out.append(items.popleft()[1])
            self._count -= 1
            if not items:
                del by_key[key]
        return out


class Watermarks:
    """Each producer's latest watermark (Unix ns) and when it was last heard from.

    A producer silent for more than ``live_s`` is left out of ``caught_up``: one that died
    must not hold the others' events back. One that said it is done (its last frame) is
    past every time at once."""

    def __init__(self, live_s: float) -> None:
        check_range("live_s", live_s, 0.0, 3600.0)
        self.live_s = live_s
        self._producers: dict[int, list] = {}     # producer id -> [watermark_ns, heard]

    def note(self, producer_id: int, watermark_ns: int, now: float, done: bool = False) -> bool:
        """Records a frame (``done``: the producer's last); True when the watermark moved
        forward. A frame after a last one is a producer restarted with the same id."""
        if done:
            watermark_ns = _DONE
        entry = self._producers.get(producer_id)
        if entry is None:
            self._producers[producer_id] = [watermark_ns, now]
            return True
        entry[1] = now
        if watermark_ns > entry[0] or (entry[0] == _DONE and not done):
            entry[0] = watermark_ns
            return True
        return False

    def done(self, producer_id: int) -> bool:
        entry = self._producers.get(producer_id)
        return entry is not None and entry[0] == _DONE

    def passed(self, producer_id: int, time_ns: int) -> bool:
        """Whether ``producer_id`` has shipped everything it recorded before ``time_ns``."""
        entry = self._producers.get(producer_id)
        return entry is not None and entry[0] >= time_ns

    def caught_up(self, producer_id: int, time_ns: int, now: float) -> bool:
        """Whether every other live producer has shipped all it recorded before ``time_ns``."""
        for other, (watermark_ns, heard) in self._producers.items():
            # a done producer's watermark is _DONE, past every time, however long ago heard
            if other != producer_id and now - heard <= self.live_s and watermark_ns < time_ns:
                return False
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(self._producers)
