"""Process-wide settings that keep the collector's event-loop turns short while its threads work.

The loop itself does little per request; what held it (and /healthz) for 100-500 ms under
many identities or a crowd of scrapers was the interpreter, not a callback: (1) every
system call the loop makes lets go of the GIL, and getting it back from a busy aggregator,
decoder or /metrics-render thread waits a whole switch interval (5 ms by default) each
time, so one accepted request paid tens of them; (2) a full cyclic garbage collection,
which holds the GIL throughout, scanned every object the process ever imported (~130,000)
besides the aggregator's own. :func:`settle` shortens the switch interval to
``SWITCH_INTERVAL_S`` and moves everything alive once the collector has started into the
collector's permanent generation (``gc.freeze``), which full collections skip.
Guarantee: a loop system call waits at most about ``SWITCH_INTERVAL_S`` for the GIL; a full
collection scans only what was made after start. Cost: a thread switch per
``SWITCH_INTERVAL_S`` of contended work (microseconds); objects frozen at start are never
freed by the cycle collector (they are the modules, the servers and the empty stores).
"""

from __future__ import annotations

import gc
import sys

__all__ = ["SWITCH_INTERVAL_S", "settle"]

SWITCH_INTERVAL_S = 0.0005


def settle(switch_interval_s: float = SWITCH_INTERVAL_S) -> int:
    """Applies the module docstring's two settings once the process has started; returns
    the number of objects frozen."""
    sys.setswitchinterval(switch_interval_s)
    gc.collect()  # the start's garbage is freed, not frozen
    gc.freeze()
    return gc.get_freeze_count()
