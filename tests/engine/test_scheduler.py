"""Scheduler: exact admission order, chunk sizes, preemption by recompute, and a randomized run.

A fake model stands in for the runner so that correctness is checkable without torch: it writes
each scheduled token id into a slot-addressed "KV cache" list and, before sampling, reads the
whole context back through the request's slots. A wrong slot mapping, a reused block that was not
recomputed, or a chunk that skips positions makes the read-back differ from ``all_token_ids``.
The sampled token is a hash of that context, so outputs with preemption must equal outputs of a
plain autoregressive loop.
"""

from __future__ import annotations

import math
import random

import pytest

from sightline.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from sightline.engine.scheduler import QueueFullError, SchedulerConfig
from tests.engine.scheduler_harness import Harness, next_token, reference_output, step_with_random_abort


def _chunks(h: Harness, rid: str) -> list[tuple[int, bool, bool]]:
    return [(e.num_new_tokens, e.is_prefill, e.samples_token)
            for p in h.plans for e in p.scheduled if e.request.request_id == rid]


def test_config_validation_names_the_bad_value():
    with pytest.raises(ValueError, match=r"max_num_seqs=0 is not an integer in \[1, inf\]"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8 is not an integer in \[16, inf\] "
                                         r"\(at least max_num_seqs\)"):
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"aging_s=-1 is not a number in \(0, inf\]"):
        SchedulerConfig(aging_s=-1)
    with pytest.raises(ValueError, match=r"max_tokens=0 is not an integer in \[1, inf\]"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"top_p=1.5 is not a number in \(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="at least 1 token"):
        Request("x", [])
    assert SamplingParams(stop="END").stop == ("END",)


def test_priority_order_with_one_slot():
    h = Harness(max_num_seqs=1)
    for rid, prio in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        h.add(rid, 5, max_tokens=3, priority=prio, arrival=0.0)
    finished = h.run()
    # b and d share class 0 and arrival time: admission order breaks the tie.
    assert [r.request_id for r in finished] == ["b", "d", "c", "a"]
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 3 for r in finished)


def test_fifo_within_a_class_follows_arrival_time():
    h = Harness(max_num_seqs=1)
    h.add("late", 4, max_tokens=2, arrival=3.0)
    h.add("early", 4, max_tokens=2, arrival=1.0)
    h.add("mid", 4, max_tokens=2, arrival=2.0)
    h.clock.now = 5.0
    assert [r.request_id for r in h.run()] == ["early", "mid", "late"]


def test_aging_improves_priority_one_class_per_aging_s():
    h = Harness(max_num_seqs=1, aging_s=10.0)
    old = h.add("old", 4, max_tokens=1, priority=3, arrival=0.0)
    assert [h.sched.effective_priority(old, t) for t in (0.0, 9.99, 10.0, 25.0, 30.0)] == [3, 3, 2, 1, 0]
    # At t=15 "old" is class 2: a fresh class-1 request goes first.
    h.clock.now = 15.0
    h.add("new1", 4, max_tokens=1, priority=1)
    assert [e.request.request_id for e in h.step()[0].scheduled] == ["new1"]
    # At t=20 "old" is class 1, tied with a fresh class-1 request: the earlier arrival wins.
    h.clock.now = 20.0
    h.add("new2", 4, max_tokens=1, priority=1)
    assert [e.request.request_id for e in h.step()[0].scheduled] == ["old"]


@pytest.mark.parametrize("aging_s", [10.0, math.inf])
def test_aging_prevents_starvation(aging_s):
    h = Harness(max_num_seqs=1, aging_s=aging_s)
    low = h.add("low", 4, max_tokens=2, priority=5, arrival=0.0)
    for i in range(300):  # a new class-0 request every second, each needing two steps: a growing backlog
        h.add(f"hi{i}", 4, max_tokens=2, priority=0)
        h.step()
        h.clock.now += 1.0
        if low.is_finished:
            break
    if aging_s == math.inf:
        assert not low.is_finished and low.first_scheduled_time_s is None
        return
    # Everyone ages alike, so 5 classes are a 50 s head start: "low" precedes every request that
    # arrived 50 s or more after it, and follows (only) earlier ones.
    assert low.is_finished
    before = [p.scheduled[0].request for p in h.plans
              if p.scheduled and p.scheduled[0].request.first_scheduled_time_s < low.first_scheduled_time_s]
    assert all(r.arrival_time_s < 50.0 for r in before)
    # Exactly: hi0..hi44 ran (2 s each); at t=90 "low" is class 5-9=-4, tied with hi45 (-floor(45/10)),
    # and wins the tie by arriving first.
    assert [r.request_id for r in dict.fromkeys(before)] == [f"hi{i}" for i in range(45)]
    assert low.first_scheduled_time_s == 90.0


def test_chunked_prefill_splits_long_prompts_exactly():
    h = Harness(max_num_batched_tokens=32, num_blocks=64)
    h.add("long", 100, max_tokens=3)
    h.run()
    assert _chunks(h, "long") == [(32, True, False), (32, True, False), (32, True, False), (4, True, True),
                                  (1, False, True), (1, False, True)]


def test_decodes_go_first_and_prefills_fill_the_rest():
    h = Harness(max_num_batched_tokens=32, num_blocks=64)
    h.add("a", 10, max_tokens=4)
    h.add("b", 50, max_tokens=2)
    h.step()
    h.add("c", 40, max_tokens=2)
    h.run()
    per_step = [[(e.request.request_id, e.num_new_tokens) for e in p.scheduled] for p in h.plans]
    assert per_step[:4] == [
        [("a", 10), ("b", 22)],
        [("a", 1), ("b", 28), ("c", 3)],  # the split prefill of b continues before c is admitted
        [("a", 1), ("b", 1), ("c", 30)],
        [("a", 1), ("c", 7)],  # b finished (2 tokens)
    ]
    assert [(p.num_decode_tokens, p.num_prefill_tokens) for p in h.plans[:4]] == [(0, 32), (1, 31), (2, 30), (1, 7)]


def test_preemption_picks_least_urgent_and_recomputes_exactly():
    # 6 blocks of 4 = 24 slots; three requests that each end up needing 4 blocks.
    h = Harness(block_size=4, num_blocks=6, max_num_batched_tokens=32)
    reqs = {rid: h.add(rid, 6, max_tokens=8, priority=prio, arrival=0.0, ignore_eos=True)
            for rid, prio in (("c", 2), ("a", 0), ("b", 1))}
    finished = h.run()
    preempted = [[r.request_id for r in p.preempted] for p in h.plans if p.preempted]
    assert preempted[0] == ["c"]  # the least urgent goes first
    assert all("a" not in ids for ids in preempted)  # the most urgent is never preempted
    assert reqs["a"].num_preemptions == 0 and reqs["c"].num_preemptions >= 1
    for rid, r in reqs.items():
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 8, None), rid
    # c's recompute prefill covered its prompt plus the tokens it had already generated.
    c_entries = [e for p in h.plans for e in p.scheduled if e.request is reqs["c"]]
    first_after = next(i for i, e in enumerate(c_entries) if i > 0 and e.computed_before == 0)
    before = c_entries[first_after - 1]
    assert c_entries[first_after].num_tokens_at_schedule == before.num_tokens_at_schedule + int(before.samples_token)
    assert c_entries[first_after].num_tokens_at_schedule > 6
    assert sorted(r.request_id for r in finished) == ["a", "b", "c"]


def test_urgent_split_prefill_withdraws_a_less_urgent_decode():
    # 4 blocks of 4. d (class 1) decodes; p (class 0) arrives with a 13-token prompt.
    h = Harness(block_size=4, num_blocks=4, max_num_batched_tokens=8, max_num_seqs=4)
    d = h.add("d", 3, max_tokens=10, priority=1, ignore_eos=True)
    h.step()
    p = h.add("p", 13, max_tokens=1, priority=0)
    for _ in range(3):
        h.step()
    steps = [([(e.request.request_id, e.num_new_tokens, e.is_prefill) for e in pl.scheduled],
              [r.request_id for r in pl.preempted], pl.kv_blocks_used) for pl in h.plans]
    assert steps == [
        ([("d", 3, True)], [], 1),
        ([("d", 1, False), ("p", 7, True)], [], 3),
        # d's position 4 takes the last free block; p shrinks to the 1 slot left in its own blocks
        ([("d", 1, False), ("p", 1, True)], [], 4),
        # p needs 2 more blocks: d's decode, already scheduled, is withdrawn and d is preempted
        ([("p", 5, True)], ["d"], 4),
    ]
    assert h.plans[-1].num_decode_tokens == 0 and h.plans[-1].num_prefill_tokens == 5
    h.run()
    assert p.num_preemptions == 0 and d.num_preemptions == 1
    assert d.output_token_ids == reference_output(d.prompt_token_ids, 10, None)


def test_waiting_admission_keeps_priority_order_when_blocks_are_short():
    h = Harness(block_size=4, num_blocks=6, max_num_batched_tokens=32)
    hog = h.add("hog", 10, max_tokens=2, ignore_eos=True)  # 3 blocks, then 3 free
    h.step()
    big = h.add("big", 16, max_tokens=1, priority=0)  # needs 4 blocks: does not fit yet
    small = h.add("small", 4, max_tokens=1, priority=1)  # would fit, but may not pass "big"
    plan, _ = h.step()
    assert [e.request.request_id for e in plan.scheduled] == ["hog"]
    assert small.status is RequestStatus.WAITING and hog.is_finished
    plan, _ = h.step()
    assert [(e.request.request_id, e.num_new_tokens) for e in plan.scheduled] == [("big", 16), ("small", 4)]
    assert big.is_finished and small.is_finished


def test_update_finish_rules_and_times():
    h = Harness()
    h.clock.now = 100.0
    stop = h.add("stop", 5, max_tokens=8)
    stop.eos_token_id = next_token(stop.prompt_token_ids)  # its first token is eos
    keep = h.add("keep", 5, max_tokens=4, ignore_eos=True)
    keep.eos_token_id = next_token(keep.prompt_token_ids)  # also eos first, but ignored
    h.clock.now = 101.0
    finished = h.run(tick_s=1.0)
    assert [r.request_id for r in finished] == ["stop", "keep"]
    assert stop.finish_reason is FinishReason.STOP and stop.output_token_ids == [stop.eos_token_id]
    assert keep.finish_reason is FinishReason.LENGTH and keep.num_output_tokens == 4
    assert keep.output_token_ids == reference_output(keep.prompt_token_ids, 4, keep.eos_token_id, ignore_eos=True)
    assert keep.output_token_ids[0] == keep.eos_token_id
    # one step per second from t=101: prefill (first token) at 101, then 3 decodes
    assert (stop.first_scheduled_time_s, stop.first_token_time_s, stop.finish_time_s) == (101.0, 101.0, 101.0)
    assert (keep.first_token_time_s, keep.finish_time_s) == (101.0, 104.0)


def test_finish_with_stop_string_reason_and_missing_sample():
    h = Harness()
    r = h.add("s", 5, max_tokens=10)
    plan = h.sched.schedule()
    with pytest.raises(ValueError, match="no sampled token for request s in step 0"):
        h.sched.update(plan, {})
    assert h.sched.finish("s", FinishReason.STOP) is r
    assert r.finish_reason is FinishReason.STOP and r.block_ids == [] and h.kv.num_used_blocks == 0
    assert h.sched.finish("s", FinishReason.STOP) is None


def test_queue_bound_duplicates_and_oversized_requests():
    h = Harness(block_size=4, num_blocks=4, max_waiting=2)
    h.add("a", 4)
    h.add("b", 4)
    with pytest.raises(QueueFullError, match="full \\(2 requests\\)"):
        h.add("c", 4)
    h.step()  # both admitted: the queue has room again
    h.add("c", 4)
    with pytest.raises(ValueError, match="already queued"):
        h.add("c", 4)
    # 16 slots hold the KV of prompt + max_tokens - 1 tokens: 9 + 8 fits, 10 + 8 does not.
    h.add("fits", 9, max_tokens=8)
    h.sched.abort("fits")
    with pytest.raises(ValueError, match="needs up to 18 tokens .* holds at most 17"):
        h.add("huge", 10, max_tokens=8)


def test_abort_frees_blocks_in_every_state():
    h = Harness(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    decoding = h.add("decoding", 3)
    prefilling = h.add("prefilling", 40)
    waiting = h.add("waiting", 4, priority=9)
    h.step()  # decoding: 3 tokens, prefilling: 13 of 40; waiting got no budget
    assert decoding.num_output_tokens == 1 and prefilling.num_computed_tokens == 13
    assert waiting.status is RequestStatus.WAITING
    plan = h.sched.schedule()
    assert h.sched.abort("prefilling") is prefilling  # between schedule() and update()
    assert prefilling.block_ids == [] and prefilling.finish_reason is FinishReason.ABORT
    h.sched.update(plan, {e.request.request_id: 1 for e in plan.scheduled if e.samples_token})
    assert prefilling.num_computed_tokens == 13  # the stale entry was skipped
    for r in (waiting, decoding):
        assert h.sched.abort(r.request_id) is r and r.is_finished and r.block_ids == []
    assert h.sched.abort("nope") is None and h.sched.abort("waiting") is None
    assert not h.sched.has_work and h.kv.num_used_blocks == 0
    h.kv.check_invariants()


def test_randomized_operations_keep_invariants_and_outputs():
    rng = random.Random(20261129)
    h = Harness(block_size=4, num_blocks=48, max_num_seqs=6, max_num_batched_tokens=24, max_waiting=12, aging_s=3.0)
    eos = 3
    live: list[Request] = []
    done: list[Request] = []
    n_preempt = n_full = 0
    for op in range(3000):
        x = rng.random()
        if x < 0.25:
            try:
                live.append(h.add(f"r{op}", rng.randint(1, 40), max_tokens=rng.randint(1, 30),
                                  priority=rng.randint(0, 3), eos=eos, ignore_eos=rng.random() < 0.3))
            except QueueFullError:
                n_full += 1
        elif x < 0.29 and live:
            r = live[rng.randrange(len(live))]
            reason = FinishReason.ABORT if rng.random() < 0.5 else FinishReason.STOP
            expected = None if r.is_finished else r
            assert h.sched.finish(r.request_id, reason) is expected
        else:
            n_preempt += len(step_with_random_abort(h, rng).preempted)
        h.clock.now += rng.choice((0.0, 0.5, 1.0))
        if op % 50 == 0:  # the lazy per-class merge agrees with a full sort by urgency
            waiting = h.sched.waiting_requests()
            assert waiting == sorted(waiting, key=lambda r: h.sched.urgency_key(r, h.clock.now))
            assert len(waiting) == h.sched.num_waiting
        assert h.sched.num_waiting + h.sched.num_running == sum(not r.is_finished for r in live)
        done += [r for r in live if r.is_finished]
        live = [r for r in live if not r.is_finished]
    for r in live:
        h.sched.abort(r.request_id)
    done += live
    assert not h.sched.has_work and h.kv.num_used_blocks == 0
    h.kv.check_invariants()
    # the run did exercise preemption and the queue bound
    assert n_preempt > 20 and n_full > 0, f"exercise: {n_preempt} preemptions, {n_full} full-queue rejections"
    natural = [r for r in done if r.finish_reason is FinishReason.LENGTH or
               (r.finish_reason is FinishReason.STOP and r.output_token_ids[-1:] == [eos] and not r.sampling.ignore_eos)]
    assert len(natural) > 100, f"exercise: {len(natural)} natural finishes"
    for r in natural:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens, eos,
                                                      r.sampling.ignore_eos), r.request_id
    for r in done:  # everything else stopped early: its output is a prefix of the reference
        ref = reference_output(r.prompt_token_ids, r.sampling.max_tokens, eos, r.sampling.ignore_eos)
        assert r.output_token_ids == ref[:r.num_output_tokens]
