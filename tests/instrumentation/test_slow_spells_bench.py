"""bench/slow_spells.py's replay of the engine's spell rule over a step sequence."""

from __future__ import annotations

import numpy as np

from bench.slow_spells import shares, spells


def steps(durations: list[float], traced: set[int] = frozenset()) -> dict:
    start = np.concatenate(([0.0], np.cumsum(durations)[:-1]))
    return {"start": (start * 1e9).astype(np.int64), "end": ((start + durations) * 1e9).astype(np.int64),
            "kind": np.zeros(len(durations), dtype=int), "duration": np.array(durations),
            "gpu": np.array([0.005 if i in traced else np.nan for i in range(len(durations))])}


def test_a_stall_on_a_third_of_the_steps_is_a_spell_and_a_few_slow_steps_are_not():
    usual = [0.010] * 1000
    hiccups = [0.040 if i % 20 == 0 else 0.010 for i in range(300)]   # 3 or 4 slow in any 64
    stall = [0.040 if i % 3 == 0 else 0.010 for i in range(600)]
    a = steps(usual + hiccups + stall + usual)
    lo = int(a["start"][1300])
    hi = int(a["start"][1900])
    found = spells(a, 1.5, 6, 64)
    # it begins at the sixth slow step of the stall and lasts a second past its last (step 1897)
    assert len(found) == 1 and lo <= found[0][0] <= lo + 0.2e9 and found[0][1] == int(a["start"][1897]) + 10**9
    got = shares(a, lo, hi, found)
    assert got["inside"] > 0.95 and got["outside"] < 0.1
    early = spells(a, 1.5, 3, 64)   # three slow steps in 64: the hiccups begin it, 3 s early
    assert early[0][0] < int(a["start"][1000]) + 10**9 and shares(a, lo, hi, early)["outside"] > 0.1
    # traced steps are out of the rule (their tracing slows them)
    traced = set(range(1300, 1900, 3))
    assert spells(steps(usual + hiccups + stall + usual, traced), 1.5, 6, 64) == []
