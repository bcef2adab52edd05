"""Per-rank GPU telemetry of tensor-parallel steps, from raw CUPTI records (no GPU needed).

A worker rank's records are tagged with its rank and carry their kernel names unasked
(``RankRecorder``). In the telemetry process each rank's CUPTI records join the traced step
through their own rank's builder; NCCL kernels become kernel spans with their collective
and bytes, and with the GPU's rank and UUID; each rank's part of the step (from its first
all-reduce's end to its last kernel; its later all-reduces are its wait) joins the step
span: per-rank arrays on it and an ``engine.step.rank`` child span per rank, exactly.
"""

from __future__ import annotations

import ctypes

import numpy as np
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sightline.instrumentation import semconv as sc
from sightline.instrumentation.config import TelemetryConfig
from sightline.instrumentation.cupti_records import KERNEL_DTYPE
from sightline.instrumentation.gpu_records import GpuIdentity, KernelActivity, KernelNames
from sightline.instrumentation.lifecycle import Step
from sightline.instrumentation.rank_recorder import RankRecorder
from sightline.instrumentation.telemetry_worker import TelemetryWorker
from sightline.instrumentation.tracing import Telemetry
from tests.instrumentation.cupti_buffers import correlation_record, kernel_record

ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
_NAMES = {name: ctypes.create_string_buffer(name.encode()) for name in (ALL_REDUCE, "gemm_bf16")}
US = 1000


def _record(name: str, corr: int, start_us: int, end_us: int, t0: int) -> bytes:
    """test_cupti's kernel record, naming one of these kernels."""
    r = np.frombuffer(kernel_record("rms_norm", corr, t0 + start_us * US, (end_us - start_us) * US),
                      KERNEL_DTYPE).copy()
    r["name_ptr"] = ctypes.addressof(_NAMES[name])
    return r.tobytes()


def _buffer(kernels: list[tuple[str, int, int]], step_id: int, t0: int) -> bytes:
    """One rank's CUPTI buffer for a traced step: its kernels, each with its correlation."""
    out = b""
    for corr, (name, start, end) in enumerate(kernels, start=1):
        out += _record(name, corr, start, end, t0) + correlation_record(corr, step_id + 1)
    return out


# rank 0 waits 400 us in each later all-reduce for rank 1, whose compute takes that much longer
RANK0 = [("gemm_bf16", 0, 100), (ALL_REDUCE, 100, 150), ("gemm_bf16", 150, 250), (ALL_REDUCE, 250, 650),
         ("gemm_bf16", 650, 750), (ALL_REDUCE, 750, 1150)]
RANK1 = [("gemm_bf16", 0, 140), (ALL_REDUCE, 140, 150), ("gemm_bf16", 150, 640), (ALL_REDUCE, 640, 650),
         ("gemm_bf16", 650, 1140), (ALL_REDUCE, 1140, 1150)]


def test_a_worker_rank_tags_its_records_and_sends_kernel_names_unasked():
    recorder = RankRecorder(1, TelemetryConfig(level="kernels", exporter="none"))
    buffer = _buffer(RANK1, 7, 10**18)
    recorder.record(KernelActivity(buffer))
    recorder.record(KernelActivity(buffer))   # its names went with the first
    recorder.record(GpuIdentity(1, "GPU-bbb"))
    names, first, second, identity = recorder.drain()
    assert names == KernelNames({ctypes.addressof(b): n for n, b in _NAMES.items()}, rank=1)
    assert (first, second) == (KernelActivity(buffer, rank=1), KernelActivity(buffer, rank=1))
    assert identity == GpuIdentity(1, "GPU-bbb", rank=1) and recorder.drain() == []


def test_each_ranks_collectives_and_part_of_a_traced_step_exactly():
    spans = InMemorySpanExporter()
    telemetry = Telemetry.start(TelemetryConfig(level="kernels", exporter="none", metrics_enabled=False),
                                span_exporters=[spans])
    asked = []
    worker = TelemetryWorker(telemetry, asked.append)
    t0 = 1_800_000_000 * 10**9
    step = Step(3, t0 - 50 * US, t0 + 1200 * US, 0x1234, 0x55, (), 1, (), (), 0, 1, 0, 1, 4, 100, None,
                {sc.STEP_TRACE_REASON: "sampled", sc.TP_SIZE: 2, sc.COLLECTIVE_BYTES: 16384})
    rank1 = RankRecorder(1, TelemetryConfig(level="kernels", exporter="none"))
    rank1.record(GpuIdentity(1, "GPU-bbb"))
    rank1.record(KernelActivity(_buffer(RANK1, 3, t0)))
    worker.handle([GpuIdentity(0, "GPU-aaa"), step, KernelActivity(_buffer(RANK0, 3, t0)),
                   KernelNames({ctypes.addressof(b): n for n, b in _NAMES.items()}), *rank1.drain()])
    # rank 0's builder asked the engine (answered above); rank 1's names came with its buffer
    assert [sorted(a) for a in asked] == [sorted(ctypes.addressof(b) for b in _NAMES.values())]
    worker.poll(force=True)
    telemetry.shutdown()
    finished = spans.get_finished_spans()
    [step_span] = [s for s in finished if s.name == sc.SPAN_ENGINE_STEP]
    assert step_span.context.span_id == 0x55
    assert step_span.attributes[sc.STEP_RANK_COLLECTIVE_WAIT_S] == (800e-6, 20e-6)
    assert step_span.attributes[sc.STEP_RANK_COMPUTE_S] == (200e-6, 980e-6)
    ranks = {s.attributes[sc.TP_RANK]: s for s in finished if s.name == sc.SPAN_RANK_STEP}
    assert sorted(ranks) == [0, 1]
    for rank, uuid in ((0, "GPU-aaa"), (1, "GPU-bbb")):
        span = ranks[rank]
        assert span.parent.span_id == 0x55
        assert (span.start_time, span.end_time) == (t0 + 150 * US, t0 + 1150 * US)
        assert span.attributes[sc.ATTR_GPU_UUID] == uuid and span.attributes[sc.ATTR_GPU_ID] == rank
        assert span.attributes[sc.RANK_COLLECTIVE_CALLS] == 3
        assert span.attributes[sc.COLLECTIVE_BYTES] == 16384
    collectives = [s for s in finished if s.attributes.get(sc.COLLECTIVE_OP) == "all_reduce"]
    assert len(collectives) == 6
    for s in collectives:   # each launch its own span, under the step, with its bytes and GPU
        assert s.name == sc.SPAN_KERNEL_PREFIX + ALL_REDUCE and s.parent.span_id == 0x55
        assert s.attributes[sc.COLLECTIVE_BYTES] == 16384
        assert s.attributes[sc.ATTR_GPU_UUID] == ("GPU-aaa", "GPU-bbb")[s.attributes[sc.TP_RANK]]
    summaries = {(s.attributes[sc.TP_RANK], s.attributes[sc.KERNEL_LAUNCHES]) for s in finished
                 if s.name == sc.SPAN_KERNEL_SUMMARY_PREFIX + "gemm_bf16"}
    assert summaries == {(0, 3), (1, 3)}


def test_per_sm_histograms_carry_the_rank_and_uuid_their_gpu_reported():
    from opentelemetry.sdk.resources import Resource

    from sightline.instrumentation import ExpHistogram
    from sightline.instrumentation.cta_metrics import build_cta_metrics

    h = ExpHistogram(scale=6)
    h.record(np.array([1e-5, 2e-5]))
    data = build_cta_metrics({(1, 7, "fa2"): h}, {}, 1, 2, Resource.create({}),
                             gpu_ranks={1: (1, "GPU-bbb")})
    [point] = data.resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    assert dict(point.attributes) == {sc.ATTR_GPU_ID: 1, sc.ATTR_SM_ID: 7, sc.ATTR_KERNEL_NAME: "fa2",
                                      sc.ATTR_GPU_UUID: "GPU-bbb", sc.TP_RANK: 1}
