"""The OpenAI wire format: request parsing with validation, response and SSE chunk bodies.

Parsing turns a JSON body into a typed request or raises ``ProtocolError`` carrying the HTTP
status and OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``; the
message names the bad value (abbreviated, so an error costs O(1) whatever was sent) and what
is allowed. Refused with 400 too: bodies nested deeper than ``MAX_JSON_DEPTH``, text holding a
lone UTF-16 surrogate (valid JSON, not Unicode text), more than ``MAX_STOP_SEQUENCES`` stop
strings or one longer than ``MAX_STOP_CHARS``, more than ``MAX_ALLOWED_TOKEN_IDS`` allowed ids
(checked before their elements; the server bounds them by the vocabulary), a priority outside
``semconv.REQUEST_PRIORITY_MIN..MAX``. Supported: ``/v1/completions`` and ``/v1/chat/completions``
with max_tokens (chat: also max_completion_tokens), temperature, top_p, seed, stop, stream,
stream_options, and vLLM's top_k, min_p, repetition_penalty, ignore_eos, allowed_token_ids,
priority, presence_penalty, frequency_penalty. Features this engine lacks (n > 1, logprobs,
logit_bias, tools, batch prompts) are refused with a 400 that says so, never ignored.
"""

from __future__ import annotations

import itertools
import json
import math
import reprlib
import time
from dataclasses import dataclass, field
from typing import Any

from ..instrumentation import semconv as sc
from .request import MIN_REPETITION_PENALTY
from .tokenizer import ChatMessage

__all__ = ["ProtocolError", "CompletionRequest", "ChatCompletionRequest", "error_body",
           "parse_completion_request", "parse_chat_request", "completion_response",
           "chat_response", "completion_chunk", "chat_chunk", "usage", "usage_chunk", "sse", "SSE_DONE"]

SSE_DONE = b"data: [DONE]\n\n"
MAX_STOP_SEQUENCES = 4
# A stop string is held back from the stream while it may still be starting, and searched
# for after every token: its length is both a delay and a per-token cost.
MAX_STOP_CHARS = 512
# The widest vocabularies in use (Gemma 3) have 262,144 ids; a longer list cannot be a set of
# distinct ids of any model, and is refused before its elements are checked.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_JSON_DEPTH = 32  # a chat request with content parts is 5 deep
MAX_CACHE_SALT_CHARS = 256
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ProtocolError(Exception):
    """A request the server refuses; ``body()`` is the OpenAI error JSON."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers or {}  # extra response headers (Retry-After on a 429)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Abbreviated(reprlib.Repr):
    """reprlib's abbreviations, without its sorting of a dict's keys (O(n log n) for a huge one)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 80

    def repr_dict(self, x: dict, level: int) -> str:
        if not x or level <= 0:
            return "{}" if not x else "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces + ["..."] * (len(x) > self.maxdict)) + "}"


_SHOW = _Abbreviated()


def _shown(value: Any) -> str:
    """``repr(value)`` abbreviated: an error message never copies a large body back."""
    return _SHOW.repr(value)


@dataclass
class _Common:
    model: str
    max_tokens: int | None = None  # None: the API's default (16 for completions, context for chat)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk (stream_options.continuous_usage_stats)
    top_k: int | None = None  # None: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token id
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached blocks


@dataclass
class CompletionRequest(_Common):
    prompt: str | list[int] = ""


@dataclass
class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = field(default_factory=list)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying why not."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except ValueError as exc:  # an integer of more digits than int() converts (4,300 by default)
        raise ProtocolError(f"request body holds a number JSON cannot carry here: {exc}",
                            code="invalid_json") from None
    except RecursionError:  # the parser's own guard, far deeper than MAX_JSON_DEPTH
        raise ProtocolError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                            code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(body).__name__}")
    if _too_deep(body, MAX_JSON_DEPTH):
        raise ProtocolError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    return body


def _too_deep(document: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than ``limit`` (walked without recursion)."""
    stack = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _text(value: str, param: str) -> str:
    """``value`` if it is Unicode text; a lone surrogate (valid JSON escape) is not."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ProtocolError(f"{param} is not valid Unicode text: lone surrogate {value[exc.start]!r} at "
                                f"character {exc.start}", param=param, code="invalid_value") from None
    return value


MAX_TOP_K = 2**31 - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False,
            hint: str = "") -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > hi or (value <= lo if lo_open else value < lo):
        raise ProtocolError(f"{name}={_shown(value)} is not a number in {'(' if lo_open else '['}{lo}, {hi}]"
                            f"{hint}", param=name, code="invalid_value")
    return float(value)


def _common(body: dict, max_tokens_keys: tuple[str, ...]) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError(f"model={_shown(model)} must be a non-empty string", param="model",
                            code="invalid_value")
    _text(model, "model")
    n = body.get("n")
    if n is not None and n != 1:
        raise ProtocolError(f"n={_shown(n)} is not supported: this engine returns one choice per request (n=1)",
                            param="n", code="unsupported_value")
    for name, neutral in (("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("echo", (None, False)),
                          ("best_of", (None, 1)), ("suffix", (None, "")),
                          ("logit_bias", (None, {})), ("tools", (None, [])), ("response_format", (None,))):
        if name in body and body[name] not in neutral:
            raise ProtocolError(f"{name}={_shown(body[name])} is not supported by this engine", param=name,
                                code="unsupported_parameter")
    max_tokens = None
    for key in max_tokens_keys:
        value = body.get(key)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise ProtocolError(f"{key}={_shown(value)} must be an integer >= 1", param=key, code="invalid_value")
        max_tokens = value
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise ProtocolError(f"seed={_shown(seed)} must be an integer", param="seed", code="invalid_value")
    stops = _stop(body.get("stop"))
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ProtocolError(f"ignore_eos={_shown(ignore_eos)} must be a boolean", param="ignore_eos",
                            code="invalid_value")
    priority = body.get("priority", 0)
    if priority is None:
        priority = 0
    if not _is_int(priority) or not sc.REQUEST_PRIORITY_MIN <= priority <= sc.REQUEST_PRIORITY_MAX:
        raise ProtocolError(f"priority={_shown(priority)} must be an integer in [{sc.REQUEST_PRIORITY_MIN}, "
                            f"{sc.REQUEST_PRIORITY_MAX}] (lower is more urgent)",
                            param="priority", code="invalid_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ProtocolError(f"stream={_shown(stream)} must be a boolean", param="stream", code="invalid_value")
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    top_k = body.get("top_k")
    if top_k is None or (_is_int(top_k) and top_k in (-1, 0)):
        top_k = None
    elif not _is_int(top_k) or top_k < 1:
        raise ProtocolError(f"top_k={_shown(top_k)} must be an integer >= 1, or -1 or 0 for off", param="top_k",
                            code="invalid_value")
    else:   # past any vocabulary top_k means every token; kept within what the core's records carry
        top_k = min(top_k, MAX_TOP_K)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ProtocolError(f"cache_salt={str(salt)[:300]!r} must be a string of 1..{MAX_CACHE_SALT_CHARS} "
                            "characters", param="cache_salt", code="invalid_value")
    allowed = _allowed_token_ids(body.get("allowed_token_ids"))
    return dict(model=model, max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                seed=seed % 2**63 if seed is not None else None, stop=stops, ignore_eos=ignore_eos,
                priority=priority, stream=stream, include_usage=include_usage,
                continuous_usage=continuous_usage, top_k=top_k, min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                repetition_penalty=_number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, 10.0,
                                           hint=" (a smaller one underflows float32)"),
                presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                allowed_token_ids=allowed,
                cache_salt=_text(salt, "cache_salt") if salt is not None else None)


def _stop(stop: Any) -> tuple[str, ...]:
    """The stop strings: at most MAX_STOP_SEQUENCES non-empty ones of at most MAX_STOP_CHARS."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop] if stop else []
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise ProtocolError(f"stop={_shown(stop)} must be a string or a list of at most {MAX_STOP_SEQUENCES} "
                            f"non-empty strings of at most {MAX_STOP_CHARS} characters", param="stop",
                            code="invalid_value")
    return tuple(_text(s, "stop") for s in stop)


def _allowed_token_ids(allowed: Any) -> tuple[int, ...] | None:
    """The allowed ids, or None (every id); the length is checked before the elements."""
    if allowed is None:
        return None
    if not isinstance(allowed, list) or not 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
        length = f" (a list of {len(allowed):,})" if isinstance(allowed, list) else ""
        raise ProtocolError(f"allowed_token_ids must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS:,} "
                            f"token ids{length}", param="allowed_token_ids", code="invalid_value")
    if not all(_is_int(t) and t >= 0 for t in allowed):
        bad = next(t for t in allowed if not (_is_int(t) and t >= 0))
        raise ProtocolError(f"allowed_token_ids holds {_shown(bad)}, not a token id (an integer >= 0)",
                            param="allowed_token_ids", code="invalid_value")
    return tuple(allowed)



_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def _stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of ``stream_options``; unknown keys are refused."""
    if options is None:
        return False, False
    if (not isinstance(options, dict) or set(options) - set(_STREAM_OPTIONS)
            or not all(isinstance(options.get(k, False), bool) for k in _STREAM_OPTIONS)):
        raise ProtocolError(f"stream_options={_shown(options)} must be an object with boolean keys among "
                            f"{', '.join(_STREAM_OPTIONS)}", param="stream_options", code="invalid_value")
    if not stream:
        raise ProtocolError("stream_options is only allowed when stream is true",
                            param="stream_options", code="invalid_value")
    return options.get("include_usage", False), options.get("continuous_usage_stats", False)


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise ProtocolError("prompt must be a string, or a non-empty list of token ids; batches of "
                                f"several prompts are not supported (got a list of {len(prompt)})",
                                param="prompt", code="invalid_value")
    elif not isinstance(prompt, str):
        raise ProtocolError(f"prompt={_shown(prompt)} must be a string or a list of token ids", param="prompt",
                            code="invalid_value")
    else:
        _text(prompt, "prompt")
    return CompletionRequest(prompt=prompt, **_common(body, ("max_tokens",)))


def parse_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list of {role, content} objects",
                            param="messages", code="invalid_value")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise ProtocolError(f"messages[{i}].role={_shown(role)} is not one of {'|'.join(_ROLES)}",
                                param=f"messages[{i}].role", code="invalid_value")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ProtocolError(f"messages[{i}].content parts must be text parts, got {_shown(part)}",
                                        param=f"messages[{i}].content", code="invalid_value")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and message["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content={_shown(content)} must be a string",
                                param=f"messages[{i}].content", code="invalid_value")
        parsed.append(ChatMessage(message["role"], _text(content, f"messages[{i}].content")))
    return ChatCompletionRequest(messages=parsed,
                                 **_common(body, ("max_tokens", "max_completion_tokens")))


# ---- responses -------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage block; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV
    the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_response(response_id: str, model: str, created: int, text: str,
                        finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
                        cached_tokens: int = 0) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chat_response(response_id: str, model: str, created: int, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_chunk(response_id: str, model: str, created: int, text: str,
                     finish_reason: str | None, include_usage: bool, usage_now: dict | None = None) -> dict:
    """One streamed piece of a completion. ``usage`` is null on chunks when include_usage asks
    for a final usage chunk; ``usage_now`` (continuous_usage_stats) puts the totals so far there."""
    return _with_usage({"id": response_id, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]},
                       include_usage, usage_now)


def chat_chunk(response_id: str, model: str, created: int, delta: dict[str, str],
               finish_reason: str | None, include_usage: bool, usage_now: dict | None = None) -> dict:
    """One streamed piece of a chat completion (``usage`` as in :func:`completion_chunk`)."""
    return _with_usage({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]},
                       include_usage, usage_now)


def _with_usage(chunk: dict, include_usage: bool, usage_now: dict | None) -> dict:
    if include_usage or usage_now is not None:
        chunk["usage"] = usage_now
    return chunk


def usage_chunk(response_id: str, model: str, created: int, chat: bool, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The extra last chunk of ``stream_options.include_usage``: no choices, the totals."""
    return {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def now_s() -> int:
    return int(time.time())
