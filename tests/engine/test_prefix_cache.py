"""Prefix caching in the KV cache manager and the scheduler, through the fake model of
test_scheduler (it writes each token id into a slot-addressed list and reads the whole
context back before sampling): a block shared by mistake, or evicted and reused while
still matched, makes the read-back differ from the request's tokens. Exact block ids,
hits and evictions; a colliding key; overlapped scheduling's stand-in tokens; a random
load with shared prefixes, aborts, preemption and eviction."""

from __future__ import annotations

import random

import pytest

from sightline.engine.kv_cache import KVCacheConfig, KVCacheManager
from sightline.engine.prefix_cache import PrefixCache, PrefixCacheStats
from sightline.engine.request import FinishReason, Request, SamplingParams
from sightline.engine.scheduler import QueueFullError
from tests.engine.scheduler_harness import VOCAB, Harness, reference_output, step_with_random_abort


def _entries(h: Harness, rid: str) -> list[tuple[int, int]]:
    """(computed_before, num_new_tokens) of every chunk scheduled for ``rid``."""
    return [(e.computed_before, e.num_new_tokens) for p in h.plans for e in p.scheduled
            if e.request.request_id == rid]


def _run_one(h: Harness, rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    r = h.add(rid, 0, prompt=prompt, max_tokens=max_tokens, ignore_eos=True)
    h.run()
    assert r.output_token_ids == reference_output(prompt, max_tokens, None, True)
    return r


def test_shared_prefixes_at_and_off_block_boundaries():
    h = Harness(block_size=4, num_blocks=16, prefix_caching=True)
    p = [(i * 5 + 1) % VOCAB for i in range(10)]   # 2 full blocks and 2 tokens
    a = _run_one(h, "a", p)
    assert _entries(h, "a") == [(0, 10)] and a.num_cached_tokens == 0
    # a boundary: 2 blocks shared, 3 tokens computed after them
    b = _run_one(h, "b", p[:8] + [40, 41, 42])
    assert _entries(h, "b") == [(8, 3)] and b.num_cached_tokens == 8
    # off a boundary: 6 tokens in common, only the first whole block is shared
    c = _run_one(h, "c", p[:6] + [43, 44, 45])
    assert _entries(h, "c") == [(4, 5)] and c.num_cached_tokens == 4
    # the same prompt again: its partial last block is computed
    d = _run_one(h, "d", p)
    assert _entries(h, "d") == [(8, 2)] and d.num_cached_tokens == 8
    # a prompt of exactly two cached blocks: the last token must be computed for its logits,
    # so the second block is computed again (a copy; the cached one keeps its key)
    e = _run_one(h, "e", p[:8], max_tokens=3)
    assert _entries(h, "e") == [(4, 4), (8, 1), (9, 1)] and e.num_cached_tokens == 4
    stats = h.kv.prefix_cache_stats()
    assert stats.queries == 10 + 11 + 9 + 10 + 8
    assert stats.hits == 0 + 8 + 4 + 8 + 4
    assert stats.evictions == 0
    assert sum(p.num_cached_prefill_tokens for p in h.plans) == stats.hits
    assert sum(p.prefix_cache_queries for p in h.plans) == stats.queries
    assert h.plans[-1].prefix_cache_blocks == stats.cached_blocks == h.kv.prefix_cache.num_cached_blocks
    assert h.kv.num_used_blocks == 0 and h.kv.num_free_blocks == 16


def test_two_running_requests_share_blocks_with_ref_counts():
    h = Harness(block_size=4, num_blocks=16, prefix_caching=True)
    p = [(i * 3 + 2) % VOCAB for i in range(9)]
    a = h.add("a", 0, prompt=p, max_tokens=6, ignore_eos=True)
    h.step()
    b = h.add("b", 0, prompt=p[:8] + [7], max_tokens=6, ignore_eos=True)
    h.step()
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [h.kv.ref_count(x) for x in a.block_ids] == [2, 2, 1]
    h.sched.abort("a")
    assert [h.kv.ref_count(x) for x in b.block_ids] == [1, 1, 1]
    h.kv.check_invariants()
    h.run()
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 6, None, True)
    assert all(h.kv.ref_count(x) == 0 for x in range(16))


def test_eviction_is_least_recently_released_and_only_when_needed():
    h = Harness(block_size=4, num_blocks=6, max_num_batched_tokens=16, prefix_caching=True)
    pa = [(i * 7 + 3) % VOCAB for i in range(9)]
    pb = [(i * 11 + 5) % VOCAB for i in range(8)]
    a = _run_one(h, "a", pa)
    assert a.block_ids == [] and h.kv.prefix_cache.num_parked == 2  # a's third block is partial
    _run_one(h, "b", pb)
    assert h.kv.prefix_cache.num_parked == 4 and h.kv.num_free_blocks == 6
    # 3 blocks: the two never-cached free blocks first, then one eviction: a's second block,
    # released before its first (a sequence's tail goes first) and before all of b's
    c = h.add("c", 0, prompt=[(i * 13 + 1) % VOCAB for i in range(12)], max_tokens=1, ignore_eos=True)
    h.step()
    assert h.kv.prefix_cache_stats().evictions == 1 and h.plans[-1].prefix_cache_evictions == 1
    assert c.is_finished
    # a's first block and b's two are still cached: looked up, not taken
    assert h.kv.find_cached_prefix(Request("d", pa)).num_tokens == 4
    assert h.kv.find_cached_prefix(Request("e", pb + [9])).num_tokens == 8
    _run_one(h, "e", pb + [9])
    assert _entries(h, "e") == [(8, 1)]
    h.kv.check_invariants()


class _CollidingKey:
    """A cache key whose hash is the same for every key: only equality tells keys apart."""

    __slots__ = ("parent", "tokens")

    def __init__(self, parent: int, tokens) -> None:
        self.parent, self.tokens = parent, tuple(tokens)

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other) -> bool:
        return isinstance(other, _CollidingKey) and (self.parent, self.tokens) == (other.parent, other.tokens)


@pytest.mark.parametrize("colliding", [False, True])
def test_different_prefixes_never_share_blocks(monkeypatch, colliding):
    if colliding:
        monkeypatch.setattr(PrefixCache, "key", staticmethod(_CollidingKey))
    h = Harness(block_size=4, num_blocks=16, prefix_caching=True)
    common = [9, 8, 7, 6]
    x = [1, 2, 3, 4] + common + [5]
    y = [1, 2, 3, 5] + common + [5]     # first block differs in its last token, second is x's
    _run_one(h, "x", x)
    _run_one(h, "y", y)
    assert _entries(h, "y") == [(0, 9)]           # nothing shared: y's second block follows another prefix
    _run_one(h, "x2", x)
    assert _entries(h, "x2") == [(8, 1)]
    _run_one(h, "y2", y)
    assert _entries(h, "y2") == [(8, 1)]
    entries = h.kv.prefix_cache._entries
    assert len(entries) == 4
    assert len({hash(k) for k in entries}) == (1 if colliding else 4)
    h.kv.check_invariants()


def test_only_requests_of_one_cache_salt_share_blocks():
    h = Harness(block_size=4, num_blocks=32, prefix_caching=True)
    p = [(i * 9 + 4) % VOCAB for i in range(9)]
    cached = []
    for i, salt in enumerate((None, "a", "a", "b", None)):
        r = Request(f"r{i}", p, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=salt)
        h.sched.add(r)
        h.run()
        cached.append(r.num_cached_tokens)
    assert cached == [0, 0, 8, 0, 8]
    h.kv.check_invariants()


def test_blocks_with_tokens_not_read_back_are_cached_when_they_are():
    """Overlapped scheduling: update_pending leaves stand-ins for the step in flight; a block
    whose last input is a stand-in is cached when resolve() puts the real token there."""
    kv = KVCacheManager(KVCacheConfig(block_size=4, num_blocks=8, enable_prefix_caching=True))
    from sightline.engine.scheduler import Scheduler, SchedulerConfig
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add(r)
    p1 = sched.schedule()
    sched.update_pending(p1, {"r": 0})               # KV of 0..2 computed; token 3 pending
    p2 = sched.schedule()                            # decodes position 3 from the stand-in
    sched.update_pending(p2, {"r": 0})               # KV of 0..3 in flight, token 3 not read
    assert r.num_computed_tokens == 4 and kv.prefix_cache.num_cached_blocks == 0
    sched.resolve(p1, {"r": 11})
    assert r.prefix_ids and kv.prefix_cache.num_cached_blocks == 1
    other = Request("o", [1, 2, 3, 11, 5], SamplingParams(max_tokens=1))
    assert kv.find_cached_prefix(other).block_ids == (r.block_ids[0],)
    assert kv.find_cached_prefix(Request("n", [1, 2, 3, 12, 5])).num_tokens == 0
    kv.check_invariants()


def test_take_prefix_needs_an_empty_request_and_invariants_catch_corruption():
    kv = KVCacheManager(KVCacheConfig(block_size=4, num_blocks=4, enable_prefix_caching=True))
    r = Request("r", list(range(9)))
    kv.allocate(r, 9)
    r.num_computed_tokens = 9
    kv.cache_full_blocks(r)
    assert len(r.prefix_ids) == 2 and kv.prefix_cache.num_cached_blocks == 2
    s = Request("s", list(range(9)))
    hit = kv.find_cached_prefix(s)
    assert hit.block_ids == tuple(r.block_ids[:2]) and hit.num_parked == 0
    assert kv.num_blocks_needed(s, 1, hit) == 1
    with pytest.raises(ValueError, match="holds 3 blocks"):
        kv.take_prefix(r, hit)
    kv.free(r)
    assert kv.find_cached_prefix(s).num_parked == 2 and kv.num_free_blocks == 4
    kv.check_invariants()
    kv._ref_counts[r.prefix_ids[0] if r.prefix_ids else hit.block_ids[0]] = 1
    with pytest.raises(AssertionError, match="parked block"):
        kv.check_invariants()
    with pytest.raises(ValueError, match="enable_prefix_caching="):
        KVCacheConfig(num_blocks=4, enable_prefix_caching="yes")


def test_counts_agree_with_the_requests_and_the_plans():
    """A load without preemption: the hits are the requests' cached tokens, and the plans'
    per-step counts add up to the cache's totals."""
    rng = random.Random(7)
    h = Harness(block_size=4, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=24, prefix_caching=True)
    system = [rng.randrange(VOCAB) for _ in range(21)]
    requests = []
    for i in range(20):
        prompt = system[:rng.randint(0, 21)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        requests.append(h.add(f"r{i}", 0, prompt=prompt, max_tokens=rng.randint(1, 6), ignore_eos=True))
        if i % 3 == 0:
            h.step()
    h.run()
    assert not any(p.preempted for p in h.plans)
    stats = h.kv.prefix_cache_stats()
    assert stats.hits == sum(r.num_cached_tokens for r in requests) > 40
    assert stats.queries == sum(r.num_prompt_tokens for r in requests)
    assert (sum(p.num_cached_prefill_tokens for p in h.plans), sum(p.prefix_cache_queries for p in h.plans),
            sum(p.prefix_cache_evictions for p in h.plans)) == (stats.hits, stats.queries, stats.evictions)
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens, None, True)
    assert PrefixCacheStats(5, 3, 1, 9).minus(PrefixCacheStats(2, 1, 1, 4)) == PrefixCacheStats(3, 2, 0, 9)


def test_random_load_with_shared_prefixes_aborts_preemption_and_eviction():
    rng = random.Random(20261201)
    h = Harness(block_size=4, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=24, max_waiting=12,
                aging_s=3.0, prefix_caching=True)
    eos = 3
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(10, 40))] for _ in range(4)]
    live: list[Request] = []
    done: list[Request] = []
    n_preempt = 0
    for op in range(2500):
        x = rng.random()
        if x < 0.25:
            system = rng.choice(systems)
            prompt = system[:rng.randint(1, len(system))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
            try:
                live.append(h.add(f"r{op}", 0, prompt=prompt, max_tokens=rng.randint(1, 30),
                                  priority=rng.randint(0, 3), eos=eos, ignore_eos=rng.random() < 0.3))
            except QueueFullError:
                pass
        elif x < 0.29 and live:
            r = live[rng.randrange(len(live))]
            h.sched.finish(r.request_id, FinishReason.ABORT if rng.random() < 0.5 else FinishReason.STOP)
        else:
            n_preempt += len(step_with_random_abort(h, rng).preempted)
        h.clock.now += rng.choice((0.0, 0.5, 1.0))
        done += [r for r in live if r.is_finished]
        live = [r for r in live if not r.is_finished]
    for r in live:
        h.sched.abort(r.request_id)
    done += live
    kv = h.kv
    kv.check_invariants()
    assert not h.sched.has_work and kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks
    assert all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))
    stats = kv.prefix_cache_stats()
    assert n_preempt > 10 and stats.evictions > 50 and stats.hits > 500, (n_preempt, stats)
    natural = [r for r in done if r.finish_reason is FinishReason.LENGTH or
               (r.finish_reason is FinishReason.STOP and r.output_token_ids[-1:] == [eos] and not r.sampling.ignore_eos)]
    assert len(natural) > 100
    for r in done:
        ref = reference_output(r.prompt_token_ids, r.sampling.max_tokens, eos, r.sampling.ignore_eos)
        assert r.output_token_ids == ref[:r.num_output_tokens], r.request_id
    for r in natural:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens, eos,
                                                      r.sampling.ignore_eos), r.request_id
