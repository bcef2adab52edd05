"""When slow decode steps are a slow spell: more of them than the engine's own rate gives.

A spell begins where, among the last ``within`` steps, ``slow_steps`` or more decode steps
ran slow, and more than the engine's rate of slow steps outside spells would put there by
chance (a binomial tail under ``alpha``). An engine whose load makes one step in ten slow
(large batches, turns of a burst) then begins no spell at every tenth of its steps, while
a stall that slows a third of them still does. The rate is known after ``min_base_steps``
steps (before, ``slow_steps`` alone decides); in it spell time counts ``spell_weight`` as
much as other time: a long incident does not become the usual soon, a lasting change of load
(spells all along) does. The rate forgets by halving its counts past ``horizon`` steps.
Cost per slow step: a deque append, a bisection over at most ``within`` ids and, when the
rate moved 5 %, a binomial tail over at most ``within`` terms; other steps cost nothing here.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from .config_checks import check_range

__all__ = ["SlowSpellRule"]


class SlowSpellRule:
    """Fed the id of each slow decode step (``observe``); says whether a spell is due now."""

    __slots__ = ("slow_steps", "within", "alpha", "horizon", "min_base_steps", "spell_weight", "_ids",
                 "_last_id", "_seen", "_base_steps", "_base_slow", "_limit_for", "_limit")

    def __init__(self, slow_steps: int, within: int, alpha: float = 1e-3, horizon: int = 8192,
                 min_base_steps: int = 1024, spell_weight: float = 0.125) -> None:
        check_range("slow_steps", slow_steps, 1, 1_000, integer=True)
        check_range("within", within, 1, 1_000_000, integer=True)
        check_range("alpha", alpha, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("horizon", horizon, 2, integer=True)
        check_range("min_base_steps", min_base_steps, 0, integer=True)
        check_range("spell_weight", spell_weight, 0.0, 1.0)
        self.slow_steps, self.within, self.alpha = slow_steps, within, alpha
        self.horizon, self.min_base_steps, self.spell_weight = horizon, min_base_steps, spell_weight
        self._ids: deque[int] = deque(maxlen=within)   # the last slow steps' ids
        self._last_id: int | None = None
        self._seen = 0            # steps since the first slow one, spells or not
        self._base_steps = 0.0    # steps, those in spells weighed less (halved past the horizon)
        self._base_slow = 0.0     # slow decode steps among them, alike
        self._limit_for: float | None = None   # the rate the cached limit was taken at
        self._limit = slow_steps

    @property
    def rate(self) -> float | None:
        """Slow decode steps per step, spell time weighed less (None before ``min_base_steps``)."""
        if self._seen < max(self.min_base_steps, 1):
            return None
        return self._base_slow / self._base_steps

    def observe(self, step_id: int, in_spell: bool) -> bool:
        """Step ``step_id`` was a slow decode step; ``in_spell``: a spell was running. True
        when the last ``within`` steps hold a spell's worth of slow ones."""
        if self._last_id is not None:
            gap, weight = max(step_id - self._last_id, 1), self.spell_weight if in_spell else 1.0
            self._seen += gap
            self._base_steps += weight * gap
            self._base_slow += weight
            if self._base_steps > self.horizon:
                self._base_steps /= 2
                self._base_slow /= 2
        self._last_id = step_id
        ids = self._ids
        ids.append(step_id)
        return len(ids) - bisect.bisect_right(ids, step_id - self.within) >= self.limit()

    def limit(self) -> int:
        """Slow steps within ``within`` that begin a spell now."""
        rate = self.rate
        if rate is None:
            return self.slow_steps
        # the limit moves in whole steps: recomputed when the rate moved 5 % or more
        key = round(20 * math.log(rate)) if rate > 0 else -math.inf
        if key != self._limit_for:
            self._limit_for = key
            self._limit = max(self.slow_steps, _chance_limit(self.within, rate, self.alpha))
        return self._limit


def _chance_limit(n: int, p: float, alpha: float) -> int:
    """The least k with P(X >= k) < ``alpha`` for X ~ Binomial(n, p) (n + 1: never)."""
    if p <= 0.0:
        return 1
    if p >= 1.0:
        return n + 1
    # P(X = i) term by term, from i = n down: the tail sums its largest terms last
    tail, log_q, log_p = 0.0, math.log1p(-p), math.log(p)
    for k in range(n, -1, -1):
        tail += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                         + k * log_p + (n - k) * log_q)
        if tail >= alpha:
            return k + 1
    return 0
