"""What clients built against vLLM's server rely on, checked with the openai SDK and raw SSE.

One in-process server (tiny model, CPU, trace level ``requests`` into the OTel SDK's
in-memory exporter), an offline engine with the same weights for exact expected tokens:

- one SSE chunk per generated token, even when its text is empty; the chat role rides on
  the first token's chunk; ``continuous_usage_stats`` counts 1..n on every chunk;
- ``X-Request-Id`` echoed, used as the span's request id and the response id; generated
  when absent; a reused in-flight id and a malformed one are 400s;
- ``models.retrieve``, ``/version``, ``/ping``;
- top_k, min_p, repetition, presence and frequency penalties and allowed_token_ids change
  tokens exactly as the offline engine does; top_k=1 and min_p=1 reduce sampling to greedy; bad values are 400s;
- per-token ITL and per-request token / phase histograms count exactly; OpenMetrics
  negotiation carries trace-id exemplars on TTFT, ITL and e2e.
"""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams
from sightline.engine.api_server import serve_in_thread
from sightline.engine.tokenizer import ByteTokenizer
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.config import TelemetryConfig
from sightline.instrumentation.tracing import Telemetry

MODEL = "tiny"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def served():
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.start(TelemetryConfig(level="requests", exporter="none", schedule_delay_s=0.05,
                                                metrics_enabled=False), span_exporters=[exporter])
    running = serve_in_thread(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.02, port=0,
                                           shutdown_timeout_s=5), telemetry=telemetry)
    try:
        yield running, exporter
    finally:
        running.stop()


@pytest.fixture(scope="module")
def offline():
    return LLMEngine(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.02))


def _client(url: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         default_headers=headers or None)


def _offline_ids(engine: LLMEngine, prompt: str, **sampling) -> list[int]:
    [request] = engine.generate([ByteTokenizer().encode(prompt)], SamplingParams(ignore_eos=True, **sampling))
    return request.output_token_ids


def _sse(url: str, route: str, body: dict, headers: dict | None = None) -> tuple[dict, list[dict]]:
    request = urllib.request.Request(url + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as response:
        events = response.read().decode().split("\n\n")
        head = dict(response.headers)
    assert events[-2:] == ["data: [DONE]", ""]
    return head, [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def _samples(text: str, parser=text_string_to_metric_families) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in parser(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _scrape(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url + "/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def _value(samples: dict, name: str) -> float:
    return sum(s.value for s in samples.get(name, []))


def test_one_chunk_per_token_with_empty_texts(served, offline):
    running, _ = served
    # A prompt whose greedy continuation holds multi-byte characters: tokens that end
    # half-way through one have empty text and still get their chunk.
    prompt, n = "héllo ✓ wörld", 40
    expected = _offline_ids(offline, prompt, max_tokens=n, temperature=0.0)
    _, chunks = _sse(running.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                      "temperature": 0, "stream": True, "ignore_eos": True})
    assert len(chunks) == n
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == offline.tokenizer.decode(expected)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (n - 1) + ["length"]
    assert "" in texts, "the prompt was chosen so that some token decodes to nothing on its own"


def test_chat_role_on_first_token_and_continuous_usage(served, offline):
    running, _ = served
    n = 12
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": n,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, chunks = _sse(running.url, "/v1/chat/completions", body)
    token_chunks, [final] = chunks[:-1], chunks[-1:]
    assert len(token_chunks) == n
    assert token_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in token_chunks[1:])
    prompt_tokens = token_chunks[0]["usage"]["prompt_tokens"]
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == list(range(1, n + 1))
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens and
               c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in token_chunks)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == n
    # continuous usage alone: usage on every chunk, no extra usage chunk
    body["stream_options"] = {"continuous_usage_stats": True}
    _, alone = _sse(running.url, "/v1/chat/completions", body)
    assert len(alone) == n and alone[-1]["usage"]["completion_tokens"] == n
    # The SDK assembles the same text as the unstreamed reply.
    client = _client(running.url)
    whole = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=n, temperature=0,
                                           extra_body={"ignore_eos": True})
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in token_chunks)
    assert streamed == whole.choices[0].message.content


def test_x_request_id_is_echoed_and_names_the_span(served):
    running, exporter = served
    client = _client(running.url, traceparent=f"00-{TRACE_ID}-00f067aa0ba902b7-01")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="id", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "caller-42"})
    assert raw.headers["x-request-id"] == "caller-42"
    assert raw.parse().id == "cmpl-caller-42"
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                            max_tokens=2, stream=True)
    generated = stream.response.headers["x-request-id"]
    assert [c.id for c in stream] == [generated] * 2 and generated.startswith("chatcmpl-")
    deadline = time.monotonic() + 10   # the server ends a request's span after its last chunk
    while True:
        running.server.telemetry.force_flush()
        ids = {s.attributes[sc.REQUEST_ID] for s in exporter.get_finished_spans()
               if s.name.startswith("POST /v1/") and format(s.context.trace_id, "032x") == TRACE_ID}
        if {"caller-42", generated} <= ids or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {"caller-42", generated} <= ids
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_headers={"X-Request-Id": "a b"})
    assert info.value.body["param"] == "X-Request-Id"
    held = client.completions.create(model=MODEL, prompt="hold", max_tokens=400, stream=True,
                                     extra_headers={"X-Request-Id": "twice"}, extra_body={"ignore_eos": True})
    next(iter(held))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_headers={"X-Request-Id": "twice"})
    assert info.value.body["code"] == "duplicate_request_id"
    held.close()


def test_model_retrieve_version_and_ping(served):
    running, _ = served
    client = _client(running.url)
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nope")
    assert info.value.body["code"] == "model_not_found"
    with urllib.request.urlopen(running.url + "/version", timeout=10) as response:
        assert json.loads(response.read())["version"]
    for method in ("GET", "POST"):
        with urllib.request.urlopen(urllib.request.Request(running.url + "/ping", method=method), timeout=10) as r:
            assert r.status == 200


@pytest.mark.parametrize("params", [
    {"top_k": 1, "temperature": 1.5, "seed": 7},
    {"min_p": 1.0, "temperature": 1.5, "seed": 7},
])
def test_top_k_1_and_min_p_1_reduce_sampling_to_greedy(served, offline, params):
    running, _ = served
    greedy = _offline_ids(offline, "reduce", max_tokens=24, temperature=0.0)
    result = _client(running.url).completions.create(model=MODEL, prompt="reduce", max_tokens=24,
                                                     extra_body={"ignore_eos": True, **params})
    assert result.choices[0].text == offline.tokenizer.decode(greedy)
    plain = _client(running.url).completions.create(model=MODEL, prompt="reduce", max_tokens=24, temperature=1.5,
                                                    seed=7, extra_body={"ignore_eos": True})
    assert plain.choices[0].text != result.choices[0].text  # without the filter, the draw differs


@pytest.mark.parametrize("params", [
    {"top_k": 5, "temperature": 1.0, "seed": 11},
    {"min_p": 0.2, "temperature": 1.2, "seed": 11},
    {"repetition_penalty": 1.8, "temperature": 0.0},
    {"presence_penalty": 1.5, "frequency_penalty": 1.0, "temperature": 0.0},
    {"repetition_penalty": 0.5, "top_k": 3, "min_p": 0.05, "top_p": 0.9, "temperature": 0.8, "seed": 3},
])
def test_sampling_parameters_reach_the_sampler(served, offline, params):
    running, _ = served
    expected = _offline_ids(offline, "sample me", max_tokens=32, **params)
    unfiltered = {k: v for k, v in params.items() if k in ("temperature", "seed")}
    assert expected != _offline_ids(offline, "sample me", max_tokens=32, **unfiltered), "the parameter matters"
    result = _client(running.url).completions.create(model=MODEL, prompt="sample me", max_tokens=32,
                                                     extra_body={"ignore_eos": True, **params})
    assert result.choices[0].text == offline.tokenizer.decode(expected)


def test_allowed_token_ids_give_one_character_per_chunk(served, offline):
    running, _ = served
    printable = list(range(0x20, 0x7f))  # the byte tokenizer's ids of printable ASCII
    expected = _offline_ids(offline, "text only", max_tokens=32, seed=5, allowed_token_ids=printable)
    assert set(expected) <= set(printable)
    _, chunks = _sse(running.url, "/v1/completions", {
        "model": MODEL, "prompt": "text only", "max_tokens": 32, "seed": 5, "stream": True,
        "ignore_eos": True, "allowed_token_ids": printable})
    assert [c["choices"][0]["text"] for c in chunks] == [chr(t) for t in expected]
    chat = _client(running.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True, "allowed_token_ids": [ord("a"), ord("b")]})
    assert len(chat.choices[0].message.content) == 16 and set(chat.choices[0].message.content) <= {"a", "b"}


def test_repetition_penalty_avoids_seen_tokens(offline):
    prompt = ByteTokenizer().encode("penalty")
    [request] = offline.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                          repetition_penalty=10.0))
    out = request.output_token_ids
    assert len(set(out)) == len(out) and not set(out) & set(prompt)


@pytest.mark.parametrize("body,param", [
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"logprobs": 2}, "logprobs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [1, 512]}, "allowed_token_ids"),
    ({"allowed_token_ids": "abc"}, "allowed_token_ids"),
    ({"stream": True, "stream_options": {"include_usage": True, "bogus": True}}, "stream_options"),
])
def test_bad_sampling_parameters_are_400(served, body, param):
    running, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        _client(running.url).completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=body)
    assert info.value.body["param"] == param


def test_vllm_style_histograms_count_exactly(served):
    running, _ = served
    before = _samples(_scrape(running.url)[1])
    lengths = [1, 5, 9]
    client = _client(running.url)
    for n in lengths:
        client.completions.create(model=MODEL, prompt="count me", max_tokens=n, extra_body={"ignore_eos": True})
    after = _samples(_scrape(running.url)[1])

    def delta(name: str) -> float:
        return _value(after, name) - _value(before, name)

    prompt_len = len(ByteTokenizer().encode("count me"))
    assert delta(sc.ENGINE_ITL_SECONDS + "_count") == sum(n - 1 for n in lengths)
    assert delta(sc.ENGINE_REQUEST_GENERATION_TOKENS + "_sum") == sum(lengths)
    assert delta(sc.ENGINE_REQUEST_GENERATION_TOKENS + "_count") == len(lengths)
    assert delta(sc.ENGINE_REQUEST_PROMPT_TOKENS + "_sum") == prompt_len * len(lengths)
    for name in (sc.ENGINE_PREFILL_SECONDS, sc.ENGINE_DECODE_SECONDS):
        assert delta(name + "_count") == len(lengths)
    # Per request, the token gaps add up to first-to-last-token time (the decode phase).
    assert delta(sc.ENGINE_ITL_SECONDS + "_sum") == pytest.approx(delta(sc.ENGINE_DECODE_SECONDS + "_sum"),
                                                                   abs=2e-3)


def test_openmetrics_carries_trace_exemplars(served):
    running, _ = served
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    _client(running.url, traceparent=f"00-{trace_id}-b7ad6b7169203331-01").completions.create(
        model=MODEL, prompt="exemplar", max_tokens=4, extra_body={"ignore_eos": True})
    content_type, text = _scrape(running.url, "application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    samples = _samples(text, parse_openmetrics)
    for name in (sc.ENGINE_TTFT_SECONDS, sc.ENGINE_ITL_SECONDS, sc.ENGINE_E2E_SECONDS):
        traces = {s.exemplar.labels[sc.EXEMPLAR_TRACE_ID_LABEL] for s in samples[name + "_bucket"] if s.exemplar}
        assert trace_id in traces, name
    plain_type, plain = _scrape(running.url)
    assert plain_type.startswith("text/plain") and "# EOF" not in plain and " # {" not in plain
    # An unsampled trace (flags 00) is stored nowhere: no exemplar points at it.
    unsampled = "1af7651916cd43dd8448eb211c80319c"
    _client(running.url, traceparent=f"00-{unsampled}-b7ad6b7169203331-00").completions.create(
        model=MODEL, prompt="exemplar", max_tokens=4, extra_body={"ignore_eos": True})
    assert unsampled not in _scrape(running.url, "application/openmetrics-text")[1]
