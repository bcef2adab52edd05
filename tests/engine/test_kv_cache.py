"""Paged KV block manager: exact block ids, slots, ref counts, copy-on-write, invariant checks."""

from __future__ import annotations

import random

import pytest

from sightline.engine.kv_cache import (
    KVCacheConfig,
    KVCacheManager,
    NoFreeBlocksError,
    blocks_for_budget,
    kv_bytes_per_block,
)
from sightline.engine.request import Request


def _req(rid: str, n: int = 4) -> Request:
    return Request(rid, list(range(n)), arrival_time_s=0.0)


def test_config_validation_names_the_bad_value():
    assert KVCacheConfig(num_blocks=3).block_size == 16
    assert KVCacheConfig(8, 10).num_token_slots == 80
    with pytest.raises(ValueError, match=r"num_blocks=0 is not an integer in \[1, inf\]"):
        KVCacheConfig()
    with pytest.raises(ValueError, match=r"block_size=0 is not an integer in \[1, 4096\]"):
        KVCacheConfig(block_size=0, num_blocks=4)
    with pytest.raises(ValueError, match="num_blocks=2.5 is not an integer"):
        KVCacheConfig(num_blocks=2.5)


def test_blocks_for_budget_and_bytes_per_block():
    # Llama-3-8B-like: 32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks = 2 MiB per block.
    per_block = kv_bytes_per_block(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2)
    assert per_block == 2 * 32 * 16 * 8 * 128 * 2 == 2 * 1024 * 1024
    assert blocks_for_budget(10 * 1024**3, per_block) == 5120
    assert blocks_for_budget(per_block - 1, per_block) == 0
    assert blocks_for_budget(3.9 * per_block, per_block) == 3
    assert blocks_for_budget(0, 7) == 0
    with pytest.raises(ValueError, match="bytes_per_block=0 is not"):
        blocks_for_budget(100, 0)
    with pytest.raises(ValueError, match="bytes_budget=-1 is not"):
        blocks_for_budget(-1, 10)
    with pytest.raises(ValueError, match="head_dim=0 is not"):
        kv_bytes_per_block(num_layers=1, num_kv_heads=1, head_dim=0, block_size=16, dtype_bytes=2)


def test_allocate_covers_tokens_and_slots_are_exact():
    kv = KVCacheManager(KVCacheConfig(block_size=4, num_blocks=6))
    a, b = _req("a"), _req("b")
    assert kv.num_blocks_needed(a, 5) == 2
    kv.allocate(a, 5)  # positions 0..4 -> 2 blocks
    assert a.block_ids == [0, 1]
    kv.allocate(b, 4)  # exactly one block
    assert b.block_ids == [2]
    a.num_computed_tokens = 5
    kv.allocate(a, 3)  # positions 5..7 still fit in block 1
    assert a.block_ids == [0, 1]
    a.num_computed_tokens = 8
    kv.allocate(a, 1)  # position 8 needs a third block
    assert a.block_ids == [0, 1, 3]
    assert (kv.num_used_blocks, kv.num_free_blocks, kv.usage) == (4, 2, 4 / 6)
    assert [kv.slot(a, p) for p in (0, 3, 4, 7, 8)] == [0, 3, 4, 7, 12]
    assert kv.slots(b, 1, 4) == [9, 10, 11]
    with pytest.raises(IndexError, match="position 12 of request a"):
        kv.slot(a, 12)
    kv.check_invariants()


def test_out_of_blocks_changes_nothing_and_free_recycles_in_order():
    kv = KVCacheManager(KVCacheConfig(block_size=2, num_blocks=3))
    a, b = _req("a"), _req("b")
    kv.allocate(a, 4)
    assert not kv.can_allocate(b, 3)
    with pytest.raises(NoFreeBlocksError, match="needs 2 blocks, 1 free of 3"):
        kv.allocate(b, 3)
    assert b.block_ids == [] and kv.num_free_blocks == 1
    kv.free(a)
    kv.free(a)  # idempotent
    assert a.block_ids == [] and kv.num_used_blocks == 0
    kv.allocate(b, 6)
    # free list: 2 was never taken, then a's blocks came back tail first (1, 0)
    assert b.block_ids == [2, 1, 0]
    kv.check_invariants()


def test_fork_shares_blocks_and_copies_on_write():
    kv = KVCacheManager(KVCacheConfig(block_size=4, num_blocks=8))
    parent, child = _req("p", 6), _req("c", 6)
    kv.allocate(parent, 6)  # blocks 0 (full) and 1 (2 of 4 used)
    parent.num_computed_tokens = 6
    kv.fork(parent, child)
    assert child.block_ids == [0, 1] and child.num_computed_tokens == 6
    assert (kv.ref_count(0), kv.ref_count(1), kv.num_used_blocks) == (2, 2, 2)
    kv.check_invariants()
    # The child writes position 6 into shared block 1: it gets a private copy (block 2).
    assert kv.num_blocks_needed(child, 1) == 1
    kv.allocate(child, 1)
    assert child.block_ids == [0, 2]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.take_pending_copies() == []
    assert (kv.ref_count(0), kv.ref_count(1), kv.ref_count(2)) == (2, 1, 1)
    kv.check_invariants()
    # The parent now owns block 1 alone: writing into it copies nothing; a new block is appended.
    kv.allocate(parent, 3)
    assert parent.block_ids == [0, 1, 3] and kv.take_pending_copies() == []
    kv.free(parent)
    assert kv.ref_count(0) == 1 and kv.ref_count(1) == 0
    assert kv.num_used_blocks == 2
    kv.free(child)
    assert kv.num_used_blocks == 0
    kv.check_invariants()
    with pytest.raises(ValueError, match="into itself"):
        kv.fork(parent, parent)


def test_check_invariants_detects_corruption():
    kv = KVCacheManager(KVCacheConfig(block_size=4, num_blocks=4))
    a = _req("a")
    kv.allocate(a, 8)
    kv.check_invariants()
    a.block_ids.append(3)  # a block the manager never handed out
    with pytest.raises(AssertionError, match="block 3: ref count 0, held by 1"):
        kv.check_invariants()
    a.block_ids.pop()
    kv._free.append(0)  # a used block also on the free list
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_random_allocate_fork_free_keeps_invariants():
    rng = random.Random(7)
    kv = KVCacheManager(KVCacheConfig(block_size=4, num_blocks=40))
    live: list[Request] = []
    for i in range(3000):
        op = rng.random()
        if op < 0.45 or not live:
            r = live[rng.randrange(len(live))] if live and rng.random() < 0.6 else _req(f"r{i}", 64)
            n = rng.randint(1, 9)
            if kv.can_allocate(r, n):
                kv.allocate(r, n)
                r.num_computed_tokens += n
                if r not in live:
                    live.append(r)
            else:
                with pytest.raises(NoFreeBlocksError):
                    kv.allocate(r, n)
        elif op < 0.6:
            child = _req(f"f{i}", 64)
            kv.fork(live[rng.randrange(len(live))], child)
            live.append(child)
        else:
            kv.free(live.pop(rng.randrange(len(live))))
        kv.take_pending_copies()
        kv.check_invariants()
        for r in live:
            assert len(r.block_ids) * 4 >= r.num_computed_tokens
    for r in live:
        kv.free(r)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 40
    kv.check_invariants()
