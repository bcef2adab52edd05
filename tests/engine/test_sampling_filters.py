"""top_k, min_p, top_p and repetition_penalty against hand-computed answers, and the
Sampler (generators, batching) against the pure reference pipeline with the same noise."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sightline.engine.sampling import Sampler, SamplingBatch  # noqa: E402
from sightline.engine.sampling_filters import (  # noqa: E402
    FilterRows, apply_repetition_penalty, min_p_filter, sample_reference, top_k_filter, top_p_filter)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 3.0, -4.0], [2.0, -1.0, 3.0, -4.0]])
    seen = torch.tensor([[True, True, False, False], [False, False, False, True]])
    out = apply_repetition_penalty(logits, torch.tensor([2.0, 0.5]), seen)
    assert out.tolist() == [[1.0, -2.0, 3.0, -4.0], [2.0, -1.0, 3.0, -2.0]]


def test_top_k_keeps_ties_at_the_boundary_and_zero_is_off():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1]] * 3)
    out = top_k_filter(probs, torch.tensor([2, 0, 9]))
    assert out[0].tolist() == pytest.approx([0.0, 0.4, 0.2, 0.2, 0.0])  # 2nd largest is 0.2: both stay
    assert out[1].tolist() == out[2].tolist() == probs[0].tolist()  # off, and k past the vocabulary


def test_min_p_is_relative_to_the_most_likely_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = min_p_filter(probs, torch.tensor([0.3, 0.0]))  # floor 0.15 in row 0
    assert out.tolist() == [pytest.approx([0.5, 0.3, 0.15, 0.0]), pytest.approx([0.5, 0.3, 0.15, 0.05])]


def test_top_p_works_on_unnormalized_rows():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [1.0, 0.6, 0.3, 0.1]])  # row 1 = 2x row 0
    out = top_p_filter(probs, torch.tensor([0.8, 0.8]))
    assert out.tolist() == [pytest.approx([0.5, 0.3, 0.0, 0.0]), pytest.approx([1.0, 0.6, 0.0, 0.0])]


def test_reference_pipeline_by_hand():
    logits = torch.tensor([[1.5, 0.0, 2.0, 0.5]]).repeat(2, 1)
    seen = torch.tensor([[False, False, True, False]] * 2)
    # Row 0 greedy: the penalty (2) pushes token 2 (the argmax) below token 0.
    # Row 1: penalized, top_k=1 keeps only the new argmax whatever the noise.
    noise = torch.rand(2, 4) + 0.1
    ids = sample_reference(logits, torch.tensor([0.0, 1.0]), torch.ones(2), torch.tensor([0, 1]),
                           torch.zeros(2), torch.tensor([2.0, 2.0]), seen, noise)
    expected = apply_repetition_penalty(logits, torch.tensor([2.0, 2.0]), seen).argmax(-1)
    assert ids.tolist() == expected.tolist() == [0, 0]


def test_sampler_equals_the_reference_with_the_same_noise():
    vocab, rows = 64, 6
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.9])
    top_ps = torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0, 0.95])
    top_ks = torch.tensor([0, 5, 0, 10, 3, 0])
    min_ps = torch.tensor([0.0, 0.0, 0.1, 0.05, 0.0, 0.2])
    penalties = torch.tensor([1.5, 1.0, 1.2, 1.0, 0.8, 1.0])
    seen = torch.zeros(rows, vocab, dtype=torch.bool)
    seen[0, logits[0].argmax()] = seen[2, :10] = seen[4, 5] = True
    for trial in range(20):
        sampler = Sampler(torch.device("cpu"), seed=trial)
        batch = SamplingBatch(temps, top_ps, [None] * rows, False, True, top_ks=top_ks, min_ps=min_ps,
                              repetition_penalties=penalties, seen=seen)
        got = sampler.sample(logits, batch)
        noise = torch.empty(rows, vocab).exponential_(generator=torch.Generator().manual_seed(trial))
        assert got.tolist() == sample_reference(logits, temps, top_ps, top_ks, min_ps, penalties, seen,
                                                noise).tolist()


class _Params:
    def __init__(self, **kw):
        self.top_k, self.min_p, self.repetition_penalty = kw.get("top_k", 0), kw.get("min_p", 0.0), kw.get(
            "repetition_penalty", 1.0)


class _Req:
    def __init__(self, tokens, **kw):
        self.sampling, self.all_token_ids = _Params(**kw), tokens


def test_filter_rows_builds_only_what_some_row_uses():
    rows = FilterRows()
    rows.add(0, _Req([1, 2]))
    rows.add(1, _Req([3], top_k=4, repetition_penalty=1.3))
    rows.add(2, _Req([5, 5, 7]))
    batch = SamplingBatch(torch.ones(3), torch.ones(3), [None] * 3, False, False)
    rows.to_batch(batch, 3, 8, torch.device("cpu"))
    assert batch.top_ks.tolist() == [0, 4, 0] and batch.min_ps is None
    assert batch.repetition_penalties.tolist() == pytest.approx([1.0, 1.3, 1.0])
    assert batch.seen.nonzero().tolist() == [[1, 3]]
    empty = SamplingBatch(torch.ones(1), torch.ones(1), [None], False, False)
    none = FilterRows()
    none.add(0, _Req([1]))
    none.to_batch(empty, 1, 8, torch.device("cpu"))
    assert empty.top_ks is None and empty.seen is None
