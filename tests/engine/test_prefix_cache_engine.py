"""Prefix caching through the whole engine on the tiny preset (CPU, torch path): greedy
outputs with the cache equal those without it, token for token, for prefixes shared at and
off block boundaries, whole prompts cached, preemption and eviction pressure, synchronous
and overlapped scheduling, eager and the static (CUDA-graph) decode and mixed-step paths."""

from __future__ import annotations

import random

import pytest

from sightline.engine.config import EngineConfig
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig

BLOCK = 16


def _engine(prefix_caching: bool, *, async_scheduling: bool = False, static: bool = False,
            mixed: bool = False, kv_cache_gib: float = 0.00045):
    """0.00045 GiB holds 14 blocks of the tiny model (224 tokens): six running requests of
    50-80 tokens do not fit, so requests are preempted and cached blocks evicted."""
    from sightline.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(device="cpu", block_size=BLOCK, kv_cache_gib=kv_cache_gib,
                                    enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                                    scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64)))
    if static:
        engine.runner.static_decode(capture=False)
    if mixed:   # steps with prefill tokens through the static mixed path too
        engine.runner.static_mixed(capture=False)
    return engine


def test_config_default_is_on_with_cuda_and_off_on_the_cpu():
    config = EngineConfig()
    assert (config.prefix_caching_on("cuda"), config.prefix_caching_on("cpu")) == (True, False)
    assert EngineConfig(enable_prefix_caching=False).prefix_caching_on("cuda") is False
    assert EngineConfig(enable_prefix_caching=True).prefix_caching_on("cpu") is True
    with pytest.raises(ValueError, match="enable_prefix_caching=1 must be a bool or None"):
        EngineConfig(enable_prefix_caching=1)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    system = [rng.randrange(1, 500) for _ in range(64)]
    other = [rng.randrange(1, 500) for _ in range(40)]

    def user(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    return [
        system[:48] + user(9),     # three whole blocks shared, at a block boundary
        system[:48] + user(14),
        system[:37] + user(20),    # 37 tokens shared: two whole blocks, then a partial one
        system[:37] + user(3),
        system[:64],               # a whole prompt of four cached blocks (the last is recomputed)
        system[:64],
        other + user(7),           # no prefix in common with the others
        system[:48] + user(9),
        other[:32] + user(30),
        system[:20] + user(40),
        system[:64] + user(1),     # all but its last token cached
        other + user(7),
    ]


def _run(engine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["sync", "overlapped", "static-decode", "static-mixed"])
def test_greedy_outputs_with_the_cache_equal_those_without(mode):
    """Each mode against itself without the cache (the static path's padded decode rounds
    differently from the eager one, cache or not)."""
    prompts = _prompts()
    kind = {"async_scheduling": mode == "overlapped", "static": mode.startswith("static"),
            "mixed": mode == "static-mixed"}
    want = _run(_engine(False, **kind), prompts)
    engine = _engine(True, **kind)
    got = _run(engine, prompts)
    assert got == want
    kv = engine.kv_cache
    stats = kv.prefix_cache_stats()
    preemptions = engine.metrics.preemptions._value.get()
    assert stats.hits >= 30 * BLOCK and stats.evictions >= 5 and preemptions >= 3, (stats, preemptions)
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))
    assert engine.num_live == 0 and not engine.scheduler.has_work


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_random_aborts_leave_no_reference_behind(overlapped):
    """The engine's own loop with aborts arriving between steps (a client going away), while
    requests share blocks, are preempted and evict: afterwards every ref count is zero, the
    invariants hold and every block is free (never-cached or parked)."""
    rng = random.Random(3)
    prompts = _prompts()
    engine = _engine(True, async_scheduling=overlapped)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [engine.new_request_id("r") for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    aborted = 0
    run = engine.step_overlapped if overlapped else engine.step
    while engine.has_work:
        run()
        engine.kv_cache.check_invariants()
        live = [i for i in ids if engine.scheduler.get(i) is not None]
        if live and rng.random() < 0.3:
            engine.abort(rng.choice(live))
            aborted += 1
    kv = engine.kv_cache
    assert aborted >= 3 and kv.prefix_cache_stats().hits > 0 and engine.metrics.preemptions._value.get() > 0
    kv.check_invariants()
    assert all(kv.ref_count(b) == 0 for b in range(kv.num_blocks)) and kv.num_free_blocks == kv.num_blocks
    assert engine.num_live == 0


def test_cached_requests_compute_only_their_uncached_tokens():
    """With room for everything (no preemption, no eviction): each request's prefill computes
    exactly its prompt minus its cached tokens, and the cached ones are whole blocks."""
    prompts = _prompts()
    engine = _engine(True, kv_cache_gib=0.004)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    requests = []
    for prompt in prompts:   # one at a time: each sees what the earlier ones cached
        requests += engine.generate([prompt], params)
    cached = [r.num_cached_tokens for r in requests]
    assert cached == [0, 48, 32, 32, 48, 48, 0, 48, 32, 16, 64, 32]
    stats = engine.kv_cache.prefix_cache_stats()
    assert stats.hits == sum(cached) and stats.queries == sum(map(len, prompts)) and stats.evictions == 0
    off = _engine(False, kv_cache_gib=0.004).generate(prompts, params)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in off]
    assert [r.num_cached_tokens for r in off] == [0] * len(prompts)


def test_usage_spans_and_metrics_agree_with_the_engines_count():
    """Served over HTTP (openai SDK, spans to the OTel SDK's in-memory exporter): one chat,
    then six sharing its system prompt (one of them its very prompt), then the first again
    with a ``cache_salt`` (it shares nothing). Each response's
    ``prompt_tokens_details.cached_tokens`` is the exact whole-block share, its server
    span says the same, the step spans' cached and computed prefill tokens add up, and
    /metrics reports the KV cache manager's own totals."""
    import asyncio

    import openai
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sightline.engine.api_server import serve_in_thread
    from sightline.engine.tokenizer import ByteTokenizer, ChatMessage, apply_chat_template
    from sightline.instrumentation import semconv as sc
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.tracing import Telemetry
    from tests.collector.servers import scrape

    system = "You are a terse assistant. Answer in one line, cite nothing, never apologise."
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
             for i in (0, 1, 2, 3, 4, 5)] + [[{"role": "system", "content": system},
                                               {"role": "user", "content": "question 0"}]]
    tokenizer = ByteTokenizer()
    prompts = [tokenizer.encode(apply_chat_template([ChatMessage(m["role"], m["content"]) for m in chat]))
               for chat in chats]
    common = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    expected = [0] + [min(common, len(p) - 1) // BLOCK * BLOCK for p in prompts[1:6]]
    expected.append((len(prompts[6]) - 1) // BLOCK * BLOCK)   # the first prompt again
    assert expected[1] >= 5 * BLOCK and expected[6] > expected[1]
    prompts.append(prompts[0])                                # again, with a cache_salt
    expected.append(0)

    exporter = InMemorySpanExporter()
    telemetry = Telemetry.start(TelemetryConfig(level="steps", exporter="none", schedule_delay_s=0.05,
                                                metrics_enabled=False), span_exporters=[exporter])
    config = EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01, port=0, shutdown_timeout_s=5,
                          block_size=BLOCK, enable_prefix_caching=True)
    running = serve_in_thread(config, telemetry=telemetry)
    try:
        async def chat(client, messages):
            return await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                        temperature=0, extra_body={"ignore_eos": True})

        async def run():
            client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
            first = await chat(client, chats[0])
            rest = await asyncio.gather(*(chat(client, c) for c in chats[1:6]))
            stream = await client.chat.completions.create(  # the usage chunk of a stream
                model="tiny", messages=chats[6], max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            last = [chunk async for chunk in stream][-1]
            salted = await client.chat.completions.create(   # shares nothing: another salt
                model="tiny", messages=chats[0], max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True, "cache_salt": "tenant-b"})
            await client.close()
            return [first, *rest, last, salted]

        responses = asyncio.run(run())
        metrics = scrape(running.url + "/metrics")
        stats = running.engine.kv_cache.prefix_cache_stats()
    finally:
        running.stop()
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in responses]
    assert cached == expected
    assert [r.usage.prompt_tokens for r in responses] == [len(p) for p in prompts]
    assert (stats.hits, stats.queries, stats.evictions) == (sum(expected), sum(map(len, prompts)), 0)

    model = (("model", "tiny"),)
    assert metrics[(sc.ENGINE_PREFIX_CACHE_HITS_TOTAL + "_total", model)] == stats.hits
    assert metrics[(sc.ENGINE_PREFIX_CACHE_QUERIES_TOTAL + "_total", model)] == stats.queries
    assert metrics[(sc.ENGINE_PREFIX_CACHE_EVICTIONS_TOTAL + "_total", model)] == 0
    assert metrics[(sc.ENGINE_PREFIX_CACHE_BLOCKS, model)] == stats.cached_blocks > 0
    ttft_count = {outcome: metrics[(sc.ENGINE_PREFIX_CACHE_TTFT_SECONDS + "_count",
                                    (("model", "tiny"), (sc.LABEL_PREFIX_CACHE, outcome)))]
                  for outcome in (sc.PREFIX_CACHE_HIT, sc.PREFIX_CACHE_MISS)}
    assert ttft_count == {sc.PREFIX_CACHE_HIT: 6, sc.PREFIX_CACHE_MISS: 2}

    spans = exporter.get_finished_spans()
    by_id = {s.attributes[sc.REQUEST_ID]: s for s in spans if s.name == sc.SPAN_HTTP_CHAT_COMPLETIONS}
    assert [by_id[r.id].attributes[sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS]
            for r in responses] == expected
    steps = [s for s in spans if s.name == sc.SPAN_ENGINE_STEP]
    assert sum(s.attributes[sc.STEP_PREFILL_CACHED_TOKENS] for s in steps) == stats.hits
    assert sum(s.attributes[sc.STEP_PREFILL_TOKENS] for s in steps) == stats.queries - stats.hits


_TRITON_SCRIPT = """
import json, os, random
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig
rng = random.Random(5)
a = [rng.randrange(500) for _ in range(20)]
prompts = [a, a[:16] + [rng.randrange(500) for _ in range(3)], a]
out = {}
for backend, caching in (("triton", True), ("torch", True), ("torch", False)):
    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_gib=0.002, attention_backend=backend,
                                    enable_prefix_caching=caching,
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)))
    done = [engine.generate([p], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
            for p in prompts]   # one after another: the later ones find the first one's blocks
    out[f"{backend}-{caching}"] = [[r.output_token_ids, r.num_cached_tokens] for r in done]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_triton_prefill_from_a_cached_prefix_matches_the_torch_path():
    """The Triton FA2 prefill (Triton interpreter) of a chunk that starts after a cached
    prefix, its keys read back from the paged cache: the torch path's tokens, with or
    without the cache. (~20 s: the interpreter is slow.)"""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [cached for _, cached in out["triton-True"]] == [0, 16, 16]
    assert [cached for _, cached in out["torch-False"]] == [0, 0, 0]
    tokens = {key: [t for t, _ in runs] for key, runs in out.items()}
    assert tokens["triton-True"] == tokens["torch-True"] == tokens["torch-False"]


@pytest.mark.gpu
def test_on_a_gpu_the_cache_gives_the_uncached_tokens_with_graphs_and_overlap():
    """On CUDA (float32, Triton kernels, CUDA graphs, overlapped scheduling: the defaults
    there, prefix caching included) against the same engine with the cache off: the same
    greedy tokens; a cache small enough to preempt and evict."""
    import torch

    from sightline.engine.kv_cache import KVCacheConfig, KVCacheManager
    from sightline.engine.llm_engine import LLMEngine

    prompts = _prompts()

    def engine(caching: bool) -> LLMEngine:
        built = LLMEngine(EngineConfig(device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                                       block_size=BLOCK, enable_prefix_caching=None if caching else False,
                                       scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64)))
        # 14 of the runner's blocks, as on the CPU: requests are preempted and blocks evicted
        built.core.kv_cache = built.scheduler.kv_cache = KVCacheManager(KVCacheConfig(BLOCK, 14, caching))
        return built

    off = engine(False)
    want = _run(off, prompts)
    del off
    torch.cuda.empty_cache()
    on = engine(True)
    assert on.kv_cache.prefix_cache is not None and on.runner.graphs is not None and on.async_scheduling
    assert _run(on, prompts) == want
    assert on.kv_cache.prefix_cache_stats().hits >= 30 * BLOCK
    stats = on.kv_cache.prefix_cache_stats()
    assert stats.evictions >= 5 and on.metrics.preemptions._value.get() >= 3, stats
    on.kv_cache.check_invariants()
    assert on.kv_cache.num_used_blocks == 0
