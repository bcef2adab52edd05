"""A fake model for scheduler tests: it writes each scheduled token into a slot-addressed
"KV cache" and samples a hash of the context it reads back, so any wrong slot, skipped
position or unrecomputed block changes the output (``reference_output`` is the oracle)."""

from __future__ import annotations


from sightline.engine.kv_cache import KVCacheConfig, KVCacheManager
from sightline.engine.request import Request, RequestStatus, SamplingParams
from sightline.engine.scheduler import Scheduler, SchedulerConfig, StepPlan


VOCAB = 50


def next_token(context: list[int]) -> int:
    h = 0
    for t in context:
        h = (h * 131 + t + 7) % 1_000_003
    return h % VOCAB


def reference_output(prompt: list[int], max_tokens: int, eos: int | None, ignore_eos: bool = False) -> list[int]:
    """What a plain autoregressive loop over next_token produces."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t == eos and not ignore_eos:
            break
    return out


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Harness:
    """Scheduler + KV manager + fake model, checking every step."""

    def __init__(self, *, block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32,
                 max_waiting=1024, aging_s=10.0, prefix_caching=False) -> None:
        self.clock = Clock()
        self.kv = KVCacheManager(KVCacheConfig(block_size=block_size, num_blocks=num_blocks,
                                               enable_prefix_caching=prefix_caching))
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_waiting=max_waiting, aging_s=aging_s)
        self.sched = Scheduler(self.config, self.kv, clock=self.clock)
        self.cache: list[int | None] = [None] * (block_size * num_blocks)
        self.plans: list[StepPlan] = []

    def add(self, rid: str, prompt_len: int, *, max_tokens=8, priority=0, arrival=None, eos=None,
            ignore_eos=False, prompt: list[int] | None = None) -> Request:
        """A request of ``prompt_len`` tokens made from its id, or of ``prompt`` when given."""
        if prompt is None:
            prompt = [(len(rid) * 17 + i * 7 + sum(map(ord, rid))) % VOCAB for i in range(prompt_len)]
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), priority=priority,
                    arrival_time_s=self.clock.now if arrival is None else arrival, eos_token_id=eos)
        self.sched.add(r)
        return r

    def step(self, between=None) -> tuple[StepPlan, list[Request]]:
        """One engine step; ``between(plan)`` runs after schedule() and before the model (e.g. an abort)."""
        plan = self.sched.schedule()
        self.plans.append(plan)
        assert plan.num_prefill_tokens + plan.num_decode_tokens <= self.config.max_num_batched_tokens
        assert sum(e.num_new_tokens for e in plan.scheduled) == plan.num_scheduled_tokens
        assert self.sched.num_running <= self.config.max_num_seqs
        assert len({id(e.request) for e in plan.scheduled}) == len(plan.scheduled)
        assert plan.kv_blocks_used == self.kv.num_used_blocks
        for r in plan.preempted:
            assert r.status is RequestStatus.WAITING and r.block_ids == [] and r.num_computed_tokens == 0
        self.kv.check_invariants()
        if between is not None:
            between(plan)
        for src, dst in self.kv.take_pending_copies():
            bs = self.kv.block_size
            self.cache[dst * bs:(dst + 1) * bs] = self.cache[src * bs:(src + 1) * bs]
        sampled = {}
        for e in plan.scheduled:
            r = e.request
            if r.is_finished:  # finished between schedule() and the model: the runner skips it
                continue
            assert e.num_new_tokens >= 1 and e.computed_before == r.num_computed_tokens
            decode_shaped = e.num_new_tokens == 1 and r.num_output_tokens > 0 and e.computed_before == r.num_tokens - 1
            if self.kv.prefix_cache is None:
                assert e.is_prefill is not decode_shaped
            else:  # a re-admitted request may find all but its last token cached: still its prefill
                assert e.is_prefill or decode_shaped
            for pos, tok in zip(range(e.computed_before, e.end), r.token_ids(e.computed_before, e.end)):
                self.cache[self.kv.slot(r, pos)] = tok
            if e.samples_token:
                context = [self.cache[self.kv.slot(r, p)] for p in range(e.end)]
                assert context == r.all_token_ids, f"KV of {r.request_id} differs from its tokens"
                sampled[r.request_id] = next_token(context)
        finished = self.sched.update(plan, sampled)
        for r in finished:
            assert r.block_ids == [] and r.is_finished
        self.kv.check_invariants()
        return plan, finished

    def run(self, max_steps=10_000, tick_s=0.0) -> list[Request]:
        finished = []
        for _ in range(max_steps):
            if not self.sched.has_work:
                break
            finished += self.step()[1]
            self.clock.now += tick_s
        assert not self.sched.has_work, "did not drain"
        assert self.kv.num_used_blocks == 0
        return finished


def step_with_random_abort(h: Harness, rng: random.Random) -> StepPlan:
    """One step; 5 % of the time one of its requests is aborted between schedule() and the model."""
    def abort_one(plan: StepPlan) -> None:
        if plan.scheduled and rng.random() < 0.05:
            victim = plan.scheduled[rng.randrange(len(plan.scheduled))].request
            assert h.sched.abort(victim.request_id) is victim and victim.block_ids == []
    return h.step(between=abort_one)[0]
