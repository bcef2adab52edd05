"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, prefix caching.

The manager owns block *ids* only; the runner turns a request's ``block_ids`` into slots
(position ``p``: ``block_ids[p // block_size] * block_size + p % block_size``). ``fork``
shares a parent's blocks with a child; the first write into a shared, partly filled block
copies it (a fresh block, and a (source, destination) pair the runner drains with
``take_pending_copies()``). With ``enable_prefix_caching`` full blocks are cached by their
tokens (``prefix_cache.py``): ``find_cached_prefix`` + ``take_prefix`` give a new request the
blocks of its cached leading tokens, ``cache_full_blocks`` caches blocks as they fill, and a
cached block nobody holds is free but keeps its KV until no never-cached block is left.

Guarantees: a block is either free (ref count 0) or held, and its ref count equals the
number of requests whose ``block_ids`` contain it (``check_invariants`` verifies this).
Costs: allocate/free/fork O(blocks touched); slot() O(1); find_cached_prefix O(prompt);
check_invariants() O(num_blocks + blocks held), for tests. Not thread-safe.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..instrumentation import check_range
from .prefix_cache import NO_HIT, PrefixCache, PrefixCacheStats, PrefixHit, root_prefix
from .request import Request

__all__ = [
    "KVCacheConfig",
    "KVCacheManager",
    "NoFreeBlocksError",
    "blocks_for_budget",
    "kv_bytes_per_block",
]


class NoFreeBlocksError(RuntimeError):
    """allocate() was asked for more blocks than are free (call can_allocate first)."""


@dataclass(frozen=True)
class KVCacheConfig:
    """Cache geometry. ``num_blocks`` is required (0 is rejected), usually from ``blocks_for_budget``."""

    block_size: int = 16  # tokens per block
    num_blocks: int = 0
    enable_prefix_caching: bool = False  # reuse full blocks across requests (prefix_cache.py)

    def __post_init__(self) -> None:
        check_range("block_size", self.block_size, 1, 4096, integer=True)
        check_range("num_blocks", self.num_blocks, 1, integer=True)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")

    @property
    def num_token_slots(self) -> int:
        return self.block_size * self.num_blocks


def blocks_for_budget(bytes_budget: int | float, bytes_per_block: int) -> int:
    """How many whole blocks fit in ``bytes_budget`` bytes (floor; 0 when none fit).

    The runner computes the budget from ``--gpu-memory-utilization`` (free memory times the
    fraction, minus activations) or ``--kv-cache-gib``; ``bytes_per_block`` from
    ``kv_bytes_per_block``.
    """
    check_range("bytes_per_block", bytes_per_block, 1, integer=True)
    check_range("bytes_budget", bytes_budget, 0)
    return int(bytes_budget // bytes_per_block)


def kv_bytes_per_block(*, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes one block occupies across all layers: K and V, ``[block_size, Hkv, D]`` each per layer."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("block_size", block_size), ("dtype_bytes", dtype_bytes)):
        check_range(name, value, 1, integer=True)
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


class KVCacheManager:
    """Hands out block ids to requests and takes them back."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self._ref_counts = [0] * config.num_blocks
        # FIFO reuse keeps allocation order deterministic and spreads writes over the cache.
        self._free: deque[int] = deque(range(config.num_blocks))
        self._holders: dict[int, Request] = {}  # id(request) -> request, for check_invariants
        self._pending_copies: list[tuple[int, int]] = []
        self._num_shared = 0  # blocks with ref count > 1; 0 (no forks) skips the copy-on-write scan
        # cached blocks nobody holds are free too, parked there rather than in _free
        self.prefix_cache = (PrefixCache(config.block_size, config.num_blocks)
                             if config.enable_prefix_caching else None)

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-cached ones and parked cached ones."""
        parked = self.prefix_cache.num_parked if self.prefix_cache is not None else 0
        return len(self._free) + parked

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ---- allocation ---------------------------------------------------------------------------
    def num_blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """Free blocks that allocate(request, num_new_tokens) would take (new ones plus copies),
        after ``take_prefix(request, hit)`` when a hit is given (its parked blocks count)."""
        if num_new_tokens < 0:
            check_range("num_new_tokens", num_new_tokens, 0, integer=True)
        if hit.block_ids:
            self._check_takes_prefix(request)
            end = hit.num_tokens + num_new_tokens
            return max(0, -(-end // self.block_size) - len(hit.block_ids)) + hit.num_parked
        end = request.num_computed_tokens + num_new_tokens
        have = len(request.block_ids)
        need_total = -(-end // self.block_size)
        appended = max(0, need_total - have)
        return appended + len(self._shared_in_write_range(request, end))

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        return self.num_blocks_needed(request, num_new_tokens, hit) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Extend ``request.block_ids`` to cover ``num_computed_tokens + num_new_tokens`` positions.

        Shared blocks that the new tokens would write into are replaced by private copies first.
        Raises NoFreeBlocksError (changing nothing) when too few blocks are free.
        """
        needed = self.num_blocks_needed(request, num_new_tokens)
        free = self.num_free_blocks
        if needed > free:
            raise NoFreeBlocksError(
                f"request {request.request_id} needs {needed} blocks, {free} free of {self.num_blocks}"
            )
        end = request.num_computed_tokens + num_new_tokens
        for index in self._shared_in_write_range(request, end):
            src = request.block_ids[index]
            dst = self._take()
            self._ref_counts[src] -= 1  # still > 0: another holder keeps it
            self._num_shared -= self._ref_counts[src] == 1
            request.block_ids[index] = dst
            self._pending_copies.append((src, dst))
        need_total = -(-end // self.block_size)
        while len(request.block_ids) < need_total:
            request.block_ids.append(self._take())
        if request.block_ids:
            self._holders[id(request)] = request

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks nobody else holds go back on the free list.

        Blocks are released last-first, so the tail of a sequence is reused before its head.
        Idempotent: freeing a request that holds nothing does nothing.
        """
        cache = self.prefix_cache
        for block_id in reversed(request.block_ids):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated (request {request.request_id})")
            self._ref_counts[block_id] = count
            if count == 0:
                if cache is not None and cache.is_cached(block_id):
                    cache.park(block_id)
                else:
                    self._free.append(block_id)
            elif count == 1:
                self._num_shared -= 1
        request.block_ids.clear()
        request.prefix_ids.clear()
        self._holders.pop(id(request), None)

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` share all of ``parent``'s blocks and computed tokens (no copy now).

        The child must hold no blocks. Its later writes into a shared, partly filled block copy
        that block (see take_pending_copies). Costs O(len(parent.block_ids)), no free blocks.
        """
        if child.block_ids:
            raise ValueError(f"fork target {child.request_id} already holds {len(child.block_ids)} blocks")
        if child is parent:
            raise ValueError(f"cannot fork request {parent.request_id} into itself")
        for block_id in parent.block_ids:
            self._ref_counts[block_id] += 1
            self._num_shared += self._ref_counts[block_id] == 2
        child.block_ids = list(parent.block_ids)
        child.prefix_ids = list(parent.prefix_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        if child.block_ids:
            self._holders[id(child)] = child

    # ---- prefix caching -----------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The cached blocks holding ``request``'s leading tokens (NO_HIT when caching is off).

        At most ``num_tokens - 1`` tokens, in whole blocks: the last token is always computed,
        since its logits give the next token. Tokens not read back yet (overlapped
        scheduling's stand-ins) end the match. Changes nothing."""
        if self.prefix_cache is None or request.block_ids:
            return NO_HIT
        known = request.num_prompt_tokens + request.num_output_tokens_read
        usable = min(request.num_tokens - 1, known) // self.block_size * self.block_size
        if usable == 0:
            return NO_HIT
        # the prompt itself when it holds them all: a miss then costs one block, not a copy
        tokens = (request.prompt_token_ids if usable <= request.num_prompt_tokens
                  else request.token_ids(0, usable))
        return self.prefix_cache.match(tokens, usable, root_prefix(request.cache_salt))

    def take_prefix(self, request: Request, hit: PrefixHit) -> None:
        """Gives a request that holds no block the blocks of ``hit`` (a parked one leaves the
        free blocks) and counts the lookup: ``num_tokens`` tokens queried, ``hit.num_tokens``
        found. The caller sets ``num_computed_tokens`` to ``hit.num_tokens``."""
        cache = self.prefix_cache
        if cache is None:
            return
        self._check_takes_prefix(request)
        for block_id in hit.block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                cache.unpark(block_id)
            elif count == 1:
                self._num_shared += 1
            self._ref_counts[block_id] = count + 1
        request.block_ids.extend(hit.block_ids)
        request.prefix_ids.extend(hit.prefix_ids)
        if hit.block_ids:
            self._holders[id(request)] = request
        cache.record_lookup(request.num_tokens, hit)

    def cache_full_blocks(self, request: Request) -> None:
        """Caches the request's blocks that are full of computed, known tokens and not cached
        yet (call after ``num_computed_tokens`` grows or stand-in tokens are read back).
        O(1) when no block filled."""
        cache = self.prefix_cache
        ids = request.prefix_ids
        bs = self.block_size
        if cache is None or request.num_computed_tokens < (len(ids) + 1) * bs:
            return   # the usual call (every scheduled request, every step): no block filled
        known = request.num_prompt_tokens + request.num_output_tokens_read
        full = min(request.num_computed_tokens, known, len(request.block_ids) * bs) // bs
        for index in range(len(ids), full):
            parent = ids[-1] if ids else root_prefix(request.cache_salt)
            ids.append(cache.register(parent, request.token_ids(index * bs, (index + 1) * bs),
                                      request.block_ids[index]))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's totals (all zero when caching is off)."""
        return self.prefix_cache.stats() if self.prefix_cache is not None else PrefixCacheStats()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source block, destination block) copies the runner must do before writing KV; clears them."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- addressing ---------------------------------------------------------------------------
    def slot(self, request: Request, position: int) -> int:
        """Flat cache slot of sequence position ``position`` (IndexError when no block covers it)."""
        if position < 0:
            raise IndexError(f"position must be >= 0, got {position}")
        index, offset = divmod(position, self.block_size)
        if index >= len(request.block_ids):
            raise IndexError(
                f"position {position} of request {request.request_id} is past its "
                f"{len(request.block_ids)} blocks of {self.block_size}"
            )
        return request.block_ids[index] * self.block_size + offset

    def slots(self, request: Request, start: int, end: int) -> list[int]:
        """Slots of positions [start, end), in order: the slot mapping of one scheduled chunk."""
        return [self.slot(request, p) for p in range(start, end)]

    # ---- checking -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant.

        free + used == total; no block both free and used; no block listed free twice; each
        block's ref count equals the number of live holders whose block_ids contain it.
        """
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        cache = self.prefix_cache
        if cache is not None:
            cache.check(self._ref_counts)
            cached_free = [b for b in free if cache.is_cached(b)]
            if cached_free:
                raise AssertionError(f"cached blocks on the never-cached free list: {cached_free[:8]}")
            free.update(b for b in range(self.num_blocks) if cache.is_parked(b))
        used = [b for b, c in enumerate(self._ref_counts) if c > 0]
        if any(c < 0 for c in self._ref_counts):
            raise AssertionError("negative ref count")
        if len(free) != self.num_free_blocks:
            raise AssertionError(f"{len(free)} distinct free blocks, num_free_blocks says {self.num_free_blocks}")
        if len(free) + len(used) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {len(used)} != total {self.num_blocks}")
        shared = sum(c > 1 for c in self._ref_counts)
        if shared != self._num_shared:
            raise AssertionError(f"{shared} blocks are shared, the counter says {self._num_shared}")
        both = free.intersection(used)
        if both:
            raise AssertionError(f"blocks both free and used: {sorted(both)[:8]}")
        expected = [0] * self.num_blocks
        for request in self._holders.values():
            if len(set(request.block_ids)) != len(request.block_ids):
                raise AssertionError(f"request {request.request_id} lists a block twice")
            if len(request.prefix_ids) > len(request.block_ids):
                raise AssertionError(f"request {request.request_id}: {len(request.prefix_ids)} prefix ids "
                                     f"for {len(request.block_ids)} blocks")
            for block_id in request.block_ids:
                expected[block_id] += 1
        for block_id, (want, got) in enumerate(zip(expected, self._ref_counts)):
            if want != got:
                raise AssertionError(f"block {block_id}: ref count {got}, held by {want} requests")

    # ---- internals ----------------------------------------------------------------------------
    def _take(self) -> int:
        """A free block: a never-cached one while any is left, else the cache's LRU parked one."""
        block_id = self._free.popleft() if self._free else self.prefix_cache.evict()
        self._ref_counts[block_id] = 1
        return block_id

    def _check_takes_prefix(self, request: Request) -> None:
        if request.block_ids or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} holds {len(request.block_ids)} blocks and "
                             f"{request.num_computed_tokens} computed tokens; a cached prefix is only "
                             "given to a request that holds none")

    def _shared_in_write_range(self, request: Request, end: int) -> list[int]:
        """Indices of shared blocks that positions [num_computed_tokens, end) would write into."""
        start = request.num_computed_tokens
        if end <= start or self._num_shared == 0:
            return []
        first = start // self.block_size
        last = min(len(request.block_ids), -(-end // self.block_size))
        return [i for i in range(first, last) if self._ref_counts[request.block_ids[i]] > 1]
