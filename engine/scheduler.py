"""Continuous batching with priorities, a per-step token budget, chunked prefill and preemption.

Each ``schedule()`` call builds one engine step (a ``StepPlan``) of at most
``max_num_batched_tokens`` new tokens and ``max_num_seqs`` running requests: decodes first,
then split prefills, then waiting requests, each group most urgent first (``Scheduler``
states the policy). Lower ``priority`` is more urgent, and waiting ages a request's priority,
so no request starves. When blocks run out the least urgent running request is preempted by
recompute. With prefix caching, an admitted request starts after its cached leading blocks.

Guarantees (checked by tests/engine/test_scheduler.py): the budget and ``max_num_seqs`` are
never exceeded; outputs with preemption equal outputs without; every finished or aborted
request leaves no blocks behind; the most urgent running request always makes progress.
Costs per step: O(R log R) for R running requests plus O(C + k log C) to admit k waiting
requests from C priority classes. Deterministic for a given clock; not thread-safe: one
thread (the engine loop), or one lock around it and add() and abort().
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..instrumentation import check_range, check_settings, setting
from .kv_cache import KVCacheManager
from .prefix_cache import PrefixCacheStats
from .request import FinishReason, Request, RequestStatus, pending_token

__all__ = ["SchedulerConfig", "QueueFullError", "ScheduledRequest", "StepPlan", "Scheduler"]

_NO_CACHE = PrefixCacheStats()   # a plan's prefix cache counts when the cache is off


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests; the server answers HTTP 429."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits and priority aging. Errors name the bad value and the allowed range."""

    max_num_seqs: int = setting(64, "running requests (holding KV blocks) per step", lo=1,
                                flag="--max-num-seqs")
    # the flag's absence lets the engine core pick by device (engine/cli.py)
    max_num_batched_tokens: int = setting(2048, "new tokens per step, prefill and decode together "
                                                "(default: 8192 on a GPU of >= 70 GiB, else 2048)",
                                          lo=1, flag="--max-num-batched-tokens", flag_default=None)
    max_waiting: int = setting(1024, "waiting queue bound (HTTP 429 past it)", lo=1, flag="--max-waiting")
    aging_s: float = setting(10.0, "a waiting request gains one priority level per this many seconds",
                             lo=0, lo_open=True, hint="(math.inf disables aging)", flag="--aging-s")

    def __post_init__(self) -> None:
        check_settings(self)
        # Otherwise decodes alone could eat the budget and starve a split prefill forever.
        check_range("max_num_batched_tokens", self.max_num_batched_tokens, self.max_num_seqs, integer=True,
                    hint="(at least max_num_seqs)")


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: positions [computed_before, computed_before + num_new_tokens)."""

    request: Request
    num_new_tokens: int
    is_prefill: bool
    computed_before: int
    # Sequence length when scheduled; update() appends tokens, so samples_token must not read it live.
    num_tokens_at_schedule: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens_at_schedule", self.request.num_tokens)

    @property
    def end(self) -> int:
        """One past the last position computed in this step."""
        return self.computed_before + self.num_new_tokens

    @property
    def samples_token(self) -> bool:
        """This chunk reaches the end of the known tokens: its last position's logits yield a token."""
        return self.end == self.num_tokens_at_schedule


@dataclass
class StepPlan:
    """What one engine step computes, and the cache state after scheduling it."""

    step_id: int
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    num_prefill_tokens: int
    num_decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int = 0  # after scheduling (extension, for step telemetry)
    num_waiting: int = 0
    # Prefix cache (``prefix_caching``: on), while this plan was made: prompt tokens of the
    # requests it admitted whose KV came from the cache (its cached prefill tokens;
    # num_prefill_tokens are the computed ones) and the tokens looked up; parked blocks
    # evicted; blocks cached after it.
    prefix_caching: bool = False
    num_cached_prefill_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_blocks: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Scheduler:
    """Owns waiting and running requests; decides each step; applies each step's sampled tokens.

    Each step fills the token budget in this order:

    1. decodes of running requests (one token each), most urgent first;
    2. running requests whose prefill was split (chunked prefill), most urgent first;
    3. waiting requests, most urgent first, each getting ``min(tokens left, budget left)``
       tokens; admission stops at the first waiting request whose chunk does not fit in the
       free blocks, so a less urgent request never jumps ahead of a more urgent one. With
       prefix caching, "tokens left" starts after the cached blocks of its leading tokens
       (``KVCacheManager.find_cached_prefix``), which it takes on admission; a preempted
       request finds the blocks it released again unless they were evicted meanwhile.

    Urgency: a request's effective priority is ``priority - floor(seconds since arrival /
    aging_s)``; ties go to the earlier arrival (FIFO within a class). Everyone ages alike, so
    a priority gap of ``k`` is a head start of about ``k * aging_s`` seconds: a request is
    never passed by one that arrived ``(its priority - other's priority) * aging_s`` seconds
    or more after it.

    Preemption: when a running request needs a block and none is free (a split prefill first
    shrinks its chunk to the room it has), the least urgent running request that is either
    not yet scheduled in this step or less urgent than the requester is preempted by
    recompute (a scheduled victim's entry is withdrawn and its tokens refunded); the victim
    may be the requester itself. Its blocks are freed, ``num_computed_tokens`` drops to 0, it
    returns to the waiting queue with ``num_preemptions += 1`` and is listed in
    ``StepPlan.preempted``; a later prefill covers all of ``all_token_ids``. A request never
    loses its blocks to a less urgent one; waiting requests never preempt running ones.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.clock = clock
        self._waiting = _WaitingQueue()
        self._running: list[Request] = []
        self._live: dict[str, Request] = {}
        self._order: dict[int, int] = {}  # id(request) -> admission number: the last tie-breaker
        self._next_order = 0
        self._next_step_id = 0

    # ---- queue ------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def get(self, request_id: str) -> Request | None:
        """The live (waiting or running) request with this id, if any."""
        return self._live.get(request_id)

    def waiting_requests(self) -> list[Request]:
        """The waiting requests, most urgent first at the clock's current time (O(W log C))."""
        now = self.clock()
        return list(self._waiting.in_order(lambda r: self.urgency_key(r, now)))

    def running_requests(self) -> list[Request]:
        """The running requests, in no particular order (a copy)."""
        return list(self._running)

    def max_request_tokens(self) -> int:
        """Largest prompt + max_tokens the cache can ever hold for one request (KV of all but the last token)."""
        return self.kv_cache.num_blocks * self.kv_cache.block_size + 1

    def add(self, request: Request) -> None:
        """Queue a new request. Raises ValueError (unusable: duplicate id, not fresh, or longer than
        the whole cache could ever hold) or QueueFullError (queue at max_waiting). Preempted
        requests re-enter the queue without this bound, so num_waiting may briefly exceed it."""
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already queued or running")
        if request.status is not RequestStatus.WAITING or request.block_ids or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} is not fresh (status {request.status.name})")
        needed = request.num_tokens + request.sampling.max_tokens - request.num_output_tokens
        if needed > self.max_request_tokens():
            raise ValueError(
                f"request {request.request_id} needs up to {needed} tokens (prompt + max_tokens); "
                f"the KV cache holds at most {self.max_request_tokens()}"
            )
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self._order[id(request)] = self._next_order
        self._next_order += 1
        self._live[request.request_id] = request
        self._waiting.add(request, self._order[id(request)])

    def effective_priority(self, request: Request, now: float) -> int:
        """``priority - floor(waited / aging_s)``, never above ``priority``."""
        waited = max(0.0, now - request.arrival_time_s)
        aged = waited / self.config.aging_s
        return request.priority - (math.floor(aged) if math.isfinite(aged) else 0)

    def urgency_key(self, request: Request, now: float) -> tuple[int, float, int]:
        """Sort key, smallest first: effective priority, then arrival, then admission order."""
        return (self.effective_priority(request, now), request.arrival_time_s, self._order[id(request)])

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Build the next step. Allocates the blocks it schedules; may preempt (see module doc)."""
        now = self.clock()
        caching = self.kv_cache.prefix_cache is not None
        cache_before = self.kv_cache.prefix_cache_stats() if caching else None
        step = _StepBuilder(self.config.max_num_batched_tokens)
        key = {id(r): self.urgency_key(r, now) for r in self._running}
        self._running.sort(key=lambda r: key[id(r)])
        decodes = [r for r in self._running if _is_decode(r)]
        partials = [r for r in self._running if not _is_decode(r)]

        for is_prefill, group in ((False, decodes), (True, partials)):
            for request in group:
                if step.budget == 0:
                    break
                if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                    continue
                want = min(request.num_tokens - request.num_computed_tokens, step.budget)
                if want <= 0:
                    continue
                num_new = self._fit_or_preempt(request, want, step, key)
                if num_new > 0:
                    step.add(self._schedule_chunk(request, num_new, is_prefill))

        if step.budget > 0 and self._waiting and len(self._running) < self.config.max_num_seqs:
            self._admit_waiting(step, now)

        cache = self.kv_cache.prefix_cache_stats().minus(cache_before) if caching else _NO_CACHE
        plan = StepPlan(
            step_id=self._next_step_id,
            scheduled=step.scheduled,
            preempted=step.preempted,
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_tokens=step.num_decode_tokens,
            kv_blocks_used=self.kv_cache.num_used_blocks,
            kv_blocks_total=self.kv_cache.num_blocks,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            prefix_caching=caching,
            num_cached_prefill_tokens=cache.hits,
            prefix_cache_queries=cache.queries,
            prefix_cache_evictions=cache.evictions,
            prefix_cache_blocks=cache.cached_blocks,
        )
        self._next_step_id += 1
        return plan

    def _admit_waiting(self, step: _StepBuilder, now: float) -> None:
        """Move waiting requests to running, most urgent first, while budget, seats and blocks last."""
        just_preempted = {id(r) for r in step.preempted}
        admitted: list[Request] = []
        for request in self._waiting.in_order(lambda r: self.urgency_key(r, now)):
            if step.budget == 0 or len(self._running) >= self.config.max_num_seqs:
                break
            if id(request) in just_preempted:
                break  # it just gave its blocks up: re-admitting it would thrash, passing it would invert priority
            hit = self.kv_cache.find_cached_prefix(request)
            num_new = min(request.num_tokens - hit.num_tokens, step.budget)
            if not self.kv_cache.can_allocate(request, num_new, hit):
                break  # keep priority order: nobody less urgent may pass it
            self.kv_cache.take_prefix(request, hit)
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time_s is None:
                request.first_scheduled_time_s = now
                request.num_cached_tokens = hit.num_tokens
            self._running.append(request)
            admitted.append(request)
            step.add(self._schedule_chunk(request, num_new, True))
        for request in admitted:
            self._waiting.remove(request)

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Apply a finished step: advance computed tokens, append sampled tokens, finish requests.

        ``sampled`` maps request_id -> token for every entry whose ``samples_token`` is True.
        A request finishes on its eos token (unless ``ignore_eos``) with STOP, or on reaching
        ``max_tokens`` with LENGTH; its blocks are freed. Entries whose request was aborted or
        finished after schedule() are skipped. Returns the requests finished here, in plan order.
        """
        now: float | None = None
        finished: list[Request] = []
        for entry in plan.scheduled:
            request = entry.request
            if request.status is not RequestStatus.RUNNING or request.num_computed_tokens != entry.computed_before:
                continue  # aborted/finished since schedule(), or a stale plan
            request.num_computed_tokens = entry.end
            # Cached as soon as the step that writes them is applied (with overlapped scheduling,
            # launched): a later step reads them in stream order. A step that fails at launch is
            # never applied; one that fails on the device leaves the CUDA context unusable.
            self.kv_cache.cache_full_blocks(request)
            if not entry.samples_token:
                continue
            try:
                token = sampled[request.request_id]
            except KeyError:
                raise ValueError(f"no sampled token for request {request.request_id} in step {plan.step_id}") from None
            if now is None:
                now = self.clock()
            request.output_token_ids.append(token)
            if request.first_token_time_s is None:
                request.first_token_time_s = now
            reason = _finish_reason(request, token)
            if reason is not None:
                self._finish(request, reason, now)
                finished.append(request)
        return finished

    def update_pending(self, plan: StepPlan, rows: dict[str, int]) -> list[Request]:
        """``update`` for a step still running on the device (overlapped scheduling): each
        sampled request gets ``pending_token(row)``, so that the next ``schedule()`` can plan
        its decode; max_tokens finishes as in ``update``, an eos waits for ``resolve``."""
        return self.update(plan, {rid: pending_token(row) for rid, row in rows.items()})

    def resolve(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Puts the tokens of a step applied by ``update_pending`` in place of their stand-ins,
        then does what ``update`` would have: a request on its eos token finishes with STOP
        (one already finished on max_tokens says STOP too: the eos came first), and a first
        token or a finish is timed now. A request that ended meanwhile (abort, stop string,
        an earlier eos) dropped its stand-ins and is skipped. Returns the requests finished
        here, in plan order. O(sampled rows)."""
        now = self.clock()
        finished: list[Request] = []
        for entry in plan.scheduled:
            request = entry.request
            token = sampled.get(request.request_id) if entry.samples_token else None
            index = entry.end - request.num_prompt_tokens  # the token at position entry.end
            outputs = request.output_token_ids
            if token is None or index >= len(outputs) or outputs[index] >= 0:
                continue
            outputs[index] = token
            self.kv_cache.cache_full_blocks(request)   # a block of known tokens may be full now
            if index == 0:
                request.first_token_time_s = now
            eos = (not request.sampling.ignore_eos and request.eos_token_id is not None
                   and token == request.eos_token_id)
            if request.status is RequestStatus.FINISHED:  # on max_tokens, by update_pending
                if eos:
                    request.finish_reason = FinishReason.STOP
                if index == len(outputs) - 1:
                    request.finish_time_s = now
                elif eos:    # it ended before the step that reached max_tokens: ended here
                    del outputs[index + 1:]
                    request.finish_time_s = now
                    finished.append(request)
            elif eos:
                del outputs[index + 1:]    # stand-ins of the steps after it
                self._finish(request, FinishReason.STOP, now)
                finished.append(request)
        return finished

    def abort(self, request_id: str) -> Request | None:
        """Finish a waiting or running request with ABORT and free its blocks; None if unknown or done."""
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish a live request with ``reason`` (e.g. STOP on a stop string); None if unknown or done."""
        request = self._live.get(request_id)
        if request is None:
            return None
        outputs = request.output_token_ids
        while outputs and outputs[-1] < 0:   # stand-ins of steps in flight: never delivered
            outputs.pop()
        self._finish(request, reason, self.clock())
        return request

    # ---- internals ----------------------------------------------------------------------------
    def _schedule_chunk(self, request: Request, num_new: int, is_prefill: bool) -> ScheduledRequest:
        entry = ScheduledRequest(request, num_new, is_prefill, request.num_computed_tokens)
        self.kv_cache.allocate(request, num_new)
        return entry

    def _fit_or_preempt(self, request: Request, want: int, step: _StepBuilder,
                        key: dict[int, tuple[int, float, int]]) -> int:
        """Tokens (<= want) of ``request`` the free blocks can take, preempting to make room.

        Victims are the least urgent running requests that are either not yet scheduled in this
        step or less urgent than ``request`` (their entry is withdrawn and its tokens refunded), so
        a request never loses its blocks to a less urgent one. Returns 0 when ``request`` itself
        was the least urgent and got preempted.
        """
        kv = self.kv_cache
        mine = key[id(request)]
        while True:
            if kv.can_allocate(request, want):
                return want
            # A split prefill may shrink to whatever its own blocks plus the free ones cover.
            room = (len(request.block_ids) + kv.num_free_blocks) * kv.block_size - request.num_computed_tokens
            if room > 0 and not _is_decode(request) and kv.can_allocate(request, min(want, room)):
                return min(want, room)
            victim = max((r for r in self._running if not step.holds(r) or key[id(r)] > mine),
                         key=lambda r: key[id(r)])
            if step.holds(victim):
                step.withdraw(victim)
                want = min(request.num_tokens - request.num_computed_tokens, step.budget)
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return 0

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._running.remove(request)
        self._waiting.add(request, self._order[id(request)])

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time_s = now
        self._live.pop(request.request_id, None)
        self._order.pop(id(request), None)


class _WaitingQueue:
    """Waiting requests, one list per priority class, each in (arrival, admission) order.

    Everyone ages alike, so within a class that order is the urgency order at any moment; the
    global urgency order is then a lazy merge of the class lists. Cost: O(log W) to add or
    remove (plus a list shift), O(C + k log C) to take the k most urgent of C classes -- instead
    of re-sorting all W waiting requests every step.
    """

    def __init__(self) -> None:
        self._classes: dict[int, list[tuple[float, int, Request]]] = {}
        self._where: dict[int, tuple[int, float, int]] = {}  # id(request) -> (class, arrival, order)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, request: Request, order: int) -> None:
        where = (request.priority, request.arrival_time_s, order)
        self._where[id(request)] = where
        bisect.insort(self._classes.setdefault(where[0], []), (where[1], where[2], request))
        self._size += 1

    def remove(self, request: Request) -> None:
        cls, arrival, order = self._where.pop(id(request))
        entries = self._classes[cls]
        index = bisect.bisect_left(entries, (arrival, order))
        del entries[index]
        if not entries:
            del self._classes[cls]
        self._size -= 1

    def in_order(self, key: Callable[[Request], tuple[int, float, int]]):
        """Iterate the requests most urgent first (do not add or remove while iterating)."""
        streams = ((entry[2] for entry in entries) for entries in self._classes.values())
        return heapq.merge(*streams, key=key)


class _StepBuilder:
    """The step being assembled: entries, token budget left, counters, preemptions."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: list[ScheduledRequest] = []
        self.preempted: list[Request] = []
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self._entry: dict[int, ScheduledRequest] = {}  # id(request) -> its entry in this step

    def holds(self, request: Request) -> bool:
        return id(request) in self._entry

    def add(self, entry: ScheduledRequest) -> None:
        self.scheduled.append(entry)
        self._entry[id(entry.request)] = entry
        self._count(entry, +1)

    def withdraw(self, request: Request) -> None:
        """Take a request back out of this step (it is being preempted) and refund its tokens."""
        entry = self._entry.pop(id(request))
        self.scheduled.remove(entry)
        self._count(entry, -1)

    def _count(self, entry: ScheduledRequest, sign: int) -> None:
        self.budget -= sign * entry.num_new_tokens
        if entry.is_prefill:
            self.num_prefill_tokens += sign * entry.num_new_tokens
        else:
            self.num_decode_tokens += sign * entry.num_new_tokens


def _is_decode(request: Request) -> bool:
    """Only the newest sampled token lacks KV: the next step is a one-token decode."""
    return request.num_output_tokens > 0 and request.num_computed_tokens == request.num_tokens - 1


def _finish_reason(request: Request, token: int) -> FinishReason | None:
    if not request.sampling.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
        return FinishReason.STOP
    if request.num_output_tokens >= request.sampling.max_tokens:
        return FinishReason.LENGTH
    return None
