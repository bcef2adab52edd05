"""The slow-spell rule: a fixed count until the engine's own rate of slow steps is known,
then more slow steps than that rate puts in a window by chance; spell time weighs less."""

from __future__ import annotations

import math

import pytest

from sightline.instrumentation.slow_spells import SlowSpellRule, _chance_limit


def tail(n: int, p: float, k: int) -> float:
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


@pytest.mark.parametrize("p", [0.001, 0.02, 0.1, 0.3, 0.9])
def test_the_chance_limit_is_the_least_count_rarer_than_alpha(p):
    k = _chance_limit(64, p, 1e-3)
    assert tail(64, p, k) < 1e-3 <= tail(64, p, k - 1)
    assert (_chance_limit(64, 0.0, 1e-3), _chance_limit(64, 1.0, 1e-3)) == (1, 65)


class Engine:
    """Feeds slow step ids as the engine does: a spell runs ``spell_steps`` past the last due."""

    def __init__(self, rule: SlowSpellRule, spell_steps: int = 200) -> None:
        self.rule, self.spell_steps, self.until = rule, spell_steps, -1

    def run(self, first: int, last: int, every: int) -> list[int]:
        due = []
        for i in range(first, last, every):
            if self.rule.observe(i, i < self.until):
                due.append(i)
                self.until = i + self.spell_steps
        return due


def test_a_fixed_count_until_the_rate_is_known():
    rule = SlowSpellRule(6, 64)
    engine = Engine(rule)
    assert rule.rate is None and engine.run(0, 50, 10) == [] and rule.limit() == 6
    assert engine.run(51, 54, 1) == [51, 52, 53]   # the sixth slow step within 64, and on


def test_an_engine_whose_load_makes_one_step_in_ten_slow_stops_spelling_and_a_stall_still_does():
    rule = SlowSpellRule(6, 64)
    engine = Engine(rule)
    due = engine.run(0, 8192, 10)   # 6 or 7 slow in any 64: the fixed count's spell every time
    assert due and due[0] < 100 and max(due) < 1400   # until the rate is known
    assert rule.rate == pytest.approx(0.1, rel=0.05)
    assert rule.limit() == _chance_limit(64, round(rule.rate, 4), 1e-3) > 6
    stall = engine.run(8192, 8192 + 640, 3)   # a stall slowing every third step
    assert stall and stall[0] < 8192 + 64


def test_a_long_incident_moves_the_rate_an_eighth_as_fast_and_stays_a_spell():
    rule = SlowSpellRule(6, 64)
    engine = Engine(rule)
    assert engine.run(0, 4096, 50) == []
    before = rule.rate
    due = engine.run(4096, 4096 + 6000, 2)
    # every slow step of the incident, from its sixth on, found a spell due
    assert len(due) == 3000 - 5
    # 750 weighted steps with 375 slow joined 4,096 with 82: not the 6,000 with 3,000
    assert before == pytest.approx(0.02, rel=0.02)
    assert rule.rate == pytest.approx((82 + 375) / (4096 + 750), rel=0.02)
    with pytest.raises(ValueError, match="alpha"):
        SlowSpellRule(6, 64, alpha=0.0)


def test_an_incident_before_the_rate_is_known_fades_once_usual_time_comes():
    rule = SlowSpellRule(6, 64)
    engine = Engine(rule)
    assert engine.run(0, 1200, 3)   # a stall from the start: spells, and a rate of 1 in 3
    assert rule.rate == pytest.approx(1 / 3, rel=0.05)
    engine.run(1200, 1200 + 2048, 50)   # then the usual load: spell time weighs an eighth
    assert rule.rate < 0.05 and rule.limit() <= 10
    engine.run(3248, 3248 + 4096, 50)
    assert rule.rate < 0.03 and rule.limit() <= 8
    assert engine.run(7344, 7344 + 300, 3)   # a stall is a spell again
