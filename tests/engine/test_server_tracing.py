"""Spans the engine emits for a request, received by the OpenTelemetry SDK's in-memory exporter.

One streamed chat completion with a W3C ``traceparent`` through the openai SDK, at trace
level ``steps``: the server span continues the caller's trace; tokenize > queue > prefill >
decode > detokenize are its children, in time order; every engine step that served the
request is an ``engine.step`` span linked to it, and prefill/decode link back to exactly
the steps they rode (1 prefill step + max_tokens - 1 decode steps).
"""

from __future__ import annotations

import openai
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sightline.engine.config import EngineConfig
from sightline.engine.api_server import serve_in_thread
from sightline.engine.tokenizer import ByteTokenizer, ChatMessage, apply_chat_template
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.config import TelemetryConfig
from sightline.instrumentation.tracing import Telemetry

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_request_and_step_spans():
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.start(TelemetryConfig(level="steps", exporter="none", schedule_delay_s=0.05,
                                                metrics_enabled=False), span_exporters=[exporter])
    config = EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01, port=0, shutdown_timeout_s=5)
    running = serve_in_thread(config, telemetry=telemetry)
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0,
                               default_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        messages = [{"role": "user", "content": "trace me"}]
        chunks = list(client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, stream=True, temperature=0,
            extra_body={"ignore_eos": True, "priority": 3}))
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        running.stop()  # drains and shuts telemetry down, which flushes the spans
    spans = exporter.get_finished_spans()
    [server] = [s for s in spans if s.name == sc.SPAN_HTTP_CHAT_COMPLETIONS]
    assert server.kind == SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert format(server.parent.span_id, "016x") == PARENT_ID
    prompt_len = len(ByteTokenizer().encode(apply_chat_template([ChatMessage("user", "trace me")])))
    attrs = server.attributes
    assert attrs[sc.GEN_AI_USAGE_INPUT_TOKENS] == prompt_len
    assert attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert tuple(attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS]) == ("length",)
    assert attrs[sc.REQUEST_PRIORITY] == 3 and attrs[sc.HTTP_RESPONSE_STATUS_CODE] == 200
    assert 0 < attrs[sc.REQUEST_QUEUE_S] <= attrs[sc.REQUEST_TTFT_S] <= attrs[sc.REQUEST_E2E_S]
    assert attrs[sc.REQUEST_ID] == chunks[0].id
    assert sc.GEN_AI_PROMPT not in attrs and sc.GEN_AI_COMPLETION not in attrs  # content is opt-in

    phases = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == server.context.span_id}
    assert set(phases) == set(sc.REQUEST_PHASE_SPANS)
    order = [phases[name] for name in sc.REQUEST_PHASE_SPANS]  # tokenize, queue, prefill, decode, detokenize
    for before, after in zip(order, order[1:]):
        assert before.end_time <= after.start_time, (before.name, after.name)
    assert server.start_time <= order[0].start_time and order[-1].end_time <= server.end_time

    steps = sorted((s for s in spans if s.name == sc.SPAN_ENGINE_STEP), key=lambda s: s.start_time)
    assert len(steps) == 5  # one prefill step, then 4 decode steps (the 1st token comes from prefill)
    for step in steps:
        assert [link.context.span_id for link in step.links] == [server.context.span_id]
        assert step.parent is None  # a root: a batch has many parents, so links
    assert steps[0].attributes[sc.STEP_PREFILL_TOKENS] == prompt_len
    assert all(s.attributes[sc.STEP_DECODE_TOKENS] == 1 for s in steps[1:])
    step_ids = [s.context.span_id for s in steps]
    assert [link.context.span_id for link in phases[sc.SPAN_PREFILL].links] == step_ids[:1]
    assert [link.context.span_id for link in phases[sc.SPAN_DECODE].links] == step_ids[1:]
