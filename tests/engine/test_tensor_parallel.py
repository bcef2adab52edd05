"""Tensor parallelism on the CPU: two ranks over gloo, offline and served.

Two ranks give one rank's greedy tokens (offline with overlapped scheduling and chunked
prefills, and served through the openai SDK); each rank holds half of the heads and of the
KV cache. Served with a real collector, a request's trace reaches its steps' spans, and
each step span has a child span from each rank with that rank's compute and collective
wait; the collector counts the steps. A worker SIGKILLed mid-load ends every stream with an
error naming the rank, and ``engine serve`` exits non-zero. On a GPU (one is enough), the
NCCL path, captured in CUDA graphs, gives the plain engine's tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from sightline.deploy.processes import free_ports
from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig
from sightline.engine.tokenizer import ByteTokenizer
from sightline.instrumentation import semconv as sc
from tests.engine.served_engine import MODEL, Served, Streams
from tests.support import wait_for_http

PROMPTS = ["héllo ✓ wörld", "Sightline", "a", "the engine core sends each step to the other rank",
           "1 2 3", "two ranks, one answer: the same tokens as one rank gives"]


def _sampling(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(n)]


def test_config_checks_the_split():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_kv_heads=2"):
        EngineConfig(model=MODEL, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=MODEL, device="cpu", tensor_parallel_size=0)


def test_two_ranks_give_one_ranks_greedy_tokens_offline():
    # overlapped scheduling: stand-in inputs come from the ids rank 0 broadcast; 40 tokens a
    # step: the long prompts are prefilled in chunks over cached keys
    config = EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.02, async_scheduling=True,
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=40))
    tokenizer = ByteTokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, prompts)) > 40
    want = [r.output_token_ids for r in LLMEngine(config).generate(prompts, _sampling(len(prompts)))]
    two = LLMEngine(config.replace(tensor_parallel_size=2))
    try:
        assert two.runner.kv_cache.shape[4] == 1          # one of the tiny model's 2 KV heads
        assert two.runner.model.layers[0].attn.num_heads == 4 and two.runner.model.lm_head is not None
        got = [r.output_token_ids for r in two.generate(prompts, _sampling(len(prompts)))]
        [worker] = two.core.tp.processes.values()
    finally:
        two.shutdown()
    assert got == want
    assert worker.exitcode == 0   # stopped when told


@pytest.mark.gpu
def test_the_nccl_path_in_cuda_graphs_gives_the_plain_engines_tokens(tmp_path):
    """One rank over NCCL: its all-reduces run in every forward pass and inside the captured
    graphs, each step goes out over the gloo group and the sampled ids are broadcast
    (overlapped scheduling)."""
    import torch

    from sightline.engine.model_runner import ModelRunner
    from sightline.engine.tensor_parallel import TpGroup

    tokenizer = ByteTokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    engine = LLMEngine(EngineConfig(model=MODEL, device="cuda"))
    assert engine.core.async_scheduling and engine.runner.graphs is not None
    want = [r.output_token_ids for r in engine.generate(prompts, _sampling(len(prompts)))]
    group = TpGroup.join(0, 1, f"file://{tmp_path / 'rendezvous'}", torch.device("cuda", 0))
    try:
        runner = ModelRunner(engine.config, engine.model_config, None, tp=group)
        assert runner.num_blocks == engine.kv_cache.num_blocks and runner.graphs.buckets
        runner.async_ids = True
        engine.core.runner = runner
        got = [r.output_token_ids for r in engine.generate(prompts, _sampling(len(prompts)))]
    finally:
        group.close()
    assert got == want


# ---- served ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def collector():
    grpc, http, zipkin, query = free_ports(4)
    process = subprocess.Popen(
        [sys.executable, "-m", "sightline.deploy.cli", "collector", "run", "--otlp-grpc",
         f"127.0.0.1:{grpc}", "--otlp-http", f"127.0.0.1:{http}", "--zipkin", f"127.0.0.1:{zipkin}",
         "--http", f"127.0.0.1:{query}", "--log-level", "WARNING"])
    try:
        wait_for_http(f"http://127.0.0.1:{query}/healthz", timeout_s=120, process=process)
        yield grpc, f"http://127.0.0.1:{query}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


@pytest.fixture(scope="module")
def served(collector):
    grpc, _ = collector
    served = Served(1, "--tensor-parallel-size", "2", "--otlp-endpoint", f"http://127.0.0.1:{grpc}",
                    trace_level="steps", OTEL_BSP_SCHEDULE_DELAY="50", OTEL_RESOURCE_ATTRIBUTES="service.instance.id=tp-engine")
    try:
        yield served
    finally:
        served.close()


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError:
        return None


def test_served_two_ranks_give_one_ranks_tokens(served):
    tokenizer = ByteTokenizer()
    offline = LLMEngine(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.02))
    want = [tokenizer.decode(r.output_token_ids) for r in
            offline.generate([tokenizer.encode(p) for p in PROMPTS], _sampling(len(PROMPTS)))]
    client = served.client()
    for prompt, sampling, text in zip(PROMPTS, _sampling(len(PROMPTS)), want):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=sampling.max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == text
        assert len(chunks) == sampling.max_tokens


def test_spans_from_both_ranks_join_the_requests_trace(served, collector):
    _, query = collector
    trace_id, parent = "5cf92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7"
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                           default_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    completion = client.completions.create(model=MODEL, prompt="ranks", max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4
    deadline = time.monotonic() + 30
    while True:   # the request's trace, then each step it rode, with its ranks' spans
        spans = (_get(f"{query}/api/v1/traces/{trace_id}") or {}).get("spans", [])
        links = [(link["trace_id"], link["span_id"]) for s in spans if s["name"] in ("prefill", "decode")
                 for link in s["links"]]
        steps = {link: (_get(f"{query}/api/v1/traces/{link[0]}") or {}).get("spans", []) for link in links}
        ranks = {link: [s for s in step if s["name"] == sc.SPAN_RANK_STEP] for link, step in steps.items()}
        # the server span ends on the request's end, which may leave in a later export
        served_span = any(s["name"] == "POST /v1/completions" for s in spans)
        if (served_span and len(links) == 4 and all(len(r) == 2 for r in ranks.values())) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    [server] = [s for s in spans if s["name"] == "POST /v1/completions"]
    assert server["parent_span_id"] == parent
    assert len(links) == 4    # the prefill step and three decode steps
    for (step_trace, step_span), step in steps.items():
        [step_record] = [s for s in step if s["span_id"] == step_span]
        assert step_record["name"] == sc.SPAN_ENGINE_STEP
        attributes = step_record["attributes"]
        assert attributes[sc.TP_SIZE] == 2
        compute, wait = attributes[sc.STEP_RANK_COMPUTE_S], attributes[sc.STEP_RANK_COLLECTIVE_WAIT_S]
        by_rank = {s["attributes"][sc.TP_RANK]: s for s in ranks[(step_trace, step_span)]}
        assert sorted(by_rank) == [0, 1]
        for rank, span in by_rank.items():   # rank 1's figures were measured in its own process
            assert span["parent_span_id"] == step_span and span["trace_id"] == step_trace
            assert span["attributes"][sc.RANK_COMPUTE_S] == compute[rank] > 0
            assert span["attributes"][sc.RANK_COLLECTIVE_WAIT_S] == wait[rank] >= 0
            assert span["attributes"][sc.RANK_COLLECTIVE_CALLS] == 2 * 4   # two per layer
            assert step_record["start_time_unix_nano"] <= span["start_time_unix_nano"]
    # the collector counted the producer's steps, each with both ranks
    deadline = time.monotonic() + 20
    while True:
        with urllib.request.urlopen(f"{query}/metrics", timeout=10) as response:
            text = response.read().decode()
        counted = [line for line in text.splitlines()
                   if line.startswith(sc.COLLECTOR_TP_STEPS_TOTAL + '_total{instance_id="tp-engine"}')]
        if counted or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 4
    for rank in ("0", "1"):
        assert f'{sc.COLLECTOR_TP_COLLECTIVE_WAIT_SECONDS_TOTAL}_total{{instance_id="tp-engine",rank="{rank}"}}' in text


def test_a_worker_killed_mid_load_ends_the_streams_and_serve_exits_nonzero(served):
    """Last: it ends the served engine."""
    _, health = served.get("/health")
    [worker] = health["tp_worker_pids"]
    streams = Streams(served, 3)
    streams.wait_tokens()
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    streams.join(timeout_s=20)
    assert all(e is not None for e in streams.ended), streams.ended
    for ended_at, error in streams.ended:
        assert ended_at - killed < 5.0
        assert isinstance(error, openai.APIError), error
        assert f"tensor-parallel rank 1 (pid {worker}) exited with -9" in str(error), error
    assert served.process.wait(30) != 0
