"""Error logs that bad clients cannot flood: each kind of record at most once per interval.

:class:`RateLimitFilter` is a ``logging.Filter`` for the loggers of the libraries that log a
client's mistakes as errors with a traceback (aiohttp's server logs one per malformed HTTP
request): the first record of each kind (logger, message, exception type) passes whole, and
then one per ``interval_s``, which says how many like it were held back. Guarantee: a flood
of malformed requests writes O(kinds x elapsed / interval) lines, not one traceback each.
Cost: one dictionary lookup per record; at most ``max_kinds`` kinds remembered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["RateLimitFilter", "limit_library_errors"]

# Libraries whose error records are driven by what clients send.
LIBRARY_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access")


class RateLimitFilter(logging.Filter):
    """See the module docstring."""

    def __init__(self, interval_s: float = 60.0, max_kinds: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s, self.max_kinds = interval_s, max_kinds
        self._clock = clock
        self._kinds: dict[tuple, list] = {}  # kind -> [next time one passes, held back since]
        self._lock = threading.Lock()  # records arrive from any thread

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        kind = (record.name, record.msg if isinstance(record.msg, str) else type(record.msg).__name__, exc)
        now = self._clock()
        with self._lock:
            state = self._kinds.get(kind)
            if state is None:
                if len(self._kinds) >= self.max_kinds:  # bounded: forget old kinds rather than grow
                    self._kinds.clear()
                self._kinds[kind] = [now + self.interval_s, 0]
                return True
            if now < state[0]:
                state[1] += 1
                return False
            held, state[0], state[1] = state[1], now + self.interval_s, 0
        if held:
            record.msg = f"{record.msg} ({held} more like this in the last {self.interval_s:.0f} s, not logged)"
        return True


_installed: RateLimitFilter | None = None


def limit_library_errors() -> RateLimitFilter:
    """Installs one :class:`RateLimitFilter` on every logger in ``LIBRARY_LOGGERS`` (once per
    process; later calls return the same filter)."""
    global _installed
    if _installed is None:
        _installed = RateLimitFilter()
        for name in LIBRARY_LOGGERS:
            logging.getLogger(name).addFilter(_installed)
    return _installed
