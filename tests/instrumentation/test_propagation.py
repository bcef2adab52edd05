"""Header propagation: W3C trace context + baggage and Zipkin B3 (single and multi), both ways.

The B3 headers come from py-zipkin (the Zipkin Python client) as well as from literals,
so the extractor is checked against what a real Zipkin-instrumented caller sends.
"""

from __future__ import annotations

import pytest
from opentelemetry import baggage, trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from sightline.instrumentation.propagation import HeaderPropagator, extract_context, inject_headers

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331


def _span_context(ctx: Context) -> SpanContext:
    return trace.get_current_span(ctx).get_span_context()


def _context(sampled: bool = True, state: TraceState | None = None) -> Context:
    span_context = SpanContext(
        TRACE_ID, SPAN_ID, is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else 0),
        trace_state=state or TraceState(),
    )
    return trace.set_span_in_context(NonRecordingSpan(span_context))


def test_w3c_traceparent_tracestate_baggage_any_case():
    headers = {
        "TraceParent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "TRACESTATE": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
        "Baggage": "tenant=acme,user%20id=a%2Cb",
    }
    ctx = extract_context(headers)
    sc = _span_context(ctx)
    assert (sc.trace_id, sc.span_id, sc.is_remote, sc.trace_flags.sampled) == (TRACE_ID, SPAN_ID, True, True)
    assert list(sc.trace_state.items()) == [("rojo", "00f067aa0ba902b7"), ("congo", "t61rcWkgMzE")]
    assert baggage.get_all(ctx) == {"tenant": "acme", "user id": "a,b"}


def test_unsampled_flag_is_kept():
    ctx = extract_context({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"})
    assert _span_context(ctx).trace_flags.sampled is False


@pytest.mark.parametrize("headers,sampled", [
    ({"b3": "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1"}, True),
    ({"B3": "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0"}, False),
    ({"b3": "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-d-0000000000000001"}, True),
    ({"X-B3-TraceId": "0af7651916cd43dd8448eb211c80319c", "x-b3-spanid": "b7ad6b7169203331",
      "X-B3-Sampled": "1"}, True),
    ({"x-b3-traceid": "0af7651916cd43dd8448eb211c80319c", "x-b3-spanid": "b7ad6b7169203331",
      "x-b3-flags": "1"}, True),
])
def test_b3_single_and_multi(headers, sampled):
    sc = _span_context(extract_context(headers))
    assert (sc.trace_id, sc.span_id, sc.trace_flags.sampled) == (TRACE_ID, SPAN_ID, sampled)


def test_b3_64_bit_trace_id_is_left_padded():
    sc = _span_context(extract_context({"X-B3-TraceId": "8448eb211c80319c",
                                        "X-B3-SpanId": "b7ad6b7169203331", "X-B3-Sampled": "1"}))
    assert sc.trace_id == 0x8448EB211C80319C and sc.span_id == SPAN_ID


def test_headers_from_py_zipkin_are_continued():
    from py_zipkin import Encoding
    from py_zipkin.zipkin import create_http_headers_for_new_span, zipkin_span

    sent = []
    with zipkin_span(service_name="gateway", span_name="route", transport_handler=sent.append,
                     sample_rate=100.0, encoding=Encoding.V2_JSON) as outer:
        headers = create_http_headers_for_new_span()
        zipkin_trace_id = outer.zipkin_attrs.trace_id
    assert "X-B3-TraceId" in headers
    sc = _span_context(extract_context(headers))
    assert sc.trace_id == int(zipkin_trace_id, 16)
    assert sc.span_id == int(headers["X-B3-SpanId"], 16)
    assert sc.trace_flags.sampled is True
    assert sent  # py-zipkin really emitted its own span


def test_w3c_wins_over_b3_when_both_present():
    headers = {
        "b3": "463ac35c9f6413ad48485a3953bb6124-a2fb4a1d1a96d312-1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    assert _span_context(extract_context(headers)).trace_id == TRACE_ID


@pytest.mark.parametrize("headers", [
    None, {}, {"traceparent": "garbage"}, {"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"},
    {"b3": "not-hex"}, {"X-B3-TraceId": "zz", "X-B3-SpanId": "b7ad6b7169203331"},
])
def test_bad_or_missing_headers_give_an_empty_context(headers):
    assert not _span_context(extract_context(headers)).is_valid


def test_repeated_header_pairs_first_wins():
    pairs = [("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
             ("Traceparent", "00-463ac35c9f6413ad48485a3953bb6124-a2fb4a1d1a96d312-01")]
    assert _span_context(extract_context(pairs)).trace_id == TRACE_ID


def test_inject_each_format_exactly():
    ctx = baggage.set_baggage("tenant", "acme", _context(state=TraceState([("rojo", "1")])))
    out = HeaderPropagator(("tracecontext", "baggage", "b3", "b3multi")).inject({}, ctx)
    assert out == {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "rojo=1",
        "baggage": "tenant=acme",
        "b3": "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
        "x-b3-traceid": "0af7651916cd43dd8448eb211c80319c",
        "x-b3-spanid": "b7ad6b7169203331",
        "x-b3-sampled": "1",
    }
    assert inject_headers(context=_context()) == {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


@pytest.mark.parametrize("formats", [("tracecontext",), ("b3",), ("b3multi",)])
def test_round_trip(formats):
    headers = inject_headers(context=_context(sampled=False), formats=formats)
    sc = _span_context(extract_context(headers))
    assert (sc.trace_id, sc.span_id, sc.trace_flags.sampled) == (TRACE_ID, SPAN_ID, False)


def test_unknown_inject_format_is_named():
    with pytest.raises(ValueError, match=r"propagator 'jaeger' is not one of"):
        HeaderPropagator(("tracecontext", "jaeger"))
