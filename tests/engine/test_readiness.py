"""Readiness and liveness while the engine starts: the real server, probed over HTTP.

At the start of each start-up phase (the ``on_phase`` hook runs on the thread that builds
the engine, while the server's event loop answers), ``/health`` is 503 and names that
phase, ``/live`` is 200, a completion is refused with 503 in OpenAI's error shape, and
``/metrics`` answers (the scrape target is up while it starts; the core's start-up series
come once it is ready).
Once ``serve_in_thread`` returns (the engine is warm) ``/health`` is 200 and says how long
start-up took; ``/live`` stays 200 while draining, when ``/health`` is 503 again. On a GPU
(``gpu`` marker), load using every sampling option meets no kernel variant once ready.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from sightline.engine.config import EngineConfig
from sightline.engine.scheduler import SchedulerConfig
from sightline.engine.api_server import serve_in_thread
from sightline.instrumentation import semconv as sc

from ..support import free_port


def _get(url: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_health_is_503_naming_the_phase_until_warm_and_live_is_200_throughout():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    seen: dict[str, tuple] = {}
    ended: list[str] = []
    scrapes: list[tuple[int, bool]] = []

    def on_phase(name: str, report) -> None:
        if report is not None:
            ended.append(name)
            return
        completion = _get(base + "/v1/completions",
                          json.dumps({"model": "tiny", "prompt": "hi"}).encode())
        seen[name] = (_get(base + "/health"), _get(base + "/live"), completion)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as response:   # the target is up
            scrapes.append((response.status, sc.ENGINE_STARTUP_SECONDS.encode() in response.read()))

    running = serve_in_thread(EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01,
                                           port=port, shutdown_timeout_s=5), on_phase=on_phase)
    try:
        phases = [sc.STARTUP_LOAD_WEIGHTS, sc.STARTUP_ALLOCATE_KV, sc.STARTUP_WARMUP_FUSED,
                  sc.STARTUP_WARMUP_PREFILL, sc.STARTUP_WARMUP_DECODE, sc.STARTUP_WARMUP_MIXED,
                  sc.STARTUP_WARMUP_SAMPLER]
        assert list(seen) == phases and ended == phases   # the CPU's phases, in order
        # the API server's own series are there from the start; the core's once it is ready
        assert scrapes == [(200, False)] * len(phases)
        for i, (name, (health, live, completion)) in enumerate(seen.items()):
            status, body = health
            assert status == 503 and body["status"] == "starting" and body["phase"] == name
            assert body["phases_done"] == phases[:i]
            assert live == (200, {"status": "alive"})
            status, body = completion
            assert status == 503 and body["error"]["code"] == "starting"
            assert body["error"]["type"] == "service_unavailable"
            assert f"phase {name}" in body["error"]["message"]
        status, body = _get(base + "/health")
        report = running.engine.startup_report
        assert status == 200 and body["status"] == "ok"
        assert body["startup_s"] == round(report.total_s, 3) > 0
        assert [p.name for p in report.phases] == phases
        assert all(p.variants_run > 0 for p in report.phases if p.name.startswith("warmup_"))
        assert _get(base + "/live") == (200, {"status": "alive"})
        status, body = _get(base + "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode())
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        for phase in phases:
            assert f'{sc.ENGINE_STARTUP_SECONDS}{{model="tiny",phase="{phase}"}}' in metrics
        assert f'{sc.ENGINE_STARTUP_TOTAL_SECONDS}{{model="tiny"}}' in metrics
        running.server.draining = True   # what SIGTERM sets first
        assert _get(base + "/health") == (503, {"status": "draining"})
        assert _get(base + "/live") == (200, {"status": "alive"})
    finally:
        running.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["requests", "kernels"])
def test_no_kernel_variant_is_met_while_serving_every_sampling_option_on_gpu(tmp_path, level):
    """On CUDA, once /health is 200: concurrent requests using every sampling path, prompts
    from 1 token to the step budget (prefill, mixed and decode steps, every graph size),
    leave sightline_engine_jit_compiles_total without a single sample."""
    import concurrent.futures

    import openai

    from sightline.engine.warmup import SAMPLER_CASES
    from sightline.instrumentation.config import TelemetryConfig

    config = EngineConfig(model="tiny", device="cuda", port=0, shutdown_timeout_s=10,
                          compile_cache_dir=str(tmp_path / "cache"),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024),
                          telemetry=TelemetryConfig(level=level, exporter="none",
                                                    kernel_sample_ratio=0.5,
                                                    metrics_enabled=False))
    running = serve_in_thread(config, timeout_s=600)
    try:
        report = running.engine.startup_report
        assert report.compiled + report.cached > 0   # the warm-up met the variants
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        cases = list(SAMPLER_CASES.values())

        def one(i: int) -> str:
            params = cases[i % len(cases)]
            extra = {"ignore_eos": True, "min_p": params.min_p,
                     "repetition_penalty": params.repetition_penalty}
            if params.top_k is not None:
                extra["top_k"] = params.top_k
            if params.allowed_token_ids is not None:
                extra["allowed_token_ids"] = list(params.allowed_token_ids)
            out = client.completions.create(
                model="tiny", prompt=[1] * (1 + (i * 97) % 1000), max_tokens=1 + i % 24,
                temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty, extra_body=extra)
            return out.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            assert set(pool.map(one, range(96))) == {"length"}
        metrics = urllib.request.urlopen(running.url + "/metrics", timeout=10).read().decode()
        served = [line for line in metrics.splitlines()
                  if line.startswith(sc.ENGINE_JIT_COMPILES_TOTAL + "_total")]
        assert served == [], served
    finally:
        running.stop()
