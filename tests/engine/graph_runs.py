"""Builders shared by the CUDA-graph tests: random prompts, a small CUDA engine config, and
greedy generation driven step by step with a per-step reading of the runner."""

from __future__ import annotations

import random

from sightline.engine.config import EngineConfig
from sightline.engine.request import SamplingParams
from sightline.engine.scheduler import SchedulerConfig


def run_greedy(engine, prompts, max_tokens, per_step=lambda runner: runner.last_step_graph_bucket):
    """Drives the engine step by step; returns (outputs, ``per_step(runner)`` after every
    step: by default the graph bucket it replayed)."""
    tokens: dict[str, list[int]] = {}
    for prompt, m in zip(prompts, max_tokens):
        tokens[engine.new_request_id("g")] = []
        engine.add_request(list(tokens)[-1], prompt,
                           SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
    readings = []
    while engine.scheduler.has_work:
        for _, output in engine.step():
            tokens[output.request_id] += output.token_ids
        readings.append(per_step(engine.runner))
    return list(tokens.values()), readings


def random_prompts(seed=0, lens=(9, 30, 4, 17, 12)):
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lens]


def cuda_config(**kw):
    """The tiny model on CUDA in float32 (its margins dwarf float32 rounding), 8 sequences,
    128 tokens a step."""
    return EngineConfig(device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128), **kw)
