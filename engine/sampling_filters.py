"""top_k, min_p and repetition_penalty as batched tensor operations, plus the whole
sampling pipeline as one pure function (the reference the ``Sampler`` is tested against).

Semantics follow vLLM's: ``repetition_penalty`` divides the positive logits (multiplies
the negative ones) of every token already in the prompt or the output, before anything
else, greedy rows included; ``top_k`` keeps the tokens whose probability is at least the
k-th largest (ties at the boundary survive; 0 = off); ``min_p`` keeps the tokens whose
probability is at least ``min_p`` times the row's largest (0 = off); then ``top_p``.
Order: penalty -> temperature -> top_k -> min_p -> top_p -> draw.

Cost: one ``[S, V]`` sort when some row has top_k (shared with top_p when both are on),
a few elementwise passes otherwise; no host-device sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .request import Request
    from .sampling import SamplingBatch

__all__ = ["FilterRows", "apply_repetition_penalty", "top_k_filter", "min_p_filter", "top_p_filter",
           "sample_reference"]


def apply_repetition_penalty(logits: torch.Tensor, penalties: torch.Tensor,
                             seen: torch.Tensor) -> torch.Tensor:
    """logits [S, V]; penalties [S] (1 = off); seen [S, V] bool -> penalized logits [S, V]."""
    p = penalties.to(logits.dtype).unsqueeze(1)  # [S, 1]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def top_k_filter(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Zeroes every entry below the row's k-th largest. probs [S, V]; top_ks [S] int (0 = off)."""
    vocab = probs.shape[-1]
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), torch.full_like(top_ks, vocab))  # [S]
    sorted_probs = probs.sort(dim=-1, descending=True).values  # [S, V]
    kth = sorted_probs.gather(1, (k - 1).long().unsqueeze(1))  # [S, 1]
    return probs.masked_fill(probs < kth, 0.0)


def min_p_filter(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zeroes entries below ``min_p * max(row)``. probs [S, V]; min_ps [S] (0 = off)."""
    floor = min_ps.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
    return probs.masked_fill(probs < floor, 0.0)


def top_p_filter(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zeroes the tail beyond the smallest prefix (by descending probability) whose mass
    reaches top_p; the most likely token always survives. probs [S, V] (need not sum to
    1: the mass is taken relative to the row's sum); top_ps [S]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [S, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
    drop = mass_before >= top_ps.unsqueeze(1) * sorted_probs.sum(dim=-1, keepdim=True)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_reference(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
                     top_ks: torch.Tensor, min_ps: torch.Tensor, repetition_penalties: torch.Tensor,
                     seen: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The whole pipeline for one batch, every feature on for every row.

    logits [S, V] float32; temperatures, top_ps, min_ps, repetition_penalties [S] float32;
    top_ks [S] int64; seen [S, V] bool; noise [S, V] draws of Exp(1) -> token ids [S] int64.
    Rows at temperature 0 take the argmax of the penalized logits.
    """
    logits = apply_repetition_penalty(logits, repetition_penalties, seen)
    greedy = logits.argmax(dim=-1)  # [S]
    temps = temperatures.unsqueeze(1)  # [S, 1]
    probs = torch.softmax(logits / torch.where(temps > 0, temps, torch.ones_like(temps)), dim=-1)
    probs = top_p_filter(min_p_filter(top_k_filter(probs, top_ks), min_ps), top_ps)
    sampled = (probs / noise.clamp(min=1e-20)).argmax(dim=-1)  # exponential race: a draw from probs
    return torch.where(temperatures > 0, sampled, greedy)


class FilterRows:
    """Collects one step's per-row top_k / min_p / repetition_penalty while the runner builds
    the batch, then puts them on the ``SamplingBatch`` as device tensors. Only rows that use
    a filter are recorded, and nothing is built when none does: the common case costs three
    attribute tests per row."""

    __slots__ = ("top_ks", "min_ps", "penalties", "seen_rows", "seen_tokens")

    def __init__(self) -> None:
        self.top_ks: dict[int, int] = {}  # row -> k, rows with top_k only
        self.min_ps: dict[int, float] = {}
        self.penalties: dict[int, float] = {}
        self.seen_rows: list[int] = []  # (row, token) pairs of the penalized rows
        self.seen_tokens: list[int] = []

    def add(self, row: int, request: "Request") -> None:
        params = request.sampling
        if params.top_k:
            self.top_ks[row] = params.top_k
        if params.min_p:
            self.min_ps[row] = params.min_p
        if params.repetition_penalty != 1.0:
            self.penalties[row] = params.repetition_penalty
            tokens = request.all_token_ids
            self.seen_rows += [row] * len(tokens)
            self.seen_tokens += tokens

    def to_batch(self, batch: "SamplingBatch", rows: int, vocab_size: int, device: torch.device) -> None:
        def dense(values: dict, fill, dtype: torch.dtype) -> torch.Tensor:
            host = torch.full((rows,), fill, dtype=dtype)  # [S]
            host[list(values)] = torch.tensor(list(values.values()), dtype=dtype)
            return host.to(device, non_blocking=True)

        if self.top_ks:
            batch.top_ks = dense(self.top_ks, 0, torch.long)
        if self.min_ps:
            batch.min_ps = dense(self.min_ps, 0.0, torch.float32)
        if self.penalties:
            batch.repetition_penalties = dense(self.penalties, 1.0, torch.float32)
            index = torch.tensor([self.seen_rows, self.seen_tokens], dtype=torch.long).to(device)  # [2, N]
            seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)  # [S, V]
            seen[index[0], index[1]] = True
            batch.seen = seen
