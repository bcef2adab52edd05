"""Automatic prefix caching: full KV blocks found again by their tokens, kept until room is needed.

A full block is cached under the key ``(prefix id, its tokens)``. The prefix id names the
exact tokens before the block: 0 is the empty prefix (a request's ``cache_salt`` instead, so
that only requests of one salt share blocks), and each key cached for the first time draws
the next id from a counter. The key is a dict key: Python hashes it, chaining the block's
tokens onto its prefix's id, and compares it exactly on a match, so two different prefixes
never share a block whatever the hash values (ids are never reused). Nothing else changes a
block's KV today (no adapters, no images); whatever did would join the key.

Blocks no request holds stay cached, parked in least-recently-released order; the KV cache
manager hands out never-cached free blocks first and evicts the least recently used parked
block only when none is left. Costs: ``match`` O(prompt tokens) (one tuple and one dict
lookup per block); park, unpark, evict and register O(1). Plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["NO_HIT", "PrefixCache", "PrefixCacheStats", "PrefixHit", "ROOT_PREFIX_ID", "root_prefix"]

ROOT_PREFIX_ID = 0  # the empty prefix: the parent of every unsalted sequence's first block
PrefixId = int | str   # a salted sequence's empty prefix is its salt (a str: never an id)


def root_prefix(cache_salt: str | None) -> PrefixId:
    """The parent of a sequence's first block: its salt, else the shared empty prefix."""
    return ROOT_PREFIX_ID if cache_salt is None else cache_salt


class PrefixHit(NamedTuple):
    """The cached blocks that hold a request's leading tokens (a match; nothing is taken yet)."""

    block_ids: tuple[int, ...]   # the request's first len(block_ids) blocks
    prefix_ids: tuple[int, ...]  # prefix_ids[i]: the id of the tokens through block i
    num_tokens: int              # len(block_ids) * block_size
    num_parked: int              # of block_ids, held by nobody now (taking them uses free blocks)


NO_HIT = PrefixHit((), (), 0, 0)


class PrefixCacheStats(NamedTuple):
    """Running totals since start (counters) and the cached blocks now (a gauge)."""

    queries: int = 0         # tokens of the requests looked up when they were admitted
    hits: int = 0            # of those, tokens whose KV came from the cache
    evictions: int = 0       # parked blocks taken for other content
    cached_blocks: int = 0   # blocks cached now, held or parked

    def minus(self, before: "PrefixCacheStats") -> "PrefixCacheStats":
        """The counters' growth since ``before``; ``cached_blocks`` stays this record's."""
        return PrefixCacheStats(self.queries - before.queries, self.hits - before.hits,
                                self.evictions - before.evictions, self.cached_blocks)


class PrefixCache:
    """The key -> block map, the parked (evictable) blocks and the hit counters.

    The KV cache manager owns ref counts and the never-cached free list; this class only
    knows which blocks are cached and which of those nobody holds.
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        # (parent prefix id, tokens) -> (block id, prefix id of the tokens through the block)
        self._entries: dict[tuple[PrefixId, tuple[int, ...]], tuple[int, int]] = {}
        self._key_of: list[tuple[PrefixId, tuple[int, ...]] | None] = [None] * num_blocks
        self._parked: OrderedDict[int, None] = OrderedDict()   # least recently released first
        self._next_id = ROOT_PREFIX_ID + 1
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # ---- state --------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def is_cached(self, block_id: int) -> bool:
        return self._key_of[block_id] is not None

    def is_parked(self, block_id: int) -> bool:
        return block_id in self._parked

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries, self.hits, self.evictions, len(self._entries))

    @staticmethod
    def key(parent_id: PrefixId, tokens: Sequence[int]) -> tuple[PrefixId, tuple[int, ...]]:
        """The cache key of a block of ``tokens`` after the prefix ``parent_id`` (tests
        replace it with a colliding one to show that matches compare whole keys)."""
        return (parent_id, tuple(tokens))

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int, parent_id: PrefixId = ROOT_PREFIX_ID) -> PrefixHit:
        """The longest run of cached blocks holding ``tokens[:limit]`` from their start (whole
        blocks only; a partial last block is never matched)."""
        bs = self.block_size
        blocks: list[int] = []
        ids: list[int] = []
        parked = 0
        for start in range(0, min(limit, len(tokens)) - bs + 1, bs):
            entry = self._entries.get(self.key(parent_id, tokens[start:start + bs]))
            if entry is None:
                break
            block_id, parent_id = entry
            blocks.append(block_id)
            ids.append(parent_id)
            parked += block_id in self._parked
        return PrefixHit(tuple(blocks), tuple(ids), len(blocks) * bs, parked) if blocks else NO_HIT

    def record_lookup(self, num_query_tokens: int, hit: PrefixHit) -> None:
        self.queries += num_query_tokens
        self.hits += hit.num_tokens

    # ---- caching ------------------------------------------------------------------------------
    def register(self, parent_id: PrefixId, tokens: Sequence[int], block_id: int) -> int:
        """Caches ``block_id`` (full, its KV written or being written by the step in flight)
        as ``tokens`` after ``parent_id``; returns the prefix id through it. When that key is
        cached already (another request computed the same tokens meanwhile), the block
        stays uncached and the cached key's id is returned."""
        key = self.key(parent_id, tokens)
        entry = self._entries.get(key)
        if entry is not None:
            return entry[1]
        if self._key_of[block_id] is not None:
            raise RuntimeError(f"block {block_id} is cached already under another key")
        prefix_id = self._next_id
        self._next_id += 1
        self._entries[key] = (block_id, prefix_id)
        self._key_of[block_id] = key
        return prefix_id

    def park(self, block_id: int) -> None:
        """A cached block nobody holds any more: newest in the eviction order."""
        self._parked[block_id] = None

    def unpark(self, block_id: int) -> None:
        """A parked block matched again: held, so out of the eviction order."""
        del self._parked[block_id]

    def evict(self) -> int:
        """Uncaches the least recently released parked block and returns it (its tokens' KV
        is forgotten; a block cached after it in the same chain becomes unreachable and is
        evicted in its turn). IndexError when nothing is parked."""
        if not self._parked:
            raise IndexError("no parked block to evict")
        block_id, _ = self._parked.popitem(last=False)
        del self._entries[self._key_of[block_id]]
        self._key_of[block_id] = None
        self.evictions += 1
        return block_id

    # ---- checking -----------------------------------------------------------------------------
    def check(self, ref_counts: Sequence[int]) -> None:
        """AssertionError naming the first broken invariant: the key map and its inverse
        agree; a parked block is cached and held by nobody; a cached block nobody holds is
        parked."""
        for key, (block_id, _) in self._entries.items():
            if self._key_of[block_id] != key:
                raise AssertionError(f"block {block_id}: cached under {key!r} but records another key")
        cached = sum(k is not None for k in self._key_of)
        if cached != len(self._entries):
            raise AssertionError(f"{cached} blocks record a key, {len(self._entries)} keys are cached")
        for block_id in self._parked:
            if self._key_of[block_id] is None:
                raise AssertionError(f"parked block {block_id} is not cached")
            if ref_counts[block_id] != 0:
                raise AssertionError(f"parked block {block_id} has ref count {ref_counts[block_id]}")
        for block_id, key in enumerate(self._key_of):
            if key is not None and ref_counts[block_id] == 0 and block_id not in self._parked:
                raise AssertionError(f"cached block {block_id} is held by nobody and not parked")
