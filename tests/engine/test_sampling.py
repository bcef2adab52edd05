"""The batch sampler's allowed ids, top-k, min-p and penalties against exact answers, and the host-side
batch builder against the requests it was built from."""

from __future__ import annotations

import math

import pytest
import torch

from sightline.engine.request import Request, SamplingParams
from sightline.engine.sampling import Sampler, _apply_penalties

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
N = 20000


def _request(rid, prompt=(1, 2), output=(), **sampling):
    r = Request(rid, list(prompt), SamplingParams(**sampling))
    r.output_token_ids = list(output)
    return r


def _draw(sampler, **sampling):
    """N rows of PROBS's logits sampled with one parameter set; frequencies [5]."""
    batch = sampler.batch([_request(f"r{i}", **sampling) for i in range(N)], vocab_size=5)
    drawn = sampler.sample(PROBS.log().repeat(N, 1), batch)
    return torch.bincount(drawn, minlength=5).double() / N


def test_top_k_min_p_and_top_p_keep_exactly_the_right_tokens():
    sampler = Sampler(torch.device("cpu"), seed=1)
    # top_k=2 keeps {0, 1}: 4/7 and 3/7 after renormalizing
    freq = _draw(sampler, temperature=1.0, top_k=2)
    assert freq[2:].sum() == 0 and abs(freq[0].item() - 4 / 7) < 0.015
    # min_p=0.3: floor 0.12 keeps {0, 1, 2}: 4/9, 3/9, 2/9
    freq = _draw(sampler, temperature=1.0, min_p=0.3)
    assert freq[3:].sum() == 0
    torch.testing.assert_close(freq[:3], torch.tensor([4 / 9, 3 / 9, 2 / 9], dtype=torch.double),
                               atol=0.015, rtol=0)
    # top_k=3, then top_p=0.75 of the 0.9 left: the mass before token 2 (0.7) reaches 0.675,
    # so token 2 goes too and {0, 1} remain
    freq = _draw(sampler, temperature=1.0, top_k=3, top_p=0.75)
    assert freq[2:].sum() == 0 and freq[1] > 0.35
    # top_k=1 is greedy whatever the temperature
    assert _draw(sampler, temperature=5.0, top_k=1)[0] == 1.0


def test_penalties_follow_the_openai_and_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    sampler = Sampler(torch.device("cpu"), seed=0)
    # row 0: prompt {2}, output [0, 0, 1]; row 1: no penalties
    reqs = [_request("a", prompt=(2,), output=(0, 0, 1), repetition_penalty=2.0,
                     presence_penalty=0.5, frequency_penalty=0.25),
            _request("b", prompt=(3,), output=(3,))]
    batch = sampler.batch(reqs, vocab_size=4)
    out = _apply_penalties(logits, batch.penalties)
    expect = torch.tensor([[2.0 / 2 - 0.25 * 2 - 0.5,      # output twice: rep, freq x2, presence
                            -1.0 * 2 - 0.25 - 0.5,         # negative logit: multiplied
                            0.5 / 2,                       # prompt only: repetition alone
                            3.0],                          # unseen
                           [1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(out, expect)
    # greedy rows see the penalties too: a strong presence penalty moves row 1's argmax off
    # its only output token
    reqs[1] = _request("b", prompt=(3,), output=(3,), temperature=0.0, presence_penalty=2.0)
    logits[1, 3] = 2.0
    batch = sampler.batch(reqs, vocab_size=4)
    assert sampler.sample(logits, batch)[1].item() == 0


def test_batch_builder_copies_only_what_rows_use():
    sampler = Sampler(torch.device("cpu"), seed=0)
    plain = sampler.batch([_request("a", temperature=0.0), _request("b", top_p=0.5)], vocab_size=9)
    assert plain.all_greedy is False and plain.any_top_p is True
    assert plain.top_ks is None and plain.min_ps is None and plain.penalties is None
    assert plain.temperatures.tolist() == [0.0, 1.0] and plain.top_ps.tolist() == [1.0, 0.5]
    assert plain.generators == [None, None]
    full = sampler.batch([_request("a", top_k=50, min_p=0.1, seed=3),
                          _request("b", output=(4, 5), frequency_penalty=1.0)], vocab_size=9)
    assert full.top_ks.tolist() == [9, 9] and full.min_ps.tolist() == pytest.approx([0.1, 0.0])
    p = full.penalties  # only row 1 is penalized: its output counts, no prompt (no repetition penalty)
    assert p.rows.tolist() == [1] and p.frequency.tolist() == [1.0] and p.repetition.tolist() == [1.0]
    assert p.counts.tolist() == [[0, 0, 0, 0, 1, 1, 0, 0, 0]] and not p.prompt_seen.any()
    assert full.generators[0] is sampler.generator_for("a", 3) and full.generators[1] is None
    assert sampler.to_host(torch.tensor([7, 8])) == [7, 8]


def test_allowed_token_ids_leave_only_those_ids():
    sampler = Sampler(torch.device("cpu"), seed=4)
    rows = [_request(f"r{i}", allowed_token_ids=(1, 3)) for i in range(N)] + [_request("free")]
    batch = sampler.batch(rows, vocab_size=5)
    assert batch.allowed_rows.tolist() == list(range(N)) and batch.allowed_bias.shape == (N, 5)
    assert batch.allowed_bias[:2].tolist() == [[-math.inf, 0, -math.inf, 0, -math.inf]] * 2
    drawn = sampler.sample(PROBS.log().repeat(N + 1, 1), batch)[:N]
    freq = torch.bincount(drawn, minlength=5).double() / N
    assert freq[[0, 2, 4]].tolist() == [0.0, 0.0, 0.0]
    assert freq[1].item() == pytest.approx(0.3 / 0.36, abs=0.015)  # renormalized over {1, 3}
    greedy = sampler.batch([_request("g", temperature=0.0, allowed_token_ids=(2, 4)),
                            _request("p", temperature=0.0, allowed_token_ids=(0, 4), output=(0,),
                                     presence_penalty=2.0, frequency_penalty=1.0)], vocab_size=5)
    assert sampler.sample(PROBS.log().repeat(2, 1), greedy).tolist() == [2, 4]


def test_the_most_likely_token_survives_any_top_p_and_no_row_is_nan():
    """top_p 1e-300 is 0 in float32: before, every token was cut, the row all zero and id 0
    drawn. A repetition penalty whose division overflows float32 is clamped, not NaN."""
    sampler = Sampler(torch.device("cpu"), seed=2)
    logits = torch.tensor([[0.1, 0.2, 3.0, 1.0, 0.5]]).repeat(200, 1)
    batch = sampler.batch([_request(f"t{i}", temperature=2.0, top_p=1e-300) for i in range(200)], vocab_size=5)
    assert batch.top_ps.tolist() == [0.0] * 200
    assert sampler.sample(logits, batch).tolist() == [2] * 200
    # 5 / 2**-126 overflows to inf; clamped, the boosted prompt tokens 3 and 4 tie at the float32
    # maximum and share the draws; id 0 (never seen) is never drawn, no row is NaN
    logits = torch.tensor([[-5.0, 1.0, 2.0, 5.0, 5.0]]).repeat(400, 1)
    reqs = [_request(f"p{i}", prompt=(3, 4), temperature=0.5, repetition_penalty=2.0 ** -126)
            for i in range(400)]
    drawn = sampler.sample(logits.clone(), sampler.batch(reqs, vocab_size=5))
    assert set(drawn.tolist()) == {3, 4}
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=1e-5).temperature == 1e-5
    with pytest.raises(ValueError, match="repetition_penalty=1e-40 is not a number in"):
        SamplingParams(repetition_penalty=1e-40)


def test_request_rows_live_on_the_device_from_first_sample_to_release():
    """Allowed ids and the prompt cross to the device once; output counts then grow on the
    device with each sampled token (no per-step copy of a request's history); release frees
    the rows for the next request."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    req = _request("a", prompt=(1, 1, 2), temperature=0.0, allowed_token_ids=(0, 3, 4),
                   frequency_penalty=0.5, repetition_penalty=1.5)
    logits = torch.tensor([[0.0, 9.0, 9.0, 2.0, 1.0]])
    first = sampler.batch([req], vocab_size=5)
    assert first.penalties.prompt_seen.tolist() == [[False, True, True, False, False]]
    assert first.allowed_bias.tolist() == [[0, -math.inf, -math.inf, 0, 0]]
    tokens = []
    for _ in range(4):  # the host never tells the sampler which token came: it counts on the device
        batch = sampler.batch([req], vocab_size=5)
        tokens.append(sampler.sample(logits.clone(), batch).item())
    # allowed logits 0: 0, 3: 2, 4: 1. Once seen, a logit is divided by 1.5 and loses 0.5 per
    # occurrence: 3 -> 2/1.5 - 0.5 = 0.83 < 1, so 4; then 4 -> 1/1.5 - 0.5 = 0.17 < 0.83, so 3;
    # then 3 -> 2/1.5 - 1.0 = 0.33, still above 0.17 and 0
    assert tokens == [3, 4, 3, 3]
    assert sampler.batch([req], vocab_size=5).penalties.counts.tolist() == [[0, 0, 0, 3, 1]]
    assert sampler.num_device_rows == 1
    sampler.release("a")
    assert sampler.num_device_rows == 0
    again = _request("a", prompt=(4,), temperature=0.0, presence_penalty=1.0)  # a new request, same id
    batch = sampler.batch([again], vocab_size=5)
    assert batch.allowed_bias is None and batch.penalties.counts.sum().item() == 0
    assert not batch.penalties.prompt_seen.any()


def test_sampling_params_name_the_bad_value():
    for kwargs, text in (({"top_k": 0}, "top_k=0 is not an integer in"),
                         ({"min_p": 1.5}, "min_p=1.5 is not a number in"),
                         ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 is not a number in"),
                         ({"presence_penalty": 3}, "presence_penalty=3 is not a number in"),
                         ({"frequency_penalty": float("nan")}, "frequency_penalty=nan is not a number in"),
                         ({"allowed_token_ids": ()}, "allowed_token_ids must be"),
                         ({"allowed_token_ids": (1, -2)}, "allowed_token_ids must be")):
        with pytest.raises(ValueError, match=text):
            SamplingParams(**kwargs)
    assert SamplingParams(frequency_penalty=0.1).penalized and not SamplingParams().penalized


@pytest.mark.gpu
def test_gpu_sampler_agrees_with_the_cpu_one_where_it_is_deterministic():
    """Greedy with penalties and top_k=1 rows: the same ids on CUDA as on the CPU, back
    through the pinned buffer (grown past its first size)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 1000, generator=gen)
    reqs = [_request(f"r{i}", prompt=(i, i + 1), output=(i + 2,) * (i % 3),
                     temperature=0.0 if i % 2 else 0.7, top_k=1 if i % 2 == 0 else None,
                     repetition_penalty=1.0 + (i % 4) / 4, frequency_penalty=0.5 * (i % 2))
            for i in range(40)]
    cpu = Sampler(torch.device("cpu"), seed=0)
    want = cpu.to_host(cpu.sample(logits, cpu.batch(reqs, 1000)))
    gpu = Sampler(torch.device("cuda"), seed=0)
    assert gpu.to_host(gpu.sample(logits[:3].cuda(), gpu.batch(reqs[:3], 1000))) == want[:3]
    for r in reqs[:3]:  # that sample counted their tokens on the device: start them afresh
        gpu.release(r.request_id)
    assert gpu.to_host(gpu.sample(logits.cuda(), gpu.batch(reqs, 1000))) == want
