"""Threads that may be inside torch are stopped before the interpreter exits.

CPython ends a daemon thread that takes the GIL back during finalization with an unwind
that, through torch's C++ frames, aborts the whole process ("terminate called without an
active exception", exit 134), whatever the program had done. ``stop_at_exit(owner, stop)``
calls ``owner.stop()`` from an ``atexit`` handler, which runs before finalization, for each
owner still alive and not ``cancel_stop_at_exit``-ed; it holds owners weakly. Cost: a dict entry.
"""

from __future__ import annotations

import atexit
import logging
import weakref

__all__ = ["cancel_stop_at_exit", "stop_at_exit"]

log = logging.getLogger(__name__)

_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # owner -> its stop method's name


def stop_at_exit(owner: object, stop: str) -> None:
    _OWNERS[owner] = stop


def cancel_stop_at_exit(owner: object) -> None:
    _OWNERS.pop(owner, None)


@atexit.register
def _stop_all() -> None:
    for owner, stop in list(_OWNERS.items()):
        try:
            getattr(owner, stop)()
        except Exception:
            log.exception("stopping %s at exit failed", type(owner).__name__)
