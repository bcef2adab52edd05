"""bench/overhead_http.py's arithmetic: CPU sets for pinning, paired ratios, stall counts and
telemetry counters between two scrapes."""

from __future__ import annotations

import pytest

from bench.overhead_http import _per_step_us, api_server_count, cpu_plan, slow_decode_steps, summarize


def test_cpu_plan_gives_every_level_its_own_cpus_a_shared_telemetry_pool_and_the_load_the_rest():
    levels = ["off", "off-b", "requests", "steps", "kernels"]   # the split server on 16 CPUs
    plan = cpu_plan(levels, list(range(16)))
    assert [sorted(plan[level]) for level in levels] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert sorted(plan["telemetry"]) == [10, 11] and sorted(plan["load"]) == [12, 13, 14, 15]
    six = cpu_plan(levels + ["kernels@0.05"], list(range(16)))
    assert sorted(six["telemetry"]) == [12, 13] and sorted(six["load"]) == [14, 15]
    # two API servers per level: a core and two servers each, 17 CPUs before the load
    assert api_server_count(["--api-server-count", "2"]) == 2 and api_server_count([]) == 1
    assert cpu_plan(levels, list(range(16)), 1 + api_server_count(["--api-server-count=2"])) is None
    assert cpu_plan(["off", "kernels"], [0, 1, 2, 3, 4]) is None     # under two CPUs for the load


def test_summary_pairs_bursts_by_round_and_counts_steps_over_twice_offs_median():
    bursts = [{"round": r, "level": level, "output_tokens": 1000, "wall_s": wall, "failed": 0,
               "server_cpu_s": 0.2, "children_cpu_s": 0.01}
              for r, walls in enumerate([(1.0, 1.25), (1.0, 1.0), (2.0, 2.5)])
              for level, wall in zip(("off", "kernels"), walls)]
    steps = {"off": [0.010, 0.010, 0.030], "kernels": [0.010, 0.021, 0.019]}
    held = "sightline_telemetry_events_held_total {}\nsightline_telemetry_events_orphaned_total 0.0\n"
    summary = summarize(["off", "kernels"], bursts, steps, {"off": "", "kernels": held.format(9.0)},
                        {"off": "", "kernels": held.format(4.0)})
    assert summary["kernels"]["telemetry_held"] == 5 and summary["kernels"]["telemetry_orphaned"] == 0
    assert summary["kernels"]["ratio_vs_off_paired_median"] == 0.8
    assert summary["kernels"]["ratio_vs_off_paired_range"] == [0.8, 1.0]
    assert summary["off"]["steps_over_2x_off_median"] == 1       # 0.030 > 2 x 0.010
    assert summary["kernels"]["steps_over_2x_off_median"] == 1   # 0.021
    assert summary["kernels"]["steps_over_2x_median"] == 0       # its own median is 0.019
    assert summary["kernels"]["engine_cpu_s_per_1k_tokens"] == pytest.approx(0.2)   # 3 x 0.2 s / 3k


def test_per_step_telemetry_time_splits_traced_probed_and_plain_steps():
    before = {"telemetry_engine_thread_s": 1.0, "telemetry_traced_steps_s": 0.5, "steps_traced": 10,
              "steps_traced_spell": 2, "steps_traced_prefill": 1, "telemetry_probed_steps_s": 0.2,
              "steps_probed": 80}
    after = {"telemetry_engine_thread_s": 1.0 + 0.0098 + 0.004, "telemetry_traced_steps_s": 0.504,
             "steps_traced": 20, "steps_traced_spell": 5, "steps_traced_prefill": 3,
             "telemetry_probed_steps_s": 0.2018,
             "steps_probed": 160}
    # 1,000 steps: 10 traced (4 ms: 400 µs each; 3 of them in slow spells, 2 the interval's
    # prefill steps), 990 untraced
    # (9.8 ms: ~9.9 µs each), of which 70 probed (80 probed less the 10 traced; 1.8 ms:
    # ~25.7 µs each), 920 plain (8 ms)
    assert _per_step_us(before, after, 1000) == {"untraced_step": 9.9, "traced_step": 400.0,
                                                 "steps_traced": 10, "steps_traced_spell": 3,
                                                 "steps_traced_prefill": 2, "probed_step": 25.7, "plain_step": 8.7}
    old = {"telemetry_engine_thread_s": 0.0}   # an engine without the split: all untraced
    assert _per_step_us(old, {"telemetry_engine_thread_s": 0.01}, 1000)["traced_step"] is None


def test_pooled_runs_pair_bursts_within_each_run_and_bound_the_median():
    from bench.overhead_pool import median_interval, pool

    def run(walls):   # one burst of 1,000 tokens per level and round
        return {"bursts": [{"round": r, "level": level, "output_tokens": 1000, "wall_s": wall}
                           for r, pair in enumerate(walls) for level, wall in zip(("off", "kernels"), pair)]}

    # the rounds are paired within a run: run b's round 0 is not run a's
    pooled = pool([run([(1.0, 1.25), (2.0, 2.0)]), run([(1.0, 1.0), (0.5, 0.625)])])
    assert pooled["kernels"]["bursts"] == 4
    assert pooled["kernels"]["median"] == pytest.approx(0.9)   # of 0.8, 1.0, 1.0, 0.8
    assert pooled["off"]["median"] == 1.0
    values = [i / 100 for i in range(100)]                      # n = 100: ranks 40 and 60
    assert median_interval(values) == (0.39, 0.60)


def test_slow_decode_steps_counts_decode_only_steps_over_the_limit_with_their_batch_and_what_came_before():
    durations = [0.010, 0.010, 0.030, 0.016, 0.040, 0.010, 0.010]
    tokens = [[0, 4], [0, 4], [0, 8], [512, 8], [0, 16], [0, 4], [128, 2]]
    # decode-only: 10, 10, 30, 40, 10 ms (median 10: limit 15 ms); over it: 30 (batch 8) and 40 (16, after a prefill)
    assert slow_decode_steps(durations, tokens) == {"decode_only": 5, "over_limit": 2, "median_batch": 4,
                                                    "median_batch_over_limit": 12.0, "after_prefill": 1}
    assert slow_decode_steps([0.02], [[64, 0]]) == {"decode_only": 0}


def test_after_traced_finds_what_a_trace_cost_the_steps_after_it():
    """Steps of 1 ms, every 20th traced (3 ms) and the third after each 6 ms: the usual is
    1 ms, the traced step 3 and the third after it 6, so each traced step cost 7 ms."""
    from bench.overhead_http import after_traced

    durations, traced = [], []
    for i in range(400):
        traced.append(int(i % 20 == 5))
        durations.append(0.003 if i % 20 == 5 else 0.006 if i % 20 == 8 else 0.001)
    out = after_traced(durations, traced)
    assert out["usual_ms"] == pytest.approx(1.0) and out["traced"] == 20
    assert out["mean_ms"] == {"0": 3.0, "1": 1.0, "2": 1.0, "3": 6.0, "4": 1.0, "5": 1.0, "6": 1.0}
    assert out["excess_ms_per_traced"] == pytest.approx(7.0)
    assert after_traced(durations, [0] * 400) is None and after_traced(durations, traced[:10]) is None
