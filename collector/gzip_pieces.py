"""A gzip body joined from pieces compressed on their own, so unchanged pieces are kept.

``deflate_piece`` compresses one piece as raw deflate that starts with an empty window and
ends byte-aligned (a sync flush, no final block): such pieces put back to back are one
valid deflate stream. ``gzip_join`` writes the gzip member around them (RFC 1952: header,
the pieces, a final empty block, CRC-32 and size of the whole text), compressing the
pieces that come without their deflate form together, in runs.
Guarantee: ``gzip.decompress(gzip_join(pieces))`` is the pieces' texts joined, whatever was
kept. Cost: one CRC-32 pass over the whole text, zlib (level 1) only over the pieces without
a kept form; each piece pays a few bytes of flush and no back-references across pieces.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

__all__ = ["deflate_piece", "gzip_join"]

_HEADER = b"\x1f\x8b\x08\x00" + bytes(4) + b"\x00\xff"  # deflate, no name, mtime 0, OS unknown
_FINAL_EMPTY_BLOCK = b"\x03\x00"


def deflate_piece(text: bytes) -> bytes:
    """``text`` as raw deflate (level 1), independent of what comes before or after it."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
    return compressor.compress(text) + compressor.flush(zlib.Z_SYNC_FLUSH)


def gzip_join(pieces: Iterable[tuple[bytes, bytes | None]]) -> bytes:
    """One gzip member of ``(text, deflate_piece(text) or None)`` pieces, in order."""
    out = [_HEADER]
    pending: list[bytes] = []
    crc = size = 0
    for text, deflated in pieces:
        crc = zlib.crc32(text, crc)
        size += len(text)
        if deflated is None:
            pending.append(text)
            continue
        if pending:
            out.append(deflate_piece(b"".join(pending)))
            pending = []
        out.append(deflated)
    if pending:
        out.append(deflate_piece(b"".join(pending)))
    out += [_FINAL_EMPTY_BLOCK, struct.pack("<II", crc, size & 0xFFFFFFFF)]
    return b"".join(out)
