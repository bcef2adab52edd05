"""The engine's OpenAI-compatible server, driven by the official ``openai`` SDK.

The main server is the real CLI (``sightline engine serve``) in a subprocess on a free port;
its texts are checked against an in-process offline engine with the same seed (exact tokens,
not "looks plausible"). A second, in-process server with a one-slot queue shows 429. The
load test runs 200 concurrent streams of mixed priorities, then aborts 100 streams mid-way and
checks through /metrics that every KV block came back. The last test sends SIGTERM and checks
the drain: 503 for new work, in-flight requests complete, exit code 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig
from sightline.engine.tokenizer import ByteTokenizer, ChatMessage, apply_chat_template
from sightline.instrumentation import semconv as sc
from tests.support import free_port, wait_for_http

MODEL = "tiny"
KV_GIB = 0.05


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = dict(os.environ, SIGHTLINE_TRACE_LEVEL="off")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sightline.deploy.cli", "engine", "serve", "--model", MODEL,
         "--device", "cpu", "--port", str(port), "--kv-cache-gib", str(KV_GIB), "--trace-level", "off",
         "--max-num-seqs", "64", "--shutdown-timeout", "60", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", timeout_s=120, process=proc)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def offline():
    """Same weights as the server (same preset and seed), driven step by step in-process."""
    return LLMEngine(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=KV_GIB))


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy_text(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> str:
    [request] = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                             ignore_eos=True))
    return engine.tokenizer.decode(request.output_token_ids)


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _metric(url: str, name: str, **labels) -> float:
    labels = {"model": MODEL, **labels}
    return _metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


def _post_raw(url: str, path: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- API behaviour --------------------------------------------------------------------------------
def test_models_and_health(server):
    _, url = server
    models = _client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        assert json.loads(response.read())["status"] == "ok"


def test_completion_matches_offline_engine(server, offline):
    _, url = server
    result = _client(url).completions.create(model=MODEL, prompt="Hello, Sightline", max_tokens=12,
                                             temperature=0, extra_body={"ignore_eos": True})
    prompt_ids = ByteTokenizer().encode("Hello, Sightline")
    assert result.object == "text_completion"
    assert result.usage.prompt_tokens == len(prompt_ids) == 17
    assert result.usage.completion_tokens == 12 and result.usage.total_tokens == 29
    assert result.choices[0].finish_reason == "length"
    assert result.choices[0].text == _greedy_text(offline, prompt_ids, 12)


def test_streamed_chat_with_usage(server, offline):
    _, url = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo ✓"}]
    stream = _client(url).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    prompt_ids = ByteTokenizer().encode(apply_chat_template([ChatMessage(**m) for m in messages]))
    assert usage_chunks[0].usage.prompt_tokens == len(prompt_ids)
    assert usage_chunks[0].usage.completion_tokens == 20
    assert text == _greedy_text(offline, prompt_ids, 20)
    # The same request unstreamed gives the same text.
    whole = _client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                 temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"


def test_stop_strings(server, offline):
    _, url = server
    client = _client(url)
    prompt = "Stop strings: "
    full = _greedy_text(offline, ByteTokenizer().encode(prompt), 48)
    # A two-character window of the greedy text, first occurring past its start: the reply must
    # end right before its first occurrence, streamed or not.
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1)
                if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    expected = full[:full.index(stop)]
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                       stop=[stop, "never-there"], extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == expected
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_determinism(server):
    _, url = server
    client = _client(url)

    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Roll the dice", max_tokens=24,
                                         temperature=1.0, top_p=0.95, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1235), sample(1236)}) == 3


BAD_REQUESTS = [  # (route, body, status, param, code)
    ("completions", {"prompt": "x", "n": 2}, 400, "n", "unsupported_value"),
    ("completions", {"prompt": "x", "temperature": 5}, 400, "temperature", "invalid_value"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens", "context_length_exceeded"),
    ("completions", {"prompt": "x" * 3000}, 400, "max_tokens", "context_length_exceeded"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("completions", {"prompt": "x", "priority": "high"}, 400, "priority", "invalid_value"),
    ("completions", {"prompt": "x", "seed": 1.5}, 400, "seed", "invalid_value"),
    ("completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt", "invalid_value"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "cache_salt": 7}, 400, "cache_salt",
     "invalid_value"),
    ("completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs", "unsupported_parameter"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
    ("completions", {"prompt": [1, 2, 99999]}, 400, "prompt", "invalid_value"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ("chat", {"messages": []}, 400, "messages", "invalid_value"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n", "unsupported_value"),
]


@pytest.mark.parametrize("route,body,status,param,code", BAD_REQUESTS,
                         ids=[f"{r}-{p}-{c}" for r, _, _, p, c in BAD_REQUESTS])
def test_openai_shaped_errors(server, route, body, status, param, code):
    _, url = server
    client = _client(url)
    before = _metric(url, sc.ENGINE_REQUEST_ERRORS_TOTAL + "_total", code=str(status))
    create = client.completions.create if route == "completions" else client.chat.completions.create
    if route == "chat":
        body.setdefault("messages", [{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        # extra_body carries even invalid types past the SDK's own typing, as raw JSON would
        create(model=MODEL, extra_body=body, **({"messages": body.pop("messages")} if route == "chat"
                                                  else {"prompt": body.pop("prompt")}))
    error = info.value.body
    assert info.value.status_code == status
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert error["message"]
    assert _metric(url, sc.ENGINE_REQUEST_ERRORS_TOTAL + "_total", code=str(status)) == before + 1


def test_malformed_json_and_unknown_model_and_route(server):
    _, url = server
    status, body = _post_raw(url, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    assert "not valid JSON" in body["error"]["message"]
    status, body = _post_raw(url, "/v1/completions", b'[1, 2]')
    assert status == 400 and "JSON object" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:
        _client(url).completions.create(model="gpt-9", prompt="x")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    status, body = _post_raw(url, "/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["code"] == "not_found"
    # Nested 5,000 deep (the JSON parser's own limit) and 40 deep (past ours): 400, not 500.
    for depth in (5000, 40):
        deep = b'{"model": "tiny", "prompt": "x", "logit_bias": ' + b"[" * depth + b"]" * depth + b"}"
        status, body = _post_raw(url, "/v1/completions", deep)
        assert status == 400 and body["error"]["code"] == "invalid_json", (depth, body)
        assert "nested deeper than 32" in body["error"]["message"]
    # A lone surrogate is valid JSON but not text: 400 naming the field, in both routes.
    status, body = _post_raw(url, "/v1/completions", b'{"model": "tiny", "prompt": "ab\\udc80"}')
    assert status == 400 and body["error"]["param"] == "prompt" and "surrogate" in body["error"]["message"]
    status, body = _post_raw(url, "/v1/chat/completions",
                             b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800x"}]}')
    assert status == 400 and body["error"]["param"] == "messages[0].content"
    for stop in (b'["\\udfff"]', b'"\\udc80"'):
        status, body = _post_raw(url, "/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ' + stop + b"}")
        assert status == 400 and body["error"]["param"] == "stop"
    # A surrogate pair is an ordinary character.
    status, body = _post_raw(url, "/v1/completions", b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert status == 200
    # Still serving after all that.
    assert _client(url).completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_queue_full_is_429_and_priority_orders_the_queue():
    from sightline.engine.request import RequestStatus
    from sightline.engine.api_server import serve_in_thread

    config = EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.01, port=0, shutdown_timeout_s=5,
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256,
                                                    max_waiting=2))
    running = serve_in_thread(config)
    try:
        client = _client(running.url)
        scheduler = running.engine.scheduler
        long = dict(model=MODEL, max_tokens=500, stream=True, extra_body={"ignore_eos": True})
        first = client.completions.create(prompt="one", **long)
        next(iter(first))  # running: the one slot is taken
        lax = client.completions.create(prompt="two", model=MODEL, max_tokens=500, stream=True,
                                        extra_body={"ignore_eos": True, "priority": 5})
        urgent = client.completions.create(prompt="three", model=MODEL, max_tokens=500, stream=True,
                                           extra_body={"ignore_eos": True, "priority": -1})
        lax_id, urgent_id = (s.response.headers["x-request-id"] for s in (lax, urgent))
        assert scheduler.get(lax_id).status is RequestStatus.WAITING
        assert scheduler.get(urgent_id).status is RequestStatus.WAITING
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt="four", max_tokens=4)
        assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
        assert info.value.body["type"] == "rate_limit_error"
        assert info.value.response.headers["Retry-After"] == "1"
        first.close()  # the slot frees: the more urgent request gets it although it came later
        next(iter(urgent))
        assert scheduler.get(lax_id).status is RequestStatus.WAITING
        lax.close()
        urgent.close()
        deadline = time.monotonic() + 20
        while running.engine.num_live and time.monotonic() < deadline:
            time.sleep(0.02)
        assert running.engine.num_live == 0 and running.engine.kv_cache.num_used_blocks == 0
        result = client.completions.create(model=MODEL, prompt="five", max_tokens=3,
                                           extra_body={"ignore_eos": True})
        assert result.usage.completion_tokens == 3
    finally:
        running.stop()


def test_failed_model_step_is_a_500_and_the_server_goes_on():
    from sightline.engine.api_server import serve_in_thread

    running = serve_in_thread(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.01, port=0,
                                           shutdown_timeout_s=5))
    try:
        client = _client(running.url)
        runner = running.engine.runner
        real_launch = runner.launch
        failures = []

        def fail_twice(plan, step_trace=None, previous=None):  # a device error, as CUDA would raise it
            if len(failures) < 2:
                failures.append(plan.step_id)
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return real_launch(plan, step_trace, previous)

        runner.launch = fail_twice
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="boom", max_tokens=4)
        assert info.value.status_code == 500 and info.value.body["code"] == "engine_error"
        assert "illegal memory access" in info.value.body["message"]
        # Streamed: the 200 head is gone already, so the failure arrives as an SSE error event,
        # which the SDK raises.
        with pytest.raises(openai.APIError, match="illegal memory access"):
            list(client.completions.create(model=MODEL, prompt="boom", max_tokens=4, stream=True))
        runner.launch = real_launch
        assert running.engine.kv_cache.num_used_blocks == 0 and running.engine.num_live == 0
        ok = client.completions.create(model=MODEL, prompt="fine", max_tokens=3, extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 3 and len(failures) == 2
        assert _metric(running.url, sc.ENGINE_REQUEST_ERRORS_TOTAL + "_total", code="500") == 2
    finally:
        running.stop()


# ---- load -------------------------------------------------------------------------------------------
def test_load_200_streams_then_100_aborts_leak_nothing(server):
    _, url = server
    aborts_before = _metric(url, sc.ENGINE_REQUESTS_TOTAL + "_total", finish_reason="abort")
    length_before = _metric(url, sc.ENGINE_REQUESTS_TOTAL + "_total", finish_reason="length")

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def complete(i):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=6,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "priority": i % 4})
            finish, usage = None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
            return finish, usage.completion_tokens if usage else None

        async def abort(i):
            stream = await client.completions.create(
                model=MODEL, prompt=f"abort {i}", max_tokens=400, stream=True,
                extra_body={"ignore_eos": True, "priority": i % 3})
            async for _ in stream:
                break  # mid-stream: one chunk in, then hang up
            await stream.close()

        done = await asyncio.gather(*(complete(i) for i in range(200)))
        await asyncio.gather(*(abort(i) for i in range(100)))
        await client.close()
        return done

    started = time.monotonic()
    done = asyncio.run(run())
    assert done == [("length", 6)] * 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        values = _metrics(url)
        key = (("model", MODEL),)
        if (values[(sc.ENGINE_KV_USAGE, key)], values[(sc.ENGINE_RUNNING, key)],
                values[(sc.ENGINE_WAITING, key)]) == (0.0, 0.0, 0.0):
            break
        time.sleep(0.1)
    assert values[(sc.ENGINE_KV_USAGE, key)] == 0.0, "KV blocks leaked"
    assert values[(sc.ENGINE_RUNNING, key)] == 0.0 and values[(sc.ENGINE_WAITING, key)] == 0.0
    assert _metric(url, sc.ENGINE_REQUESTS_TOTAL + "_total", finish_reason="abort") == aborts_before + 100
    assert _metric(url, sc.ENGINE_REQUESTS_TOTAL + "_total", finish_reason="length") == length_before + 200
    print(f"load: 200 streams + 100 aborts in {time.monotonic() - started:.1f} s")


# ---- shutdown (keep last: it stops the module's server) -------------------------------------------
def test_sigterm_drains_then_exits(server):
    proc, url = server
    client = _client(url)
    # long enough that the drain outlasts the probe below (40 tokens took under 0.1 s, and a
    # loaded machine sent the probe after the listener had closed)
    stream = client.completions.create(model=MODEL, prompt="long", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    iterator = iter(stream)
    first = next(iterator)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    status = None
    while time.monotonic() < deadline:
        status, body = _post_raw(url, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode())
        if status == 503:
            break
        time.sleep(0.05)
    assert status == 503 and body["error"]["code"] == "shutting_down"
    rest = list(iterator)
    assert rest[-1].choices[0].finish_reason == "length"  # the in-flight request completed
    assert first.choices
    assert proc.wait(60) == 0


def test_a_token_id_request_reaches_the_engine_without_a_thread_or_a_task_of_its_own():
    """On a busy server each turn of the event loop waits behind a step's SSE writes, so the
    request path takes as few as it can: a token-id prompt is checked on the loop (text still
    goes to the tokenizer's threads), and a body that came with its headers is read in the
    request's own task (a POST costs the loop no more tasks than a GET)."""
    import threading

    from sightline.engine.api_server import serve_in_thread

    running = serve_in_thread(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.01, port=0))
    try:
        created: list[str] = []

        def factory(loop, coro, **kwargs):
            created.append(coro.__qualname__)
            return asyncio.Task(coro, loop=loop, **kwargs)

        asyncio.run_coroutine_threadsafe(_set_task_factory(factory), running.loop).result(10)

        def tokenizer_threads() -> set:
            return {t for t in threading.enumerate() if t.name.startswith("sightline-tokenize")}

        def tasks_of(request: urllib.request.Request) -> list[str]:
            """The tasks one request on a new connection made, its headers and body sent in
            one write (the listener's accept tasks are the loop's, not the request's)."""
            host, port = urllib.parse.urlsplit(running.url).netloc.split(":")
            data = request.data or b""
            head = (f"{request.get_method()} {urllib.parse.urlsplit(request.full_url).path} HTTP/1.1\r\n"
                    f"Host: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            created.clear()
            with socket.create_connection((host, int(port)), timeout=30) as conn:
                conn.sendall(head + data)
                reply = b""
                while chunk := conn.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
            return sorted(name for name in created if "_accept_connection" not in name)

        threads = tokenizer_threads()
        get = tasks_of(urllib.request.Request(running.url + "/v1/models"))
        for stream in (False, True):
            body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3,
                               "stream": stream}).encode()
            post = tasks_of(urllib.request.Request(running.url + "/v1/completions", data=body,
                                                   headers={"Content-Type": "application/json"}))
            assert post == get
        assert tokenizer_threads() == threads
        _client(running.url).completions.create(model=MODEL, prompt="text", max_tokens=2)
        assert len(tokenizer_threads() - threads) == 1
    finally:
        running.stop()


async def _set_task_factory(factory) -> None:
    asyncio.get_running_loop().set_task_factory(factory)


_EXIT_MID_GENERATION = """
import time
from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams

engine = LLMEngine(EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.02))
engine.start()
for i in range(4):
    engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1500, ignore_eos=True))
time.sleep(0.5)
print("exiting mid-generation", engine.has_work, flush=True)
"""


def test_a_program_that_exits_mid_generation_exits_cleanly():
    """The engine's loop thread inside a torch call at interpreter exit would abort the
    process (exit 134, "terminate called without an active exception"): it is shut down at
    exit first (instrumentation/exit_guard.py). Three exits, each clean."""
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _EXIT_MID_GENERATION], capture_output=True,
                              text=True, timeout=120)
        assert (done.returncode, done.stdout, "terminate" in done.stderr) == (
            0, "exiting mid-generation True\n", False), done.stderr[-2000:]
