"""The collector agrees with the engine and with the protocols at their seams:

- a request whose client went away (``error.type=client_disconnected``) counts as
  ``abort``, as the engine counts it; any other error as ``error``;
- the trace API returns span events and status messages, and takes a 64-bit (16 hex) B3
  trace id, zero-padded as the Zipkin receiver stores it.
"""

from __future__ import annotations

import json
import urllib.request

from opentelemetry.proto.trace.v1 import trace_pb2

from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import T0_S, make_aggregator, otlp_attrs, otlp_span, otlp_traces
from tests.collector.servers import ApiServer


def _request(trace_id: bytes, reason: str, error: str | None) -> trace_pb2.Span:
    attrs = {sc.GEN_AI_REQUEST_MODEL: "m", sc.REQUEST_PRIORITY: 0, sc.REQUEST_E2E_S: 0.1,
             sc.GEN_AI_RESPONSE_FINISH_REASONS: [reason]}
    if error is not None:
        attrs[sc.ERROR_TYPE] = error
    span = otlp_span(sc.SPAN_HTTP_COMPLETIONS, trace_id, trace_id[:8], T0_S - 1.1, T0_S - 1, attrs, kind=2)
    if error is not None:
        span.status.code = trace_pb2.Status.STATUS_CODE_ERROR
        span.status.message = error
    return span


def test_client_disconnect_is_abort_and_other_errors_are_errors():
    agg = make_aggregator()
    agg.consume_traces(otlp_traces([
        _request(b"\x01" * 16, "abort", sc.ERROR_TYPE_CLIENT_DISCONNECTED),
        _request(b"\x02" * 16, "abort", sc.ERROR_TYPE_CLIENT_DISCONNECTED),
        _request(b"\x03" * 16, "abort", "engine_error"),
        _request(b"\x04" * 16, "stop", None),
    ]))
    assert agg.exposition_snapshot().requests_total == {("m", "0", "abort"): 2, ("m", "0", "error"): 1,
                                                        ("m", "0", "stop"): 1}


def test_trace_api_returns_events_and_status_and_takes_64_bit_ids():
    agg = make_aggregator()
    trace_id = bytes(8) + bytes.fromhex("463ac35c9f6413ad")  # a 64-bit B3 id, as the Zipkin receiver pads it
    span = _request(trace_id, "abort", sc.ERROR_TYPE_CLIENT_DISCONNECTED)
    span.events.add(name=sc.EVENT_PREEMPTED, time_unix_nano=int((T0_S - 1.05) * 1e9),
                    attributes=otlp_attrs({sc.PHASE_NAME: sc.SPAN_DECODE}))
    agg.consume_traces(otlp_traces([span]))
    server = ApiServer(agg)
    try:
        for asked in ("463ac35c9f6413ad", "463AC35C9F6413AD", trace_id.hex()):
            with urllib.request.urlopen(server.url(f"/api/v1/traces/{asked}"), timeout=10) as response:
                answer = json.loads(response.read())
            assert answer["trace_id"] == trace_id.hex()
            [got] = answer["spans"]
            assert got["status_code"] == 2 and got["status_message"] == sc.ERROR_TYPE_CLIENT_DISCONNECTED
            assert got["events"] == [{"name": sc.EVENT_PREEMPTED, "time_unix_nano": int((T0_S - 1.05) * 1e9),
                                      "attributes": {sc.PHASE_NAME: sc.SPAN_DECODE}}]
        for bad in ("463ac35c9f6413a", "x" * 16, "0" * 24):
            try:
                urllib.request.urlopen(server.url(f"/api/v1/traces/{bad}"), timeout=10)
                raise AssertionError(f"{bad} was accepted")
            except urllib.error.HTTPError as err:
                assert err.code == 400 and json.loads(err.read())["error"]["param"] == "trace_id"
    finally:
        server.close()
