"""Range checks for typed configs: one error sentence, the same in every room.

``check_range("port", 70000, 0, 65535, integer=True)`` raises
``ValueError("port=70000 is not an integer in [0, 65535]")``: the field, the bad value and
the allowed range, so a typo fails at start-up with a sentence. Booleans are refused where
numbers are expected, and NaN is outside every range. Stdlib only; O(1) per check.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_range"]


def check_range(name: str, value: object, lo: float, hi: float = math.inf, *,
                integer: bool = False, lo_open: bool = False, hi_open: bool = False,
                hint: str = "") -> None:
    """Raises ValueError unless ``value`` is a number (``integer``: a whole one) in the range
    from ``lo`` to ``hi``, each end closed unless ``lo_open``/``hi_open``. ``hint`` is appended
    to the error, e.g. what a special value means."""
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        what = "an integer" if integer else "a number"
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}={value!r} is not {what} in {interval}{' ' + hint if hint else ''}")
