"""The engine records lifecycle events; spans built from them equal the in-process spans.

The fixture is the canonical span tree (``span_trees.py``) of a preempting workload as the
engine produced it when it built spans in its own loop. The same workload, recorded as
events and assembled by a TelemetryWorker, must give the same names, parents, links,
events and attributes (the engine's start-up, a trace of its own, aside).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.config import TelemetryConfig
from sightline.instrumentation.telemetry_pipeline import TelemetryPipeline

from .span_trees import canonical_tree

FIXTURE = Path(__file__).parent / "fixtures" / "span_tree_preempted.json"


def run_preempting_workload(pipeline: TelemetryPipeline, async_scheduling: bool = False) -> dict:
    """4 requests of 30 prompt tokens in 9 KV blocks of 16: two are preempted."""
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", kv_cache_gib=9 * 32768 / 2**30,
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
                                    async_scheduling=async_scheduling),
                       pipeline)
    handles = {}
    for i in range(4):
        request_id = f"p{i}"
        handles[request_id] = pipeline.start_request(
            route="/v1/completions", headers={}, model="tiny", operation="text_completion",
            request_id=request_id, priority=i)
        handles[request_id].tokenized(1, 2)
        sampling = SamplingParams(max_tokens=20 if i != 3 else 6, temperature=0.0, ignore_eos=True)
        engine.add_request(request_id, list(range(1, 31)), sampling, priority=i, trace=handles[request_id])
    finals = {}
    step = engine.step_overlapped if async_scheduling else engine.step
    while engine.has_work:
        for _, output in step():
            if output.finished:
                finals[output.request_id] = output
    for request_id, out in finals.items():
        handles[request_id].finish(status_code=200, finish_reason=out.finish_reason,
                                   input_tokens=out.num_prompt_tokens, output_tokens=out.num_output_tokens,
                                   preemptions=out.num_preemptions, ttft_s=out.ttft_s, tpot_s=out.tpot_s,
                                   queue_s=out.queue_s, e2e_s=out.e2e_s)
    pipeline.shutdown()
    return finals


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_spans_from_events_equal_the_in_process_span_tree(async_scheduling):
    """Overlapped scheduling plans each step before the previous one's tokens are read: the
    same steps, batches, preemptions and spans."""
    exporter = InMemorySpanExporter()
    pipeline = TelemetryPipeline.start(TelemetryConfig(level="steps", exporter="none", metrics_enabled=False),
                                       span_exporters=[exporter])
    finals = run_preempting_workload(pipeline, async_scheduling)
    assert {r: o.num_preemptions for r, o in finals.items()} == {"p0": 0, "p1": 0, "p2": 1, "p3": 1}
    spans = exporter.get_finished_spans()
    startup = [s for s in spans if s.name.startswith(sc.SPAN_ENGINE_STARTUP)]
    assert len({s.context.trace_id for s in startup}) == 1   # start-up: a trace of its own
    tree = canonical_tree([s for s in spans if s not in startup])
    expected = json.loads(FIXTURE.read_text())
    assert len(tree) == len(expected) == 53
    for got, want in zip(tree, expected):
        assert got == want, got["span"]
    assert pipeline.dropped_events() == {"queue_full": 0, "process_down": 0, "buffer_full": 0,
                                         "build_error": 0}
