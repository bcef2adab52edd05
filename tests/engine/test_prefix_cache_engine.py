"""Prefix caching through the whole engine on the tiny preset (CPU, torch path): greedy
outputs with the cache equal those without it, token for token, for prefixes shared at and
off block boundaries, whole prompts cached, preemption and eviction pressure, synchronous
and overlapped scheduling, eager and the static (CUDA-graph) decode path."""

from __future__ import annotations

import random

import pytest

from sightline.engine.config import EngineConfig
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig

BLOCK = 16


def _engine(prefix_caching: bool, *, async_scheduling: bool = False, static: bool = False,
            kv_cache_gib: float = 0.00045):
    """0.00045 GiB holds 14 blocks of the tiny model (224 tokens): six running requests of
    50-80 tokens do not fit, so requests are preempted and cached blocks evicted."""
    from sightline.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(device="cpu", block_size=BLOCK, kv_cache_gib=kv_cache_gib,
                                    enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                                    scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64)))
    if static:
        engine.runner.static_decode(capture=False)
    return engine


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    system = [rng.randrange(1, 500) for _ in range(64)]
    other = [rng.randrange(1, 500) for _ in range(40)]

    def user(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    return [
        system[:48] + user(9),     # three whole blocks shared, at a block boundary
        system[:48] + user(14),
        system[:37] + user(20),    # 37 tokens shared: two whole blocks, then a partial one
        system[:37] + user(3),
        system[:64],               # a whole prompt of four cached blocks (the last is recomputed)
        system[:64],
        other + user(7),           # no prefix in common with the others
        system[:48] + user(9),
        other[:32] + user(30),
        system[:20] + user(40),
        system[:64] + user(1),     # all but its last token cached
        other + user(7),
    ]


def _run(engine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["sync", "overlapped", "static-decode"])
def test_greedy_outputs_with_the_cache_equal_those_without(mode):
    """Each mode against itself without the cache (the static path's padded decode rounds
    differently from the eager one, cache or not)."""
    prompts = _prompts()
    kind = {"async_scheduling": mode == "overlapped", "static": mode == "static-decode"}
    want = _run(_engine(False, **kind), prompts)
    engine = _engine(True, **kind)
    got = _run(engine, prompts)
    assert got == want
    kv = engine.kv_cache
    stats = kv.prefix_cache_stats()
    preemptions = engine.metrics.preemptions._value.get()
    assert stats.hits >= 30 * BLOCK and stats.evictions >= 5 and preemptions >= 3, (stats, preemptions)
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))
    assert engine.num_live == 0 and not engine.scheduler.has_work


def test_cached_requests_compute_only_their_uncached_tokens():
    """With room for everything (no preemption, no eviction): each request's prefill computes
    exactly its prompt minus its cached tokens, and the cached ones are whole blocks."""
    prompts = _prompts()
    engine = _engine(True, kv_cache_gib=0.004)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    requests = []
    for prompt in prompts:   # one at a time: each sees what the earlier ones cached
        requests += engine.generate([prompt], params)
    cached = [r.num_cached_tokens for r in requests]
    assert cached == [0, 48, 32, 32, 48, 48, 0, 48, 32, 16, 64, 32]
    stats = engine.kv_cache.prefix_cache_stats()
    assert stats.hits == sum(cached) and stats.queries == sum(map(len, prompts)) and stats.evictions == 0
    off = _engine(False, kv_cache_gib=0.004).generate(prompts, params)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in off]
    assert [r.num_cached_tokens for r in off] == [0] * len(prompts)
