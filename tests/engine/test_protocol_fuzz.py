"""Property-based fuzzing (hypothesis) of the engine's request parser.

Bodies are generated as raw bytes (bad UTF-8, truncated JSON), as JSON of any shape
nested up to thousands deep, and as near-valid completion and chat requests whose every
field may take a wrong type, an extreme number or text holding lone surrogates. The
property: ``parse_json`` + ``parse_completion_request`` / ``parse_chat_request`` return a
request or raise ``ProtocolError`` with a 4xx and OpenAI's error shape, nothing else; and
text that comes through is encodable as UTF-8 (the tokenizer's precondition).
CI runs a small seeded slice; ``SIGHTLINE_FUZZ_EXAMPLES`` raises it.
"""

from __future__ import annotations

import json
import math
import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sightline.engine.openai_protocol import (ProtocolError, parse_chat_request, parse_completion_request,
                                              parse_json)

FUZZ = settings(max_examples=int(os.environ.get("SIGHTLINE_FUZZ_EXAMPLES", "60")), derandomize=True,
                deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TEXT = st.text(st.characters(exclude_categories=()), max_size=10)
NUMBERS = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 2**70, -(2**70), 1e30, math.nan, math.inf,
                           -math.inf, 0.5, True, False])
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
          "logit_bias": ANY, "tools": ANY}
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
