"""Trace store: deferred and eager indexing agree; links both ways; oldest traces evicted."""

from __future__ import annotations

from sightline.collector.aggregation_config import TraceStoreConfig
from sightline.collector.trace_store import TraceStore
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import T0_S, otlp_attrs, otlp_span, otlp_traces

REQ, STEP = b"\x01" * 16, b"\x02" * 16


def _requests():
    root = otlp_span(sc.SPAN_HTTP_COMPLETIONS, REQ, b"\x0a" * 8, T0_S - 2, T0_S - 1, {sc.REQUEST_E2E_S: 1.0}, kind=2)
    step = otlp_span(sc.SPAN_ENGINE_STEP, STEP, b"\x0b" * 8, T0_S - 2, T0_S - 1.9, links=[(REQ, b"\x0a" * 8)])
    first, second = otlp_traces([root]), otlp_traces([step])
    second.resource_spans[0].resource.attributes.extend(otlp_attrs({sc.RESOURCE_SERVICE_INSTANCE_ID: "node-7"}))
    return [first, second]


def _index(store: TraceStore):
    def read(s: TraceStore):
        req, step = s.get(REQ), s.get(STEP)
        return (req.request_root.e2e_s, [t.trace_id for t in s.linked(REQ)], [t.trace_id for t in s.linked(STEP)],
                step.step_spans[0].instance, req.request_root.instance, len(s), s.num_spans)
    return store.read(read)


def test_deferred_and_eager_indexing_agree():
    got = []
    for defer in (True, False):
        store = TraceStore(TraceStoreConfig(mode="deferred" if defer else "eager"))
        for request in _requests():
            store.add_request(request)
        got.append(_index(store))
    assert got[0] == got[1] == (1.0, [STEP], [REQ], "node-7", "unknown", 2, 2)


def test_oldest_trace_evicted_first():
    store = TraceStore(TraceStoreConfig(max_traces=2, mode="eager"))
    for i in range(3):
        store.add_request(otlp_traces([otlp_span("decode", bytes([i + 1]) * 16, b"\x01" * 8, T0_S - 1, T0_S)]))
    assert store.evicted_traces == 1 and store.get(b"\x01" * 16) is None and len(store) == 2
