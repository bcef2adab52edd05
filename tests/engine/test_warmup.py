"""The warm-up's plan covers every variant; its report says what compiled and what was cached.

The plan is checked against brute force: every (rows, block-table width) an eager decode
step can have maps to a paged-decode variant (one split, or several with pass 2 at a power
of two) that the plan runs, and every prefill length maps to a tuning bucket the plan runs.
Phases are checked with real Triton compiles (built for sm_90 on the CPU): compiled in one
phase, from the on-disk cache in the next, nothing in a third. The engine's warm-up on the
CPU runs every family, leaves the KV cache zeroed, and stops at its time limit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sightline.engine.compile_watch import CompileWatch
from sightline.engine.config import EngineConfig, PRESETS
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig
from sightline.engine.startup import StartupProgress
from sightline.engine.warmup import _decode_layouts, plan_warmup
from sightline.instrumentation import semconv as sc

from tests.engine.triton_variants import compile_variant


def _variant(rows: int, context: int, kv_heads: int, block_n: int) -> int:
    from sightline.engine.kernels.paged_decode_attention import split_plan
    splits, _ = split_plan(rows, kv_heads, context, 132, block_n)
    return 0 if splits == 1 else max(2, 1 << (splits - 1).bit_length())


@pytest.mark.parametrize("kv_heads, max_rows, width", [(8, 64, 512), (1, 48, 300), (2, 4, 3)])
def test_decode_layouts_cover_every_variant_an_eager_step_can_meet(kv_heads, max_rows, width):
    from sightline.engine.kernels.paged_decode_attention import launch_config
    block_n = launch_config()["BLOCK_N"]
    runner = SimpleNamespace(model_config=SimpleNamespace(num_kv_heads=kv_heads),
                             device=torch.device("cpu"), block_size=16)
    layouts = _decode_layouts(runner, max_rows, width)
    planned = [_variant(rows, w * 16, kv_heads, block_n) for rows, w in layouts]
    reachable = {_variant(rows, w * 16, kv_heads, block_n)
                 for rows in range(1, max_rows + 1) for w in range(1, width + 1)}
    assert sorted(planned) == sorted(reachable)     # each variant once, none missing
    assert all(1 <= rows <= max_rows and 1 <= w <= width for rows, w in layouts)
    if (kv_heads, max_rows, width) == (8, 64, 512):   # llama-8b at 8192 tokens on an H200
        assert reachable == {0, 2, 4, 8, 16}


def test_prefill_lengths_cover_every_tuning_bucket(monkeypatch):
    from sightline.engine.kernels.prefill_attention import tuning_bucket
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # the Triton path on the CPU
    for budget, max_model_len in ((8192, 8192), (2048, 1000), (40, 2048), (8192, 20000)):
        runner = SimpleNamespace(
            max_model_len=max_model_len, block_size=16, device=torch.device("cpu"),
            backend="triton", model_config=PRESETS["tiny"], uses_graphs=False, gpu_telemetry=None)
        config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4,
                                                        max_num_batched_tokens=budget))
        plan = plan_warmup(runner, config)
        limit = min(budget, max_model_len)
        assert max(plan.prefill_lengths) == limit
        assert {tuning_bucket(n) for n in plan.prefill_lengths} == \
            {tuning_bucket(n) for n in range(1, limit + 1)}
        assert len(plan.prefill_lengths) == len({tuning_bucket(n) for n in plan.prefill_lengths})


@pytest.fixture
def watch(tmp_path, monkeypatch):
    from triton import knobs
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    before = knobs.compilation.listener
    w = CompileWatch()
    assert w.hook_triton()
    yield w
    knobs.compilation.listener = before


def test_phases_report_compiled_then_cached_then_warm(watch):
    calls = []
    progress = StartupProgress(lambda name, report: calls.append((name, report)), watch)
    with progress.phase("first") as run:
        assert progress.state()["phase"] == "first"
        compile_variant(64)
        run.variants_run = 1
    with progress.phase("second"):
        compile_variant(64)   # the same variant in a new miss: the binary comes from the disk cache
    with progress.phase("third"):
        pass
    report = progress.ready()
    first, second, third = report.phases
    variant = "doubler[BLOCK=64] w4 s3"   # the kernel, its constexprs, warps and stages
    assert (first.compiled, first.cached, first.status, first.variants_run) == (
        (variant,), (), "compiled", 1)
    assert (second.compiled, second.cached, second.status) == ((), (variant,), "cached")
    assert third.status == "warm" and (report.compiled, report.cached) == (1, 1)
    assert [(name, r is None) for name, r in calls] == [
        ("first", True), ("first", False), ("second", True), ("second", False),
        ("third", True), ("third", False)]
    assert "compiled 1 (doubler)" in first.summary() and "from cache 1" in second.summary()
    attributes = first.attributes()
    assert attributes[sc.STARTUP_KERNELS_COMPILED] == [variant]
    assert attributes[sc.STARTUP_STATUS] == "compiled" and first.compile_s > 0
    assert report.start_ns == progress.start_ns <= first.start_ns <= third.end_ns <= report.ready_ns


def test_the_engine_warms_every_family_on_the_cpu_and_leaves_the_kv_cache_zeroed():
    from sightline.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01))
    report = engine.startup_report
    assert [p.name for p in report.phases] == [
        sc.STARTUP_LOAD_WEIGHTS, sc.STARTUP_ALLOCATE_KV, sc.STARTUP_WARMUP_FUSED,
        sc.STARTUP_WARMUP_PREFILL, sc.STARTUP_WARMUP_DECODE, sc.STARTUP_WARMUP_MIXED,
        sc.STARTUP_WARMUP_SAMPLER]
    runs = {p.name: p.variants_run for p in report.phases}
    assert runs[sc.STARTUP_WARMUP_PREFILL] == 2 and runs[sc.STARTUP_WARMUP_DECODE] == 2
    assert runs[sc.STARTUP_WARMUP_MIXED] == 2 and runs[sc.STARTUP_WARMUP_SAMPLER] == 2
    assert all(p.status == "warm" and p.variants_skipped == 0 for p in report.phases)
    assert engine.runner.kv_cache.abs().sum().item() == 0
    assert engine.runner.sampler.num_generators == 0   # the seeded cases let theirs go
    [request] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0,
                                                            ignore_eos=True))
    assert request.num_output_tokens == 3


def test_the_time_limit_leaves_cases_out_and_the_engine_still_serves():
    from sightline.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01,
                                    warmup_limit_s=1e-6))
    warm = [p for p in engine.startup_report.phases if p.name.startswith("warmup_")]
    assert len(warm) == 5
    assert all(p.status == "timed_out" and p.variants_run == 0 and p.variants_skipped > 0
               for p in warm)
    assert "cases: 0 run, 1 left out (time limit)" in warm[0].summary()
    [request] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0,
                                                            ignore_eos=True))
    assert request.num_output_tokens == 2
    off = LLMEngine(EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01, warmup=False))
    assert [p.name for p in off.startup_report.phases] == [sc.STARTUP_LOAD_WEIGHTS,
                                                           sc.STARTUP_ALLOCATE_KV]


def test_fa2_tuning_choices_survive_a_round_trip():
    from sightline.engine.kernels import prefill_attention as fa2
    saved = dict(fa2._tuned)
    try:
        fa2._tuned.clear()
        fa2._tuned[(128, 128, 4, torch.bfloat16)] = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8,
                                                      "num_stages": 3}
        entries = fa2.tuned_entries()
        assert entries == [{"seq_bucket": 128, "head_dim": 128, "group": 4, "dtype": "bfloat16",
                            "config": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8,
                                       "num_stages": 3}}]
        fa2._tuned.clear()
        bad = [{"seq_bucket": 64}, {**entries[0], "dtype": "no_such_dtype"}, "junk"]
        assert fa2.restore_tuned(entries + bad) == 1
        assert fa2.tuned_configs() == {(128, 128, 4, torch.bfloat16): entries[0]["config"]}
        assert fa2.restore_tuned(entries) == 0   # a key tuned already is kept
    finally:
        fa2._tuned.clear()
        fa2._tuned.update(saved)
