"""Span series: what the decoded request's spans leave in the series; dispatch by name alone."""

from __future__ import annotations

from sightline.collector.aggregation_config import AggregationConfig
from sightline.collector.decoded_traces import as_decoded
from sightline.collector.span_series import SpanRole, SpanSeries
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import T0_S, otlp_span, otlp_traces


def _spans():
    return as_decoded(otlp_traces(_stock_spans()))


def _stock_spans():
    spans = []
    for i in range(30):
        tid = bytes([i + 1]) * 16
        spans.append(otlp_span(sc.SPAN_HTTP_COMPLETIONS, tid, b"\x01" * 8, T0_S - 2, T0_S - 1, {
            sc.GEN_AI_REQUEST_MODEL: "m", sc.REQUEST_PRIORITY: i % 2, sc.REQUEST_TTFT_S: 0.01 * (i + 1),
            sc.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"]}, kind=2))
        spans.append(otlp_span(sc.SPAN_ENGINE_STEP, tid, b"\x02" * 8, T0_S - 2, T0_S - 2 + 0.001 * (i + 1),
                               {sc.STEP_PREFILL_TOKENS: i % 3, sc.STEP_DECODE_TOKENS: 4}))
        for k in range(3):
            spans.append(otlp_span(sc.SPAN_KERNEL_PREFIX + f"k{k}", tid, bytes([k + 3]) * 8, T0_S - 2,
                                   T0_S - 2 + 1e-5 * (i + k + 1), {sc.HW_GPU_ID: 0, sc.CUDA_KERNEL_NAME: f"k{k}"}))
        spans.append(otlp_span("decode", tid, b"\x09" * 8, T0_S - 2, T0_S - 1.5))
    return spans


class _ScanOnly(SpanSeries):
    """Attribute positions that never match: every kernel and step span takes the scan."""

    _kernel_pos = _gpu_pos = _prefill_pos = _decode_pos = property(lambda self: 99, lambda self, value: None)


def _state(series: SpanSeries):
    return ({k: (s.classic.counts, s.classic.count) for k, s in series.kernels.items()},
            {k: (s.classic.counts, s.classic.count) for k, s in series.steps.items()},
            {k: {f: s.classic.counts for f, s in v.items()} for k, v in series.requests.items()},
            dict(series.requests_total))


def test_the_fast_path_and_the_scan_leave_the_same_state():
    request = _spans()
    states = []
    for cls in (SpanSeries, _ScanOnly):
        series = cls(AggregationConfig(), {}, {})
        assert series.consume(request, T0_S) == 30 * 6
        states.append(_state(series))
    assert states[0] == states[1]
    kernels, steps, requests, totals = states[0]
    assert {k: n for k, (_, n) in kernels.items()} == {("0", f"k{k}"): 30 for k in range(3)}
    assert sum(n for _, n in steps.values()) == 30 and set(steps) == {"decode", "mixed"}
    assert totals == {("m", "0", "stop"): 15, ("m", "1", "stop"): 15}


def test_span_kinds_are_an_enum_and_unknown_names_feed_nothing():
    series = SpanSeries(AggregationConfig(), {}, {})
    assert series._learn_name("queue") is SpanRole.NONE  # noqa: SLF001 -- the dispatch rule itself
    assert series._learn_name(sc.SPAN_KERNEL_PREFIX + "x") is SpanRole.KERNEL  # noqa: SLF001


def test_request_labels_read_from_the_cache_leave_the_same_state(monkeypatch):
    # each encoded model and priority is cached; a cache of 2 entries is cleared again and
    # again over these exports (30 requests, 2 priorities, 3 models)
    requests = []
    for model in ("a", "b", "c"):
        request = otlp_traces(_stock_spans())
        for span in request.resource_spans[0].scope_spans[0].spans:
            for kv in span.attributes:
                if kv.key == sc.GEN_AI_REQUEST_MODEL:
                    kv.value.string_value = model
        requests.append(as_decoded(request))
    states = []
    for cache_entries in (4_096, 2):
        monkeypatch.setattr("sightline.collector.span_series._MAX_ATTRIBUTE_CACHE", cache_entries)
        series = SpanSeries(AggregationConfig(), {}, {})
        for request in requests + requests:  # the second round reads the labels from the cache
            series.consume(request, T0_S)
        states.append(_state(series))
    assert states[0] == states[1]
    assert states[0][3] == {(m, p, "stop"): 30 for m in "abc" for p in "01"}
