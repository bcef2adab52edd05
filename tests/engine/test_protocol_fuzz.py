"""Property-based fuzzing (hypothesis) of the engine's request parser and, over HTTP, of a
real engine server's OpenAI endpoints.

Bodies are generated as raw bytes (bad UTF-8, truncated JSON), as JSON of any shape
nested up to thousands deep, and as near-valid completion and chat requests whose every
field may take a wrong type, an extreme number (NaN, 2**70, 1e-40, 5e-324) or text holding
lone surrogates. The properties: ``parse_json`` + ``parse_completion_request`` /
``parse_chat_request`` return a request or raise ``ProtocolError`` with a 4xx and OpenAI's
error shape, nothing else; text that comes through is encodable as UTF-8 (the tokenizer's
precondition). Over HTTP (the official ``openai`` SDK cannot send malformed bodies, so a raw
client does): every answer is a 200 whose JSON or SSE stream is well formed and ends with
``[DONE]``, or a 4xx in OpenAI's error shape; never a 5xx, and the server serves on.
CI runs a small seeded slice; ``SIGHTLINE_FUZZ_EXAMPLES`` raises it; bench/fuzz_engine.py
runs 100,000s of cases against ``sightline engine serve``.
"""

from __future__ import annotations

import http.client
import json
import math
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sightline.engine.config import EngineConfig

from sightline.engine.openai_protocol import (ProtocolError, parse_chat_request, parse_completion_request,
                                              parse_json)

FUZZ = settings(max_examples=int(os.environ.get("SIGHTLINE_FUZZ_EXAMPLES", "60")), derandomize=True,
                deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TEXT = st.text(st.characters(exclude_categories=()), max_size=10)
NUMBERS = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 2**70, -(2**70), 1e30, math.nan, math.inf,
                           -math.inf, 0.5, True, False, 1e-40, 1e-300, 5e-324, 2.0**-126, -0.0, 101, -101])
SCALARS = st.one_of(st.none(), NUMBERS, st.integers(), st.floats(), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=10)


@st.composite
def deep(draw):
    value = draw(JSON)
    for _ in range(draw(st.sampled_from([0, 3, 31, 33, 500, 3000]))):
        value = [value] if draw(st.booleans()) else {"k": value}
    return value


ANY = st.one_of(JSON, deep())
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "wizard"]), ANY),
    "content": st.one_of(TEXT, ANY, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.one_of(TEXT, ANY)}), max_size=3))})
COMMON = {"model": st.one_of(st.just("tiny"), TEXT, ANY), "max_tokens": st.one_of(st.integers(), NUMBERS, ANY),
          "temperature": st.one_of(NUMBERS, ANY), "top_p": st.one_of(NUMBERS, ANY), "seed": st.one_of(NUMBERS, ANY),
          "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6), ANY), "stream": st.one_of(st.booleans(), ANY),
          "stream_options": ANY, "priority": st.one_of(NUMBERS, ANY), "ignore_eos": ANY, "n": ANY,
          "logit_bias": ANY, "tools": ANY, "top_k": st.one_of(NUMBERS, ANY), "min_p": st.one_of(NUMBERS, ANY),
          "repetition_penalty": st.one_of(NUMBERS, ANY), "presence_penalty": st.one_of(NUMBERS, ANY),
          "frequency_penalty": st.one_of(NUMBERS, ANY),
          "allowed_token_ids": st.one_of(st.lists(st.integers(min_value=-2, max_value=600), max_size=8), ANY)}
COMPLETION = st.fixed_dictionaries({}, optional={**COMMON, "prompt": st.one_of(
    TEXT, st.lists(st.integers(min_value=-5, max_value=2**70), max_size=5), ANY)})
CHAT = st.fixed_dictionaries({}, optional={**COMMON, "messages": st.one_of(st.lists(MESSAGE, max_size=3), ANY)})


def _encode(document) -> bytes:
    try:
        return json.dumps(document).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        return b'{"model": ' + b"[" * 5000


@FUZZ
@example(b'{"model": "tiny", "prompt": [1, 2], "stop": "\\udc80"}', False)  # found by bench/fuzz.py
@given(st.one_of(COMPLETION, CHAT, ANY).map(_encode) | st.binary(max_size=200), st.booleans())
def test_request_parser_answers_4xx_or_a_request(body, chat):
    try:
        parsed = parse_json(body)
        request = parse_chat_request(parsed) if chat else parse_completion_request(parsed)
    except ProtocolError as error:
        assert 400 <= error.status < 500
        shape = error.body()["error"]
        assert set(shape) == {"message", "type", "param", "code"} and shape["message"]
        json.dumps(error.body())  # the error itself is always serialisable
        return
    texts = [request.model, *request.stop]
    texts += [m.content for m in request.messages] if chat else [request.prompt] if isinstance(request.prompt, str) else []
    for text in texts:
        text.encode("utf-8")  # what the tokenizer will do


# ---- over HTTP, against a real server ---------------------------------------------------------------
BODIES = st.one_of(COMPLETION, CHAT, ANY).map(_encode) | st.binary(max_size=200)
# the SDK's usual streams, so that accepted requests often stream
STREAMING = st.fixed_dictionaries({"model": st.just("tiny"), "stream": st.just(True)}, optional={
    **{k: v for k, v in COMMON.items() if k not in ("model", "stream")}, "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                    "continuous_usage_stats": st.booleans()}),
    "prompt": st.one_of(TEXT, st.lists(st.integers(min_value=0, max_value=511), min_size=1, max_size=5))})
HEADERS = st.fixed_dictionaries({}, optional={  # well-formed HTTP: aiohttp's parser answers the rest
    "X-Request-Id": st.one_of(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300),
                              st.just("fuzz")),
    "Content-Type": st.sampled_from(["application/json", "text/plain", ""])})


@pytest.fixture(scope="module")
def engine_port():
    from sightline.engine.api_server import serve_in_thread

    # max_model_len 48: whatever a request asks, an accepted one generates a few tokens at most
    running = serve_in_thread(EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01, max_model_len=48,
                                           port=0, shutdown_timeout_s=2))
    yield running.port
    running.stop()


def _exchange(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def check_answer(status: int, content_type: str, data: bytes) -> None:
    """A well-formed 200 (JSON, or an SSE stream ending with [DONE]) or an OpenAI-shaped 4xx."""
    if status != 200:
        assert 400 <= status < 500, (status, data[:300])
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    if content_type.startswith("text/event-stream"):
        events = [e for e in data.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]", events[-3:]
        for event in events[:-1]:
            chunk = json.loads(event.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                assert choice["finish_reason"] in (None, "stop", "length")
        return
    reply = json.loads(data)
    [choice] = reply["choices"]
    assert choice["finish_reason"] in ("stop", "length")
    assert reply["usage"]["completion_tokens"] >= 1


@FUZZ
@example(b'{"model": "tiny", "prompt": "x", "temperature": 1e-40, "max_tokens": 3}', False, {})
@example(b'{"model": "tiny", "prompt": "x", "seed": ' + b"7" * 5000 + b"}", True, {})
@given(BODIES | STREAMING.map(_encode), st.booleans(), HEADERS)
def test_endpoints_answer_a_well_formed_200_or_an_openai_4xx(engine_port, body, chat, headers):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    check_answer(*_exchange(engine_port, path, body, headers))
    status, _, data = _exchange(engine_port, "/v1/completions", b'{"model": "tiny", "prompt": "ok", "max_tokens": 1}',
                                {"Content-Type": "application/json"})
    assert status == 200, data  # still serving
