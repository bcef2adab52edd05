"""Steps with prefill tokens through the static path of ``engine/mixed_graphs.py``: the
segments between attentions on padded static buffers (on the CPU without graphs, on a GPU
replayed), against the eager forward, token for token."""

from __future__ import annotations

import pytest

from sightline.engine.config import EngineConfig
from sightline.engine.mixed_graphs import mixed_buckets
from sightline.engine.scheduler import SchedulerConfig
from tests.engine.graph_runs import cuda_config, random_prompts, run_greedy


def test_buckets_climb_the_ladder_to_the_token_budget_and_stop_at_1024():
    assert mixed_buckets(48) == (16, 32, 48)
    assert mixed_buckets(64) == (16, 32, 64)
    assert mixed_buckets(2048) == (16, 32, 64, 128, 256, 384, 512, 768, 1024)
    assert mixed_buckets(8) == (8,)


def _graph_tokens(runner):
    """The step's padded token count on the mixed path (None: not this path)."""
    return runner.last_execution.graph_tokens


_LENS = (9, 30, 4, 17, 12, 70)


def test_static_mixed_steps_match_eager_on_cpu():
    """Six requests under a 48-token budget: pure prefill steps, prefill chunks beside
    decodes, a 70-token prompt chunked (its later chunks continue the cached prefix), then
    decodes. Each step runs in the smallest bucket holding its tokens (padded rows at
    position 0, writing the scratch block only); the greedy tokens equal the eager engine's."""
    from sightline.engine.llm_engine import LLMEngine
    config = EngineConfig(device="cpu", kv_cache_gib=0.004,
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48))
    prompts, max_tokens = random_prompts(0, _LENS), [6, 9, 3, 12, 7, 5]
    eager = LLMEngine(config)
    want, eager_buckets = run_greedy(eager, prompts, max_tokens, _graph_tokens)
    assert set(eager_buckets) == {None}
    static = LLMEngine(config)
    static.runner.static_mixed(capture=False)
    got, buckets = run_greedy(static, prompts, max_tokens, _graph_tokens)
    assert got == want
    assert buckets[:2] == [48, 48] and {16, 48} <= set(buckets)
    assert static.runner.last_execution.attributes() == {"sightline.step.cuda_graph": False,
                                                         "sightline.step.graph_tokens": 16}
    scratch = static.runner.kv_cache[:, :, static.runner.num_blocks]
    assert scratch.abs().sum() > 0 and eager.runner.kv_cache[:, :, eager.runner.num_blocks].abs().sum() == 0


def test_decode_steps_take_the_decode_graphs_and_the_rest_the_mixed_path_on_cpu():
    """With both static paths: decode-only steps replay the decode path (batch buckets), every
    step with prefill tokens the mixed one, and the tokens are the eager engine's."""
    from sightline.engine.llm_engine import LLMEngine
    config = EngineConfig(device="cpu", kv_cache_gib=0.004, async_scheduling=True,
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48))
    prompts, max_tokens = random_prompts(3, _LENS), [4, 11, 2, 8, 6, 9]
    want, _ = run_greedy(LLMEngine(config), prompts, max_tokens, _graph_tokens)
    static = LLMEngine(config)
    static.runner.static_mixed(capture=False)
    static.runner.static_decode(capture=False)
    got, _ = run_greedy(static, prompts, max_tokens, _graph_tokens)
    assert got == want


# -- on a GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_mixed_graph_replays_give_the_eager_tokens_on_gpu():
    """Greedy tokens token for token: the captured segments (token buckets 16..128) with
    eager attention between them against --enforce-eager, tiny model in float32."""
    from sightline.engine.llm_engine import LLMEngine
    prompts, max_tokens = random_prompts(1, (9, 130, 4, 17, 60)), [20, 33, 8, 41, 15]
    eager = LLMEngine(cuda_config(enforce_eager=True))
    assert eager.runner.mixed is None
    want, _ = run_greedy(eager, prompts, max_tokens, _graph_tokens)
    del eager
    graphs = LLMEngine(cuda_config())
    cap = graphs.runner.mixed_capture
    assert cap.buckets == (16, 32, 64, 128) and not cap.skipped
    got, buckets = run_greedy(graphs, prompts, max_tokens, _graph_tokens)
    assert got == want
    assert 128 in buckets and None in buckets   # decode-only steps replay the decode graphs
