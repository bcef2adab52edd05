"""Which GPUs' per-SM data the admission limits refused: bounded, however many identities arrive.

:class:`RefusedGpus` keeps, per refused (instance, gpu), the limit that refused it and the
distinct series it refused (those counted while at most ``max_tracked_series`` are held in
all: past that, ``refused_series`` is a lower bound). It holds at most ``max_gpus``
identities (the least recently refused let go first, counted in ``evicted``) and lets go of
those not refused within the window horizon (:meth:`expire`), so its memory has a ceiling
whatever the number of instance ids ever seen. An index by GPU answers the query API's
lookups (:meth:`of_gpu`) without a scan or a copy of the table.

Cost: O(1) per refused point; memory O(max_gpus + max_tracked_series). Not thread-safe: the
owner (:class:`~.sm_store.SmStore`) holds its lock around every call.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import NamedTuple

__all__ = ["GpuKey", "Refusal", "RefusedGpus"]


class GpuKey(NamedTuple):
    instance: str
    gpu: str


class Refusal(NamedTuple):
    """Why per-SM data of a GPU is (partly) missing: the limit, its value, what it refused."""

    limit: str
    value: int
    refused_series: int


class _Entry:
    __slots__ = ("limit", "value", "series", "last_s")

    def __init__(self, limit: str, value: int, now_s: float) -> None:
        self.limit, self.value, self.last_s = limit, value, now_s
        self.series: set[tuple[str, str]] = set()


class RefusedGpus:
    """See the module docstring."""

    def __init__(self, max_gpus: int = 4_096, max_tracked_series: int = 100_000) -> None:
        self.max_gpus = max_gpus
        self.max_tracked_series = max_tracked_series
        self._entries: OrderedDict[GpuKey, _Entry] = OrderedDict()  # least recently refused first
        self._by_gpu: dict[str, dict[GpuKey, None]] = {}
        self._tracked = 0
        self.evicted = 0  # identities let go because the table was full

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: GpuKey) -> bool:
        return key in self._entries

    def refuse(self, key: GpuKey, limit: str, value: int, series: tuple[str, str], now_s: float) -> None:
        """Records that ``series`` (kernel, sm) of ``key`` was refused by ``limit``."""
        entry = self._entries.get(key)
        if entry is None:
            while len(self._entries) >= self.max_gpus:
                self._remove(next(iter(self._entries)))
                self.evicted += 1
            entry = self._entries[key] = _Entry(limit, value, now_s)
            self._by_gpu.setdefault(key.gpu, {})[key] = None
        else:
            self._entries.move_to_end(key)
            entry.last_s = now_s
        if self._tracked < self.max_tracked_series and series not in entry.series:
            entry.series.add(series)
            self._tracked += 1

    def forget(self, key: GpuKey) -> None:
        """``key`` was admitted after all: it has no refusal any more."""
        if key in self._entries:
            self._remove(key)

    def expire(self, before_s: float) -> None:
        """Lets go of every identity last refused before ``before_s``."""
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.last_s >= before_s:
                return
            self._remove(key)

    def _remove(self, key: GpuKey) -> None:
        entry = self._entries.pop(key)
        self._tracked -= len(entry.series)
        keys = self._by_gpu[key.gpu]
        del keys[key]
        if not keys:
            del self._by_gpu[key.gpu]

    def get(self, key: GpuKey) -> Refusal | None:
        entry = self._entries.get(key)
        return Refusal(entry.limit, entry.value, len(entry.series)) if entry is not None else None

    def of_gpu(self, gpu: str, instance: str | None = None, limit: int = 8) -> list[tuple[GpuKey, Refusal]]:
        """At most ``limit`` refusals of ``gpu`` (its UUID or index as sent), of ``instance``
        or of any instance; O(limit) whatever the table holds."""
        if instance is not None:
            key = GpuKey(instance, gpu)
            return [(key, self.get(key))] if key in self._entries else []
        keys = self._by_gpu.get(gpu, {})
        return [(k, self.get(k)) for k in itertools.islice(keys, limit)]

    def all(self) -> dict[GpuKey, Refusal]:
        """Every refusal held (at most ``max_gpus``)."""
        return {key: self.get(key) for key in self._entries}
