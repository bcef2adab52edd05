"""A device ring of per-step probe snapshots, filled without a torch call on the engine thread.

Every torch op lets the GIL go, and the server's event loop may then hold it for
milliseconds; so the engine thread copies a step's probe records into this ring with the
CUDA driver's ``cuMemcpyDtoDAsync`` through ``ctypes.PyDLL`` (the GIL kept, ~2 µs, ordered
on the engine's stream). Guarantee: a range is reused only after the worker has retired
it, i.e. after the GPU finished every read the worker enqueued on it (an event it polls);
when no range is free, ``place`` returns None and the step's records are dropped (counted
by the caller). Where the driver cannot be loaded, or on the CPU, a torch copy is used.
Cost: one device buffer as large as the probe's (24 bytes per CTA).
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque

logger = logging.getLogger(__name__)

__all__ = ["SnapshotRing"]


def _driver_copy():
    """``cuMemcpyDtoDAsync_v2`` of libcuda through a GIL-keeping handle, or None."""
    try:
        lib = ctypes.PyDLL("libcuda.so.1")
        fn = lib.cuMemcpyDtoDAsync_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class SnapshotRing:
    """Snapshots of ``source``'s leading words into ``buffer`` (same dtype and device).
    ``place(words)`` (engine thread) -> start or None; ``view(start, words)`` and
    ``retire_through(start, words)`` (worker thread); ``release_newest()`` (engine thread)
    for a placed range that never reached the worker."""

    def __init__(self, source, buffer, stream_handle: int = 0) -> None:
        self.source, self.buffer = source, buffer   # 1-D int64 device (or CPU) tensors
        self.words = buffer.numel()
        self.stream_handle = stream_handle     # the engine stream's cudaStream_t
        self._base, self._source_base = buffer.data_ptr(), source.data_ptr()
        self._copy = _driver_copy() if buffer.device.type == "cuda" else None
        self._live: deque[tuple[int, int]] = deque()   # (start, words) placed, not retired
        self._head = 0
        self.copy_errors = 0

    def _free_start(self, words: int) -> int | None:
        live = self._live
        try:   # tested first: raising is slow, and the ring is rarely empty
            oldest = live[0][0] if live else -1
        except IndexError:             # the worker retired the last range meanwhile
            oldest = -1
        if oldest < 0:                 # all retired
            return 0 if words <= self.words else None
        head = self._head
        if head > oldest:              # free: [head, end) and [0, oldest)
            if head + words <= self.words:
                return head
            return 0 if words <= oldest else None
        if head < oldest:              # free: [head, oldest)
            return head if head + words <= oldest else None
        return None                    # head caught up with the oldest: full

    def place(self, words: int) -> int | None:
        """Enqueues a copy of the source's first ``words`` int64 words on the engine's stream."""
        start = self._free_start(words)
        if start is None:
            return None
        if self._copy is not None:
            result = self._copy(self._base + 8 * start, self._source_base, 8 * words,
                                self.stream_handle)
            if result != 0:
                self.copy_errors += 1
                return None
        else:
            self.buffer[start:start + words].copy_(self.source[:words])
        self._live.append((start, words))
        self._head = start + words
        return start

    def release_newest(self) -> None:
        start, _ = self._live.pop()
        self._head = start

    def view(self, start: int, words: int):
        return self.buffer[start:start + words]

    def retire_through(self, start: int, words: int) -> None:
        """The range placed at ``start`` and every older one may be overwritten: the GPU
        finished the reads of them (older ones that never reached a reader are lost)."""
        while self._live:
            if self._live.popleft() == (start, words):
                return
