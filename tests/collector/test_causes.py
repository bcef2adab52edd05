"""The cause ``explain`` names for a slow request: one hand-built trace per cause class.

Each scenario is a minute of an engine's life sent to a real aggregator as OTLP: decode
steps back to back (18 ms, every tenth traced with its kernels' GPU time), a prefill step
now and then, background requests, per-SM CTA points every 10 s slot; then one target
request and what was planted around it. The answer is known by construction.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sightline.collector.aggregation_config import AggregationConfig
from sightline.collector.aggregator import Aggregator
from sightline.collector.causes import CauseConfig, CauseEvidence, classify
from sightline.collector.explain import explain_slowest, explain_trace
from sightline.collector.query_cli import format_explanation
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import T0_S, make_aggregator, otlp_cta_point, otlp_metrics, otlp_span, otlp_traces

T = T0_S - 100  # a multiple of the 10 s slot: slots start at T, T + 10, ...
STEP_S, GAP_S, GPU_S = 0.018, 0.002, 0.015  # a usual decode step: its time, the gap after, its GPU time
PREFILL_TOKENS, PREFILL_S, PREFILL_GPU_S = 512, 0.040, 0.036
LAUNCH_S = 0.001  # a replay's launch call returns this long after its step began
SMS, CTAS, CTA_S = 16, 200, 20e-6
TARGET = (9, 9)  # the target request's trace id kind and index
SERVER = 2
USUAL_OFF_CPU_S = 0.0005  # a traced replay's host time its thread spends off the CPU, usually


def tid(kind: int, i: int) -> bytes:
    return bytes([kind, i % 256, i // 256, 0]) * 4


def sid(kind: int, i: int, j: int = 0) -> bytes:
    return bytes([kind, i % 256, i // 256, j])


class Scenario:
    """The engine's minute: ``steps`` [(start, duration, prefill tokens, gpu time or None,
    jit compiles, spread)], requests, and per-slot CTA durations per SM. Decode steps are
    CUDA graph replays; a traced one's kernels run ``gpu`` in all over ``gpu * spread``."""

    def __init__(self, until_s: float = 60.0) -> None:
        self.steps = []
        t, n = T, 0
        while t < T + until_s:
            prefill = PREFILL_TOKENS if n % 25 == 12 else 0
            duration, gpu = (PREFILL_S, PREFILL_GPU_S) if prefill else (STEP_S, GPU_S)
            self.steps.append([t, duration, prefill, gpu if n % 10 == 0 else None, 0, 1.0])
            t += duration + GAP_S
            n += 1
        # slot start -> SM -> (CTAs, duration of each)
        self.ctas = {T + 10 * k: {sm: (CTAS, CTA_S) for sm in range(SMS)} for k in range(int(until_s // 10))}
        self.requests = []  # (trace kind, index, start, queue end, prefill end, end, priority)
        self.output_tokens = {}  # (trace kind, index) -> its output tokens, where not 32
        self.kernels_late = {}  # step index -> how long after the step's start its kernels begin
        # with launch ends: step index -> how long after the step's start its last launch call
        # returned (traced steps not listed: at LAUNCH_S for a replay, before its kernels' end
        # for an eager step, as when the launches pace it); None: no API records
        self.launched: dict[int, float] | None = None
        self.graphs = True  # decode steps replay CUDA graphs (False: every step eager)
        # step index -> how long after the step's start the engine began waiting for it
        # (traced steps with launch ends; not listed: no such attribute)
        self.waits: dict[int, float] = {}
        self.kv_blocks: dict[int, int] = {}   # step index -> KV blocks in use (not listed: not recorded)
        self.reasons: dict[int, str] = {}   # step index -> why its kernels were traced (not listed: none)
        # traced steps: how much of their host time their engine thread spent off the CPU
        # (the rest its CPU time); None: no step records its thread's CPU time
        self.off_cpu: dict[int, float] | None = None
        for i in range(int(until_s * 2)):
            start = T + 0.5 * i + 0.25
            self.requests.append((1, i, start, start + 0.005, start + 0.05, start + 1.0, 1))

    def between(self, a: float, b: float):
        return [s for s in self.steps if s[0] < T + b and s[0] + s[1] > T + a]

    def decoded(self, step) -> list[tuple[int, int]]:
        """The requests (trace kind, index) a step decoded: those past their queue while it ran."""
        start, end = step[0], step[0] + step[1]
        return [(kind, i) for kind, i, _, q, _, b, _ in self.requests if q < end and b > start]

    def target(self, start: float, queue_s: float, e2e: float, priority: int = 1) -> None:
        s = T + start
        self.requests.append((*TARGET, s, s + queue_s, s + queue_s + 0.05, s + e2e, priority))

    def send(self, agg) -> None:
        spans = []
        for n, (start, duration, prefill, gpu, compiles, spread) in enumerate(self.steps):
            end = start + duration
            links = [(tid(kind, i), sid(kind, i)) for kind, i in self.decoded(self.steps[n])]
            attrs = {sc.STEP_ID: n, sc.STEP_BATCH_SIZE: len(links) or 1, sc.STEP_PREFILL_TOKENS: prefill,
                     sc.STEP_DECODE_TOKENS: len(links)}
            if compiles:
                attrs[sc.STEP_JIT_COMPILES] = compiles
            graph = self.graphs and not prefill
            if graph:
                attrs[sc.STEP_CUDA_GRAPH] = True
            if n in self.waits:
                attrs[sc.STEP_WAIT_START_NS] = int((start + self.waits[n]) * 1e9)
            if n in self.kv_blocks:
                attrs[sc.STEP_KV_BLOCKS_USED] = self.kv_blocks[n]
            if n in self.reasons:
                attrs[sc.STEP_TRACE_REASON] = self.reasons[n]
            if self.off_cpu is not None and gpu is not None and graph and self.launched is None:
                # a replay's host time is its end beyond its last kernel (step_facts)
                host = duration - self.kernels_late.get(n, 0.0) - gpu * spread
                attrs[sc.STEP_HOST_CPU_S] = host - self.off_cpu.get(n, USUAL_OFF_CPU_S)
            spans.append(otlp_span(sc.SPAN_ENGINE_STEP, tid(3, n), sid(3, n), start, end, attrs, links=links))
            if gpu is not None:  # a traced step: summary spans of its kernels' GPU time
                at = start + self.kernels_late.get(n, 0.0)
                halves = [(at, at + gpu)] if spread == 1.0 else \
                    [(at, at + gpu / 2), (at + gpu * (spread - 0.5), at + gpu * spread)]
                launch = {}
                if self.launched is not None:
                    usual = LAUNCH_S if graph else halves[-1][1] - start - 0.001
                    launch = {sc.KERNEL_LAUNCH_END_NS: int((start + self.launched.get(n, usual)) * 1e9)}
                for j, (a, b) in enumerate(halves):
                    spans.append(otlp_span(sc.SPAN_KERNEL_SUMMARY_PREFIX + f"gemm{j}", tid(3, n), sid(3, n, 1 + j), a,
                                           b, {sc.HW_GPU_ID: 0, sc.CUDA_KERNEL_NAME: f"gemm{j}",
                                               sc.KERNEL_TOTAL_DURATION_S: gpu / len(halves),
                                               sc.KERNEL_LAUNCHES: 40, **launch}, parent=sid(3, n)))
        for kind, i, start, queue_end, prefill_end, end, priority in self.requests:
            root = (tid(kind, i), sid(kind, i))
            spans.append(otlp_span(sc.SPAN_HTTP_COMPLETIONS, *root, start, end, {
                sc.GEN_AI_REQUEST_MODEL: "tiny", sc.REQUEST_PRIORITY: priority, sc.REQUEST_E2E_S: end - start,
                sc.GEN_AI_USAGE_OUTPUT_TOKENS: self.output_tokens.get((kind, i), 32)},
                kind=SERVER))
            spans.append(otlp_span(sc.SPAN_QUEUE, root[0], sid(kind, i, 1), start, queue_end, parent=root[1]))
            spans.append(otlp_span(sc.SPAN_PREFILL, root[0], sid(kind, i, 2), queue_end, prefill_end, parent=root[1]))
            spans.append(otlp_span(sc.SPAN_DECODE, root[0], sid(kind, i, 3), prefill_end, end, parent=root[1]))
        agg.consume_traces(otlp_traces(spans))
        for slot, per_sm in sorted(self.ctas.items()):
            points = [otlp_cta_point(0, sm, "sightline_paged_decode", np.full(n, d), slot + 9.9)
                      for sm, (n, d) in per_sm.items() if n]
            agg.consume_metrics(otlp_metrics(points))


def explained(scenario: Scenario):
    agg = make_aggregator()
    scenario.send(agg)
    one = explain_trace(agg, tid(*TARGET).hex())
    return agg, one


def slow_steps(scenario: Scenario, a: float, b: float, factor: float, gpu_factor: float) -> None:
    """Steps in [a, b) take ``factor`` x their time, traced ones ``gpu_factor`` x their GPU time."""
    for s in scenario.between(a, b):
        s[1] *= factor
        if s[3] is not None:
            s[3] *= gpu_factor


def beyond(agg, scenario: Scenario, step) -> float:
    """The requests ``step`` decoded beyond the usual batch of ``agg``'s engine."""
    return max(0, len(scenario.decoded(step)) - agg.timeline.usual()["batch"])


def usual_gpu(agg, scenario: Scenario, start: float, end: float) -> float:
    """The GPU time of the traced steps in ``[start, end]`` over their usual: as usual, but for
    the requests they decoded beyond the usual batch (the target is one more than it)."""
    u = agg.timeline.usual()
    traced = [s for s in scenario.between(start, end) if s[3] is not None]
    usual = sum(u["gpu"] + u["gpu_per_token"] * s[2] + u["per_request"] * beyond(agg, scenario, s) for s in traced)
    return sum(s[3] for s in traced) / usual


def test_sm_contention_names_the_starved_sms_and_their_scores():
    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.5, 1.5)
    for sm in (0, 1, 2, 3):  # a neighbour on 4 of 16 SMs in the slot T+40..50: a tenth of their share
        sc_.ctas[T + 40][sm] = (20, CTA_S)
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_SM_CONTENTION, cause
    assert cause.evidence["sms"] == ["0", "1", "2", "3"]
    assert {s["reasons"][0] for s in cause.evidence["contended_sms"]} == {"starved"}
    # (16 * 200 - 4 * 180) / 16 CTAs were each SM's share; they ran 20
    assert cause.evidence["contended_sms"][0]["score"] == pytest.approx((12 * 200 + 4 * 20) / 16 / 20)
    assert cause.evidence["engine_slowdown"] == pytest.approx(1.5, rel=0.01)
    assert "other SMs in the same slots" in cause.compared_with


def test_with_half_of_the_sms_held_every_sm_alike_is_read_on_the_sms_not_flagged():
    """A neighbour on 8 of 16 SMs: they run a tenth of their share of CTAs, each 1.5x as
    long (sharing the SM), and the steps and their GPU time 1.5x. The median of all 16 SMs'
    CTA P90 (1.25x) is half held SMs; the 8 SMs no test flagged ran as usual: every SM alike
    is 1.0x. Read as 1.31x, a slowest request of the live half neighbour (H100, run 2: GPU
    2.27x, held within its steps' 1.50x, 66 SMs starved per kernel) was the device's, its
    CTAs' slowdown squared covering the GPU's; at 1.0x it is SM contention."""
    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.5, 1.5)
    for sm in range(0, SMS, 2):
        sc_.ctas[T + 40][sm] = (20, CTA_S * 1.5)
    for sm in range(1, SMS, 2):   # the held SMs' share went to the others
        sc_.ctas[T + 40][sm] = ((SMS * CTAS - 8 * 20) // 8, CTA_S)
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_SM_CONTENTION, cause
    assert cause.evidence["sms"] == [str(sm) for sm in range(0, SMS, 2)]
    assert cause.evidence["cta_slowdown"] == pytest.approx(1.0, rel=0.02)
    flags = [{"gpu": "0", "kernel": k, "sm": str(sm), "score": 4.4, "reasons": ["starved"]}
             for k in ("fa2", "decode") for sm in range(0, 132, 2)]
    live = CauseEvidence(e2e_s=0.82, queue_s=0.0, decode_s=0.8, priority="1", engine_slowdown=1.495, steps=36,
                         traced_steps=1, traced_near=6, gpu_slowdown=2.27, host_slowdown=1.0, cta_slowdown=1.31,
                         contended_sms=flags, sm_count=132, usual={"batch": 1.0, "gpu": 0.0112, "decode_mean": 0.0126})
    assert classify(live).name == sc.CAUSE_DEVICE_CONTENTION
    assert classify(CauseEvidence(**{**live.__dict__, "cta_slowdown": 1.0})).name == sc.CAUSE_SM_CONTENTION


def test_device_contention_every_sm_and_the_gpu_time_slower_alike():
    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.5, 1.5)
    sc_.ctas[T + 40] = {sm: (CTAS, CTA_S * 1.6) for sm in range(SMS)}
    sc_.target(40.2, 0.01, 2.0)
    agg, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_DEVICE_CONTENTION, cause
    assert cause.evidence["gpu_slowdown"] == pytest.approx(1.5, rel=0.01)
    # no step with prefill tokens was kernel-timed: what it was compared with says so
    assert agg.timeline.usual()["gpu_token_steps"] == 0
    assert "0.00 us per prefill token (from 0 kernel-timed steps with prefill tokens)" in cause.compared_with
    # the slot's median SM P90 over the median of the six slots' (five at 20 us, one at 32)
    assert cause.evidence["cta_slowdown"] == pytest.approx(1.6, rel=0.02)
    assert cause.evidence["cta_spread"] == pytest.approx(1.0)  # flat: every SM alike


def test_a_prefill_token_costs_the_slope_of_the_prefill_steps_though_short_ones_beat_a_decode_step():
    """Kernel-timed prefill steps of 64 to 4096 tokens at 4 ms plus 20 us a token: the short
    ones take less GPU time than a decode step's 15 ms (a CUDA graph that reads every weight
    and the KV), so their cost beyond the decode step is negative. A token costs the line's
    slope, 20 us, whatever share of the prompts is short."""
    sc_ = Scenario()
    lengths = (64, 96, 128, 256, 1024, 2048, 4096)
    for s, tokens in zip([s for s in sc_.steps if s[2]], lengths):
        s[2], s[3] = tokens, 0.004 + 20e-6 * tokens
    sc_.target(40.2, 0.01, 2.0)
    agg, _ = explained(sc_)
    u = agg.timeline.usual()
    assert u["gpu_token_steps"] == len(lengths)
    assert u["gpu_per_token"] == pytest.approx(20e-6, rel=1e-9)
    assert u["gpu"] == pytest.approx(GPU_S, rel=1e-4)


def test_the_usual_says_how_many_kernel_timed_prefill_steps_its_cost_per_token_rests_on():
    sc_ = Scenario()
    prefill_steps = [s for s in sc_.steps if s[2]]
    for s in prefill_steps[:5]:
        s[3] = PREFILL_GPU_S
    sc_.target(40.2, 0.01, 2.0)
    agg, one = explained(sc_)
    u = agg.timeline.usual()
    assert u["gpu_token_steps"] == 5
    assert u["gpu_per_token"] == pytest.approx((PREFILL_GPU_S - u["gpu"]) / PREFILL_TOKENS, rel=1e-9)
    assert (f"{u['gpu_per_token'] * 1e6:.2f} us per prefill token (from 5 kernel-timed steps with prefill "
            "tokens)") in one.cause.compared_with
    # three more traced in a slow spell: traced as the interval's prefill step, the five are
    # the usual's and the spell's are not; with none of the usual's, all of them are
    for s in prefill_steps[5:8]:
        s[3] = PREFILL_GPU_S
    for reason, counted in ((sc.TRACE_REASON_PREFILL, 5), (sc.TRACE_REASON_AFTER_TAIL, 8)):
        sc_.reasons = {sc_.steps.index(s): reason for s in prefill_steps[:5]}
        sc_.reasons.update({sc_.steps.index(s): sc.TRACE_REASON_SLOW_SPELL for s in prefill_steps[5:8]})
        agg, _ = explained(sc_)
        assert agg.timeline.usual()["gpu_token_steps"] == counted


def test_host_stall_steps_slower_with_the_gpu_time_as_usual():
    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.6, 1.0)  # host time per step 3 -> 13.8 ms, GPU time 15 ms as ever
    sc_.target(40.2, 0.01, 2.0)
    agg, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_HOST_STALL, cause
    assert cause.evidence["gpu_slowdown"] == pytest.approx(usual_gpu(agg, sc_, 40.2, 42.2), rel=1e-4)
    # the host's extra time (1.6 x the step, the GPU's part as usual) over the usual step
    assert cause.evidence["host_slowdown"] == pytest.approx(1 + (STEP_S * 1.6 - STEP_S) / STEP_S, rel=0.01)


def test_a_life_in_the_slot_still_open_says_its_sms_are_not_tested_yet():
    """The host stall above explained 5 s into the slot that holds the whole of its life (40
    to 50 s): the contention tests read closed slots only, so the cause says its last 2.0 s
    have no SM evidence yet, and when it will. Explained once the slot closed, it does not."""
    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.6, 1.0)
    sc_.target(40.2, 0.01, 2.0)
    now = [T0_S]
    agg = Aggregator(AggregationConfig(), clock=lambda: now[0])
    sc_.send(agg)
    closed = explain_trace(agg, tid(*TARGET).hex()).cause
    assert closed.name == sc.CAUSE_HOST_STALL and "sms_untested_s" not in closed.evidence, closed
    now[0] = T + 45.0
    cause = explain_trace(agg, tid(*TARGET).hex()).cause
    assert cause.name == sc.CAUSE_HOST_STALL, cause
    assert cause.evidence["sms_untested_s"] == pytest.approx(2.0, abs=0.02)
    assert cause.summary.endswith("; its last 2.0 s lie in a slot still open, whose SMs are tested when it "
                                  "closes (in 5 s)"), cause.summary


def test_host_time_the_thread_spent_on_the_cpu_is_heavier_work_not_a_stall():
    """The same steps 1.6x as long, host time 3 -> 13.8 ms, GPU time as ever, with each
    traced step's thread CPU time recorded: where the thread was on the CPU the whole time
    (its own work grew: a bigger batch), the host did not stall; where the extra time was
    off the CPU (another thread held the GIL), it did. Only off-CPU time beyond its usual
    (0.5 ms) stretches the steps."""
    def scenario(off_cpu_s: float) -> Scenario:
        sc_ = Scenario()
        sc_.off_cpu = {}
        slow_steps(sc_, 38, 46, 1.6, 1.0)
        for n, s in enumerate(sc_.steps):
            if s in sc_.between(38, 46) and s[3] is not None:
                sc_.off_cpu[n] = off_cpu_s
        sc_.target(40.2, 0.01, 2.0)
        return sc_

    host, usual_host = STEP_S * 1.6 - GPU_S, STEP_S - GPU_S
    agg, working = explained(scenario(USUAL_OFF_CPU_S))
    assert agg.timeline.usual()["host_off"] == pytest.approx(USUAL_OFF_CPU_S, rel=1e-3)
    assert agg.timeline.usual()["host_cpu"] == pytest.approx(usual_host - USUAL_OFF_CPU_S, rel=1e-3)
    assert working.cause.name != sc.CAUSE_HOST_STALL, working.cause
    assert working.cause.evidence["host_slowdown"] == pytest.approx(1.0, abs=1e-3)
    assert working.cause.evidence["host_cpu_slowdown"] == pytest.approx(
        (host - USUAL_OFF_CPU_S) / (usual_host - USUAL_OFF_CPU_S), rel=0.01)
    _, kept_off = explained(scenario(host - (usual_host - USUAL_OFF_CPU_S)))   # CPU time as usual
    assert kept_off.cause.name == sc.CAUSE_HOST_STALL, kept_off.cause
    assert kept_off.cause.evidence["host_slowdown"] == pytest.approx(1 + (host - usual_host) / STEP_S, rel=0.01)
    assert kept_off.cause.evidence["host_cpu_slowdown"] == pytest.approx(1.0, rel=0.01)
    assert "off the CPU" in kept_off.cause.summary


def test_host_time_off_the_cpu_a_fifth_over_its_usual_is_a_stall_where_the_gpu_ran_as_usual():
    """A GIL hog's slowest request live on an H100 (engine serve): steps 1.92x, its 12 traced
    steps 1.51x with GPU time 0.94x and CTAs 1.00x, host time off the CPU stretching them
    1.34x (its thread's CPU time 2.83x). Nothing but the host slowed them: a host stall. The
    same stretch beside a GPU that ran slower is not enough; under 1.2x it is not a stall."""
    live = CauseEvidence(e2e_s=0.97, queue_s=0.0, decode_s=0.9, priority="1", engine_slowdown=1.92, steps=61,
                         long_steps_s=0.11, traced_steps=12, gpu_slowdown=0.94, host_slowdown=1.34,
                         cta_slowdown=1.0, batch=2.98, kv_blocks=264.0, traced_slowdown=1.51,
                         host_cpu_slowdown=2.83, usual={"batch": 1.0, "kv_blocks": 18.0})
    cause = classify(live)
    assert cause.name == sc.CAUSE_HOST_STALL, cause
    assert classify(live, CauseConfig(host_slow_gpu_usual=1.5)).name == sc.CAUSE_UNKNOWN
    assert classify(CauseEvidence(**{**live.__dict__, "host_slowdown": 1.15})).name == sc.CAUSE_UNKNOWN
    slower_gpu = CauseEvidence(**{**live.__dict__, "gpu_slowdown": 1.6, "traced_slowdown": 1.9})
    assert classify(slower_gpu).name == sc.CAUSE_DEVICE_CONTENTION


def test_a_cpu_time_that_is_no_time_is_read_as_not_recorded():
    """Negative CPU times (a broken or hostile exporter) are not recorded ones: the steps keep
    the host-time reading of steps without them (a host stall here, 1.6x steps, GPU as usual)."""
    sc_ = Scenario()
    sc_.off_cpu = {n: 1.0 for n, s in enumerate(sc_.steps) if s[3] is not None}   # CPU time < 0
    slow_steps(sc_, 38, 46, 1.6, 1.0)
    sc_.target(40.2, 0.01, 2.0)
    agg, one = explained(sc_)
    assert "host_off" not in agg.timeline.usual() and "host_cpu" not in agg.timeline.usual()
    assert one.cause.name == sc.CAUSE_HOST_STALL, one.cause
    assert "host_cpu_slowdown" not in one.cause.evidence
    assert one.cause.evidence["host_slowdown"] == pytest.approx(1 + (STEP_S * 1.6 - STEP_S) / STEP_S, rel=0.01)


def test_a_stall_on_a_third_of_the_steps_is_a_host_stall_though_the_medians_stay_usual():
    """A thread holding the GIL 36 ms now and then: every third step's host time grows by
    36 ms, traced steps at the same rate, GPU time as ever. The median step, traced or not,
    is the usual one; its decode steps took about 1 + 36 / 3 / 18 times their usual in all,
    and the traced ones' host time says where that went. (The request is one more than
    the usual batch of 2: its steps' usual has one request's cost added.)"""
    sc_ = Scenario()
    for n, s in enumerate(sc_.steps):
        if s in sc_.between(38, 46) and n % 3 == 0:
            s[1] += 0.036
    sc_.target(40.2, 0.01, 2.0)
    agg, one = explained(sc_)
    assert one.cause.name == sc.CAUSE_HOST_STALL, one.cause
    lived = sc_.between(40.2, 42.2)
    expected = [PREFILL_S if s[2] else STEP_S for s in lived]
    assert np.median([s[1] / e for s, e in zip(lived, expected)]) == pytest.approx(1.0, rel=0.01)
    ev, u = one.cause.evidence, agg.timeline.usual()
    # its decode-only steps, but those in which a prefill step began (its launches stretch them)
    decode = [s for s in lived if not s[2] and not any(p[2] and s[0] < p[0] < s[0] + s[1] for p in sc_.steps)]
    usual = u["decode_mean"] + u["per_request"] * np.mean([beyond(agg, sc_, s) for s in decode])
    assert ev["engine_slowdown"] == pytest.approx(np.mean([s[1] for s in decode]) / usual, rel=1e-4)
    assert ev["engine_slowdown"] > 1.5
    traced = [(s, e + u["per_request"] * beyond(agg, sc_, s)) for s, e in zip(lived, expected) if s[3] is not None]
    assert ev["traced_steps"] == len(traced) >= 3
    stalled = sum(s[1] > e + 0.02 for s, e in traced)
    assert 0 < stalled < len(traced) / 2   # a minority of the traced steps
    assert ev["host_slowdown"] == pytest.approx(1 + 0.036 * stalled / sum(e for _, e in traced), rel=1e-3)
    assert ev["gpu_slowdown"] == pytest.approx(GPU_S * len(traced) / sum(
        GPU_S + u["per_request"] * beyond(agg, sc_, s) for s, _ in traced), rel=1e-4)


def test_the_wait_before_a_replays_first_kernel_is_not_host_time():
    """Steps 1.6x as long because their graph's kernels began late (the GPU's queue held by
    other work) and ran their usual time: the host saw them finish at once, so its time is
    as usual (the time after a replay's last kernel is what a late host stretches), and
    nothing in the steps says whose the wait was."""
    sc_ = Scenario()
    late = sc_.between(38, 46)
    for n, s in enumerate(sc_.steps):
        if s in late:
            sc_.kernels_late[n] = s[1] * 0.6
            s[1] *= 1.6
    sc_.target(40.2, 0.01, 2.0)
    agg, one = explained(sc_)
    assert one.cause.name == sc.CAUSE_UNKNOWN, one.cause
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx(usual_gpu(agg, sc_, 40.2, 42.2), rel=1e-4)
    assert one.cause.evidence["host_slowdown"] == pytest.approx(1.0, abs=0.01)


def test_with_launch_ends_a_replay_launched_late_is_the_hosts():
    """The GIL held elsewhere: each replay's launch returned 0.6 of a usual step late, its
    kernels began then and ran their usual time. The launch end says the wait was the
    host's (without it, nothing said whose: the test above)."""
    sc_ = Scenario()
    sc_.launched = {}
    for n, s in enumerate(sc_.steps):
        if s in sc_.between(38, 46):
            sc_.kernels_late[n] = s[1] * 0.6
            sc_.launched[n] = s[1] * 0.6 - 0.0005
            s[1] *= 1.6
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    assert one.cause.name == sc.CAUSE_HOST_STALL, one.cause
    # host: until the launch returned, then the step's end beyond its last kernel (3 ms)
    usual_host, host = LAUNCH_S + (STEP_S - GPU_S), STEP_S * 0.6 - 0.0005 + (STEP_S - GPU_S)
    assert one.cause.evidence["host_slowdown"] == pytest.approx(1 + (host - usual_host) / STEP_S, rel=0.01)
    # the GPU's part: from the launch's return (before the first kernel here) to the last kernel's end
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx((GPU_S + 0.0005) / GPU_S, rel=0.01)


def test_with_launch_ends_a_replay_waiting_on_the_gpu_is_device_contention():
    """The same late kernels, but each launch returned at once: the GPU's queue held them
    (another process's work), so the wait is the GPU's."""
    sc_ = Scenario()
    sc_.launched = {}
    for n, s in enumerate(sc_.steps):
        if s in sc_.between(38, 46):
            sc_.kernels_late[n] = s[1] * 0.6
            s[1] *= 1.6
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    assert one.cause.name == sc.CAUSE_DEVICE_CONTENTION, one.cause
    assert one.cause.evidence["host_slowdown"] == pytest.approx(1.0, abs=0.01)
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx(
        (STEP_S * 0.6 + GPU_S - LAUNCH_S) / (GPU_S - 0.0), rel=0.01)


def test_a_replay_that_waited_while_the_next_step_launched_is_not_a_host_stall():
    """Replays whose ends came 0.6 of a step late because the engine launched the next step
    (a long prefill) before waiting for them: launches, kernels and the wait after the wait
    began as usual, and the next step began as this one's kernels ended. Without the wait's
    start the late end reads as this step's host time (host_stall); with it, the host's own
    time is as usual: no host stall."""
    def scenario(wait_starts: bool) -> Scenario:
        sc_ = Scenario()
        sc_.launched = {}
        for n, s in enumerate(sc_.steps):
            if s in sc_.between(38, 46):
                s[1] *= 1.6
                if wait_starts and s[3] is not None:   # the usual 3 ms from the wait to the end
                    sc_.waits[n] = s[1] - (STEP_S - GPU_S)
                    sc_.steps[n + 1][0] = s[0] + s[3]   # the next step began as its kernels ended
        sc_.target(40.2, 0.01, 2.0)
        return sc_

    _, old = explained(scenario(False))
    assert old.cause.name == sc.CAUSE_HOST_STALL, old.cause
    _, one = explained(scenario(True))
    assert one.cause.name != sc.CAUSE_HOST_STALL, one.cause
    assert one.cause.evidence["host_slowdown"] == pytest.approx(1.0, abs=0.01)
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx(1.0, abs=0.01)


def test_a_loop_held_between_its_launches_and_its_wait_is_a_host_stall():
    """Replays 0.6 of a step late with launches and kernels as usual, whose engine came to
    wait for them only after their kernels had ended, while no next step had begun: the loop
    was held (a thread holding the GIL), the GPU idle. That time is the host's: host_stall,
    the host stretching each traced step by its time from the kernels' end to the wait."""
    sc_ = Scenario()
    sc_.launched = {}
    for n, s in enumerate(sc_.steps):
        if s in sc_.between(38, 46):
            s[1] *= 1.6
            if s[3] is not None:   # the usual 3 ms from the wait to the end, the next step after it
                sc_.waits[n] = s[1] - (STEP_S - GPU_S)
                sc_.steps[n + 1][0] = s[0] + s[1] + GAP_S
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    assert one.cause.name == sc.CAUSE_HOST_STALL, one.cause
    late = 1.6 * STEP_S - (STEP_S - GPU_S) - GPU_S   # from the kernels' end to the wait
    assert one.cause.evidence["host_slowdown"] == pytest.approx(1.0 + late / STEP_S, rel=0.02)
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx(1.0, abs=0.01)


def test_with_launch_ends_eager_steps_waiting_on_a_memory_hog_are_device_contention():
    """Eager steps (every step here, all traced) whose kernels ran 1.4x longer and waited
    between launches on another process's memory traffic, 2x the step: the launches
    returned as early as ever, so the host did not stall, and the waits after they returned
    are the GPU's. Without launch ends the step's time beyond its kernels' read as host time
    (host_stall, as a live HBM hog once was)."""
    def scenario(launch_ends: bool) -> Scenario:
        sc_ = Scenario()
        sc_.graphs = False
        sc_.launched = {} if launch_ends else None
        for n, s in enumerate(sc_.steps):
            if s in sc_.between(38, 46):
                if launch_ends and s[3] is not None:   # as usual: before its kernels' usual end
                    sc_.launched[n] = s[3] - 0.001
                s[1] *= 2.0
                if s[3] is not None:   # 1.4x the GPU time, spread over the whole 2x step
                    s[3] *= 1.4
                    s[5] = s[1] / s[3]
        sc_.target(40.2, 0.01, 2.0)
        return sc_

    _, one = explained(scenario(True))
    assert one.cause.name == sc.CAUSE_DEVICE_CONTENTION, one.cause
    # GPU time: the kernel time before the launches returned (the first half, 0.7 GPU_S)
    # plus everything from that return to the last kernel's end, the waits on the hog
    # included (usual: GPU_S, the same sum)
    launched, step, half = GPU_S - 0.001, 2.0 * STEP_S, 0.7 * GPU_S
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx((half + step - launched) / GPU_S, rel=0.02)
    assert one.cause.evidence["host_slowdown"] < 1.1
    _, old = explained(scenario(False))
    assert old.cause.name == sc.CAUSE_HOST_STALL, old.cause


def test_device_contention_when_another_process_shares_the_gpu():
    """Another process's kernels time-sliced between the engine's: each graph replay's kernels
    take their usual GPU time but span 1.9x as long, and so do its steps; CTAs as usual."""
    sc_ = Scenario()
    for s in sc_.between(38, 46):
        s[1] *= 1.9
        s[5] = 1.9
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    assert one.cause.name == sc.CAUSE_DEVICE_CONTENTION, one.cause
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx(1.9, rel=0.01)


def test_host_stall_names_the_host_though_idle_gpu_clocks_slow_the_ctas():
    """Each step waits 2.5x as long on the host; the graph replays' kernels span their usual
    time, while CTAs run 1.5x longer on every SM (a GPU left idle clocks down)."""
    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 2.5, 1.0)
    sc_.ctas[T + 40] = {sm: (CTAS, CTA_S * 1.5) for sm in range(SMS)}
    sc_.target(40.2, 0.01, 2.0)
    agg, one = explained(sc_)
    assert one.cause.name == sc.CAUSE_HOST_STALL, one.cause
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx(usual_gpu(agg, sc_, 40.2, 42.2), rel=1e-4)
    assert one.cause.evidence["cta_slowdown"] == pytest.approx(1.5, rel=0.02)


def test_a_gpu_slower_than_its_ctas_clock_says_is_not_a_clocked_down_gpu():
    """A slowest request of the kept HBM hog capture (run 2): GPU time per step 2.02x, the
    median SM's CTAs 1.32x, host time 1.90x. A clock that slowed the CTAs 1.32x slows the
    kernels about as much; the rest of the GPU's 2.02x was other work on the GPU, and the
    GPU stretched the steps more than the host did: device contention. With GPU time within
    the CTAs' slowdown at the margin (1.45x), the idle GPU clocked down: a host stall."""
    hog = CauseEvidence(e2e_s=2.0, queue_s=0.0, decode_s=1.9, priority="1", engine_slowdown=1.67, steps=60,
                        traced_steps=8, gpu_slowdown=2.02, host_slowdown=1.90, cta_slowdown=1.32, cta_spread=1.1,
                        batch=3.0, usual={"batch": 1.0})
    assert classify(hog).name == sc.CAUSE_DEVICE_CONTENTION
    clocked = CauseEvidence(**{**hog.__dict__, "gpu_slowdown": 1.45})
    assert classify(clocked).name == sc.CAUSE_HOST_STALL


def test_traced_steps_near_a_request_speak_for_its_gpu_only_within_its_own_steps_slowdown():
    """A slowest request of a live quarter-SM neighbour (H100, run 1): its steps 1.16x the
    usual, none of them traced; of the 4 traced steps within a second of its life one took
    140 ms (the GPU held whole), so their GPU time reads 3.38x. A step's GPU time is part of
    the step: its excess cannot exceed the request's own steps' (12.6 ms steps, 11.5 ms of GPU:
    at most 1.17x). Within that, the starved SMs in its slots name the cause; read as 3.38x,
    the GPU would have been slower than those SMs explain."""
    flags = [{"gpu": "0", "kernel": k, "sm": str(sm), "score": 1.5, "reasons": ["starved"]}
             for k in ("fa2", "decode") for sm in range(0, 132, 4)]
    near = CauseEvidence(e2e_s=0.47, queue_s=0.0, decode_s=0.45, priority="1", engine_slowdown=1.16, steps=45,
                         traced_steps=0, traced_near=4, gpu_slowdown=3.38, host_slowdown=1.0, cta_slowdown=1.0,
                         contended_sms=flags, sm_count=132,
                         usual={"batch": 1.0, "gpu": 0.0115, "decode_mean": 0.0126})
    assert classify(near).name == sc.CAUSE_SM_CONTENTION
    unbounded = CauseEvidence(**{**near.__dict__, "usual": {"batch": 1.0}})   # no usual GPU time to bound it
    assert classify(unbounded).name == sc.CAUSE_DEVICE_CONTENTION


def test_host_stall_from_time_with_no_step_running():
    sc_ = Scenario()
    # the engine loop stopped stepping for 0.9 s (a GIL held elsewhere); the steps themselves usual
    sc_.steps = [s for s in sc_.steps if not T + 40.5 <= s[0] < T + 41.4]
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_HOST_STALL, cause
    assert cause.evidence["idle_excess_s"] == pytest.approx(0.9, abs=0.03)


def test_queueing_with_the_priority_and_the_queue_it_found():
    sc_ = Scenario()
    # 5 urgent requests wait when it arrives (priority 0); 3 more arrive while it waits and go first
    for k in range(5):
        sc_.requests.append((4, k, T + 39.9, T + 40.6 + 0.1 * k, T + 40.7 + 0.1 * k, T + 41.5, 0))
    for k in range(3):
        sc_.requests.append((5, k, T + 40.3 + 0.1 * k, T + 41.2, T + 41.25, T + 42.0, 0))
    sc_.target(40.0, 1.5, 2.0, priority=2)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_QUEUEING, cause
    ev = cause.evidence
    assert (ev["queue_s"], ev["priority"]) == (pytest.approx(1.5), "2")
    # overtaken: those 3, and the 3 background requests (priority 1) that arrived at +0.25, +0.75
    # and +1.25 s and were taken within 5 ms
    assert (ev["depth"], ev["ahead_more_urgent"], ev["overtaken_by"]) == (5, 5, 6)
    assert "waited 1500 ms of 2000 ms in the queue (priority 2; 5 waiting when it arrived" in cause.summary
    # the steps during its wait carried, at the median, fewer requests than the fullest step
    assert ev["engine_full"] is False


def test_a_wait_with_nobody_ahead_and_the_engine_not_full_is_not_queueing():
    """The scheduler did not take it for 1.5 s, though nothing waited ahead, nothing more
    urgent went first and the engine ran below its fullest: the queue is not the cause."""
    sc_ = Scenario()
    sc_.target(40.0, 1.5, 2.0, priority=1)
    _, one = explained(sc_)
    assert one.cause.name != sc.CAUSE_QUEUEING, one.cause
    evidence = CauseEvidence(e2e_s=2.0, queue_s=1.5, decode_s=0.4, priority="1", engine_slowdown=1.0,
                             queue={"depth": 0, "ahead_more_urgent": 0, "overtaken_by": 0, "engine_full": False})
    assert classify(evidence).name == sc.CAUSE_UNKNOWN
    for behind in ({"depth": 2}, {"overtaken_by": 1}, {"engine_full": True}):
        assert classify(CauseEvidence(**{**evidence.__dict__, "queue": {**evidence.queue, **behind}})).name \
            == sc.CAUSE_QUEUEING, behind


def test_compile_names_the_step_that_compiled():
    sc_ = Scenario()
    [step] = [s for s in sc_.steps if s[0] >= T + 40.5][:1]
    step[1], step[4] = 0.8, 3  # a step that compiled three kernels while serving
    sc_.steps = [s for s in sc_.steps if not step[0] < s[0] < step[0] + 0.8]
    sc_.target(40.2, 0.01, 1.6)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_COMPILE, cause
    [c] = cause.evidence["compile_steps"]
    assert c["jit_compiles"] == 3 and c["duration_s"] == pytest.approx(0.8)
    assert c["step_id"] == sc_.steps.index(step)


def test_prefill_interference_in_its_decode_steps():
    sc_ = Scenario()
    # from its first token on, every step it rides also carries another request's 512-token
    # prefill: each takes 38 ms for that (the step after it begins 2 ms after its end), where
    # a decode-only step takes 18
    window = sc_.between(40.3, 41.5)
    for s in window[::2]:
        s[1], s[2], s[3] = 2 * STEP_S + GAP_S, PREFILL_TOKENS, None
    sc_.steps = [s for s in sc_.steps if s not in window[1::2]]
    sc_.target(40.2, 0.01, 1.3)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_PREFILL_INTERFERENCE, cause
    assert cause.evidence["engine_slowdown"] == pytest.approx(1.0, abs=0.05)
    assert cause.evidence["interference_s"] == pytest.approx(
        sum(s[1] - STEP_S for s in sc_.between(40.26, 41.5) if s[0] >= T + 40.26), rel=0.05)
    # steps that began inside the last (an engine scheduling ahead) overlap: the time of the
    # request's life they stretched counts once, so its decode bounds it
    sc_ = Scenario()
    for s in sc_.between(40.3, 41.5):
        s[1], s[2], s[3] = PREFILL_S, PREFILL_TOKENS, None
    sc_.target(40.2, 0.01, 1.3)
    _, one = explained(sc_)
    overlapping = [s for s in sc_.between(40.26, 41.5) if s[0] >= T + 40.26]
    assert one.cause.name == sc.CAUSE_PREFILL_INTERFERENCE, one.cause
    assert one.cause.evidence["interference_s"] < one.cause.evidence["decode_s"] < 1.3
    assert one.cause.evidence["interference_s"] < sum(s[1] - STEP_S for s in overlapping) - 0.1


def test_others_prefill_counts_at_its_usual_cost_and_a_slower_one_is_the_engines_slowness():
    """A neighbour on 4 SMs slows the decode steps a request rides 1.15x and the other
    requests' prefill steps among them (every fourth) 2.5x beyond their tokens' usual cost.
    Others' prefill costs it its usual (22 ms a step) of interference; the other 33 ms of
    each is the engine running slow, which with its decode steps' outweighs it: SM
    contention, where counting whole prefill steps as interference named that. Time a step
    shares with the one before counts once, so the slowed time is at most the 33 ms each."""
    sc_ = Scenario()
    window = sc_.between(40.3, 41.5)
    slow_steps(sc_, 40.3, 41.5, 1.15, 1.15)
    prefills = window[::4]
    for s in prefills:
        s[1], s[2], s[3] = STEP_S + 2.5 * (PREFILL_S - STEP_S), PREFILL_TOKENS, None
    for sm in (0, 1, 2, 3):
        sc_.ctas[T + 40][sm] = (20, CTA_S)
    sc_.target(40.2, 0.01, 1.3)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_SM_CONTENTION, cause
    most = len([s for s in prefills if s[0] >= T + 40.26]) * 1.5 * (PREFILL_S - STEP_S)
    assert 0.85 * most <= cause.evidence["prefill_slowed_s"] <= most


def test_decode_steps_stretched_by_a_prefills_launch_are_interference_not_slowness():
    """An engine that schedules ahead launches the next step before it completes this one:
    while a 512-token prefill's launches run, the decode step before it stays open 15 ms
    longer (it still completes before the prefill step: a GPU completes them in order).
    Every fifth step carries a prefill around the target, and the decode step before each
    is stretched: its own steps did not run slow, others' prefill held it."""
    sc_ = Scenario()
    for n, s in enumerate(sc_.steps):
        if s in sc_.between(40.0, 42.0) and n % 5 == 1:
            s[1], s[2], s[3] = PREFILL_S, PREFILL_TOKENS, None
    stretched = []
    for before, s in zip(sc_.steps, sc_.steps[1:]):
        if s[2] and not before[2] and s in sc_.between(40.0, 42.0):
            before[1] += 0.015   # it ends after the prefill step began, before it ends
            stretched.append(before)
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_PREFILL_INTERFERENCE, cause
    assert cause.evidence["engine_slowdown"] == pytest.approx(1.0, abs=0.01)
    decode_from = T + 40.26   # its prefill's end: its decode steps from there on
    want = sum(s[1] - STEP_S for s in sc_.steps if s[0] >= decode_from and s[0] < T + 42.2 and
               (s[2] or s in stretched))
    assert cause.evidence["interference_s"] == pytest.approx(want, rel=0.02)


def test_steps_carrying_others_prefill_beyond_its_cost_are_the_engines_slowness():
    """Live on an H200 (quarter neighbour, run 1): a request of 44 tokens took 1.0 s. Its
    decode-only steps ran 1.06x their usual, but the steps that carried others' prefill ran
    0.55 s beyond that prefill's usual cost, while 33 SMs were starved. The decode-only
    yardstick leaves that time out; at 30 % of its life or more (``idle_share``) it is the
    engine's slowness, and the SMs name its cause. Without evidence of a cause, or under that
    share, the rules say what they said before: no cause stands out."""
    flags = [{"gpu": "0", "kernel": "decode", "sm": str(sm), "score": 3.5, "reasons": ["starved"]}
             for sm in range(0, 132, 4)]
    live = CauseEvidence(e2e_s=1.004, queue_s=0.0, decode_s=0.99, priority="1", engine_slowdown=1.057, steps=47,
                         traced_steps=2, traced_near=9, gpu_slowdown=1.78, host_slowdown=1.003, cta_slowdown=1.07,
                         contended_sms=flags, sm_count=132, interference_s=0.217, prefill_slowed_s=0.55,
                         usual={"batch": 1.0, "gpu": 0.00837, "decode_mean": 0.00961})
    cause = classify(live)
    assert cause.name == sc.CAUSE_SM_CONTENTION, cause
    assert cause.summary.startswith("steps 1.06x the usual, and 550 ms beyond the usual cost of others' prefill in "
                                    "the steps that carried it while 33 SM(s) ran slow or starved"), cause.summary
    assert classify(CauseEvidence(**{**live.__dict__, "prefill_slowed_s": 0.29})).name == sc.CAUSE_UNKNOWN
    assert classify(CauseEvidence(**{**live.__dict__, "contended_sms": []})).name == sc.CAUSE_UNKNOWN


def test_one_step_far_beyond_its_usual_makes_the_engine_slow_though_the_others_are_not():
    """One step with 32 prefill tokens took 1.5 s while nothing else ran (the engine stalled
    in it; not traced, no SM flagged): the decode steps' mean is usual, but the step's time
    beyond its usual is most of the request's life. The engine was slow, and nothing says
    why: ``unknown``, with the stalled time in the text."""
    sc_ = Scenario()
    stalled = next(s for s in sc_.steps if s[0] >= T + 40.5 and not s[2])
    sc_.steps = [s for s in sc_.steps if not stalled[0] < s[0] < stalled[0] + 1.5]
    stalled[1], stalled[2], stalled[3] = 1.5, 32, None
    sc_.target(40.2, 0.01, 2.0)
    agg, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_UNKNOWN, cause
    ev = cause.evidence
    assert ev["engine_slowdown"] == pytest.approx(1.0, abs=0.01)
    per_token = (PREFILL_S - STEP_S) / PREFILL_TOKENS   # no prefill step traced: the whole step's
    usual = STEP_S + per_token * 32 + per_token * beyond(agg, sc_, stalled)
    assert ev["long_steps_s"] == pytest.approx(1.5 - usual, rel=1e-3)
    assert f"({(1.5 - usual) * 1e3:.0f} ms in steps 4x their usual or more)" in cause.summary


def test_a_slower_engine_with_nothing_traced_says_what_is_not_known():
    """Steps 1.5x slower, and no step kernel-traced nor any CTA timed (trace level steps, or an
    engine without a GPU): the engine was slow, and the answer says that nothing could say why."""
    sc_ = Scenario()
    for s in sc_.steps:
        s[3] = None
    sc_.ctas = {}
    slow_steps(sc_, 38, 46, 1.5, 1.0)
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_UNKNOWN, cause
    assert cause.evidence["engine_slowdown"] == pytest.approx(1.5, rel=0.01) and cause.evidence["traced_steps"] == 0
    assert cause.summary.endswith("but no kernel-traced step or CTA timing covers its life, so its GPU and host "
                                  "time are not known")


def slow_between_traced_steps() -> Scenario:
    """Steps 1.5x slower from T+38 to T+46, but the kernel-traced ones (1 in 10) at their usual time."""
    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.5, 1.0)
    for s in sc_.between(38, 46):
        if s[3] is not None:
            s[1] = STEP_S
    return sc_


def test_traced_steps_that_missed_the_slowness_are_said_to_have_missed_it():
    """Steps 1.5x slower, but the kernel-traced ones (1 in 10) ran their usual time with their
    usual GPU and host time (as an HBM hog's traced steps did on the H200): nothing in them says
    where the time went, and the answer says they missed it. Traced steps that ran slow too
    are no such case."""
    sc_ = slow_between_traced_steps()
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_UNKNOWN, cause
    assert cause.evidence["traced_slowdown"] == pytest.approx(1.0, abs=0.02)
    assert cause.evidence["engine_slowdown"] == pytest.approx(0.9 * 1.5 + 0.1, rel=0.02)   # 1 in 10 usual
    assert cause.summary.endswith(f"its kernel-traced decode steps ran {cause.evidence['traced_slowdown']:.2f}x "
                                  f"the usual where its decode steps ran {cause.evidence['engine_slowdown']:.2f}x, "
                                  "so the traced ones missed the slowness")
    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.5, 1.0)
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    assert one.cause.evidence["traced_slowdown"] == pytest.approx(1.5, rel=0.02)
    assert "missed" not in one.cause.summary


def test_where_traced_steps_missed_the_slowness_the_ctas_speak_for_the_gpu():
    """Steps 1.5x slower, the kernel-traced ones at their usual time, and every SM's CTAs 1.85x
    theirs in the probed steps (an HBM hog between the traced steps, as in the kept capture of
    run 3 on the H200: traced steps 1.08x, steps 1.39-1.74x, CTAs 1.85x): device contention,
    said to rest on the CTAs. With the traced steps slow too, their GPU time decides as before;
    with steps under ``engine_slow``, the CTAs do not make them slow (a control run's slowest)."""
    sc_ = slow_between_traced_steps()
    sc_.ctas[T + 40] = {sm: (CTAS, CTA_S * 1.85) for sm in range(SMS)}
    sc_.target(40.2, 0.01, 2.0)
    _, one = explained(sc_)
    cause = one.cause
    assert cause.name == sc.CAUSE_DEVICE_CONTENTION, cause
    assert cause.evidence["cta_slowdown"] == pytest.approx(1.85, rel=0.02)
    assert cause.evidence["gpu_slowdown"] == pytest.approx(1.0, abs=0.02)
    assert cause.summary.endswith("so the traced ones missed the slowness, and the CTAs, timed in every "
                                  "probed step, speak for the GPU")
    live = CauseEvidence(e2e_s=2.0, queue_s=0.0, decode_s=1.9, priority="1", engine_slowdown=1.74, steps=61,
                         traced_steps=9, gpu_slowdown=1.10, host_slowdown=1.45, cta_slowdown=1.85, batch=2.56,
                         traced_slowdown=1.08, usual={"batch": 1.0})
    assert classify(live).name == sc.CAUSE_DEVICE_CONTENTION
    # traced steps as slow as the rest (1.6x of 1.74x) did not miss it: their GPU time is usual,
    # and their host time off the CPU (1.45x) stretched them; with the host usual too, no cause
    slow_traced = CauseEvidence(**{**live.__dict__, "traced_slowdown": 1.6})
    assert classify(slow_traced).name == sc.CAUSE_HOST_STALL
    assert classify(CauseEvidence(**{**slow_traced.__dict__, "host_slowdown": 1.1})).name == sc.CAUSE_UNKNOWN
    # a control run's slowest on an H100: steps 1.10x (under engine_slow), traced ones 1.03x, and
    # CTAs 1.62x from reading 10x the usual KV blocks; the CTAs must not make its steps slow
    control = CauseEvidence(e2e_s=0.467, queue_s=0.0, decode_s=0.45, priority="2", engine_slowdown=1.10, steps=56,
                            long_steps_s=0.057, idle_excess_s=0.0012, traced_steps=2, traced_near=4,
                            gpu_slowdown=0.99, host_slowdown=1.0, cta_slowdown=1.62, cta_spread=1.12, batch=1.0,
                            kv_blocks=262.0, traced_slowdown=1.03, sm_count=132,
                            usual={"batch": 1.0, "kv_blocks": 25.0})
    assert classify(control).name == sc.CAUSE_UNKNOWN


def surge(scenario: Scenario, extra: int, factor: float = 1.0) -> None:
    """``extra`` more requests decoded from T+37.5 to T+46.5; every prefill step traced, so that
    a token's GPU cost is known. Each step then costs what the requests beyond the usual
    batch of 2 add (a prefill token's GPU cost each), times ``factor``, its GPU time too."""
    per_request = (PREFILL_GPU_S - GPU_S) / PREFILL_TOKENS
    for s in scenario.steps:
        if s[2]:
            s[3] = PREFILL_GPU_S
    scenario.requests += [(4, i, T + 37.5, T + 37.505, T + 37.55, T + 46.5, 1) for i in range(extra)]
    for s in scenario.between(38, 46):
        added = per_request * max(0, len(scenario.decoded(s)) - 2)
        s[1] = (s[1] + added) * factor
        if s[3] is not None:
            s[3] = (s[3] + added) * factor


def test_a_load_surge_is_a_busier_engine_not_a_slower_one():
    """150 more requests at once: every decode step decodes 76x the usual batch and takes 1.34x
    its usual time, its GPU time 1.41x, as a bigger batch costs. Held against the usual step
    of that batch, the engine ran at its usual speed: no cause, and the text says the engine
    was busier. The same surge with every step 1.5x slower still names the GPU."""
    sc_ = Scenario()
    sc_.target(40.2, 0.01, 2.0)
    surge(sc_, 150)
    agg, one = explained(sc_)
    u = agg.timeline.usual()
    assert u["batch"] == 2 and u["per_request"] == pytest.approx((PREFILL_GPU_S - GPU_S) / PREFILL_TOKENS, rel=1e-3)
    lived = [s for s in sc_.between(40.2, 42.2) if not s[2]]
    assert min(s[1] for s in lived) > 1.3 * STEP_S and min(s[3] or 1 for s in lived) > 1.4 * GPU_S
    cause = one.cause
    assert cause.name == sc.CAUSE_UNKNOWN, cause
    assert cause.evidence["engine_slowdown"] == pytest.approx(1.0, rel=1e-3)
    assert cause.evidence["gpu_slowdown"] == pytest.approx(1.0, rel=1e-3)
    assert cause.evidence["batch"] == pytest.approx(153, abs=0.5) and cause.evidence["usual_batch"] == 2
    assert "(153 requests, usually 2: the engine was busier, not slower)" in cause.summary   # KV not recorded

    sc_ = Scenario()
    sc_.target(40.2, 0.01, 2.0)
    surge(sc_, 150, factor=1.5)
    _, one = explained(sc_)
    assert one.cause.name == sc.CAUSE_DEVICE_CONTENTION, one.cause
    assert one.cause.evidence["engine_slowdown"] == pytest.approx(1.5, rel=0.01)
    assert one.cause.evidence["gpu_slowdown"] == pytest.approx(1.5, rel=0.01)


PER_KV_BLOCK_S = 3e-6   # what a decode step takes longer per KV block it reads


def long_contexts(scenario: Scenario) -> None:
    """The usual load's contexts: a decode step holds 20 to 300 KV blocks (eight levels in
    turn) and takes PER_KV_BLOCK_S longer for each, its GPU time alike."""
    for n, s in enumerate(scenario.steps):
        scenario.kv_blocks[n] = 20 + 40 * (n % 8)
        if not s[2]:
            s[1] += PER_KV_BLOCK_S * scenario.kv_blocks[n]
            s[3] = None if s[3] is None else s[3] + PER_KV_BLOCK_S * scenario.kv_blocks[n]


def test_a_burst_of_long_prompts_is_queueing_not_a_slower_engine():
    """A priority burst of long prompts: from T+38 its requests hold 6,000 KV blocks, and each
    decode step takes the 18 ms those blocks cost more (2x its usual), as the usual load's
    own spread of contexts says a block costs. A burst request that waited 8 of its 10 s is
    queueing: held against the usual step for its KV, the engine ran at its usual speed.
    The same steps with no KV recorded read as a GPU twice as slow."""
    for recorded in (True, False):
        sc_ = Scenario()
        long_contexts(sc_)
        sc_.requests += [(4, i, T + 37.9, T + 45.0, T + 45.1, T + 48.0, 0) for i in range(10)]
        sc_.target(38.0, 8.0, 10.0, priority=0)
        for n, s in enumerate(sc_.steps):
            if T + 38 <= s[0] < T + 48:
                s[1] -= PER_KV_BLOCK_S * sc_.kv_blocks[n]
                s[3] = None if s[3] is None else s[3] - PER_KV_BLOCK_S * sc_.kv_blocks[n]
                sc_.kv_blocks[n] = 6000
                if not s[2]:
                    s[1] += PER_KV_BLOCK_S * 6000
                    s[3] = None if s[3] is None else s[3] + PER_KV_BLOCK_S * 6000
        if not recorded:
            sc_.kv_blocks = {}
        agg, one = explained(sc_)
        u = agg.timeline.usual()
        if recorded:
            assert u["per_kv_block"] == pytest.approx(PER_KV_BLOCK_S, rel=0.05) and u["kv_blocks"] <= 140
            # the burst's steps, under a quarter of the decode steps, leave the upper quartile
            # among the usual load's levels, and the burst's 6,000 blocks beyond it
            assert 220 <= u["kv_upper"] <= 300 and one.cause.evidence["kv_blocks"] >= 8 * u["kv_upper"]
            assert one.cause.evidence["kv_load"] == pytest.approx(6000, rel=0.05)   # every step of its life
            assert one.cause.name == sc.CAUSE_QUEUEING, one.cause
            assert one.cause.evidence["engine_slowdown"] == pytest.approx(1.0, abs=0.05)
            assert one.cause.evidence["kv_blocks"] == pytest.approx(6000, rel=0.01)   # a step began before T+38
        else:
            assert u.get("per_kv_block", 0.0) == 0.0
            assert one.cause.name == sc.CAUSE_DEVICE_CONTENTION, one.cause
            assert one.cause.evidence["engine_slowdown"] > 1.8


def test_a_burst_far_beyond_the_usual_load_is_judged_by_its_traced_steps():
    """The evidence of a burst request on the H200 (bench/results/scenarios-*-part2.json,
    priority_burst run 1): 94 requests ahead, 11.1 of 13.3 s queued, decode steps of 24
    requests where one is usual, 2.3x the usual step by duration, while its 10 traced steps
    timed the GPU's work at 1.16x and the host's at 1.08x. Steps that heavy are priced by
    the traced ones: the wait is the queue's. The same load with the GPU's work 1.4x slower
    is an engine that drained the queue slowly; at the usual load, durations still count."""
    burst = CauseEvidence(e2e_s=13.26, queue_s=11.08, decode_s=1.5, priority="0", engine_slowdown=2.32,
                          long_steps_s=0.24, steps=251, traced_steps=10, gpu_slowdown=1.16, host_slowdown=1.08,
                          batch=24.2, kv_blocks=7000.0, usual={"batch": 1.0, "kv_blocks": 30.0},
                          queue={"depth": 94, "ahead_more_urgent": 0, "overtaken_by": 0, "engine_full": False})
    cause = classify(burst)
    assert cause.name == sc.CAUSE_QUEUEING, cause
    assert "its steps ran heavier, not slower: 24 requests holding 7000 KV blocks (usually 1 holding 30 KV " \
           "blocks), GPU time per step 1.16x and host time 1.08x their usual" in cause.summary
    assert cause.evidence["gpu_slowdown"] == 1.16 and cause.evidence["engine_slowdown"] == 2.32
    assert classify(CauseEvidence(**{**burst.__dict__, "gpu_slowdown": 1.4})).name == sc.CAUSE_DEVICE_CONTENTION
    usual_load = CauseEvidence(**{**burst.__dict__, "batch": 2.0, "kv_blocks": 60.0})
    assert classify(usual_load).name == sc.CAUSE_UNKNOWN
    # no traced step in its life: nothing says how fast the engine ran, so durations count
    assert classify(CauseEvidence(**{**burst.__dict__, "gpu_slowdown": None})).name == sc.CAUSE_UNKNOWN


def test_contexts_far_beyond_those_the_store_prices_are_heavier_not_slower():
    """The evidence of a burst request on an H100 (the live scenario run at 8caf8606, its
    priority_burst run 1, replayed): 56 requests holding 10,697 KV blocks where the store's
    decode steps' upper quartile held 206, steps 1.29x and GPU time 1.58x their usual priced
    by a block's cost measured across contexts 50x shorter, host time 1.00x. Beyond
    UNPRICED_KV x that quartile neither names the GPU: others' prefill in its decode steps
    does. The same figures at contexts the store prices are the device's."""
    usual = {"batch": 1.0, "kv_blocks": 19.0, "kv_upper": 206.0, "duration": 0.01269, "decode_mean": 0.01247,
             "gpu": 0.01104, "per_kv_block": 2.5e-6, "per_request": 21.42e-6}
    burst = CauseEvidence(e2e_s=11.21, queue_s=3.56, decode_s=7.02, priority="0", engine_slowdown=1.285, steps=85,
                          traced_steps=18, gpu_slowdown=1.578, host_slowdown=1.0015, cta_slowdown=5.18,
                          cta_spread=1.05, traced_slowdown=0.81, interference_s=6.47, batch=56.2,
                          kv_blocks=10697.0, usual=usual, sm_count=132,
                          queue={"depth": 89, "ahead_more_urgent": 0, "overtaken_by": 0, "engine_full": False})
    cause = classify(burst)
    assert cause.name == sc.CAUSE_PREFILL_INTERFERENCE, cause
    assert classify(CauseEvidence(**{**burst.__dict__, "interference_s": 0.0})).summary == (
        "no cause stands out; its steps held 10697 KV blocks (56 requests decoded), 52x the upper quartile of "
        "the store's steps (206), beyond the contexts a block's cost was measured across: their duration, GPU "
        "time (1.58x) and CTAs (5.18x) say how heavy they were, not how slow, and their host time 1.00x its "
        "usual, and it did not wait long")
    # waiting most of its life behind the burst: the queue's, the load said beside it
    queued = classify(CauseEvidence(**{**burst.__dict__, "queue_s": 9.4}))
    assert queued.name == sc.CAUSE_QUEUEING and "52x the upper quartile" in queued.summary, queued
    # the host's time still speaks there
    assert classify(CauseEvidence(**{**burst.__dict__, "host_slowdown": 1.8})).name == sc.CAUSE_HOST_STALL
    # within the contexts priced (or a store that does not say), the same GPU is the device's
    assert classify(CauseEvidence(**{**burst.__dict__, "kv_blocks": 1600.0})).name == sc.CAUSE_DEVICE_CONTENTION
    no_upper = {k: v for k, v in usual.items() if k != "kv_upper"}
    assert classify(CauseEvidence(**{**burst.__dict__, "usual": no_upper})).name == sc.CAUSE_DEVICE_CONTENTION
    # a burst prompt with no decode-only step of its own, riding mixed steps that held the
    # burst's blocks: the steps of its life say the load
    riding = CauseEvidence(**{**burst.__dict__, "batch": None, "kv_blocks": None, "kv_load": 9000.0,
                              "interference_s": 0.0})
    assert classify(riding).name == sc.CAUSE_UNKNOWN and "held 9000 KV blocks" in classify(riding).summary
    assert classify(CauseEvidence(**{**riding.__dict__, "kv_load": 300.0})).name == sc.CAUSE_DEVICE_CONTENTION


def test_gpu_time_far_beyond_the_load_priced_does_not_name_the_device():
    """The evidence of a load-surge request on an H100 (the scenario run at e681ba22, part 2, in
    git's history; load_surge run 1, trace 1ca00eb6), nothing planted: 37 requests decoded where
    the store's decode steps' upper quartile decoded 3, holding 1,631 KV blocks, 5.1x that
    quartile's (318).
    Its steps ran 1.75x and its traced GPU time 3.75x the usual priced by costs measured across
    that load; three such requests read device_contention and fired SightlineDeviceContention.
    From FAR_BEYOND x both quartiles, GPU time and CTAs do not name the device; the host's time
    and the SMs still speak. A few requests holding long contexts (an HBM hog's) still do."""
    usual = {"batch": 1.0, "kv_blocks": 20.0, "kv_upper": 318.0, "batch_upper": 3.0, "duration": 0.012448,
             "decode_mean": 0.012361, "gpu": 0.011351, "gpu_per_token": 20.93e-6, "per_kv_block": 0.62e-6,
             "per_request": 20.93e-6}
    surge = CauseEvidence(e2e_s=0.4446, queue_s=0.0, decode_s=0.40, priority="1", engine_slowdown=1.754, steps=30,
                          traced_steps=3, gpu_slowdown=3.754, host_slowdown=1.004, cta_slowdown=1.614,
                          cta_spread=1.109, traced_slowdown=3.776, long_steps_s=0.1033, batch=36.66,
                          kv_blocks=1631.0, kv_load=1634.1, usual=usual, sm_count=132)
    cause = classify(surge)
    assert cause.name == sc.CAUSE_UNKNOWN, cause
    assert cause.summary == (
        "the engine was slower (steps 1.75x the usual (103 ms in steps 4x their usual or more)) but neither the "
        "GPU's nor the host's evidence says why: its steps decoded 37 requests holding 1634 KV blocks, 12.2x and "
        "5.1x the upper quartiles of the store's steps (3, 318), beyond the load the usual was measured across: "
        "their GPU time (3.75x) and CTAs (1.61x) say how heavy they were, not whether the device was slower, and "
        "their host time was 1.00x its usual"), cause.summary
    # under FAR_BEYOND x either quartile the same GPU time is the device's
    nearer = CauseEvidence(**{**surge.__dict__, "kv_blocks": 1200.0, "kv_load": 1200.0})
    assert classify(nearer).name == sc.CAUSE_DEVICE_CONTENTION
    assert classify(CauseEvidence(**{**surge.__dict__, "batch": 4.0})).name == sc.CAUSE_DEVICE_CONTENTION
    # the host's time and flagged SMs still speak there
    assert classify(CauseEvidence(**{**surge.__dict__, "host_slowdown": 1.8})).name == sc.CAUSE_HOST_STALL
    flagged = [{"gpu": "GPU-0", "kernel": "sightline_paged_decode", "sm": str(sm), "score": 4.0,
                "reasons": ["starved"]} for sm in range(0, 132, 4)]
    assert classify(CauseEvidence(**{**surge.__dict__, "contended_sms": flagged})).name == sc.CAUSE_SM_CONTENTION


def test_sms_lost_to_a_neighbour_explain_a_gpu_twice_as_slow_and_slower_ctas_do_not():
    """The evidence of two requests on the H200 (bench/results/scenarios-*: sm_half run 3,
    sm_quarter run 2) that read as device contention: a neighbour held half (a quarter) of
    the SMs, both attention kernels' CTAs starved there, and the traced steps' GPU time was
    2.67x (2.00x) the usual while the median SM's CTAs ran 1.36x (1.07x). A kernel whose grid
    filled the SMs in one wave runs two once any are lost: the SMs' factor (about 2) is the
    larger, so the neighbour is named. CTAs slower alike on every SM, as much as the SMs'
    factor, are the device's; so is a GPU slower than both can make it."""
    def lost(share: int) -> list[dict]:
        return [{"gpu": "0", "kernel": kernel, "sm": str(sm), "score": 6.9, "reasons": ["starved"]}
                for kernel in ("sightline_fa2_prefill", "sightline_paged_decode") for sm in range(0, 2 * share, 2)]
    half = CauseEvidence(e2e_s=0.737, queue_s=0.0, decode_s=0.7, priority="2", engine_slowdown=1.55, steps=63,
                         idle_excess_s=0.059, long_steps_s=0.36, traced_steps=6, gpu_slowdown=2.67,
                         host_slowdown=1.40, cta_slowdown=1.36, cta_spread=1.29, contended_sms=lost(66),
                         sm_count=132, batch=2.05, usual={"batch": 1.0})
    quarter = CauseEvidence(**{**half.__dict__, "engine_slowdown": 1.23, "gpu_slowdown": 2.00, "host_slowdown": 1.04,
                               "cta_slowdown": 1.07, "idle_excess_s": 0.0, "contended_sms": lost(33)})
    for e in (half, quarter):
        cause = classify(e)
        assert cause.name == sc.CAUSE_SM_CONTENTION, cause
        assert cause.evidence["gpu_slowdown"] == e.gpu_slowdown and cause.evidence["cta_slowdown"] == e.cta_slowdown
    assert len(classify(half).evidence["sms"]) == 66
    # CTAs 1.45x slower on the median SM: the device's factor outweighs the quarter's SMs'
    assert classify(CauseEvidence(**{**quarter.__dict__, "cta_slowdown": 1.45})).name == sc.CAUSE_DEVICE_CONTENTION
    # 2.9x with CTAs as usual: more than two waves at the margin (1.3 x 2 = 2.6) can make it
    assert classify(CauseEvidence(**{**quarter.__dict__, "gpu_slowdown": 2.9})).name == sc.CAUSE_DEVICE_CONTENTION
    # without the CTAs' figure, the many-waves bound: a quarter lost explains 1.3 / 0.75 = 1.73x
    assert classify(CauseEvidence(**{**quarter.__dict__, "cta_slowdown": None})).name == sc.CAUSE_DEVICE_CONTENTION
    assert classify(CauseEvidence(**{**quarter.__dict__, "cta_slowdown": None, "gpu_slowdown": 1.7})).name \
        == sc.CAUSE_SM_CONTENTION


def test_unknown_when_nothing_stands_out_and_the_text_json_and_api_say_so():
    sc_ = Scenario()
    sc_.target(40.2, 0.01, 1.2)
    agg, one = explained(sc_)
    u = agg.timeline.usual()
    # one request more than the usual batch of 2, at the same step time: a hair under 1x
    decode = [s for s in sc_.between(40.2, 41.4) if not s[2] and not any(
        p[2] and s[0] < p[0] < s[0] + s[1] for p in sc_.steps)]
    usual = u["decode_mean"] + u["per_request"] * np.mean([beyond(agg, sc_, s) for s in decode])
    assert one.cause.name == sc.CAUSE_UNKNOWN and one.cause.evidence["engine_slowdown"] == pytest.approx(
        np.mean([s[1] for s in decode]) / usual, rel=1e-4)
    result = explain_slowest(agg, quantile=0.0, limit=200)
    # one request more than usual adds 43 us to an 18 ms step: not worth naming
    assert one.cause.evidence["batch"] > u["batch"] and "busier" not in one.cause.summary
    mine = next(r for r in result.requests if r.trace_id == tid(*TARGET).hex())
    assert mine.cause == one.cause
    as_json = json.loads(json.dumps(result.to_dict()))
    assert {r["cause"]["name"] for r in as_json["requests"]} <= set(sc.CAUSES)
    text = format_explanation(as_json)
    assert f"  cause: unknown: {one.cause.summary}" in text and "compared with: the usual step" in text


def test_the_rules_order_and_config_checks():
    base = CauseEvidence(e2e_s=1.0, queue_s=0.6, decode_s=0.3, priority="2", engine_slowdown=2.0,
                         gpu_slowdown=1.0, host_slowdown=2.0, traced_steps=3)
    # a 2x slower engine added 0.5 s; the queue's own part of the wait is 0.3 s
    assert classify(base).name == sc.CAUSE_HOST_STALL
    # neither the GPU's work nor the host's time grew: the slower steps are not explained
    assert classify(CauseEvidence(**{**base.__dict__, "host_slowdown": 1.1})).name == sc.CAUSE_UNKNOWN
    assert classify(CauseEvidence(**{**base.__dict__, "engine_slowdown": 1.0})).name == sc.CAUSE_QUEUEING
    # 1.25x: the engine added 0.2 s, the queue's own part is 0.48 s (a burst ahead of it)
    assert classify(CauseEvidence(**{**base.__dict__, "engine_slowdown": 1.25})).name == sc.CAUSE_QUEUEING
    # the host's evidence wins over flagged SMs when the GPU's work ran at its usual speed
    stalled = CauseEvidence(e2e_s=1.0, queue_s=0.0, decode_s=0.9, priority="1", engine_slowdown=3.0,
                            gpu_slowdown=1.0, host_slowdown=4.0, idle_excess_s=0.4, traced_steps=2,
                            contended_sms=[{"gpu": "0", "kernel": "k", "sm": "117", "score": 4.7,
                                            "reasons": ["starved"]}])
    assert classify(stalled).name == sc.CAUSE_HOST_STALL
    # with the GPU's work slower, the SM flags win, unless host time stretched the steps more
    assert classify(CauseEvidence(**{**stalled.__dict__, "gpu_slowdown": 1.5, "host_slowdown": 1.4})).name \
        == sc.CAUSE_SM_CONTENTION
    assert classify(CauseEvidence(**{**stalled.__dict__, "gpu_slowdown": 1.5})).name == sc.CAUSE_HOST_STALL
    # host time from a few kernel-timed steps alone does not overrule flagged SMs
    assert classify(CauseEvidence(**{**stalled.__dict__, "idle_excess_s": 0.0})).name == sc.CAUSE_SM_CONTENTION
    # weak SM flags (score under sm_score) beside a slower whole GPU: the GPU's
    weak = [{**stalled.contended_sms[0], "score": 1.3}]
    assert classify(CauseEvidence(**{**stalled.__dict__, "idle_excess_s": 0.0, "gpu_slowdown": 1.5,
                                     "host_slowdown": 1.2, "contended_sms": weak})).name == sc.CAUSE_DEVICE_CONTENTION
    assert classify(CauseEvidence(**{**stalled.__dict__, "idle_excess_s": 0.0, "gpu_slowdown": None,
                                     "contended_sms": weak})).name == sc.CAUSE_SM_CONTENTION
    assert classify(CauseEvidence(**{**base.__dict__, "gpu_slowdown": None, "host_slowdown": None})).name \
        == sc.CAUSE_UNKNOWN
    # a slower GPU with a few strong starved SMs: 8 of 132 SMs lost slow a kernel at most 1.06x,
    # (1.38x at the gpu_slow margin), so a 1.6x GPU is the whole device's; 33 flagged of 132
    # can explain up to 1.3 / 0.75 = 1.73x
    few = [{"gpu": "0", "kernel": "k", "sm": str(sm), "score": 6.5, "reasons": ["starved"]} for sm in range(8)]
    device = CauseEvidence(**{**stalled.__dict__, "idle_excess_s": 0.0, "host_slowdown": 1.0, "gpu_slowdown": 1.6,
                              "contended_sms": few, "sm_count": 132})
    assert classify(device).name == sc.CAUSE_DEVICE_CONTENTION
    assert "8 SM(s) flagged starved of 132, explaining less of that slowdown than every SM's CTAs or too " \
           "little of it" in classify(device).summary
    # slow SMs hold their kernel up by their CTAs' own slowdown: no bound from their number
    slow = [{**f, "reasons": ["slow"]} for f in few]
    assert classify(CauseEvidence(**{**device.__dict__, "contended_sms": slow})).name == sc.CAUSE_SM_CONTENTION
    quarter = [{**few[0], "sm": str(sm)} for sm in range(33)]
    assert classify(CauseEvidence(**{**device.__dict__, "contended_sms": quarter})).name == sc.CAUSE_SM_CONTENTION
    assert classify(CauseEvidence(**{**device.__dict__, "sm_count": 0})).name == sc.CAUSE_SM_CONTENTION
    # a stalled host's idle GPU clocks down: steps, GPU time and CTAs all slower, host time up;
    # another process time-slicing the GPU stretches the steps with CTAs at their usual speed
    clocked = CauseEvidence(e2e_s=1.0, queue_s=0.0, decode_s=0.9, priority="1", engine_slowdown=2.8,
                            gpu_slowdown=3.4, host_slowdown=4.5, cta_slowdown=3.3, traced_steps=2)
    assert classify(clocked).name == sc.CAUSE_HOST_STALL
    assert classify(CauseEvidence(**{**clocked.__dict__, "cta_slowdown": 1.1, "host_slowdown": 1.6})).name \
        == sc.CAUSE_DEVICE_CONTENTION
    # a GIL-holding thread in the engine (a live H200 run): eager steps' kernels 1.6x, CTAs at
    # their speed, host time stretching the steps 2.1x: more of the step's excess is the host's
    gil = CauseEvidence(e2e_s=2.2, queue_s=0.0, decode_s=2.0, priority="1", engine_slowdown=4.0,
                        gpu_slowdown=1.61, host_slowdown=2.13, cta_slowdown=1.02, traced_steps=1)
    assert classify(gil).name == sc.CAUSE_HOST_STALL
    # steps 1.15x the usual (a quarter of the SMs taken, live): under the 1.2x floor, a cause
    # only with evidence that names one, and when the engine's excess outweighs others' prefill
    mild = CauseEvidence(e2e_s=1.0, queue_s=0.0, decode_s=0.9, priority="1", engine_slowdown=1.15,
                         interference_s=0.1, contended_sms=[{"gpu": "0", "kernel": "k", "sm": str(sm), "score": 3.0,
                                                             "reasons": ["starved"]} for sm in range(0, 132, 4)])
    assert classify(mild).name == sc.CAUSE_SM_CONTENTION       # 0.13 s of engine excess > 0.1 s
    assert classify(CauseEvidence(**{**mild.__dict__, "contended_sms": []})).name == sc.CAUSE_UNKNOWN
    assert classify(CauseEvidence(**{**mild.__dict__, "interference_s": 0.5})).name \
        == sc.CAUSE_PREFILL_INTERFERENCE
    assert classify(CauseEvidence(**{**mild.__dict__, "engine_slowdown": 1.07})).name == sc.CAUSE_UNKNOWN
    # an unknown says how close its steps came, and to which bar
    assert "its steps ran 1.070x the usual, under the 1.1x that counts as slow beside evidence (33 SM(s) " \
           "flagged)" in classify(CauseEvidence(**{**mild.__dict__, "engine_slowdown": 1.07})).summary
    assert "its steps ran 1.150x the usual, under the 1.2x that counts as slow with nothing naming a cause" \
        in classify(CauseEvidence(**{**mild.__dict__, "contended_sms": []})).summary
    assert "its steps ran 1.150x the usual, less than others' prefill in its steps added" in classify(
        CauseEvidence(**{**mild.__dict__, "interference_s": 0.2})).summary
    assert "its steps took the usual time" in classify(
        CauseEvidence(**{**mild.__dict__, "engine_slowdown": 0.98})).summary
    with pytest.raises(ValueError, match="engine_slow=1.0"):
        CauseConfig(engine_slow=1.0)
    with pytest.raises(ValueError, match="queue_share=0"):
        CauseConfig(queue_share=0)


def counted_causes(agg, registry) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    from sightline.collector.exposition import metrics_page

    text = metrics_page(registry, agg)[0].decode()
    return {s.labels[sc.LABEL_CAUSE]: s.value for f in text_string_to_metric_families(text)
            if f.name == sc.COLLECTOR_SLOW_REQUESTS_EXPLAINED for s in f.samples if s.name.endswith("_total")}


def test_slow_requests_are_counted_once_by_cause_on_metrics():
    from prometheus_client import CollectorRegistry

    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.6, 1.0)
    sc_.target(40.2, 0.01, 2.0)  # 2x the others' e2e, as many tokens: the one slow request
    agg = make_aggregator()
    registry = CollectorRegistry()
    registry.register(agg.prometheus_collector())

    assert counted_causes(agg, registry) == dict.fromkeys(sc.CAUSES, 0.0)  # present before any request
    sc_.send(agg)
    assert counted_causes(agg, registry) == {**dict.fromkeys(sc.CAUSES, 0.0), sc.CAUSE_HOST_STALL: 1.0}
    assert counted_causes(agg, registry) == {**dict.fromkeys(sc.CAUSES, 0.0), sc.CAUSE_HOST_STALL: 1.0}  # once
    assert make_aggregator(slow_request_factor=None).slow_request_causes() is None


def test_a_slow_request_is_counted_once_the_slots_of_its_life_have_closed():
    """The SM neighbour above: at T+48 the target (40.2 to 42.2 s) ended over 5 s ago, but its
    slot (40 to 50 s) is still open and untested, so its slower GPU would read as the device's.
    It is counted when the slot closes, as what the closed slot shows: SM contention. (Live on
    an H200, a quarter neighbour's requests counted in their open slot fired the device alert.)"""
    from prometheus_client import CollectorRegistry

    sc_ = Scenario()
    slow_steps(sc_, 38, 46, 1.5, 1.5)
    for sm in (0, 1, 2, 3):
        sc_.ctas[T + 40][sm] = (20, CTA_S)
    del sc_.ctas[T + 50]  # sent at T+48: nothing from a slot not yet begun
    sc_.target(40.2, 0.01, 2.0)
    now = [T + 48.0]
    agg = Aggregator(AggregationConfig(), clock=lambda: now[0])
    registry = CollectorRegistry()
    registry.register(agg.prometheus_collector())
    sc_.send(agg)
    assert explain_trace(agg, tid(*TARGET).hex()).cause.name == sc.CAUSE_DEVICE_CONTENTION  # what it would count
    assert counted_causes(agg, registry) == dict.fromkeys(sc.CAUSES, 0.0)
    now[0] = T + 50.5
    assert counted_causes(agg, registry) == {**dict.fromkeys(sc.CAUSES, 0.0), sc.CAUSE_SM_CONTENTION: 1.0}
    now[0] = T + 60.5
    assert counted_causes(agg, registry) == {**dict.fromkeys(sc.CAUSES, 0.0), sc.CAUSE_SM_CONTENTION: 1.0}


def test_an_earlier_incident_does_not_hide_the_next_and_a_long_request_is_not_a_slow_one():
    from prometheus_client import CollectorRegistry

    sc_ = Scenario()
    # an earlier incident: a quarter of the stored requests took 4x (the old P90 of the store's
    # e2e then sat at 4 s, above the next incident's 2 s requests)
    earlier = {i for _, i, start, *_ in sc_.requests if T + 5 <= start < T + 20}
    sc_.requests = [(k, i, a, q, p, a + 4.0 if i in earlier else b, pr) for k, i, a, q, p, b, pr in sc_.requests]
    # a request 4x as long as the others at their pace per token
    long_one = next(i for _, i, start, *_ in sc_.requests if start >= T + 25)
    sc_.requests = [(k, i, a, q, p, a + 4.0 if i == long_one else b, pr) for k, i, a, q, p, b, pr in sc_.requests]
    sc_.output_tokens[(1, long_one)] = 128
    slow_steps(sc_, 38, 46, 1.6, 1.0)
    sc_.target(40.2, 0.01, 2.0)
    agg = make_aggregator()
    registry = CollectorRegistry()
    registry.register(agg.prometheus_collector())
    sc_.send(agg)

    counts = counted_causes(agg, registry)
    assert len(earlier) == 30 and sum(counts.values()) == 31  # the earlier incident's and the target
    assert counts[sc.CAUSE_HOST_STALL] == 1.0


def test_the_usual_is_where_most_values_lie_not_pulled_by_a_slow_minority():
    from sightline.collector.engine_timeline import usual_value

    assert usual_value(np.array([1.0, 2.0, 3.0, 100.0, 101.0])) == 2.0  # the densest 3 of 5: 1, 2, 3
    # 40 % of the steps 1.5x slower: the median moves up into the normal ones' tail (10.83), the
    # usual stays at the middle of the normal ones (10 .. 11)
    values = np.concatenate([np.linspace(10, 11, 60), np.linspace(14, 16, 40)])
    assert np.median(values) > 10.8 and 10.4 <= usual_value(values) <= 10.5
    assert usual_value(np.array([10.0] * 51 + [20.0] * 49)) == 10.0
    assert np.isnan(usual_value(np.array([np.nan]))) and usual_value(np.array([]), 0.0) == 0.0


def test_replay_causes_sorts_decode_steps_by_how_far_after_a_traced_one_they_began():
    """bench/replay_causes.py on the hand-built engine minute (``Scenario``):
    1 step in 10 kernel-traced, and the third step after each one launched 6 ms late and 10 ms
    long where the others take 18: the breakdown puts 10 ms at 3 steps after, 18 ms elsewhere,
    counts each step once, and says when each began after the last one."""
    from bench.replay_causes import steps_after_traced, stored_steps

    sc_ = Scenario()
    for n, s in enumerate(sc_.steps):
        if n % 10 == 3 and not s[2]:   # launched 6 ms late, it waits 6 ms less for the GPU
            s[0], s[1] = s[0] + 0.006, 0.010
    agg = make_aggregator()
    sc_.send(agg)
    inside = steps_after_traced(stored_steps(agg), 0, int((T + 100) * 1e9))["inside"]
    decode = [n for n, s in enumerate(sc_.steps) if not s[2]]
    for k in range(1, 7):
        row = inside[str(k)]
        assert row["untraced"]["steps"] == sum(1 for n in decode if n % 10 == k)
        assert row["traced"]["steps"] == 0
        assert row["untraced"]["duration_ms"] == pytest.approx(10.0 if k == 3 else STEP_S * 1e3)
        usual = (STEP_S + GAP_S) * 1e3
        assert row["untraced"]["after_previous_ms"] == pytest.approx({3: usual + 6, 4: usual - 6}.get(k, usual))
