"""The straggler rank of tensor-parallel steps, exactly, on hand-built traces.

A step names the rank with the least collective wait when the ranks' waits spread by at
least ``min_spread_ratio`` of the slowest rank's window (compute + wait); a window slot names the rank that
at least ``min_slot_share`` of its steps named. The collector reads steps from their
``engine.step.rank`` spans (lean and full reads alike), per producing instance, and shows
the verdicts on /metrics, in the query API and in explain.
"""

from __future__ import annotations

import json
import math
import urllib.request

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from sightline.collector.aggregation_config import AggregationConfig, StragglerConfig
from sightline.collector.decoded_traces import as_decoded
from sightline.collector.explain import explain_trace
from sightline.collector.exposition import AggregatorCollector
from sightline.collector.span_series import SpanSeries
from sightline.collector.stragglers import slot_straggler, straggler
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import T0_S, make_aggregator, otlp_attrs, otlp_span
from tests.collector.servers import ApiServer

CONFIG = StragglerConfig()   # spread >= 0.2 of the slowest window and >= 100 us; slot share 0.5
# (compute, wait) per rank of the three kinds of step
NAMES_1 = ((0.002, 0.003), (0.0045, 0.0005))    # rank 0 waited 2.5 ms for rank 1
NAMES_0 = ((0.0045, 0.0005), (0.002, 0.003))
EVEN = ((0.004, 0.001), (0.0042, 0.0008))       # 0.2 ms apart: under 0.2 * 5 ms


def test_one_step_names_the_rank_the_others_waited_for():
    assert straggler([0.003, 0.0005], [0.005, 0.005], CONFIG) == 1
    assert straggler([0.0005, 0.003], [0.005, 0.005], CONFIG) == 0
    assert straggler([0.001, 0.0008], [0.005, 0.005], CONFIG) is None
    # the bounds are inclusive: a spread of exactly 0.25 of the slowest window names the rank
    exact = StragglerConfig(min_spread_ratio=0.25, min_spread_s=0.0)
    assert straggler([0.5, 0.25], [1.0, 1.0], exact) == 1
    assert straggler([0.5, 0.25 + 2**-20], [1.0, 1.0], exact) is None
    # the absolute floor: 50 us apart is noise however short the step; the slowest window
    # scales the spread that counts
    assert straggler([60e-6, 10e-6], [100e-6, 100e-6], CONFIG) is None
    assert straggler([0.003, 0.0005], [0.005, 0.013], CONFIG) is None   # 2.5 ms < 0.2 * 13 ms
    # three ranks: the least wait; on a tie, the lowest rank; a rank that never reported: none
    assert straggler([0.004, 0.001, 0.001], [0.005] * 3, CONFIG) == 1
    assert straggler([0.004, math.nan, 0.001], [0.005] * 3, CONFIG) is None
    assert straggler([0.004], [0.005], CONFIG) is None
    assert slot_straggler(10, {1: 5, 0: 1}, CONFIG) == (1, 0.5)
    assert slot_straggler(10, {1: 4, 0: 4}, CONFIG) == (None, 0.4)
    assert slot_straggler(0, {}, CONFIG) == (None, 0.0)


def _step(trace_id: bytes, end_s: float, parts, step_id: int, links=()) -> list:
    """One step's trace: its engine.step span (per-rank arrays) and a span per rank."""
    step_span = bytes([9]) + trace_id[:7]
    window = max(c + w for c, w in parts)
    spans = [otlp_span(sc.SPAN_ENGINE_STEP, trace_id, step_span, end_s - window, end_s, {
        sc.STEP_ID: step_id, sc.STEP_BATCH_SIZE: 1, sc.STEP_PREFILL_TOKENS: 0,
        sc.STEP_DECODE_TOKENS: 1, sc.TP_SIZE: len(parts),
        sc.STEP_RANK_COMPUTE_S: [c for c, _ in parts],
        sc.STEP_RANK_COLLECTIVE_WAIT_S: [w for _, w in parts]}, links=links)]
    for rank, (compute, wait) in enumerate(parts):
        spans.append(otlp_span(sc.SPAN_RANK_STEP, trace_id, bytes([rank + 1]) + trace_id[:7],
                               end_s - compute - wait, end_s, {
                                   sc.TP_RANK: rank, sc.TP_SIZE: len(parts), sc.STEP_ID: step_id,
                                   sc.RANK_COMPUTE_S: compute, sc.RANK_COLLECTIVE_WAIT_S: wait,
                                   sc.RANK_COLLECTIVE_CALLS: 8, sc.COLLECTIVE_BYTES: 1024},
                               parent=step_span))
    return spans


def _request(spans_by_instance: dict[str, list]) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for instance, spans in spans_by_instance.items():
        rs = request.resource_spans.add()
        rs.resource.attributes.extend(otlp_attrs({sc.RESOURCE_SERVICE_NAME: sc.SERVICE_NAME_ENGINE,
                                                  sc.RESOURCE_SERVICE_INSTANCE_ID: instance}))
        rs.scope_spans.add().spans.extend(spans)
    return request


def hand_built() -> ExportTraceServiceRequest:
    """Producer a (2 ranks): slot [T0-20, T0-10) has 7 steps naming rank 1, one naming
    rank 0 and 2 even ones; slot [T0-10, T0) one naming each rank and 2 even ones; plus a
    step whose rank 1 never reported. Producer b (3 ranks): two steps in the last slot,
    where rank 2 was waited for; one rank span without its wait (malformed)."""
    a, b = [], []
    kinds = [NAMES_1] * 7 + [NAMES_0] + [EVEN] * 2
    for i, parts in enumerate(kinds):
        a += _step(bytes([1, i]) * 8, T0_S - 19 + i * 0.5, parts, i)
    for i, parts in enumerate((NAMES_1, NAMES_0, EVEN, EVEN)):
        a += _step(bytes([2, i]) * 8, T0_S - 9 + i, parts, 100 + i)
    a += _step(bytes([3, 0]) * 8, T0_S - 2, NAMES_1, 200)[:2]   # the step span and rank 0 only
    slow2 = ((0.002, 0.003), (0.0021, 0.0029), (0.0049, 0.0001))
    for i in range(2):
        b += _step(bytes([4, i]) * 8, T0_S - 5 + i, slow2, i)
    bad = _step(bytes([5, 0]) * 8, T0_S - 3, slow2, 9)[1]
    del bad.attributes[4]   # sightline.rank.collective_wait_s
    b.append(bad)
    return _request({"engine-a": a, "engine-b": b})


def _state(series: SpanSeries):
    return series.stragglers.snapshot(T0_S), series.stragglers.slots(), dict(series.dropped)


def test_hand_built_trace_exactly():
    request = as_decoded(hand_built())  # the receivers' decoded form
    series = SpanSeries(AggregationConfig(), {}, {})
    series.consume(request, T0_S)
    snapshot, slots, dropped = _state(series)
    a, b = snapshot["engine-a"], snapshot["engine-b"]
    assert a["steps"] == 14 and a["named"] == {1: 8, 0: 2}
    assert a["compute_s"][0] == pytest.approx(8 * 0.002 + 2 * 0.0045 + 4 * 0.004)
    assert a["wait_s"][1] == pytest.approx(8 * 0.0005 + 2 * 0.003 + 4 * 0.0008)
    assert a["last_slot"] == (None, 0.25)          # [T0-10, T0): 1 of 4 named each rank
    assert b["steps"] == 2 and b["named"] == {2: 2} and b["last_slot"] == (2, 1.0)
    [first, last] = slots["engine-a"]
    assert (first.start_s, first.steps, first.named, first.straggler, first.share) == (
        T0_S - 20, 10, {1: 7, 0: 1}, 1, 0.7)
    assert (last.start_s, last.steps, last.named, last.straggler) == (T0_S - 10, 4, {1: 1, 0: 1}, None)
    assert dropped == {"malformed_span": 1}
    # the step whose rank 1 never came waits (pending), counted nowhere yet
    assert len(series.stragglers._pending) == 1   # noqa: SLF001 -- the bound's subject


def test_metrics_api_and_explain_name_the_straggler():
    agg = make_aggregator()
    request = hand_built()
    # a request whose decode rode three of producer a's steps: two named rank 1, one rank 0
    root_t, root_s = bytes([7]) * 16, bytes([7]) * 8
    rode = [(bytes([1, i]) * 8, bytes([9]) + (bytes([1, i]) * 8)[:7]) for i in (0, 1, 7)]
    request.resource_spans[0].scope_spans[0].spans.extend([
        otlp_span(sc.SPAN_HTTP_COMPLETIONS, root_t, root_s, T0_S - 20, T0_S - 11,
                  {sc.GEN_AI_REQUEST_MODEL: "tiny", sc.REQUEST_E2E_S: 9.0}, kind=2),
        otlp_span(sc.SPAN_DECODE, root_t, bytes([8]) * 8, T0_S - 19, T0_S - 12, parent=root_s,
                  links=rode)])
    agg.consume_traces(request)
    families = {f.name: f for f in AggregatorCollector(agg).collect()}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for name in ("sightline_tp_steps", "sightline_tp_straggler_steps",
                            "sightline_tp_straggler_rank", "sightline_tp_straggler_share")
               for s in families[name].samples}
    assert samples[("sightline_tp_steps_total", (("instance_id", "engine-a"),))] == 14
    assert samples[("sightline_tp_straggler_steps_total", (("instance_id", "engine-a"), ("rank", "1")))] == 8
    assert samples[("sightline_tp_straggler_steps_total", (("instance_id", "engine-b"), ("rank", "0")))] == 0
    assert samples[("sightline_tp_straggler_rank", (("instance_id", "engine-a"),))] == -1
    assert samples[("sightline_tp_straggler_rank", (("instance_id", "engine-b"),))] == 2
    assert samples[("sightline_tp_straggler_share", (("instance_id", "engine-a"),))] == 0.25
    explained = explain_trace(agg, root_t.hex())
    assert (explained.straggler_rank, explained.straggler_steps, explained.steps_total) == (1, 2, 3)
    by_id = {s.step_id: s for s in explained.steps}
    assert by_id[7].straggler_rank == 0 and by_id[0].straggler_rank == 1
    assert by_id[0].rank_collective_wait_s == [0.003, 0.0005]
    server = ApiServer(agg)
    try:
        with urllib.request.urlopen(server.url("/api/v1/stragglers?instance_id=engine-a"), timeout=10) as r:
            body = json.loads(r.read())
    finally:
        server.close()
    assert body["slot_s"] == 10.0 and list(body["instances"]) == ["engine-a"]
    assert [(s["straggler"], s["steps"], s["named"]) for s in body["instances"]["engine-a"]] == [
        (1, 10, {"1": 7, "0": 1}), (None, 4, {"1": 1, "0": 1})]
