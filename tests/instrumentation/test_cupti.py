"""CUPTI kernel tracer and GpuTelemetry: a clear answer without CUPTI on the CPU; on a GPU,
real kernel records joined to steps, kernel spans under the step span, per-SM metrics."""

from __future__ import annotations

import pytest

from sightline.instrumentation.cupti_tracer import CuptiTracer, cupti_available
from sightline.instrumentation.gpu_telemetry import GpuTelemetry, GpuTelemetryConfig


def test_tracer_without_cupti_says_why_and_stays_inert():
    ok, _ = cupti_available()
    if ok:
        pytest.skip("cupti-python is installed here")
    tracer = CuptiTracer()
    assert tracer.start() is False
    assert "cupti-python is not usable" in tracer.unavailable_reason
    tracer.push(1)
    tracer.pop()
    batch = tracer.drain(flush=True)
    assert batch.kernels == [] and batch.memcpys == [] and batch.dropped_records == 0


def test_config_ranges_name_the_bad_value():
    with pytest.raises(ValueError, match="kernel_sample_ratio=1.5"):
        GpuTelemetryConfig(kernel_sample_ratio=1.5)
    with pytest.raises(ValueError, match="tail_min_steps=0"):
        GpuTelemetryConfig(tail_min_steps=0)


def test_create_returns_none_below_kernels_level_or_without_cuda():
    from sightline.instrumentation.tracing import Telemetry
    assert GpuTelemetry.create(Telemetry.disabled(), 0) is None
    assert GpuTelemetry.create(None, 0) is None


@pytest.mark.gpu
def test_cupti_records_kernels_with_external_ids():
    import torch
    ok, why = cupti_available()
    if not ok:
        pytest.skip(why)
    tracer = CuptiTracer()
    assert tracer.start(), tracer.unavailable_reason
    try:
        x = torch.randn(1024, 1024, device="cuda")
        torch.cuda.synchronize()
        tracer.drain(flush=True)
        tracer.push(41)
        y = x @ x
        tracer.pop()
        tracer.push(42)
        z = (y + 1).relu()
        tracer.pop()
        torch.cuda.synchronize()
        batch = tracer.drain(flush=True)
    finally:
        tracer.stop()
    by_ext = {}
    for k in batch.kernels:
        by_ext.setdefault(k.external_id, []).append(k)
    assert 41 in by_ext and 42 in by_ext, [(k.name, k.external_id) for k in batch.kernels]
    for k in by_ext[41] + by_ext[42]:
        assert k.end_ns > k.start_ns and k.device_id == 0
        assert k.grid[0] >= 1 and k.block[0] >= 1 and k.registers_per_thread > 0
    assert by_ext[41][0].end_ns <= by_ext[42][0].start_ns + 1000
    del z


@pytest.mark.gpu
def test_second_subscriber_is_refused_clearly():
    import torch
    ok, why = cupti_available()
    if not ok:
        pytest.skip(why)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        tracer = CuptiTracer()
        assert tracer.start() is False
        assert "torch.profiler" in tracer.unavailable_reason


@pytest.mark.gpu
def test_gpu_telemetry_emits_kernel_spans_under_the_step_and_sm_metrics():
    import torch
    from opentelemetry.sdk.metrics.export import MetricExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sightline.engine.kernels.attention import prefill_attention
    from sightline.instrumentation import semconv
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.tracing import Telemetry

    class Sink:
        def __init__(self):
            self.data = []

        def export(self, data, **_):
            self.data.append(data)
            return MetricExportResult.SUCCESS

    spans = InMemorySpanExporter()
    tel = Telemetry.start(TelemetryConfig(level="kernels", exporter="none",
                                          schedule_delay_s=0.05), span_exporters=[spans])
    sink = Sink()
    gpu = GpuTelemetry.create(tel, 0, GpuTelemetryConfig(kernel_sample_ratio=1.0, settle_s=0.0),
                              metric_exporters=[sink])
    assert gpu is not None and gpu.probe is not None
    q = torch.randn(512, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(512, 8, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 512], dtype=torch.int32, device="cuda")
    prefill_attention(q, k, k, cu, cu, 512, 512, 0.088)   # tune/compile outside the steps
    torch.cuda.synchronize()
    steps = []
    for i in range(3):
        st = tel.start_step(i, requests=[])
        gpu.begin_step(st)
        prefill_attention(q, k, k, cu, cu, 512, 512, 0.088, probe=gpu.probe)
        st.end()
        gpu.end_step(st)
        steps.append(st)
    assert gpu.flush(timeout_s=60)
    tel.force_flush()
    finished = spans.get_finished_spans()
    kernel_spans = [s for s in finished if s.name.startswith(semconv.SPAN_KERNEL_PREFIX)]
    assert gpu.kernel_spans_available, gpu.tracer.unavailable_reason
    assert len([s for s in kernel_spans
                if s.attributes[semconv.CUDA_KERNEL_NAME] == "sightline_fa2_prefill"]) == 3
    step_ids = {st.span_context.span_id for st in steps}
    for s in kernel_spans:
        assert s.parent.span_id in step_ids
        assert s.end_time > s.start_time
    fa = [s for s in kernel_spans if s.attributes[semconv.CUDA_KERNEL_NAME] == "sightline_fa2_prefill"]
    assert all(s.attributes[semconv.KERNEL_SMS_USED] > 0 for s in fa)
    points = [p for d in sink.data for rm in d.resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics for p in m.data.data_points]
    assert points and sum(p.count for p in points) == 3 * fa[0].attributes[semconv.KERNEL_CTAS]
    assert all(p.exemplars and p.exemplars[0].span_id in step_ids for p in points)
    gpu.shutdown()
    tel.shutdown()


class _FeedTracer:
    """Feeds prepared CUPTI batches to GpuTelemetry's worker (CUPTI cannot run on the CPU;
    this checks the join / settle / span logic, the GPU tests check CUPTI itself)."""

    available = True
    unavailable_reason = ""

    def __init__(self) -> None:
        import queue
        self.batches: queue.Queue = queue.Queue()
        self.pushed: list[int] = []
        self.enabled = 0
        self.flushes = 0

    def push(self, ext: int) -> None:
        self.pushed.append(ext)

    def enable(self) -> None:
        self.enabled += 1

    def disable(self) -> None:
        pass

    def flush(self) -> None:
        self.flushes += 1

    def pop(self) -> None:
        pass

    def drain(self, flush: bool = False):
        import queue

        from sightline.instrumentation.cupti_tracer import TraceBatch
        try:
            return self.batches.get_nowait()
        except queue.Empty:
            return TraceBatch([], [], 0, 0)

    def stop(self) -> None:
        pass


def _kernel(name, ext, start, corr):
    from sightline.instrumentation.cupti_tracer import KernelRecord
    return KernelRecord(name, start, start + 1000, (4, 2, 1), (128, 1, 1), 90, 1024, 2048, 7, 0,
                        corr, ext)


def _gpu_with_feed(ratio: float, **cfg):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.tracing import Telemetry
    spans = InMemorySpanExporter()
    tel = Telemetry.start(TelemetryConfig(level="kernels", exporter="none", schedule_delay_s=0.05),
                          span_exporters=[spans])
    gpu = GpuTelemetry(tel, 0, GpuTelemetryConfig(cupti=False, probe=False, seed=1,
                                                  kernel_sample_ratio=ratio, **cfg),
                       metric_exporters=[])
    feed = gpu.tracer = _FeedTracer()
    return tel, gpu, feed, spans


def _wait(cond, timeout_s=5.0):
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.01)
    return cond()


def test_kernels_join_their_steps_even_when_records_come_late():
    import time

    from sightline.instrumentation import semconv
    from sightline.instrumentation.cupti_tracer import TraceBatch
    tel, gpu, feed, spans = _gpu_with_feed(1.0, settle_s=1.0, max_wait_s=3.0)
    steps = []
    for i in range(3):
        st = tel.start_step(i, requests=[])
        gpu.begin_step(st)
        st.end()
        gpu.end_step(st)
        steps.append(st)
    assert feed.pushed == [1, 2, 3]
    t0 = time.time_ns()
    feed.batches.put(TraceBatch([_kernel("a", 1, t0, 10), _kernel("b", 1, t0 + 2000, 11),
                                 _kernel("c", 2, t0 + 4000, 12), _kernel("x", 99, t0, 13),
                                 _kernel("y", None, t0, 14)], [], 0, 0))
    time.sleep(0.1)                     # step 2's second kernel arrives in a later buffer
    feed.batches.put(TraceBatch([_kernel("d", 2, t0 + 6000, 15)], [], 0, 0))
    assert _wait(lambda: gpu.stats.kernel_spans == 4 and not gpu._awaiting, timeout_s=10.0)
    tel.force_flush()
    kernel_spans = sorted((s for s in spans.get_finished_spans()
                           if s.name.startswith(semconv.SPAN_KERNEL_PREFIX)),
                          key=lambda s: s.attributes[semconv.CUDA_CORRELATION_ID])
    assert [s.name for s in kernel_spans] == ["kernel a", "kernel b", "kernel c", "kernel d"]
    parents = [s.parent.span_id for s in kernel_spans]
    assert parents == [steps[0].span_context.span_id] * 2 + [steps[1].span_context.span_id] * 2
    a = kernel_spans[0]
    assert (a.start_time, a.end_time) == (t0, t0 + 1000)
    assert a.attributes[semconv.CUDA_GRID] == "4,2,1"
    assert a.attributes[semconv.CUDA_SHARED_MEMORY_BYTES] == 3072
    # what the step span says is not repeated on each kernel span (each costs encoding)
    assert semconv.STEP_TRACE_REASON not in a.attributes and semconv.STEP_ID not in a.attributes
    step_spans = {s.context.span_id: s for s in spans.get_finished_spans()
                  if s.name == semconv.SPAN_ENGINE_STEP}
    assert step_spans[steps[0].span_context.span_id].attributes[semconv.STEP_TRACE_REASON] == "sampled"
    assert gpu.stats.kernels_unmatched == 2 and gpu.stats.steps_traced_sampled == 2
    gpu.shutdown()
    tel.shutdown()


def test_untraced_steps_keep_nothing_and_count_their_kernels():
    from sightline.instrumentation.cupti_tracer import TraceBatch
    tel, gpu, feed, spans = _gpu_with_feed(0.0, settle_s=0.05, max_wait_s=0.1)
    st = tel.start_step(0, requests=[])
    gpu.begin_step(st)
    st.end()
    gpu.end_step(st)
    assert _wait(lambda: 1 in gpu._skipped_set)
    feed.batches.put(TraceBatch([_kernel("a", 1, 5, 1), _kernel("b", 1, 9, 2)], [], 0, 0))
    assert _wait(lambda: gpu.stats.kernels_skipped == 2)
    assert gpu.stats.kernel_spans == 0 and not gpu._awaiting
    gpu.shutdown()
    tel.shutdown()


def test_cupti_is_on_only_for_sampled_steps_and_the_steps_after_a_slow_one():
    """Ratio 0: no step is sampled. After 64 fast steps (the tail rule's minimum), one step
    far slower than their P99 switches CUPTI on for exactly the next tail_follow_steps
    steps, whose kernel spans carry the reason "after_tail"; the slow step itself is not
    traced (its kernels ran before anyone knew it was slow)."""
    import time

    from sightline.instrumentation import semconv
    from sightline.instrumentation.cupti_tracer import TraceBatch
    tel, gpu, feed, spans = _gpu_with_feed(0.0, settle_s=0.05, max_wait_s=1.0,
                                           tail_follow_steps=2)

    clock = [time.time_ns()]

    def step(i: int, duration_s: float):     # step times given, so durations are exact
        st = tel.start_step(i, requests=[], start_time_ns=clock[0])
        gpu.begin_step(st)
        clock[0] += int(duration_s * 1e9)
        st.end(end_time_ns=clock[0])
        gpu.end_step(st)
        return st

    for i in range(64):
        step(i, 0.010)
    assert _wait(lambda: gpu.stats.steps == 64 and len(gpu._skipped) == 64)
    step(64, 0.05)                                    # slow: external id 65
    assert _wait(lambda: gpu.stats.tail_steps == 1)
    # the two traced steps are slow too (CUPTI on), but must not arm further tracing
    after = [step(65, 0.2), step(66, 0.2), step(67, 0.010)]   # external ids 66, 67, 68
    assert feed.pushed == [66, 67] and feed.enabled == 2
    assert gpu.stats.tail_steps == 1                  # 66 and 67 are not compared: traced
    feed.batches.put(TraceBatch([_kernel("k66", 66, 100, 1), _kernel("k67", 67, 200, 2),
                                 _kernel("k65", 65, 50, 3)], [], 0, 0))
    assert _wait(lambda: gpu.stats.kernel_spans == 2 and not gpu._awaiting, timeout_s=10.0)
    assert feed.flushes >= 1                          # records asked for, not waited on
    tel.force_flush()
    kernel_spans = sorted((s for s in spans.get_finished_spans()
                           if s.name.startswith(semconv.SPAN_KERNEL_PREFIX)),
                          key=lambda s: s.start_time)
    assert [s.name for s in kernel_spans] == ["kernel k66", "kernel k67"]
    assert [s.parent.span_id for s in kernel_spans] == [st.span_context.span_id
                                                        for st in after[:2]]
    step_spans = {s.context.span_id: s for s in spans.get_finished_spans()
                  if s.name == semconv.SPAN_ENGINE_STEP}
    assert {step_spans[s.parent.span_id].attributes[semconv.STEP_TRACE_REASON]
            for s in kernel_spans} == {"after_tail"}
    assert gpu.stats.steps_traced_tail == 2 and gpu.stats.steps_traced_sampled == 0
    assert gpu.stats.kernels_skipped == 1             # the slow step's own kernel
    gpu.shutdown()
    tel.shutdown()


def test_steps_during_a_kernel_trace_backlog_are_marked_and_arm_no_tail_trace():
    """A traced step's records are processed on other threads, and that CPU slows the
    steps that run meanwhile (on the H200, ~460 ms instead of ~40). Those steps are marked
    on their span and left out of the tail rule, until backlog_grace_s after the traced
    step's kernel spans were emitted; a slow step after that arms tracing again. The steps
    end the way the engine ends them: end_step first, then the span."""
    import time

    from sightline.instrumentation import semconv
    from sightline.instrumentation.cupti_tracer import TraceBatch
    tel, gpu, feed, spans = _gpu_with_feed(0.0, settle_s=0.05, max_wait_s=5.0,
                                           backlog_grace_s=0.3)
    def step(i: int, duration_s: float):
        # started duration_s ago: end_step reads the clock, so the duration is exact to µs
        st = tel.start_step(i, requests=[], start_time_ns=time.time_ns() - int(duration_s * 1e9))
        gpu.begin_step(st)
        gpu.end_step(st)
        st.end()
        return st

    for i in range(64):
        step(i, 0.010)
    # durations far apart, so a loaded machine's jitter on the 10 ms steps cannot blur them
    step(64, 0.3)                                      # slow: arms one traced step
    assert _wait(lambda: gpu.stats.tail_steps == 1)
    traced = step(65, 0.04)                            # external id 66, CUPTI on
    victims = [step(66, 0.5), step(67, 0.5)]           # its records not yet processed
    assert feed.pushed == [66]
    assert _wait(lambda: gpu.stats.steps == 68)
    assert gpu.stats.tail_steps == 1 and gpu.stats.steps_backlog == 2
    feed.batches.put(TraceBatch([_kernel("k66", 66, 100, 1)], [], 0, 0))
    assert _wait(lambda: gpu.stats.kernel_spans == 1 and not gpu._awaiting)
    in_grace = step(68, 0.5)                           # the spans' export may still run
    assert _wait(lambda: gpu.stats.steps == 69)
    assert gpu.stats.tail_steps == 1 and feed.pushed == [66]
    time.sleep(1.2)                                    # past the grace, even counting back 0.6 s
    after = step(69, 0.6)                              # a slow step of the engine's own
    assert _wait(lambda: gpu.stats.tail_steps == 2)
    step(70, 0.01)
    assert feed.pushed == [66, 71]                     # it armed the next step's trace
    tel.force_flush()
    by_id = {s.context.span_id: s for s in spans.get_finished_spans()
             if s.name == semconv.SPAN_ENGINE_STEP}
    attrs = lambda st: by_id[st.span_context.span_id].attributes  # noqa: E731
    assert attrs(traced)[semconv.STEP_TRACE_REASON] == "after_tail"
    assert semconv.STEP_KERNEL_TRACE_BACKLOG not in attrs(traced)
    for st in [*victims, in_grace]:
        assert attrs(st)[semconv.STEP_KERNEL_TRACE_BACKLOG] is True
        assert semconv.STEP_TRACE_REASON not in attrs(st)
    assert semconv.STEP_KERNEL_TRACE_BACKLOG not in attrs(after)
    assert gpu.stats.steps_backlog == 3
    gpu.shutdown()
    tel.shutdown()


def test_buffer_callback_converts_joins_and_bounds_records():
    """The CUPTI buffer callback on records shaped like cupti-python's (CUPTI itself cannot
    run here; the GPU tests run it): kernels, memcpys and external-correlation records
    become typed records joined by correlation id, API records are only counted, and a
    buffer that would exceed ``max_queue_records`` is dropped whole and counted."""
    import enum
    import types

    class Kind(enum.IntEnum):
        MEMCPY = 1
        RUNTIME = 5
        CONCURRENT_KERNEL = 10
        EXTERNAL_CORRELATION = 39

    class ExtKind(enum.IntEnum):
        CUSTOM0 = 2
        CUSTOM2 = 4

    class CopyKind(enum.IntEnum):
        HTOD = 1

    fake = types.SimpleNamespace(ActivityKind=Kind, ExternalCorrelationKind=ExtKind,
                                 ActivityMemcpyKind=CopyKind, activity_flush_all=lambda flag: None)

    def kernel(corr, name="k"):
        return types.SimpleNamespace(
            kind=int(Kind.CONCURRENT_KERNEL), name=name, start=100 * corr, end=100 * corr + 50,
            grid_x=4, grid_y=2, grid_z=1, block_x=128, block_y=1, block_z=1,
            registers_per_thread=90, static_shared_memory=1024, dynamic_shared_memory=2048,
            stream_id=7, device_id=0, correlation_id=corr)

    def ext(corr, ext_id, kind=ExtKind.CUSTOM2):
        return types.SimpleNamespace(kind=int(Kind.EXTERNAL_CORRELATION), external_kind=int(kind),
                                     correlation_id=corr, external_id=ext_id)

    api = types.SimpleNamespace(kind=int(Kind.RUNTIME))
    copy = types.SimpleNamespace(kind=int(Kind.MEMCPY), copy_kind=1, bytes=4096, start=5, end=9,
                                 stream_id=7, device_id=0, correlation_id=3)
    tracer = CuptiTracer(max_queue_records=5)
    tracer._cupti, tracer._ext_kind, tracer.available = fake, ExtKind.CUSTOM2, True
    tracer._buffer_completed([api, ext(1, 41), kernel(1, "a"), api, ext(2, 42, ExtKind.CUSTOM0),
                              kernel(2, "b"), copy])           # 4 kept (not CUSTOM0), 2 API
    tracer._buffer_completed([ext(9, 49), kernel(9)])         # 4 + 2 > 5: dropped whole
    batch = tracer.drain(flush=True)
    assert [(k.name, k.external_id) for k in batch.kernels] == [("a", 41), ("b", None)]
    a = batch.kernels[0]
    assert (a.start_ns, a.end_ns, a.grid, a.block, a.shared_memory_bytes) == \
        (100, 150, (4, 2, 1), (128, 1, 1), 3072)
    assert [(m.copy_kind, m.bytes) for m in batch.memcpys] == [("HTOD", 4096)]
    assert batch.api_calls == 2 and batch.dropped_records == 2
    assert tracer.records_seen == 9 and tracer.buffers_completed == 2
    tracer._buffer_completed([ext(9, 49), kernel(9)])         # room again after the drain
    assert [(k.name, k.external_id) for k in tracer.drain(flush=True).kernels] == [("k", 49)]
