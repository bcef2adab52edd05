"""bench/prefix_cache.py: its paired arithmetic, and a whole run on the tiny CPU engine (two
engines, a collector, real HTTP) whose cached-token counts are exact."""

from __future__ import annotations

import json

import pytest

from bench.prefix_cache import main, summarize


def _burst(round_: int, engine: str, workload: str, wall_s: float, ttfts: list[float], cached: int) -> dict:
    requests = [{"ttft_s": t, "output_tokens": 10, "prompt_tokens": 100, "cached_tokens": cached} for t in ttfts]
    return {"round": round_, "engine": engine, "workload": workload, "wall_s": wall_s,
            "output_tokens": 10 * len(ttfts), "requests": requests}


def test_summary_pairs_the_engines_by_round():
    bursts = []
    for r, (on_wall, off_wall) in enumerate([(1.0, 2.0), (1.0, 4.0), (2.0, 2.0)]):
        bursts += [_burst(r, "on", "shared", on_wall, [0.1, 0.2, 0.3], 64),
                   _burst(r, "off", "shared", off_wall, [0.4, 0.8, 1.2], 0),
                   _burst(r, "on", "unique", 1.0, [0.5, 0.5, 0.5], 0),
                   _burst(r, "off", "unique", 1.0, [0.5, 0.5, 0.5], 0)]
    s = summarize(bursts)
    shared = s["shared"]
    assert shared["on"]["ttft_p50_s"] == 0.2 and shared["off"]["ttft_p50_s"] == 0.8
    assert shared["on"]["output_tokens_per_s_median"] == 30.0    # 30 tokens in 1, 1, 2 s
    assert shared["on_over_off"]["output_tokens_per_s_paired"] == [2.0, 4.0, 1.0]
    assert shared["on_over_off"]["output_tokens_per_s_paired_median"] == 2.0
    assert shared["on_over_off"]["ttft_p50_paired"] == [0.25, 0.25, 0.25]
    assert shared["on"]["cached_tokens_mean"] == 64 and shared["off"]["cached_tokens_mean"] == 0
    assert s["unique"]["on_over_off"]["output_tokens_per_s_paired_median"] == 1.0


@pytest.mark.slow
def test_a_tiny_run_on_the_cpu_counts_cached_tokens_exactly(tmp_path):
    """Two rounds of 3 concurrent requests: the shared ones find the 32-token system prompt
    (two blocks) cached, the unique ones nothing; usage, /metrics and spans agree."""
    argv = ["--model", "tiny", "--device", "cpu", "--rounds", "2", "--concurrency", "3", "--system", "32",
            "--user", "8", "--output", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    [path] = tmp_path.glob("prefix_cache-*.json")
    record = json.loads(path.read_text())
    shared, unique = record["summary"]["shared"], record["summary"]["unique"]
    assert (shared["on"]["cached_tokens_mean"], shared["off"]["cached_tokens_mean"]) == (32, 0)
    assert (unique["on"]["cached_tokens_mean"], unique["off"]["cached_tokens_mean"]) == (0, 0)
    assert shared["on"]["prompt_tokens_mean"] == unique["off"]["prompt_tokens_mean"] == 40
    counts = record["counts"]
    assert counts["on"] == {"requests": 12, "prompt_tokens": 480, "usage_cached_tokens": 192,
                            "metrics_hits": 192.0, "metrics_queries": 480.0,
                            "metrics_evictions": counts["on"]["metrics_evictions"], "spans_found": 12,
                            "span_cached_tokens": 192, "agree": True}
    assert counts["off"]["agree"] and counts["off"]["metrics_queries"] == 0
    assert len(record["bursts"]) == 8   # 2 rounds x 2 workloads x 2 engines, warm-up dropped
    report = path.with_suffix(".md").read_text()
    assert "| shared | on |" in report and "--model tiny --device cpu --rounds 2" in report
