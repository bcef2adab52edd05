"""The wire form of recorded items (the engine's pipe, other producers' socket): lifecycle
events as plain tuples, tagged by type.

Pickling a named tuple calls back into Python for every event (``__reduce_ex__`` and
``__getnewargs__``), and a producer pickles on a thread that shares its main thread's GIL;
a plain tuple is pickled in C. ``to_wire`` turns each lifecycle event into
``(code, *fields)`` and any other item (GPU records: few, and large) into ``(-1, item)``;
``from_wire`` undoes it in the telemetry process. Guarantee:
``from_wire(to_wire(items)) == items``, types included. Cost: one tuple per event.
"""

from __future__ import annotations

from .lifecycle import (Detokenized, Queued, RankStep, RequestAttributes, RequestEnd, RequestStart, Startup,
                        Step, Tokenized)

__all__ = ["from_wire", "to_wire"]

# append only: a code names its type on both ends of one pipe (one version, one host)
_TYPES = (RequestStart, Tokenized, RequestAttributes, Queued, Step, Detokenized, RequestEnd,
          Startup, RankStep)
_CODES = {cls: code for code, cls in enumerate(_TYPES)}


_OTHER = -1


def to_wire(items: list) -> list:
    code_of = _CODES.get
    return [(_OTHER, item) if (code := code_of(type(item))) is None else (code, *item)
            for item in items]


def from_wire(items: list) -> list:
    return [item[1] if item[0] == _OTHER else _TYPES[item[0]]._make(item[1:]) for item in items]
