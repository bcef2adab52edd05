"""Next-token choice for a batch: greedy at temperature 0, else temperature + top-k, min-p and
top-p sampling; repetition penalty before either (the filters: ``sampling_filters``).

Sampling uses the exponential-race form of the categorical draw, ``argmax(p / E)`` with
``E ~ Exp(1)`` per vocabulary entry, which equals a draw from ``p`` and needs no
``torch.multinomial`` (that one synchronizes with the host). The noise of a request with a
``seed`` comes from its own generator, so its tokens depend on nothing but its seed, its
logits and its position, whatever else shares the batch. Requests without a seed share
the engine's generator (seeded from ``EngineConfig.seed``).

Cost: one sort of ``[S, V]`` when some row has ``top_p < 1`` (one more for ``top_k``); no
host-device sync here (the runner reads the result with one ``.tolist()`` per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_filters import apply_repetition_penalty, min_p_filter, top_k_filter, top_p_filter

__all__ = ["SamplingBatch", "Sampler"]


@dataclass
class SamplingBatch:
    """Per-row parameters of one step's sampled positions (rows of the logits)."""

    temperatures: torch.Tensor  # [S] float32 (0 = greedy)
    top_ps: torch.Tensor  # [S] float32 in (0, 1]
    generators: list[torch.Generator | None]  # [S]: the row's own generator or None (shared one)
    all_greedy: bool
    any_top_p: bool
    top_ks: torch.Tensor | None = None  # [S] int64 (0 = off); None when no row uses top_k
    min_ps: torch.Tensor | None = None  # [S] float32 (0 = off); None when no row uses min_p
    repetition_penalties: torch.Tensor | None = None  # [S] float32 (1 = off), with ``seen``
    seen: torch.Tensor | None = None  # [S, V] bool: tokens in each row's prompt or output


class Sampler:
    """Owns the per-request generators; ``release`` drops one when its request ends."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        """The request's own generator (created at its first sampled token), or None."""
        if seed is None:
            return None
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._per_request[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    @property
    def num_generators(self) -> int:
        return len(self._per_request)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [S, V] float32 -> token ids [S] int64 (on the logits' device)."""
        if batch.repetition_penalties is not None:
            logits = apply_repetition_penalty(logits, batch.repetition_penalties, batch.seen)
        greedy = logits.argmax(dim=-1)  # [S]
        if batch.all_greedy:
            return greedy
        temps = batch.temperatures.unsqueeze(1)  # [S, 1]
        # Greedy rows get temperature 1 here (any value works: their result is replaced below).
        probs = torch.softmax(logits / torch.where(temps > 0, temps, torch.ones_like(temps)), dim=-1)
        if batch.top_ks is not None:
            probs = top_k_filter(probs, batch.top_ks)
        if batch.min_ps is not None:
            probs = min_p_filter(probs, batch.min_ps)
        if batch.any_top_p:
            probs = top_p_filter(probs, batch.top_ps)
        noise = torch.empty_like(probs)  # [S, V]
        shared_rows = [i for i, g in enumerate(batch.generators) if g is None]
        if len(shared_rows) == len(batch.generators):
            noise.exponential_(generator=self._shared)
        else:
            if shared_rows:
                noise.exponential_(generator=self._shared)
            for i, gen in enumerate(batch.generators):
                if gen is not None:
                    noise[i].exponential_(generator=gen)
        # A zero draw would turn 0/0 into NaN, which argmax ranks first.
        sampled = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)  # [S]
        return torch.where(batch.temperatures > 0, sampled, greedy)

