"""A bounded FIFO that never waits: over its bound it refuses an entry and counts it by reason.

The one queue of the engine's telemetry (the lifecycle recorder's events, a rank's records,
the hand-off to the telemetry process) and of the collector (receivers to aggregator).
:class:`BoundedQueue` bounds its entries; :class:`WeightedQueue` bounds their summed weight
(spans, data points) and bytes; :class:`WaitingQueue` lets a forwarding thread wait for one.
Guarantee: ``offer`` never blocks and never raises; a refused entry adds its weight (e.g. the
events of a batch) to ``dropped[full_reason]``. A deferred entry (``offer_later``) is built
by ``take`` on the taking thread; a builder that raises loses its entry (``build_error``).
Threads: a BoundedQueue needs no lock (CPython's deque ``append``, ``popleft`` and ``len`` are
atomic): any threads offer, one takes; offers at the same instant may pass the bound by one
entry each. A WeightedQueue's owner serialises its calls; a WaitingQueue locks for O(1).
Cost: ``offer`` is a ``len``, a comparison and an append.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, NamedTuple, TypeVar

from .config_checks import check_range

__all__ = ["BUILD_ERROR", "FULL", "BoundedQueue", "Deferred", "WaitingQueue", "WeightedQueue"]

FULL = "full"                 # the default reason of a refused entry
BUILD_ERROR = "build_error"   # a deferred entry whose builder raised

T = TypeVar("T")


class Deferred(NamedTuple):
    """An entry built by ``take`` on the taking thread, ``build(*args)``, so that the offering
    thread only appends references. ``args`` must not change after it is offered."""

    build: Callable[..., object]
    args: tuple


_new_tuple = tuple.__new__   # a named tuple's own constructor is a Python function


class BoundedQueue(Generic[T]):
    """At most ``capacity`` entries; see the module docstring. ``accepted``: weight taken in;
    ``dropped``: weight refused, by reason (pass ``dropped`` to share one count among
    successive queues, e.g. across restarts of what takes from them)."""

    __slots__ = ("capacity", "accepted", "dropped", "_full", "_entries")

    def __init__(self, capacity: int, *, full_reason: str = FULL, reasons: Iterable[str] = (),
                 dropped: dict[str, int] | None = None) -> None:
        check_range("capacity", capacity, 1, 1 << 40, integer=True)
        self.capacity = capacity
        self.accepted = 0
        self.dropped = dropped if dropped is not None else {}
        for reason in (full_reason, *reasons):
            self.dropped.setdefault(reason, 0)
        self._full = full_reason
        self._entries: deque = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def offer(self, entry: T, weight: int = 1) -> bool:
        """Appends ``entry`` unless the queue is full (then counts ``weight`` as dropped)."""
        entries = self._entries
        if len(entries) < self.capacity:
            entries.append(entry)
            self.accepted += weight
            return True
        self.dropped[self._full] += weight
        return False

    def offer_later(self, build: Callable[..., T], *args) -> bool:
        """Like ``offer(build(*args))``, with ``build`` run by ``take``: O(1) here whatever
        the entry's size."""
        # offer()'s body, and the tuple made in C: the engine calls this on every step
        entries = self._entries
        if len(entries) < self.capacity:
            entries.append(_new_tuple(Deferred, (build, args)))
            self.accepted += 1
            return True
        self.dropped[self._full] += 1
        return False

    def take(self, limit: int = 1 << 20) -> list[T]:
        """Up to ``limit`` entries, oldest first, deferred ones built (on this thread)."""
        out, pop = [], self._entries.popleft
        try:
            for _ in range(min(limit, len(self._entries))):
                entry = pop()
                if type(entry) is Deferred:
                    try:
                        entry = entry.build(*entry.args)
                    except Exception:   # a builder's bug loses its entry, never the taker
                        self.dropped[BUILD_ERROR] = self.dropped.get(BUILD_ERROR, 0) + 1
                        continue
                out.append(entry)
        except IndexError:   # another thread took them
            pass
        return out


class WeightedQueue(BoundedQueue[T]):
    """Bounded by its entries' summed ``weight`` (at most ``capacity``) and ``size_bytes`` (at
    most ``max_bytes``): an entry that would pass either is refused, except into an empty queue,
    which takes even a heavier one so that progress stays possible. The owner serialises calls."""

    __slots__ = ("max_bytes", "weight", "size_bytes")

    def __init__(self, capacity: int, max_bytes: int, **kwargs) -> None:
        super().__init__(capacity, **kwargs)
        check_range("max_bytes", max_bytes, 1, 1 << 62, integer=True)
        self.max_bytes = max_bytes
        self.weight = 0       # of the entries queued now
        self.size_bytes = 0

    def offer(self, entry: T, weight: int = 1, size_bytes: int = 0) -> bool:
        entries = self._entries
        if entries and (self.weight + weight > self.capacity
                        or self.size_bytes + size_bytes > self.max_bytes):
            self.dropped[self._full] += weight
            return False
        entries.append((entry, weight, size_bytes))
        self.weight += weight
        self.size_bytes += size_bytes
        self.accepted += weight
        return True

    def offer_later(self, build, *args) -> bool:
        raise TypeError("a WeightedQueue takes built entries only")

    def take_one(self) -> T:
        """The oldest entry (IndexError when empty)."""
        entry, weight, size_bytes = self._entries.popleft()
        self.weight -= weight
        self.size_bytes -= size_bytes
        return entry

    def take(self, limit: int = 1 << 20) -> list[T]:
        return [self.take_one() for _ in range(min(limit, len(self._entries)))]


class WaitingQueue(BoundedQueue[T]):
    """A BoundedQueue that a forwarding thread waits on (``wait_take``); ``offer`` may wait
    ``timeout_s`` for room (a last batch at shutdown). Each call locks for O(1) work."""

    __slots__ = ("_changed",)

    def __init__(self, capacity: int, **kwargs) -> None:
        super().__init__(capacity, **kwargs)
        self._changed = threading.Condition()

    def offer(self, entry: T, weight: int = 1, timeout_s: float = 0.0) -> bool:
        with self._changed:
            if timeout_s > 0:
                self._changed.wait_for(lambda: len(self._entries) < self.capacity, timeout_s)
            if not BoundedQueue.offer(self, entry, weight):
                return False
            self._changed.notify_all()
            return True

    def offer_later(self, build, *args) -> bool:
        raise TypeError("a WaitingQueue takes built entries only")

    def wait_take(self) -> T:
        """The oldest entry, waiting for one as long as it takes."""
        with self._changed:
            self._changed.wait_for(lambda: self._entries)
            entry = self._entries.popleft()
            self._changed.notify_all()
            return entry

    def take(self, limit: int = 1 << 20) -> list[T]:
        with self._changed:
            out = BoundedQueue.take(self, limit)
            self._changed.notify_all()
            return out
