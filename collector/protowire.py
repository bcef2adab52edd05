"""Protocol-buffer wire format, read by compiled code: varints, lengths, skipping fields.

Small numba functions (inlined into their callers) that the collector's byte walks share
(:mod:`.span_ids` reads span ids, :mod:`.request_shape` counts messages), so that an encoded
request is read field by field without building a message. Every function checks its
bounds: a truncated or over-long value is reported (``-1``, ``BAD_FIELD``), never read past.
Cost: a few ns per field.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["BAD_FIELD", "NONE_LEFT", "le64", "message", "next_message", "skip", "varint"]

NONE_LEFT, BAD_FIELD = -2, -1  # next_message's "no more such fields", "unreadable"


@numba.njit(cache=True, inline="always")
def varint(buf, at, end):
    """(value, next position); value -1 for a truncated or over-long varint."""
    value = 0
    shift = 0
    while at < end and shift < 63:
        byte = buf[at]
        at += 1
        value |= (np.int64(byte) & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return -1, at


@numba.njit(cache=True, inline="always")
def message(buf, at, end):
    """(content start, content end) of a length-delimited value at ``at``; end -1 if bad."""
    size, at = varint(buf, at, end)
    if size < 0 or size > end - at:
        return at, -1
    return at, at + size


@numba.njit(cache=True, inline="always")
def skip(buf, at, end, wire):
    """The position after a field of wire type ``wire`` whose value starts at ``at``; -1 when
    it cannot be skipped here (a group, or a length past ``end``)."""
    if wire == 0:
        value, at = varint(buf, at, end)
        return at if value >= 0 else -1
    if wire == 1:
        at += 8
    elif wire == 5:
        at += 4
    elif wire == 2:
        return message(buf, at, end)[1]
    else:
        return -1
    return at if at <= end else -1


@numba.njit(cache=True, inline="always")
def le64(buf, at):
    value = np.uint64(0)
    for k in range(8):
        value |= np.uint64(buf[at + k]) << np.uint64(8 * k)
    return value


@numba.njit(cache=True, inline="always")
def next_message(buf, at, end, tag):
    """(content start, content end, next position) of the next field encoded as ``tag``
    (length-delimited) between ``at`` and ``end``, the other fields skipped; content end
    ``NONE_LEFT`` past the last one, ``BAD_FIELD`` for what cannot be read."""
    while at < end:
        found, at = varint(buf, at, end)
        if found == tag:
            start, stop = message(buf, at, end)
            return start, stop, stop
        at = skip(buf, at, end, found & 7) if found >= 0 else -1
        if at < 0:
            return 0, BAD_FIELD, end
    return 0, NONE_LEFT, end
