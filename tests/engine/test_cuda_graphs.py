"""Decode steps through static padded inputs (what the CUDA graphs replay) give the eager
path's tokens: on the CPU without capture, on the GPU with graphs against --enforce-eager;
the SM probe's records come back from kernels inside a replayed graph."""

from __future__ import annotations

import pytest
import torch

from sightline.engine.config import EngineConfig
from sightline.engine.cuda_graphs import DecodeGraphs, graph_buckets
from sightline.engine.scheduler import SchedulerConfig
from sightline.instrumentation.sm_probe import PROBE_FAKE, RECORD_WORDS, ProbedLaunches, SmProbe
from tests.engine.graph_runs import cuda_config, random_prompts, run_greedy


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 32, 48, 64, 96, 100)
    assert graph_buckets(600)[-5:] == (192, 256, 384, 512, 600)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        graph_buckets(0)


def test_enforce_eager_is_a_checked_config_field_and_a_serve_flag():
    import argparse

    from sightline.engine import cli
    assert EngineConfig().enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager='yes' must be a bool"):
        EngineConfig(enforce_eager="yes")
    with pytest.raises(ValueError, match="cuda_graph_capture_limit_s=-1"):
        EngineConfig(cuda_graph_capture_limit_s=-1)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    assert parser.parse_args(["engine", "serve", "--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(["engine", "serve"]).enforce_eager is False


def test_probe_reservations_are_taken_at_capture_and_snapshotted_at_replay():
    probe = SmProbe("cpu", capacity_ctas=100, mode=PROBE_FAKE)
    assert probe.reserve("k1", 30) == 0 and probe.reserve("k2", 20) == 30
    launches = probe.take_reservations()
    assert launches == (("k1", 30), ("k2", 20)) and probe.pending_ctas == 0
    pending = probe.end_replay(launches, trace_id=1, span_id=2)
    assert pending.launches == launches and pending.words == 50 * RECORD_WORDS
    assert probe.reserve("k3", 10) == 0                 # this step's own slots are taken:
    pending = probe.end_replay(launches)                # the graph's launches are dropped
    assert pending.launches == [("k3", 10)] and probe.dropped_launches == 2
    assert probe.end_replay(ProbedLaunches()) is None and probe.pending_ctas == 0


def test_static_padded_decode_matches_eager_on_cpu():
    """Five sequences finishing at different steps: decode batches of 5, 4, 3, 2, 1 run in
    buckets 8, 4, 4, 2, 1 with padded rows; the greedy tokens equal the eager engine's, and
    the padding wrote only the scratch block."""
    from sightline.engine.llm_engine import LLMEngine
    config = EngineConfig(device="cpu", kv_cache_gib=0.004,
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    prompts, max_tokens = random_prompts(), [6, 9, 3, 12, 7]
    eager = LLMEngine(config)
    want, eager_buckets = run_greedy(eager, prompts, max_tokens)
    assert set(eager_buckets) == {None}
    static = LLMEngine(config)
    static.runner.static_decode(capture=False)
    got, buckets = run_greedy(static, prompts, max_tokens)
    assert got == want
    assert {8, 4, 2, 1} <= set(buckets) and None in buckets   # prefill steps stay eager
    assert static.runner.last_execution.attributes() == {"sightline.step.cuda_graph": False,
                                                         "sightline.step.graph_batch_size": 1}
    scratch = static.runner.kv_cache[:, :, static.runner.num_blocks]
    assert scratch.abs().sum() > 0 and eager.runner.kv_cache[:, :, eager.runner.num_blocks].abs().sum() == 0


# -- on a GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_graph_replays_give_the_eager_tokens_on_gpu():
    """Greedy tokens token for token: CUDA graphs (buckets 1..8, padded) against
    --enforce-eager, tiny model in float32 (its margins dwarf float32 rounding)."""
    from sightline.engine.llm_engine import LLMEngine
    prompts, max_tokens = random_prompts(1), [20, 33, 8, 41, 15]
    eager = LLMEngine(cuda_config(enforce_eager=True))
    assert eager.runner.graphs is None
    want, _ = run_greedy(eager, prompts, max_tokens)
    del eager
    graphs = LLMEngine(cuda_config())
    cap = graphs.runner.graph_capture
    assert cap.buckets == (1, 2, 4, 8) and not cap.skipped
    got, buckets = run_greedy(graphs, prompts, max_tokens)
    assert got == want
    assert {8, 4, 2, 1} <= set(buckets)
    assert graphs.runner.last_execution.cuda_graph is True


@pytest.mark.gpu
def test_probe_records_come_back_from_a_replayed_graph():
    """The paged-decode kernels inside a captured graph write their per-CTA records into the
    static probe buffer at every replay: real SM ids, fresh timestamps each time."""
    from sightline.engine.llm_engine import LLMEngine
    engine = LLMEngine(cuda_config(enforce_eager=True))
    runner = engine.runner
    probe = SmProbe(runner.device, capacity_ctas=1 << 16)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, 4, 8, runner.num_blocks * runner.block_size,
                          "auto", probe)
    cap = graphs.capture_all(limit_s=60)
    assert cap.buckets == (1, 2, 4)
    layers = runner.model_config.num_layers
    assert [name for name, _ in graphs.launches(2)] == ["sightline_paged_decode"] * layers
    dev = runner.device
    starts = []
    for _ in range(2):
        logits = graphs.run(torch.tensor([5, 6], device=dev), torch.tensor([3, 9], device=dev),
                            torch.tensor([3, 9], device=dev),   # block 0, slots 3 and 9
                            torch.zeros(2, 1, dtype=torch.int32, device=dev),
                            torch.tensor([4, 10], dtype=torch.int32, device=dev), bucket=2)
        assert torch.isfinite(logits).all()
        batch = probe.end_replay(graphs.launches(2), trace_id=1, span_id=2).wait()
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        assert batch.num_ctas == sum(n for _, n in graphs.launches(2))
        busy = batch.sm_id >= 0
        assert busy.any() and (batch.sm_id[busy] < num_sms).all()
        assert (batch.end_ns[busy] >= batch.start_ns[busy]).all()
        starts.append(int(batch.start_ns[busy].min()))
    assert starts[1] > starts[0]


def _cupti(request):
    """A started CuptiTracer collecting raw buffers into a list (skips without cupti)."""
    from sightline.instrumentation.cupti_tracer import CuptiTracer, cupti_available
    available = cupti_available()
    if not available[0]:
        pytest.skip(available[1])
    buffers: list[bytes] = []
    tracer = CuptiTracer(buffers.append)
    request.addfinalizer(tracer.stop)
    assert tracer.start(), tracer.unavailable_reason
    return tracer, buffers


def _replay_args(engine) -> tuple:
    """One decode row's static inputs for the batch-1 graph."""
    dev = engine.runner.device
    return (torch.tensor([5], device=dev), torch.tensor([3], device=dev),
            torch.tensor([3], device=dev), torch.zeros(1, 1, dtype=torch.int32, device=dev),
            torch.tensor([4], dtype=torch.int32, device=dev))


def _decoded(buffers: list[bytes]):
    """(kernel records, correlation -> external id, name pointer -> name) of the buffers."""
    import numpy as np

    from sightline.instrumentation.cupti_records import decode_buffer
    from sightline.instrumentation.cupti_tracer import CuptiTracer
    decoded = [decode_buffer(b) for b in buffers]
    kernels = np.concatenate([d.kernels for d in decoded])
    external = dict(zip(np.concatenate([d.correlation_ids for d in decoded]).tolist(),
                        np.concatenate([d.external_ids for d in decoded]).tolist()))
    return kernels, external, CuptiTracer.resolve_names(np.unique(kernels["name_ptr"]))


@pytest.mark.gpu
def test_cupti_joins_a_replayed_graphs_kernels_to_the_pushed_step_id(request):
    """CUPTI switched on after the graphs were captured (as kernel telemetry does for a
    traced step): every kernel node of the replay comes back under the external id pushed
    around the launch."""
    from sightline.engine.llm_engine import LLMEngine
    tracer, buffers = _cupti(request)
    tracer.disable()   # idle until a traced step, as GpuTelemetry keeps it
    engine = LLMEngine(cuda_config())
    args = _replay_args(engine)
    torch.cuda.synchronize()
    tracer.flush()
    buffers.clear()
    tracer.enable()
    tracer.push(77)
    engine.runner.graphs.run(*args, bucket=1)
    tracer.pop()
    torch.cuda.synchronize()
    tracer.disable()
    tracer.flush()
    kernels, external, names_of = _decoded(buffers)
    tagged = [(names_of[int(k["name_ptr"])], external.get(int(k["correlation_id"]))) for k in kernels]
    names = [n for n, e in tagged if e == 77]
    layers = engine.model_config.num_layers
    assert sum("sightline_paged_decode" in n for n in names) >= layers, names
    assert sum("sightline_rms_norm" in n for n in names) == 2 * layers + 1, names
    assert all(e == 77 for n, e in tagged if "sightline_" in n), tagged


@pytest.mark.gpu
def test_cupti_times_of_a_replayed_graphs_kernels_lie_inside_the_replay(request):
    """Kernel records of a replayed graph, flushed before CUPTI is switched off (as
    GpuTelemetry does for a traced step), start and end inside the replay's wall time."""
    import time

    from sightline.engine.llm_engine import LLMEngine
    tracer, buffers = _cupti(request)
    tracer.disable()
    engine = LLMEngine(cuda_config())
    args = _replay_args(engine)
    torch.cuda.synchronize()
    for attempt in range(3):
        buffers.clear()
        t0 = time.time_ns()
        tracer.enable()
        tracer.push(100 + attempt)
        engine.runner.graphs.run(*args, bucket=1)
        tracer.pop()
        torch.cuda.synchronize()
        t1 = time.time_ns()
        tracer.flush()
        tracer.disable()
        kernels, _, _ = _decoded(buffers)
        assert len(kernels)
        assert int(kernels["start_ns"].min()) >= t0 - 1_000_000, (attempt, int(kernels["start_ns"].min()) - t0)
        assert int(kernels["end_ns"].max()) <= t1 + 1_000_000, (attempt, int(kernels["end_ns"].max()) - t1)


@pytest.mark.gpu
def test_graphs_captured_before_cupti_starts_are_still_traced(request):
    """The engine subscribes to CUPTI after capturing its graphs; a traced replay's kernels
    still come back, under the pushed external id, with times inside the replay."""
    import time

    from sightline.engine.llm_engine import LLMEngine
    engine = LLMEngine(cuda_config())
    tracer, buffers = _cupti(request)
    args = _replay_args(engine)
    torch.cuda.synchronize()
    tracer.flush()
    buffers.clear()
    t0 = time.time_ns()
    tracer.push(55)
    engine.runner.graphs.run(*args, bucket=1)
    tracer.pop()
    torch.cuda.synchronize()
    t1 = time.time_ns()
    tracer.flush()
    kernels, external, names_of = _decoded(buffers)
    ours = [k for k in kernels if external.get(int(k["correlation_id"])) == 55]
    layers = engine.model_config.num_layers
    assert sum("sightline_paged_decode" in names_of[int(k["name_ptr"])] for k in ours) >= layers
    assert all(t0 - 10**6 <= int(k["start_ns"]) and int(k["end_ns"]) <= t1 + 10**6 for k in ours)
