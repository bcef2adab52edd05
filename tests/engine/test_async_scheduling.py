"""Overlapped scheduling: the next step is planned and launched before this one's tokens are
read, with stand-ins in the scheduler. Outputs must equal the synchronous engine's exactly:
tokens, text, finish reasons, token counts, and no KV block left behind."""

from __future__ import annotations

import random
import time

import pytest

from sightline.engine.config import EngineConfig
from sightline.engine.kv_cache import KVCacheConfig, KVCacheManager
from sightline.engine.request import FinishReason, Request, SamplingParams, pending_token
from sightline.engine.scheduler import Scheduler, SchedulerConfig


# -- the scheduler's stand-ins ---------------------------------------------------------------------

def _scheduler(blocks=64):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                     KVCacheManager(KVCacheConfig(block_size=4, num_blocks=blocks)))


def test_stand_ins_plan_the_next_decode_and_resolve_in_place():
    s = _scheduler()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_id=99)
    s.add(a)
    first = s.schedule()
    assert s.update_pending(first, {"a": 0}) == []
    assert a.output_token_ids == [pending_token(0)] and a.num_computed_tokens == 3
    second = s.schedule()                       # planned before the first token is known
    (entry,) = second.scheduled
    assert entry.computed_before == 3 and entry.num_new_tokens == 1 and not entry.is_prefill
    s.update_pending(second, {"a": 0})
    assert s.resolve(first, {"a": 7}) == [] and a.output_token_ids == [7, pending_token(0)]
    assert a.first_token_time_s is not None
    assert s.resolve(second, {"a": 8}) == [] and a.output_token_ids == [7, 8]


def test_eos_found_late_ends_the_request_and_drops_the_step_after_it():
    s = _scheduler()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=99)
    s.add(a)
    first = s.schedule()
    s.update_pending(first, {"a": 0})
    second = s.schedule()
    s.update_pending(second, {"a": 0})
    assert s.resolve(first, {"a": 99}) == [a]
    assert a.is_finished and a.finish_reason is FinishReason.STOP and a.output_token_ids == [99]
    assert s.kv_cache.num_used_blocks == 0
    assert s.resolve(second, {"a": 5}) == [] and a.output_token_ids == [99]   # the extra token


def test_max_tokens_finishes_at_launch_and_an_earlier_eos_still_wins():
    s = _scheduler()
    a = Request("a", [1, 2], SamplingParams(max_tokens=2), eos_token_id=99)
    b = Request("b", [1, 2], SamplingParams(max_tokens=2), eos_token_id=99)
    for r in (a, b):
        s.add(r)
    first = s.schedule()
    s.update_pending(first, {"a": 0, "b": 1})
    second = s.schedule()
    assert s.update_pending(second, {"a": 0, "b": 1}) == [a, b]     # max_tokens reached
    assert a.finish_reason is FinishReason.LENGTH and s.kv_cache.num_used_blocks == 0
    assert s.resolve(first, {"a": 99, "b": 4}) == [a]               # a's eos came first
    assert a.finish_reason is FinishReason.STOP and a.output_token_ids == [99]
    assert s.resolve(second, {"a": 5, "b": 99}) == []
    assert b.output_token_ids == [4, 99] and b.finish_reason is FinishReason.STOP
    assert a.output_token_ids == [99]


def test_an_abort_drops_stand_ins():
    s = _scheduler()
    a = Request("a", [1, 2], SamplingParams(max_tokens=8))
    s.add(a)
    first = s.schedule()
    s.update_pending(first, {"a": 0})
    assert s.abort("a") is a and a.output_token_ids == []
    assert s.resolve(first, {"a": 5}) == [] and a.output_token_ids == []


# -- the engine, overlapped against synchronous ----------------------------------------------------

def _engine(async_scheduling: bool, eos: int | None = None, static: bool = False):
    from sightline.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_gib=0.004, async_scheduling=async_scheduling,
                                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48)))
    if static:
        engine.runner.static_decode(capture=False)
    if eos is not None:
        engine.eos_token_id = eos
    return engine


def _requests(texts_stop: str | None = None):
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in (9, 30, 4, 17, 12, 40, 6)]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (6, 11, 3, 14, 9, 5, 12)]
    params[4] = SamplingParams(max_tokens=9, temperature=0.0, frequency_penalty=0.5)   # needs host tokens
    params[6] = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    if texts_stop:
        params[1] = SamplingParams(max_tokens=11, temperature=0.0, stop=(texts_stop,))
    return prompts, params


def _outcome(requests):
    return [(r.output_token_ids, r.finish_reason, r.num_output_tokens) for r in requests]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-decode"])
def test_overlapped_engine_gives_the_synchronous_outputs(static):
    """Greedy, penalized and seeded rows; an eos id taken from a real output so that one
    request ends on it mid-stream while the step after it is already launched."""
    prompts, params = _requests()
    probe = _engine(False).generate(prompts, [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                                                             seed=p.seed, ignore_eos=True) for p in params])
    eos = probe[3].output_token_ids[4]
    sync = _engine(False, eos, static)
    want = _outcome(sync.generate(prompts, params))
    assert any(reason is FinishReason.STOP for _, reason, _ in want)
    overlapped = _engine(True, eos, static)
    got = _outcome(overlapped.generate(prompts, params))
    assert got == want
    assert overlapped.kv_cache.num_used_blocks == 0 and overlapped.num_live == 0
    assert not overlapped.scheduler.has_work and overlapped._in_flight is None


def test_overlapped_engine_stops_on_stop_strings_like_the_synchronous_one():
    prompts, params = _requests()
    probe = _engine(False).generate(prompts, SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True))
    text = _engine(False).tokenizer.decode(probe[1].output_token_ids)
    stop = text[5:7] if len(text) > 8 else text[-2:]
    prompts, params = _requests(stop)
    sync, overlapped = _engine(False, -5), _engine(True, -5)
    got = [r.output_token_ids for r in overlapped.generate(prompts, params)]
    want = [r.output_token_ids for r in sync.generate(prompts, params)]
    assert got == want


def test_served_overlapped_engine_streams_what_the_synchronous_one_does():
    """The server's path (loop thread, streams, usage) with overlapped scheduling on the CPU."""
    openai = pytest.importorskip("openai")
    from sightline.engine.api_server import serve_in_thread
    answers = {}
    for mode in (False, True):
        running = serve_in_thread(EngineConfig(model="tiny", device="cpu", kv_cache_gib=0.01, port=0,
                                               shutdown_timeout_s=5, async_scheduling=mode))
        try:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="x")
            texts = []
            for prompt, n in (("hello", 7), ("sightline", 1), ("overlap", 12)):
                chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True}))
                texts.append(("".join(c.choices[0].text for c in chunks if c.choices),
                              chunks[-1].usage.completion_tokens))
            answers[mode] = texts
            assert running.engine.async_scheduling is mode
            assert running.engine.kv_cache.num_used_blocks == 0
        finally:
            running.stop()
    assert answers[True] == answers[False]
    assert [n for _, n in answers[True]] == [7, 1, 12]


def _counting_telemetry(static: bool, prefill_interval_s: float):
    """An engine on the CPU with GPU telemetry that samples nothing and whose probe turn never
    comes; the begin/end calls it gets, and the probe each forward pass was given."""
    from sightline.engine.llm_engine import LLMEngine
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.gpu_telemetry import GpuTelemetry, GpuTelemetryConfig
    from sightline.instrumentation.sm_probe import PROBE_FAKE, SmProbe
    from sightline.instrumentation.telemetry_pipeline import TelemetryPipeline
    pipeline = TelemetryPipeline.start(TelemetryConfig(level="kernels", exporter="none",
                                                       metrics_enabled=False))
    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_gib=0.004,
                                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48)),
                       pipeline)
    if static:
        engine.runner.static_decode(capture=False)
    calls, probes = [], []

    class Counting(GpuTelemetry):
        def begin_step(self, step, prefill=False):
            calls.append(("begin", step.step_id, prefill))
            super().begin_step(step, prefill)

        def end_step(self, step, done=None, graph=None):
            calls.append(("end", step.step_id))
            super().end_step(step, done, graph)

    gpu = Counting(pipeline.recorder, 0, GpuTelemetryConfig(
        cupti=False, probe=False, kernel_sample_ratio=0.0, probe_prefill_interval_s=prefill_interval_s))
    gpu.probe = SmProbe("cpu", capacity_ctas=1 << 12, mode=PROBE_FAKE)   # never probed: no turn
    engine.gpu_telemetry = engine.runner.gpu_telemetry = gpu
    model_forward = engine.runner.model.forward

    def forward(input_ids, positions, meta, *args, **kwargs):
        probes.append((meta.num_prefill_tokens > 0, meta.probe))
        return model_forward(input_ids, positions, meta, *args, **kwargs)
    engine.runner.model.forward = forward
    prompts, _ = _requests()
    engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    pipeline.shutdown()
    gpu.shutdown()
    return gpu, calls, probes


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-decode"])
def test_steps_planned_plain_call_no_gpu_telemetry_and_probe_nothing(static):
    """With GPU telemetry attached and nothing to sample or probe (prefill steps out of turn
    too: interval 0), only the first step (no plan yet) calls begin_step and end_step; every
    later one, eager or through the static decode path, calls neither, and its kernels get
    no probe."""
    gpu, calls, probes = _counting_telemetry(static, 0.0)
    assert calls == [("begin", 0, True), ("end", 0)]
    assert len(probes) > 6 and probes[0][1] is gpu.probe and all(p is None for _, p in probes[1:])


def test_a_prefill_step_is_probed_when_none_was_for_the_interval():
    """The same engine with a prefill step probed at least every hour: the first step (a
    prefill) is probed, the later prefill steps fall inside the hour and, like the decode
    steps, call nothing and get no probe."""
    gpu, calls, probes = _counting_telemetry(False, 3600.0)
    assert calls == [("begin", 0, True), ("end", 0)] and gpu._last_prefill_probe > 0
    assert sum(prefill for prefill, _ in probes) >= 2 and all(p is None for _, p in probes[1:])


def test_every_prefill_step_is_probed_when_the_interval_has_passed_each_time(monkeypatch):
    """With the interval already passed at each prefill step, every step with prefill tokens
    begins (planned plain or not), its kernels get the probe, and no decode-only step does."""
    import sightline.instrumentation.gpu_telemetry as module
    monkeypatch.setattr(module.GpuTelemetry, "prefill_probe_due",
                        lambda self: self.probe is not None)
    gpu, calls, probes = _counting_telemetry(False, 1.0)
    assert all((p is gpu.probe) == prefill for prefill, p in probes[1:]), probes
    begun = [c for c in calls if c[0] == "begin"]
    assert sum(prefill for prefill, _ in probes) == len(begun) >= 2
    assert gpu.stats.prefill_probes == len(begun)   # none of them was a 1-in-32 turn


def test_every_step_joins_the_tail_window():
    """The engine hands every step's wall time to observe_step once (the usual, quiet step
    returns at its first branch), and the tail rule sees every step: the window holds the
    engine's step durations exactly, in order, and a step slowed past the window's P99.9
    counts as a tail."""
    from sightline.engine.llm_engine import LLMEngine
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.gpu_telemetry import GpuTelemetry, GpuTelemetryConfig
    from sightline.instrumentation.telemetry_pipeline import TelemetryPipeline
    pipeline = TelemetryPipeline.start(TelemetryConfig(level="kernels", exporter="none",
                                                       metrics_enabled=False))
    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_gib=0.004,
                                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48)),
                       pipeline)
    observed, prefills = [], []

    class Counting(GpuTelemetry):
        def observe_step(self, step, duration_s, prefill=False):
            observed.append(duration_s)
            prefills.append(prefill)
            super().observe_step(step, duration_s, prefill)

    gpu = Counting(pipeline.recorder, 0, GpuTelemetryConfig(
        cupti=False, probe=False, kernel_sample_ratio=0.0, tail_min_steps=8, tail_window_steps=4096))
    engine.gpu_telemetry = engine.runner.gpu_telemetry = gpu
    model_forward = engine.runner.model.forward
    calls = [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 70:
            time.sleep(0.3)   # far past the P99.9 of the steps before it
        return model_forward(*args, **kwargs)
    engine.runner.model.forward = forward
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 250) for _ in range(6)] for _ in range(3)]
    engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    pipeline.shutdown()
    gpu.shutdown()
    steps = list(engine.step_durations_s)
    window = list(gpu.policy._recent) + gpu.policy.batch
    assert len(steps) > 70 and window == steps
    # the slow-spell rule hears which steps carried prefill tokens
    assert prefills == [p > 0 for p, _ in engine.core.step_tokens] and 0 < sum(prefills) < len(prefills)
    assert max(observed) >= 0.3 and gpu.stats.tail_steps >= 1   # (a prefill may be one too)
    assert observed == steps
    assert engine.core.debug_steps()["traced"] == [0] * len(steps)   # no CUPTI here: none traced

# -- on a GPU -------------------------------------------------------------------------------------

def _cuda_engine(telemetry=None, **kw):
    from sightline.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                                  scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
                                  **kw), telemetry)


@pytest.mark.gpu
def test_overlapped_graph_replays_give_the_eager_tokens_on_gpu():
    """CUDA graphs with overlapped scheduling (the default on CUDA) against eager synchronous
    steps: the same tokens, finish reasons and counts, an eos found mid-stream included."""
    import torch
    prompts, params = _requests()
    eager = _cuda_engine(enforce_eager=True, async_scheduling=False)
    probe = eager.generate(prompts, [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                                                    seed=p.seed, ignore_eos=True) for p in params])
    eager.eos_token_id = probe[3].output_token_ids[4]
    want = _outcome(eager.generate(prompts, params))
    eos = eager.eos_token_id
    del eager
    torch.cuda.empty_cache()
    fast = _cuda_engine()
    assert fast.async_scheduling and fast.runner.graphs is not None
    fast.eos_token_id = eos
    assert _outcome(fast.generate(prompts, params)) == want
    assert fast.kv_cache.num_used_blocks == 0 and not fast.has_work


def _hold_first_close_until_a_step_launches(gpu, timeout_s: float = 10.0) -> None:
    """Makes the worker's first close of a traced step wait until the engine has launched a
    step meanwhile: that step is then recorded under CUPTI and must be kept out of the traced
    one, whatever the timing of the machine."""
    close, held = gpu._close_traced, []

    def close_after_a_launch(done):
        if not held:
            held.append(True)
            deadline = time.monotonic() + timeout_s
            while gpu.stats.steps_recorded_untraced == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        close(done)
    gpu._close_traced = close_after_a_launch


@pytest.mark.gpu
@pytest.mark.parametrize("cupti_detach", [True, False], ids=["detached", "attached"])
def test_overlapped_steps_keep_kernel_spans_inside_their_step(cupti_detach):
    """Level kernels with overlapped scheduling, CUPTI detached or attached between traced
    steps. Detached, a traced step is waited for before the next launch; attached, it is not,
    and steps launched while the worker closes it are recorded but kept out. Either way every
    traced step gets kernel spans and each lies inside its step span."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sightline.instrumentation import semconv
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.telemetry_pipeline import TelemetryPipeline
    spans = InMemorySpanExporter()
    pipeline = TelemetryPipeline.start(TelemetryConfig(level="kernels", exporter="none", metrics_enabled=False,
                                                       kernel_sample_ratio=0.3, cupti_detach=cupti_detach),
                                       span_exporters=[spans])
    engine = _cuda_engine(pipeline)
    assert engine.async_scheduling and engine.gpu_telemetry is not None
    assert engine.gpu_telemetry.config.cupti_detach is cupti_detach
    if not cupti_detach:
        _hold_first_close_until_a_step_launches(engine.gpu_telemetry)
    prompts, _ = _requests()
    engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    engine.gpu_telemetry.flush(timeout_s=60)
    pipeline.shutdown()
    finished = spans.get_finished_spans()
    steps = {s.context.span_id: s for s in finished if s.name == semconv.SPAN_ENGINE_STEP}
    kernels = [s for s in finished if s.name.startswith((semconv.SPAN_KERNEL_PREFIX,
                                                           semconv.SPAN_KERNEL_SUMMARY_PREFIX))]
    assert engine.gpu_telemetry.stats.steps_traced_sampled > 0 and kernels
    for span in kernels:
        step = steps[span.parent.span_id]
        assert step.start_time <= span.start_time <= span.end_time <= step.end_time, span.name
    traced = {i for i, s in steps.items() if semconv.STEP_TRACE_REASON in (s.attributes or {})}
    assert traced == {span.parent.span_id for span in kernels}
    # the core's recent steps say which were traced (bench.overhead_http's after_traced)
    debug = engine.core.debug_steps()
    assert sum(debug["traced"]) == len(traced) and len(debug["traced"]) == len(debug["durations_s"])
    # each traced step says when the engine began waiting for it, inside its span
    assert all(steps[i].start_time < steps[i].attributes[semconv.STEP_WAIT_START_NS] <= steps[i].end_time
               for i in traced)
    # and the CPU time its thread spent in its host phases, at most the step's own time
    assert all(0 < steps[i].attributes[semconv.STEP_HOST_CPU_S] <= (steps[i].end_time - steps[i].start_time) / 1e9
               for i in traced)
    if not cupti_detach:
        assert engine.gpu_telemetry.stats.steps_recorded_untraced > 0
