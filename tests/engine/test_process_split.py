"""``engine serve`` as processes: an engine core and 1 or 2 API servers, driven by the openai SDK.

The boundary's records round-trip through msgpack. Each served engine is the real CLI in a
subprocess on a free port. Streams through 1 and 2 API servers give the in-process engine's
exact tokens; a client that disconnects has its request aborted in the core; a full queue is
a 429 with ``Retry-After`` from the front end. Deaths: the core SIGKILLed mid-load ends every
stream with an OpenAI-shaped error within 2 s, new requests get 503, ``/health`` fails and
``engine serve`` exits non-zero; an API server SIGKILLed has its requests aborted by the
core, whose KV blocks come back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from sightline.engine import core_records as cr
from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams
from sightline.engine.tokenizer import ByteTokenizer
from sightline.instrumentation import semconv as sc
from sightline.deploy.processes import free_ports
from tests.engine.served_engine import MODEL, Served, Streams
from tests.support import wait_for_http



# ---- the records ------------------------------------------------------------------------------
def test_a_top_k_past_any_vocabulary_crosses_the_boundary_as_all_tokens():
    """top_k 2**70 (found by bench/fuzz_engine.py: msgpack carries at most 64-bit integers,
    and the request was answered 500) is every token: clamped before the record is built."""
    from sightline.engine.openai_protocol import MAX_TOP_K, parse_completion_request

    for huge in (2**64, 2**70):
        params = parse_completion_request({"model": MODEL, "prompt": "x", "top_k": huge})
        assert params.top_k == MAX_TOP_K
        record = cr.AddRequest("r", [1, 2], SamplingParams(max_tokens=2, temperature=0.7, top_k=params.top_k))
        assert cr.core_decoder().decode(cr.encode(record)).sampling.top_k == MAX_TOP_K


def test_every_record_round_trips():
    sampling = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=("a", "bc"),
                              top_k=5, min_p=0.1, repetition_penalty=1.2, presence_penalty=-0.5,
                              frequency_penalty=0.25, allowed_token_ids=(1, 2, 3))
    trace = cr.TraceContext((3 << 48) | 17, "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    to_core = [cr.Hello(1, 4242), cr.AddRequest("cmpl-1", [256, 104, 105], sampling, -2, 1, trace),
               cr.AddRequest("cmpl-2", [1], SamplingParams()), cr.Abort("cmpl-1", 1),
               cr.Abort("cmpl-1", 1, stop_at=4), cr.UtilityCall(9, 1, "kv_blocks")]
    stats = cr.StepStats(12, 0.0042, 128, 2, 3, 2, 1, 2, 5, 40, 327)
    from_core = [cr.Phase("connecting"), cr.Phase("warmup_decode", ("imports", "load_weights"), 17),
                 cr.Ready("tiny", 2048, 512, 257, 327, 16, 1024, 64, "cpu", "float32", False, 99, None),
                 cr.Ready("m", 8, 9, None, 1, 8, 1, 1, "cuda:0", "bfloat16", True, 1, "ipc:///x"),
                 cr.Ready("m", 8, 9, None, 1, 8, 1, 1, "cuda:0", "bfloat16", True, 1, None, 42.5,
                          "4bf92f3577b34da6a3ce929d0e0e4736"),
                 cr.OutputBatch(["a", "b"], [5, 6], [cr.FinalOutput(
                     "c", [7], "length", None, None, 3, 4, 0.01, 0.02, 0.003, 0.05, 0.01, 0.03, 1)],
                     stats, 3),
                 cr.OutputBatch([], [], [cr.FinalOutput("d", [], "abort", "boom", cr.ERROR_ENGINE)],
                                cr.StepStats(None, None, 0, 0, 0, 0, 0, 0, 0, 0, 327)),
                 cr.UtilityResult(9, {"used": 3, "live_by_api_server": {"0": 1}})]
    to_decoder, from_decoder = cr.core_decoder(), cr.client_decoder()
    for record in to_core:
        assert to_decoder.decode(cr.encode(record)) == record
    for record in from_core:
        assert from_decoder.decode(cr.encode(record)) == record
    # a bad record is refused by the decoder, not taken half-way
    with pytest.raises(Exception):
        to_decoder.decode(cr.encode(cr.AddRequest("x", [1], SamplingParams()))[:-3])
    bad = cr.encode(cr.AddRequest("x", [1], SamplingParams(max_tokens=2))).replace(
        b"max_tokens\x02", b"max_tokens\x00")
    with pytest.raises(Exception, match="max_tokens"):   # SamplingParams checks itself
        to_decoder.decode(bad)


# ---- helpers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[1, 2], ids=["1-api-server", "2-api-servers"])
def served(request):
    served = Served(request.param)
    try:
        yield served
    finally:
        assert served.close() == 0


@pytest.fixture(scope="module")
def offline():
    return LLMEngine(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.02))


def test_health_is_starting_with_the_cores_phase_until_ready():
    """An API server process against a core played by this test over the real socket: /live
    at once, /health 503 with the phase until Ready, and until its peer on the port is no
    longer starting (gone, here), 200 after; the core's pipe closing is its death: /health
    503, and the server exits non-zero on SIGTERM."""
    import multiprocessing
    import socket
    import tempfile

    import zmq

    from sightline.engine.api_server import SERVER_GONE, SERVER_STARTING, run_api_server

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/core"
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.bind(address)
        listener = socket.create_server(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        core_watch, core_alive = ctx.Pipe(duplex=False)
        server_watch, server_alive = ctx.Pipe(duplex=False)
        config = EngineConfig(model=MODEL, device="cpu", shutdown_timeout_s=1)
        peers = ctx.Array("b", 2)
        process = ctx.Process(target=run_api_server, args=(config, 0, 2, address, listener, core_watch,
                                                           server_alive, "warning", peers))
        process.start()
        core_watch.close(), server_alive.close(), listener.close()
        try:
            wait_for_http(url + "/live", timeout_s=60)
            served = Served.__new__(Served)
            served.url = url
            assert served.get("/health") == (503, {"status": "starting", "phase": "connecting",
                                                   "elapsed_s": None, "phases_done": [],
                                                   "api_servers_ready": 0})
            assert router.poll(30_000)
            identity, payload = router.recv_multipart()
            hello = cr.core_decoder().decode(payload)
            assert hello == cr.Hello(0, process.pid) and identity == b"api-0"
            started = time.time_ns() - 5 * 10**9
            router.send_multipart([identity, cr.encode(cr.Phase("warmup_prefill", (
                "imports", "load_weights"), started))])
            deadline = time.monotonic() + 10
            while served.get("/health")[1].get("phase") != "warmup_prefill":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            status, health = served.get("/health")
            assert status == 503 and health.pop("elapsed_s") >= 5
            assert health == {"status": "starting", "phase": "warmup_prefill",
                              "phases_done": ["imports", "load_weights"], "api_servers_ready": 0}
            router.send_multipart([identity, cr.encode(cr.Ready(
                "tiny", 2048, 512, 257, 100, 16, 8, 4, "cpu", "float32", False, os.getpid(),
                None, 7.25, "ab" * 16))])
            deadline = time.monotonic() + 10
            while served.get("/health")[1].get("api_servers_ready") != 1:   # its peer starting
                assert time.monotonic() < deadline
                time.sleep(0.05)
            status, health = served.get("/health")
            assert status == 503 and health["status"] == "starting" and health["phase"] == "ready"
            assert peers[1] == SERVER_STARTING
            peers[1] = SERVER_GONE   # as the supervisor marks a peer that died starting
            wait_for_http(url + "/health", timeout_s=10)
            status, health = served.get("/health")
            assert status == 200 and health == {"status": "ok", "running": 0, "waiting": 0,
                                                "api_server": 0, "pid": process.pid,
                                                "core_pid": os.getpid(), "startup_s": 7.25,
                                                "startup_trace_id": "ab" * 16}
            core_alive.close()   # the core's death, as the API server sees it
            deadline = time.monotonic() + 10
            while served.get("/health")[0] != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert served.get("/health")[1]["status"] == "engine_dead"
            os.kill(process.pid, signal.SIGTERM)
            process.join(30)
            assert process.exitcode == 1
            assert server_watch.poll(0) and _eof(server_watch)   # the core would see it gone
        finally:
            if process.is_alive():
                process.kill()
            router.close(0)


def _eof(conn) -> bool:
    try:
        conn.recv_bytes()
    except EOFError:
        return True
    return False


# ---- serving -----------------------------------------------------------------------------------
def test_streams_give_the_in_process_engines_tokens(served, offline):
    prompts = ["héllo ✓ wörld", "Sightline", "a", "the engine core", "1 2 3", "zmq", "split", "ok"]
    tokenizer = ByteTokenizer()
    wanted = offline.generate([tokenizer.encode(p) for p in prompts],
                              [SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True)
                               for i in range(len(prompts))])
    got: dict[int, tuple[str, int, str]] = {}
    counters = (sc.ENGINE_REQUESTS_TOTAL + "_total", sc.ENGINE_GENERATION_TOKENS_TOTAL + "_total",
                sc.ENGINE_PROMPT_TOKENS_TOTAL + "_total")
    before = [served.metric(counters[0], finish_reason="length"), served.metric(counters[1]),
              served.metric(counters[2])]

    def run(i: int) -> None:
        chunks = list(served.client().completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=10 + i, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        got[i] = ("".join(c.choices[0].text for c in chunks), len(chunks), chunks[-1].choices[0].finish_reason)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, request in enumerate(wanted):   # one chunk per token, the same text
        assert got[i] == (tokenizer.decode(request.output_token_ids), 10 + i, "length"), i
    # the series count each request once, whichever API server served it
    after = [served.metric(counters[0], finish_reason="length"), served.metric(counters[1]),
             served.metric(counters[2])]
    assert [a - b for a, b in zip(after, before)] == [
        len(prompts), sum(10 + i for i in range(len(prompts))),
        sum(len(tokenizer.encode(p)) for p in prompts)]
    assert served.metric(sc.ENGINE_RUNNING) == served.metric(sc.ENGINE_WAITING) == 0
    # a stop string found in the front end ends the request in the core, reason stop
    i = max(got, key=lambda i: len(got[i][0]))
    text = got[i][0]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop) == 2
    reply = served.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=10 + i,
                                               temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert reply.choices[0].text == text[:text.index(stop)] and reply.choices[0].finish_reason == "stop"
    kv = served.wait_kv(lambda kv: kv["live"] == 0)
    assert kv["used"] == 0 and kv["live"] == 0


def test_both_api_servers_serve_one_port(served):
    seen = {}
    deadline = time.monotonic() + 20
    while len(seen) < int(served.process.args[served.process.args.index("--api-server-count") + 1]):
        status, health = served.get("/health")   # each call is a new connection
        assert status == 200 and health["status"] == "ok"
        seen[health["api_server"]] = health["pid"]
        assert time.monotonic() < deadline, seen
    assert len(set(seen.values())) == len(seen)
    assert health["core_pid"] not in seen.values()
    status, live = served.get("/live")
    assert (status, live) == (200, {"status": "alive"})
    # the core's start-up, the same through every API server: its report (a utility call),
    # and its series on /metrics once per phase, whichever server answers the scrape
    status, report = served.get("/debug/startup")
    # /health has it to 3 places, the report to 6: rounding the report's again can land a
    # thousandth away (2.2705 from 2.27049996 rounds up), so within half a thousandth
    assert status == 200 and report["total_s"] > 0
    assert abs(health["startup_s"] - report["total_s"]) <= 0.0005 + 1e-6
    phases = [p["name"] for p in report["phases"]]
    assert phases[0] == sc.STARTUP_IMPORTS and sc.STARTUP_WARMUP_SAMPLER in phases
    assert health["startup_trace_id"] is None   # tracing off
    for _ in range(4):
        with urllib.request.urlopen(served.url + "/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        by_phase = {line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                    for line in lines if line.startswith(sc.ENGINE_STARTUP_SECONDS + "{")}
        assert by_phase == {p["name"]: pytest.approx(p["duration_s"], abs=1e-6)   # rounded there
                            for p in report["phases"]}
        assert sum(line.startswith(sc.ENGINE_STARTUP_SECONDS + "{") for line in lines) == len(phases)
        assert [line for line in lines if line.startswith(sc.ENGINE_JIT_COMPILES_TOTAL + "_total")] == []


def test_a_client_that_disconnects_is_aborted_in_the_core(served):
    aborted = served.metric("sightline_engine_requests_total", finish_reason="abort")
    stream = served.client().completions.create(model=MODEL, prompt="bye", max_tokens=1900, stream=True,
                                                extra_body={"ignore_eos": True})
    iterator = iter(stream)
    next(iterator), next(iterator)
    assert served.kv()["live"] == 1
    stream.close()
    closed = time.monotonic()
    kv = served.wait_kv(lambda kv: kv["live"] == 0)
    assert kv == {**kv, "used": 0, "live": 0, "running": 0, "waiting": 0}
    assert time.monotonic() - closed < 2.0
    assert served.metric("sightline_engine_requests_total", finish_reason="abort") == aborted + 1


def test_a_full_queue_is_429_with_retry_after_from_the_front_end():
    served = Served(1, "--max-num-seqs", "1", "--max-waiting", "2")
    try:
        client = served.client()
        long = dict(model=MODEL, max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
        first = client.completions.create(prompt="one", **long)
        next(iter(first))   # running: the one slot is taken
        waiting = [client.completions.create(prompt=p, **long) for p in ("two", "three")]
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt="four", max_tokens=4)
        assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
        assert info.value.response.headers["Retry-After"] == "1"
        assert served.kv()["waiting"] == 2
        for stream in (first, *waiting):
            stream.close()
        served.wait_kv(lambda kv: kv["live"] == 0)
        result = client.completions.create(model=MODEL, prompt="five", max_tokens=3,
                                           extra_body={"ignore_eos": True})
        assert result.usage.completion_tokens == 3
    finally:
        assert served.close() == 0


def _trace(query: int, trace_id: str, names: set[str], timeout_s: float = 30.0) -> list[dict]:
    """The collector's spans of ``trace_id`` once they include ``names`` (or the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{query}/api/v1/traces/{trace_id}",
                                        timeout=5) as response:
                spans = json.loads(response.read()).get("spans", [])
        except urllib.error.HTTPError as exc:   # 404 until its first span arrives
            if exc.code != 404:
                raise
            spans = []
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def _families(exposition: str) -> list[str]:
    return [line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")]


def _value(exposition: str, name: str) -> float:
    """The sum of the series of ``name`` (every label set)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] == name)


@pytest.fixture(scope="module")
def collector():
    """A real ``sightline collector run``: (its OTLP gRPC port, its query port)."""
    grpc, http, zipkin, query = free_ports(4)
    process = subprocess.Popen(
        [sys.executable, "-m", "sightline.deploy.cli", "collector", "run", "--otlp-grpc",
         f"127.0.0.1:{grpc}", "--otlp-http", f"127.0.0.1:{http}", "--zipkin", f"127.0.0.1:{zipkin}",
         "--http", f"127.0.0.1:{query}", "--log-level", "WARNING"])
    try:
        wait_for_http(f"http://127.0.0.1:{query}/healthz", timeout_s=120, process=process)
        yield grpc, query
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("api_servers", [1, 2])
def test_one_trace_per_request_across_the_processes(collector, api_servers):
    """The server span, tokenize and detokenize are recorded by an API server, queue, prefill,
    decode and the steps by the core; every API server joins the core's telemetry process,
    which builds one trace per request, continuing the caller's context (read back from a
    real collector). A normal load orphans nothing, and the telemetry series are on /metrics
    once, whichever API server answers."""
    grpc, query = collector
    served = Served(api_servers, "--otlp-endpoint", f"http://127.0.0.1:{grpc}", trace_level="steps",
                    OTEL_BSP_SCHEDULE_DELAY="50")
    try:
        core_pid = served.get("/health")[1]["core_pid"]
        parent = "00f067aa0ba902b7"
        trace_ids = [f"{api_servers:02x}{i:02x}2f3577b34da6a3ce929d0e0e4736" for i in range(8)]
        chunks: dict[str, int] = {}

        def run(trace_id: str) -> None:
            client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                   default_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
            chunks[trace_id] = len(list(client.completions.create(
                model=MODEL, prompt=f"trace {trace_id[:4]}", max_tokens=4, stream=True, temperature=0,
                extra_body={"ignore_eos": True})))

        threads = [threading.Thread(target=run, args=(t,)) for t in trace_ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert chunks == dict.fromkeys(trace_ids, 4)
        api_pids = set()
        for trace_id in trace_ids:
            spans = _trace(query, trace_id, {"POST /v1/completions", "detokenize", "decode"})
            [server] = [s for s in spans if s["name"] == "POST /v1/completions"]
            assert server["parent_span_id"] == parent   # the caller's context, continued
            phases = {s["name"]: s for s in spans if s["parent_span_id"] == server["span_id"]}
            assert len(spans) == 6 and set(phases) == {"tokenize", "queue", "prefill", "decode",
                                                       "detokenize"}
            order = [phases[n] for n in ("tokenize", "queue", "prefill", "decode", "detokenize")]
            for before, after in zip(order, order[1:]):
                assert before["end_time_unix_nano"] <= after["start_time_unix_nano"]
            # who recorded what: the API server its spans, the core its own
            api_pid = server["attributes"][sc.PROCESS_PID]
            for span in (server, phases["tokenize"], phases["detokenize"]):
                assert span["attributes"][sc.PROCESS_ROLE] == sc.PROCESS_ROLE_API_SERVER
                assert span["attributes"][sc.PROCESS_PID] == api_pid
            for name in ("queue", "prefill", "decode"):
                assert phases[name]["attributes"][sc.PROCESS_ROLE] == sc.PROCESS_ROLE_ENGINE_CORE
                assert phases[name]["attributes"][sc.PROCESS_PID] == core_pid
            assert api_pid != core_pid
            api_pids.add(api_pid)
            # the core's step spans: linked from prefill and decode, and back to the request
            links = phases["prefill"]["links"] + phases["decode"]["links"]
            assert len(links) == 4   # the prefill step and three decode steps
            for link in links:
                step = next(s for s in _trace(query, link["trace_id"], {"engine.step"})
                            if s["span_id"] == link["span_id"])
                assert step["name"] == "engine.step"
                assert step["attributes"][sc.PROCESS_ROLE] == sc.PROCESS_ROLE_ENGINE_CORE
                assert step["attributes"][sc.PROCESS_PID] == core_pid
                assert (trace_id, server["span_id"]) in {(k["trace_id"], k["span_id"]) for k in step["links"]}
        assert len(api_pids) <= api_servers
        # the telemetry series: once per scrape, whichever API server answers; nothing orphaned
        for _ in range(2 * api_servers):
            with urllib.request.urlopen(served.url + "/metrics", timeout=10) as response:
                exposition = response.read().decode()
            telemetry = [f for f in _families(exposition) if f.startswith("sightline_telemetry_")]
            assert len(telemetry) == len(set(telemetry)) and {
                sc.TELEMETRY_EVENTS_DROPPED_TOTAL + "_total", sc.TELEMETRY_EVENTS_HELD_TOTAL + "_total",
                sc.TELEMETRY_EVENTS_ORPHANED_TOTAL + "_total", sc.TELEMETRY_PROCESS_UP} <= set(telemetry)
            assert _value(exposition, sc.TELEMETRY_EVENTS_ORPHANED_TOTAL + "_total") == 0
            assert _value(exposition, sc.TELEMETRY_EVENTS_DROPPED_TOTAL + "_total") == 0
            assert _value(exposition, sc.TELEMETRY_PROCESS_UP) == 1
    finally:
        assert served.close() == 0


@pytest.mark.slow
def test_the_startup_trace_and_core_series_across_the_processes(collector):
    """The server span, tokenize and detokenize are recorded by an API server, queue, prefill,
    decode and the steps by the core: one trace, joined in the core's telemetry and read
    back from a real collector, continuing the caller's context."""
    grpc, query = collector
    served = None
    try:
        served = Served(1, "--otlp-endpoint", f"http://127.0.0.1:{grpc}", trace_level="steps",
                        OTEL_BSP_SCHEDULE_DELAY="50")
        trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                               default_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        chunks = list(client.completions.create(model=MODEL, prompt="trace", max_tokens=4, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True}))
        assert len(chunks) == 4
        # the core's telemetry series, on an API server's /metrics
        with urllib.request.urlopen(served.url + "/metrics", timeout=10) as response:
            exposed = response.read().decode()
        assert f"{sc.TELEMETRY_PROCESS_UP} 1.0" in exposed
        _, health = served.get("/health")
        _, report = served.get("/debug/startup")
        assert health["startup_trace_id"] == report["trace_id"] and len(report["trace_id"]) == 32
        spans = _trace(query, trace_id, {"detokenize", "decode"})
        [server] = [s for s in spans if s["name"] == "POST /v1/completions"]
        assert server["parent_span_id"] == parent
        phases = {s["name"]: s for s in spans if s["parent_span_id"] == server["span_id"]}
        assert set(phases) == {"tokenize", "queue", "prefill", "decode", "detokenize"}
        order = [phases[n] for n in ("tokenize", "queue", "prefill", "decode", "detokenize")]
        for before, after in zip(order, order[1:]):
            assert before["end_time_unix_nano"] <= after["start_time_unix_nano"]
        step_links = [link["span_id"] for link in phases["prefill"]["links"] + phases["decode"]["links"]]
        assert len(step_links) == 4   # the prefill step and three decode steps
        # the core's start-up: one trace, a root and a span per phase, recorded by the core
        with urllib.request.urlopen(f"http://127.0.0.1:{query}/api/v1/traces/{report['trace_id']}",
                                    timeout=5) as response:
            startup = json.loads(response.read())["spans"]
        [root] = [s for s in startup if s["name"] == sc.SPAN_ENGINE_STARTUP]
        assert sorted(s["name"] for s in startup if s is not root) == sorted(
            sc.SPAN_STARTUP_PHASE_PREFIX + p["name"] for p in report["phases"])
        assert all(s["parent_span_id"] == root["span_id"] for s in startup if s is not root)
        assert root["end_time_unix_nano"] == report["ready_ns"]
        assert {s["attributes"][sc.PROCESS_ROLE] for s in startup} == {sc.PROCESS_ROLE_ENGINE_CORE}
        assert served.close() == 0
    finally:
        if served is not None:
            served.close()


@pytest.mark.slow
def test_a_request_answered_just_before_sigterm_keeps_its_whole_trace(collector):
    """SIGTERM right after a streamed response ends, through 2 API servers: they finish, then
    ship their last telemetry (waiting for a telemetry process that may bind late), the core
    stops, and its telemetry process builds and exports everything before ``engine serve``
    exits: the request's whole trace is in the collector, from both kinds of process."""
    grpc, query = collector
    served = Served(2, "--otlp-endpoint", f"http://127.0.0.1:{grpc}", trace_level="steps",
                    OTEL_BSP_SCHEDULE_DELAY="50")
    try:
        deadline = time.monotonic() + 30    # the other API server may still be joining
        while (health := served.get("/health"))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        core_pid = health[1]["core_pid"]
        trace_id, parent = "5ca1ab1e3577b34da6a3ce929d0e0e47", "00f067aa0ba902b7"
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=3,
                               default_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        chunks = list(client.completions.create(model=MODEL, prompt="stop", max_tokens=4, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True}))
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60) == 0
    finally:
        served.close()
    assert len(chunks) == 4
    names = {"POST /v1/completions", "tokenize", "queue", "prefill", "decode", "detokenize"}
    spans = _trace(query, trace_id, names, timeout_s=10)    # exported before the exit
    assert sorted(s["name"] for s in spans) == sorted(names)
    [server] = [s for s in spans if s["name"] == "POST /v1/completions"]
    assert server["parent_span_id"] == parent
    assert server["attributes"][sc.HTTP_RESPONSE_STATUS_CODE] == 200
    assert all(s["parent_span_id"] == server["span_id"] for s in spans if s is not server)
    by_name = {s["name"]: s["attributes"] for s in spans}
    api_pid = server["attributes"][sc.PROCESS_PID]
    assert api_pid != core_pid
    for name in ("POST /v1/completions", "tokenize", "detokenize"):
        assert (by_name[name][sc.PROCESS_ROLE], by_name[name][sc.PROCESS_PID]) == (
            sc.PROCESS_ROLE_API_SERVER, api_pid)
    for name in ("queue", "prefill", "decode"):
        assert (by_name[name][sc.PROCESS_ROLE], by_name[name][sc.PROCESS_PID]) == (
            sc.PROCESS_ROLE_ENGINE_CORE, core_pid)


# ---- deaths ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_api_server_then_the_core_killed():
    """An API server SIGKILLed: the core aborts its requests, their KV blocks come back, the
    other server serves on. Then the core SIGKILLed mid-load: every stream ends with an
    OpenAI-shaped error within 2 s, new requests get 503, /health fails, exit non-zero."""
    served = Served(2)
    try:
        pids = {}
        while len(pids) < 2:
            _, health = served.get("/health")
            pids[health["api_server"]] = health["pid"]
        groups = []
        deadline = time.monotonic() + 60   # until each API server holds a stream
        while True:
            groups.append(Streams(served, 2))
            groups[-1].wait_tokens()
            by_server = served.kv()["live_by_api_server"]
            if by_server.get("0") and by_server.get("1"):
                break
            assert time.monotonic() < deadline, by_server
        on_survivor = by_server["1"]
        os.kill(pids[0], signal.SIGKILL)
        kv = served.wait_kv(lambda kv: kv["live"] == on_survivor)
        assert kv["live_by_api_server"] == {"1": on_survivor} and kv["live"] == on_survivor
        assert 0 < kv["used"]
        for group in groups:   # the survivor's streams go on; closing them frees the rest
            for stream in group.streams:
                if stream is not None:
                    stream.close()
        kv = served.wait_kv(lambda kv: kv["live"] == 0)
        assert kv["used"] == 0 and kv["live"] == 0
        assert served.client().completions.create(model=MODEL, prompt="still", max_tokens=2,
                                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 2

        streams = Streams(served, 4)
        streams.wait_tokens()
        os.kill(health["core_pid"], signal.SIGKILL)
        killed = time.monotonic()
        streams.join(timeout_s=10)
        assert all(e is not None for e in streams.ended), streams.ended
        for ended_at, error in streams.ended:
            assert ended_at - killed < 2.0
            assert isinstance(error, openai.APIError) and "engine core" in str(error), error
        status, health = served.get("/health")
        assert status == 503 and health["status"] == "engine_dead"
        with pytest.raises(openai.APIStatusError) as info:
            served.client().completions.create(model=MODEL, prompt="after", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "engine_unavailable"
        assert served.process.wait(30) != 0
    finally:
        served.close()
