"""Slowest-request explanations and the trace store, against constructed traces whose
phase times, steps, kernels and SMs are known exactly."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from sightline.collector.explain import explain_slowest, trace_spans
from sightline.collector.trace_store import TraceStoreConfig
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import (T0_S, make_aggregator, otlp_attrs, otlp_cta_point, otlp_metrics,
                                           otlp_span, otlp_traces)
from tests.collector.servers import ApiServer

SERVER = 2


def tid(kind: int, i: int) -> bytes:
    return bytes([kind, i]) * 8


def sid(kind: int, i: int, j: int = 0) -> bytes:
    return bytes([kind, i, j, 0]) * 2


def build(n: int = 10):
    """n requests (e2e 0.1 .. n/10 s). Request i rides step i (linked from its prefill span)
    and step 100+i (linked only from the step's side: the request's link cap was hit).
    Step i runs kernels "k_small" (20 us) and "k_big" (i * 100 us, slowest SM = i % 7);
    step 100+i runs one kernel with no slowest-SM attribute."""
    spans = []
    for i in range(1, n + 1):
        e2e = i / 10
        t0 = T0_S - 5
        root_t, root_s = tid(1, i), sid(1, i)
        spans.append(otlp_span(sc.SPAN_HTTP_COMPLETIONS, root_t, root_s, t0, t0 + e2e, {
            sc.GEN_AI_REQUEST_MODEL: "tiny", sc.REQUEST_PRIORITY: i % 3, sc.REQUEST_E2E_S: e2e,
            sc.REQUEST_TTFT_S: e2e / 4, sc.REQUEST_TPOT_S: 0.01,
            sc.GEN_AI_RESPONSE_FINISH_REASONS: ["length"]}, kind=SERVER))
        # queue e2e/8, prefill e2e/8, decode e2e/2 (two decode spans? one is enough), rest other
        spans.append(otlp_span(sc.SPAN_QUEUE, root_t, sid(1, i, 1), t0, t0 + e2e / 8, parent=root_s))
        spans.append(otlp_span(sc.SPAN_PREFILL, root_t, sid(1, i, 2), t0 + e2e / 8, t0 + e2e / 4,
                               parent=root_s, links=[(tid(2, i), sid(2, i))]))
        spans.append(otlp_span(sc.SPAN_DECODE, root_t, sid(1, i, 3), t0 + e2e / 4, t0 + 3 * e2e / 4,
                               parent=root_s))
        # step i (linked from the prefill span) with two kernels
        spans.append(otlp_span(sc.SPAN_ENGINE_STEP, tid(2, i), sid(2, i), t0 + e2e / 8, t0 + e2e / 4,
                               {sc.STEP_ID: i, sc.STEP_BATCH_SIZE: 1, sc.STEP_PREFILL_TOKENS: 32,
                                sc.STEP_DECODE_TOKENS: 0}, links=[(root_t, root_s)]))
        for j, (name, dur, slowest) in enumerate((("k_small", 20e-6, None), ("k_big", i * 100e-6, i % 7)),
                                                 start=1):
            attrs = {sc.HW_GPU_ID: 0, sc.CUDA_KERNEL_NAME: name}
            if slowest is not None:
                attrs[sc.KERNEL_SLOWEST_SM] = slowest
            spans.append(otlp_span(sc.SPAN_KERNEL_PREFIX + name, tid(2, i), sid(2, i, j), t0 + e2e / 8,
                                   t0 + e2e / 8 + dur, attrs, parent=sid(2, i)))
        # step 100+i links to the request only from its own side
        spans.append(otlp_span(sc.SPAN_ENGINE_STEP, tid(3, i), sid(3, i), t0 + e2e / 4, t0 + e2e / 2,
                               {sc.STEP_ID: 100 + i, sc.STEP_BATCH_SIZE: 2, sc.STEP_PREFILL_TOKENS: 0,
                                sc.STEP_DECODE_TOKENS: 2}, links=[(root_t, root_s)]))
        spans.append(otlp_span(sc.SPAN_KERNEL_PREFIX + "k_dec", tid(3, i), sid(3, i, 1), t0 + e2e / 4,
                               t0 + e2e / 4 + 5e-6, {sc.HW_GPU_ID: 0, sc.CUDA_KERNEL_NAME: "k_dec"},
                               parent=sid(3, i)))
    return spans


def test_slowest_requests_explained_exactly():
    agg = make_aggregator()
    spans = build()
    assert agg.consume_traces(otlp_traces(spans[::-1])) == len(spans)  # order must not matter
    result = explain_slowest(agg, quantile=0.8, limit=10, max_kernels=1)
    assert result.requests_considered == 10
    assert result.threshold_s == pytest.approx(0.8)  # rank ceil(0.8 * 10) = 8 of 0.1..1.0
    assert [r.trace_id for r in result.requests] == [tid(1, i).hex() for i in (10, 9, 8)]
    r = result.requests[0]
    assert (r.model, r.priority, r.finish_reason) == ("tiny", "1", "length")
    assert r.e2e_s == pytest.approx(1.0) and r.ttft_s == pytest.approx(0.25)
    assert r.phases.queue_s == pytest.approx(0.125, abs=1e-6)
    assert r.phases.prefill_s == pytest.approx(0.125, abs=1e-6)
    assert r.phases.decode_s == pytest.approx(0.5, abs=1e-6)
    assert r.phases.other_s == pytest.approx(0.25, abs=1e-6)
    # both steps found: one through the prefill span's link, one through the step's own link
    assert r.steps_total == 2
    assert [s.step_id for s in r.steps] == [110, 10]  # slowest first (0.25 s vs 0.125 s)
    assert [k.name for k in r.steps[1].kernels] == ["k_big"]  # max_kernels=1: the slowest
    assert r.slowest_kernel.name == "k_big"
    assert r.slowest_kernel.duration_s == pytest.approx(1e-3, abs=1e-6)
    assert (r.slowest_sm.sm, r.slowest_sm.source) == ("3", "kernel_span")  # 10 % 7


def test_steps_say_when_their_kernels_were_traced():
    """A traced step carries the engine's reason into the explanation and its text; a step
    without one says nothing."""
    from sightline.collector.query_cli import format_explanation

    agg = make_aggregator()
    spans = build(1)
    for span in spans:
        if span.span_id == sid(2, 1):        # step 1: its kernels were traced
            span.attributes.extend(otlp_attrs({sc.STEP_TRACE_REASON: "sampled"}))
    agg.consume_traces(otlp_traces(spans))
    result = explain_slowest(agg, quantile=1.0, limit=1)
    steps = {s.step_id: s for s in result.requests[0].steps}
    assert (steps[1].kernel_trace_reason, steps[101].kernel_trace_reason) == ("sampled", None)
    lines = {line.split()[1]: line for line in format_explanation(result.to_dict()).splitlines()
             if line.startswith("    step ")}
    assert lines["1"].endswith("[kernels traced: sampled]")
    assert "traced" not in lines["101"]
    plain = make_aggregator()
    plain.consume_traces(otlp_traces(build(1)))
    assert "traced" not in format_explanation(explain_slowest(plain, 1.0, 1).to_dict())

def test_prompt_cache_hit_and_miss_are_explained():
    """A request whose prompt the prefix cache mostly served, one it missed (the prefill of
    its whole prompt), one from an engine that reports no cache figures."""
    from sightline.collector.explain import PromptCache
    from sightline.collector.query_cli import format_explanation
    from tests.collector.otlp_builders import otlp_attrs

    agg = make_aggregator()
    spans = build(3)
    extra = {sid(1, 3): {sc.GEN_AI_USAGE_INPUT_TOKENS: 2000, sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 1920},
             sid(1, 2): {sc.GEN_AI_USAGE_INPUT_TOKENS: 2000, sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0},
             sid(1, 1): {sc.GEN_AI_USAGE_INPUT_TOKENS: 2000},
             sid(2, 3): {sc.STEP_PREFILL_CACHED_TOKENS: 1920}}
    for span in spans:
        if span.span_id in extra:
            span.attributes.extend(otlp_attrs(extra[span.span_id]))
    agg.consume_traces(otlp_traces(spans))
    result = explain_slowest(agg, quantile=0.0, limit=3)
    hit, miss, unknown = result.requests
    assert hit.prompt_cache == PromptCache(2000, 1920, 80, 0.96, True, pytest.approx(0.3 / 8, abs=1e-6))
    assert miss.prompt_cache == PromptCache(2000, 0, 2000, 0.0, False, pytest.approx(0.2 / 8, abs=1e-6))
    assert unknown.prompt_cache is None
    assert {s.step_id: s.prefill_cached_tokens for s in hit.steps} == {3: 1920, 103: None}
    text = format_explanation(result.to_dict())
    assert "  prompt: 2000 tokens, 1920 from the prefix cache (96%), 80 computed in prefill 37.5 ms" in text
    assert "  prompt: 2000 tokens, prefix cache miss: 2000 computed in prefill 25.0 ms" in text
    assert text.count("  prompt: ") == 2
    assert "prefill_tokens=32 prefill_cached_tokens=1920 decode_tokens=0" in text


def test_slowest_sm_falls_back_to_per_sm_exemplars():
    agg = make_aggregator()
    spans = [s for s in build(2) if sc.KERNEL_SLOWEST_SM not in {kv.key for kv in s.attributes}]
    agg.consume_traces(otlp_traces(spans))
    # per-SM data: SM 9's slowest CTA points at request 2's prefill step span
    agg.consume_metrics(otlp_metrics([
        otlp_cta_point(0, 9, "k_big", [80e-6], T0_S - 4, exemplar=(80e-6, tid(2, 2), sid(2, 2))),
        otlp_cta_point(0, 4, "k_big", [30e-6], T0_S - 4, exemplar=(30e-6, tid(2, 1), sid(2, 1))),
    ]))
    r = explain_slowest(agg, quantile=1.0, limit=1).requests[0]
    assert r.trace_id == tid(1, 2).hex()
    assert (r.slowest_sm.gpu, r.slowest_sm.sm, r.slowest_sm.kernel, r.slowest_sm.source) == (
        "0", "9", "k_big", "sm_exemplar")
    assert r.slowest_sm.value_s == 80e-6


def test_trace_by_id_and_api(tmp_path):
    agg = make_aggregator()
    agg.consume_traces(otlp_traces(build(3)))
    got = trace_spans(agg, tid(1, 2).hex())
    assert [s["name"] for s in got["spans"]] == [sc.SPAN_HTTP_COMPLETIONS, sc.SPAN_QUEUE, sc.SPAN_PREFILL,
                                                 sc.SPAN_DECODE]
    assert got["linked_traces"] == sorted([tid(2, 2).hex(), tid(3, 2).hex()])
    server = ApiServer(agg)
    try:
        with urllib.request.urlopen(server.url(f"/api/v1/traces/{tid(2, 3).hex()}"), timeout=10) as resp:
            step = json.loads(resp.read())
        assert [s["name"] for s in step["spans"]] == [sc.SPAN_ENGINE_STEP, "kernel k_small", "kernel k_big"]
        assert step["spans"][2]["attributes"][sc.KERNEL_SLOWEST_SM] == 3
        with urllib.request.urlopen(server.url("/api/v1/explain?quantile=0.5&limit=1"), timeout=10) as resp:
            answer = json.loads(resp.read())
        assert answer["threshold_s"] == pytest.approx(0.2)
        assert [r["trace_id"] for r in answer["requests"]] == [tid(1, 3).hex()]
        # the requests that lived in a range: all start at T0 - 5 s; only the 0.3 s one reaches +0.25 s
        start = T0_S - 5 + 0.25
        query = f"quantile=0&limit=5&start_unix_s={start}&end_unix_s={start + 0.1}"
        with urllib.request.urlopen(server.url("/api/v1/explain?" + query), timeout=10) as resp:
            answer = json.loads(resp.read())
        assert answer["requests_considered"] == 1 and [r["trace_id"] for r in answer["requests"]] == [tid(1, 3).hex()]
        assert answer["requests"][0]["cause"]["name"] in sc.CAUSES
        with urllib.request.urlopen(server.url(f"/api/v1/explain?trace_id={tid(1, 2).hex()}"), timeout=10) as resp:
            one = json.loads(resp.read())
        assert one["trace_id"] == tid(1, 2).hex() and one["e2e_s"] == pytest.approx(0.2)
        assert sorted(s["step_id"] for s in one["steps"]) == [2, 102]
        for query, code in ((f"trace_id={tid(2, 2).hex()}", 404), ("trace_id=" + "f" * 32, 404), ("trace_id=xyz", 400)):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(server.url("/api/v1/explain?" + query), timeout=10)
            assert err.value.code == code and json.loads(err.value.read())["error"]["param"] == "trace_id"
        for query in ("quantile=1.5", "limit=0", "limit=2.5", "quantile=x"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(server.url("/api/v1/explain?" + query), timeout=10)
            assert err.value.code == 400 and "error" in json.loads(err.value.read())
        for query, param in (("start_unix_s=5", "end_unix_s"), ("end_unix_s=5", "start_unix_s"),
                             ("start_unix_s=9&end_unix_s=5", "end_unix_s")):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(server.url("/api/v1/explain?" + query), timeout=10)
            assert err.value.code == 400 and json.loads(err.value.read())["error"]["param"] == param
    finally:
        server.close()


def test_trace_store_bounds_and_eviction():
    agg = make_aggregator(trace_store=TraceStoreConfig(max_traces=6, max_spans_per_trace=3, max_spans=1000))
    agg.consume_traces(otlp_traces(build(4)))  # 12 traces arrive: request i, step i, step 100+i
    store = agg.store
    store.read(lambda s: None)  # indexing is deferred to the first query by default
    assert len(store) == 6
    # the oldest (requests/steps 1 and 2) went first; request 1's spans: 4 sent, 3 kept
    assert store.get(tid(1, 1).hex()) is None and store.get(tid(1, 4).hex()) is not None
    assert store.get(tid(1, 4).hex()).dropped_spans == 1 and store.dropped_spans == 4
    assert store.evicted_traces == 6
    # links to evicted traces are gone in both directions
    assert [t.trace_id for t in store.linked(tid(1, 3))] == [tid(2, 3), tid(3, 3)]
    assert [t.trace_id for t in store.linked(tid(3, 4))] == [tid(1, 4)]
    assert store.linked(tid(1, 1)) == [] and store.linked(tid(2, 2)) == []
    evicted = {tid(k, i) for k in (1, 2, 3) for i in (1, 2)}
    assert not evicted & set(store._linked)
    assert not any(evicted & peers for peers in store._linked.values())


def test_explains_spans_from_the_real_tracing_api(tmp_path):
    """Spans made by instrumentation/tracing.py (request phases, steps linked both ways)
    through its capture exporter, replayed: the slowest request's steps and phases."""
    from sightline.collector.aggregator import Aggregator
    from sightline.collector.replay import AggregatorSink, ReplayConfig, replay
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.tracing import Telemetry, TraceLevel

    capture = tmp_path / "engine.jsonl"
    telemetry = Telemetry.start(TelemetryConfig(level=TraceLevel.STEPS, exporter="none",
                                                capture_path=str(capture), metrics_enabled=False))
    assert telemetry.steps_on
    ns = 1_000_000
    t0 = __import__("time").time_ns() - 10_000 * ns
    reqs = []
    for i in range(3):
        r = telemetry.start_request(route="/v1/completions", headers={}, model="tiny",
                                    operation="text_completion", request_id=f"r{i}", priority=i)
        r.start_phase(sc.SPAN_QUEUE, start_time_ns=t0)
        r.end_phase(sc.SPAN_QUEUE, end_time_ns=t0 + (i + 1) * ns)
        r.start_phase(sc.SPAN_PREFILL, start_time_ns=t0 + (i + 1) * ns)
        reqs.append(r)
    # step 0: prefill of all three; steps 1..3: decodes, request i rides i+1 of them
    step = telemetry.start_step(0, requests=reqs, attributes={sc.STEP_PREFILL_TOKENS: 30},
                                start_time_ns=t0 + 3 * ns)
    for r in reqs:
        r.link_step(step)
    step.end(end_time_ns=t0 + 8 * ns)
    for r in reqs:
        r.end_phase(sc.SPAN_PREFILL, end_time_ns=t0 + 8 * ns)
        r.start_phase(sc.SPAN_DECODE, start_time_ns=t0 + 8 * ns)
    for s in range(1, 4):
        riding = [r for i, r in enumerate(reqs) if i + 1 >= s]
        step = telemetry.start_step(s, requests=riding, attributes={sc.STEP_DECODE_TOKENS: len(riding)},
                                    start_time_ns=t0 + (8 + 2 * s) * ns)
        for r in riding:
            r.link_step(step)
        step.end(end_time_ns=t0 + (9 + 2 * s) * ns)
        if s == 2:  # step 2 has a kernel span (GpuTelemetry builds them the same way)
            spans = telemetry.finished_spans
            spans.emit(sc.SPAN_KERNEL_PREFIX + "k", spans.child_context(step.span_context),
                       step.span_context, t0 + (8 + 2 * s) * ns, t0 + (8 + 2 * s) * ns + 1000,
                       {sc.CUDA_KERNEL_NAME: "k", sc.KERNEL_SLOWEST_SM: 7})
    for i, r in enumerate(reqs):
        end = t0 + (10 + 2 * (i + 1)) * ns
        r.end_phase(sc.SPAN_DECODE, end_time_ns=end)
        r.finish(status_code=200, finish_reason="length", input_tokens=10, output_tokens=i + 1,
                 ttft_s=0.008, tpot_s=0.002, queue_s=(i + 1) / 1000, e2e_s=(end - t0) / 1e9,
                 preemptions=0, end_time_ns=end)
    telemetry.shutdown()

    agg = Aggregator()
    replay(capture, AggregatorSink(agg), ReplayConfig())
    result = explain_slowest(agg, quantile=0.0, limit=3, max_steps=10)  # all three, slowest first
    assert result.requests_considered == 3
    slowest = result.requests[0]
    assert slowest.priority == "2" and slowest.e2e_s == pytest.approx(0.016)
    assert sorted(s.step_id for s in slowest.steps) == [0, 1, 2, 3]
    assert slowest.phases.queue_s == pytest.approx(0.003) and slowest.phases.prefill_s == pytest.approx(0.005)
    assert slowest.phases.decode_s == pytest.approx(0.008)
    assert [r.steps_total for r in result.requests] == [4, 3, 2]
    assert agg.latency_window("queue", ("tiny", "1")).count == 1
    # one step asked for: the slowest (step 0, no kernels), plus the slowest with kernels
    one = explain_slowest(agg, quantile=0.0, limit=1, max_steps=1).requests[0]
    assert [(s.step_id, [k.name for k in s.kernels]) for s in one.steps] == [(0, []), (2, ["k"])]
    assert one.slowest_sm is not None and one.slowest_sm.sm == "7"


def test_trace_store_total_span_bound():
    agg = make_aggregator(trace_store=TraceStoreConfig(max_traces=1000, max_spans_per_trace=100, max_spans=10))
    spans = build(4)  # 36 spans in 12 traces of 1..4 spans
    agg.consume_traces(otlp_traces(spans))
    store = agg.store
    store.read(lambda s: None)
    assert store.num_spans <= 10 and store.num_spans == sum(len(t.spans) for t in store._traces.values())
    # the newest traces are the ones kept
    assert store.get(tid(3, 4)) is not None and store.get(tid(1, 1)) is None


def _held(store) -> int:
    """What held_bytes must be: the encoded size of the queued requests and of every request
    holding a kept span (counted once however many of its spans are kept)."""
    holding = {id(s.held): s.held.size for t in store._traces.values() for s in t.spans}
    return sum(size for _, size in store._pending) + sum(holding.values())


def test_trace_store_deferred_indexing_byte_bound_and_chunks():
    one = otlp_traces(build(1))  # one request tree + its two steps: ~1.5 KB encoded
    size = one.ByteSize()
    agg = make_aggregator(trace_store=TraceStoreConfig(max_bytes=max(1024, 3 * size), index_chunk_spans=5,
                                                       mode="deferred"))
    for i in range(10):
        spans = [otlp_span(s.name, bytes([i]) + s.trace_id[1:], s.span_id, T0_S - 5, T0_S - 4,
                           parent=s.parent_span_id,
                           links=[(bytes([i]) + l.trace_id[1:], l.span_id) for l in s.links])
                 for s in build(1)]
        agg.consume_traces(otlp_traces(spans))
        assert agg.store.held_bytes <= 3 * size  # queued requests dropped oldest-first
    store = agg.store
    assert len(store) == 0 and store.num_spans == 0  # only queued so far: indexed on first read
    assert store.dropped_requests > 0
    assert store.held_bytes == _held(store)
    store.read(lambda s: None)  # 5 spans per lock hold, until caught up
    assert not store._pending and store.held_bytes == _held(store) <= 3 * size
    # the newest request's tree is there, linked both ways
    newest = bytes([9]) + tid(1, 1)[1:]
    assert store.get(newest) is not None
    assert len(store.linked(newest)) == 2
    result = explain_slowest(agg, quantile=1.0, limit=1)
    assert result.requests[0].steps_total == 2


def test_trace_store_byte_bound_when_indexing_eagerly():
    size = otlp_traces(build(1)).ByteSize()
    agg = make_aggregator(trace_store=TraceStoreConfig(max_bytes=max(1024, 2 * size), mode="eager"))
    for i in range(6):
        agg.consume_traces(otlp_traces(build(1)))
        store = agg.store
        assert store.held_bytes == _held(store) <= 2 * size
        assert not store._pending
    assert store.evicted_traces > 0


def test_slowest_sm_while_the_request_ran_without_kernel_spans_or_exemplars():
    agg = make_aggregator()
    spans = [s for s in build(1) if not s.name.startswith(sc.SPAN_KERNEL_PREFIX)]
    agg.consume_traces(otlp_traces(spans))  # request 1 ran T0-5 .. T0-4.9
    points = [otlp_cta_point(0, sm, "attn", [20e-6 * (3 if sm == 5 else 1)] * 10, T0_S - 4.95) for sm in range(8)]
    # another kernel with a larger absolute P99 but evenly spread: not the stand-out
    points += [otlp_cta_point(0, sm, "mlp", [90e-6] * 10, T0_S - 4.95) for sm in range(8)]
    # long before the request: SM 2 was far slower, but that is not this request's time
    points += [otlp_cta_point(0, 2, "attn", [900e-6] * 10, T0_S - 60)]
    agg.consume_metrics(otlp_metrics(points))
    r = explain_slowest(agg, quantile=1.0, limit=1).requests[0]
    assert r.slowest_kernel is None
    s = r.slowest_sm
    assert (s.gpu, s.sm, s.kernel, s.source) == ("0", "5", "attn", "sm_window")
    assert s.value_s == 20e-6 * 3 and s.score == pytest.approx(3.0)
