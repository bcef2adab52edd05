"""The front end's half of a step (engine/output_processor.py) on a real engine's steps.

A request admitted while others decode gets its first token in a step whose batch lists the
running requests' tokens first (the core plans decodes before new prompts): the processor
hands that first token out first, so its SSE chunk is not written behind the whole batch's.
"""

from __future__ import annotations

from sightline.engine.config import EngineConfig
from sightline.engine.llm_engine import LLMEngine
from sightline.engine.request import SamplingParams

MODEL = "tiny"


def test_a_first_token_goes_out_before_its_steps_other_tokens():
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu", kv_cache_gib=0.02))
    assert not engine.core.async_scheduling   # one step, waited for: its batch is its tokens
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    running = [f"running-{i}" for i in range(3)]
    for i, request_id in enumerate(running):
        engine.add_request(request_id, [10 + i, 11, 12], sampling)
    batch = engine.core.step()   # three first tokens: among themselves, the batch's order
    assert batch.request_ids == running
    assert [out.request_id for _, out in engine.processor.process(batch)] == running

    engine.add_request("new", [20, 21, 22, 23], sampling)
    batch = engine.core.step()
    assert batch.request_ids == running + ["new"]   # the core: decodes, then the new prompt
    outputs = [out for _, out in engine.processor.process(batch)]
    assert [out.request_id for out in outputs] == ["new"] + running
    assert [out.num_output_tokens for out in outputs] == [1, 2, 2, 2]
    assert [out.token_ids for out in outputs] == [[batch.token_ids[3]]] + [[t] for t in batch.token_ids[:3]]

    batch = engine.core.step()   # no first token: the batch's order as it is
    assert [out.request_id for _, out in engine.processor.process(batch)] == running + ["new"]
