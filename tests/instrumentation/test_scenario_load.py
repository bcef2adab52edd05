"""The scenario suite's load plan (bench/scenarios.py): what each scenario adds to the usual load, and
the segment lengths it accepts."""

from __future__ import annotations

import argparse

import pytest

from bench.scenarios import plan_load, segments


def prompt_chars(plan) -> int:
    body = plan.body
    return len(body["prompt"] if "prompt" in body else body["messages"][0]["content"])


def planned(order: list[str]) -> tuple[list, list]:
    args = argparse.Namespace(seed=0, rate=2.0, burst=4, surge_rate=30.0)
    timeline = segments(order, 1, 10.0, 20.0, 5.0)
    return timeline, plan_load(args, "tiny", 2048, timeline)


def test_a_load_surge_adds_usual_requests_through_its_planted_interval_only():
    _, usual = planned(["control", "control"])
    timeline, surged = planned(["control", "load_surge"])
    surge = timeline[1]
    before = {at for at, _ in usual}
    added = [(at, plan) for at, plan in surged if at not in before]
    assert before <= {at for at, _ in surged}   # the usual arrivals are kept, at their times
    assert all(surge.onset_s <= at < surge.end_s for at, _ in added)
    # Poisson at 30 a second for 20 s: 600 expected, 4 standard deviations either side
    assert 600 - 4 * 600 ** 0.5 <= len(added) <= 600 + 4 * 600 ** 0.5
    # the usual priorities, short prompts (64-512 characters) and long answers, which grow the batch
    assert {plan.priority for _, plan in added} == {1, 2}
    assert all(64 <= prompt_chars(plan) <= 512 and 128 <= plan.body["max_tokens"] <= 256 for _, plan in added)
    assert all(16 <= plan.body["max_tokens"] <= 64 for at, plan in surged if at in before)


def test_a_priority_burst_sends_its_requests_at_the_onset():
    timeline, plans = planned(["control", "priority_burst"])
    burst = [(at, plan) for at, plan in plans if plan.priority == 0]
    assert len(burst) == 4 and {at for at, _ in burst} == {timeline[1].onset_s}
    assert all(prompt_chars(plan) >= 1792 for _, plan in burst)   # long: 2,000-6,000, capped below 2,048


def test_segments_too_short_for_the_alerts_to_clear_are_refused():
    """A cause alert holds for its window after the planted interval's last slow request, SM
    flags for the gauge window after their slot closes: both must end before the next
    segment's onset."""
    from bench.scenarios import CAUSE_CLEAR_S, parse_args

    args = parse_args(["--lead-s", "20", "--tail-s", "6", "--cause-window-s", "16", "--gauge-window-s", "15"])
    assert args.lead_s + args.tail_s == args.cause_window_s + CAUSE_CLEAR_S
    assert parse_args([]).cause_window_s + CAUSE_CLEAR_S <= 30   # the defaults fit
    for flags in (["--lead-s", "12", "--tail-s", "5", "--gauge-window-s", "15"],   # the cause window, 20 s
                  ["--lead-s", "16", "--tail-s", "6", "--cause-window-s", "16", "--gauge-window-s", "15"],
                  ["--lead-s", "20", "--tail-s", "6", "--cause-window-s", "16", "--gauge-window-s", "26"],
                  # 17 s after a slot that closes up to 10 s after the interval ends: 27 s > 26
                  ["--lead-s", "20", "--tail-s", "6", "--cause-window-s", "16", "--gauge-window-s", "17"]):
        with pytest.raises(SystemExit):
            parse_args(flags)
