"""Next-token choice for a batch: greedy at temperature 0, else temperature + top-p sampling.

Sampling uses the exponential-race form of the categorical draw, ``argmax(p / E)`` with
``E ~ Exp(1)`` per vocabulary entry, which equals a draw from ``p`` and needs no
``torch.multinomial`` (that one synchronizes with the host). The noise of a request with a
``seed`` comes from its own generator, so its tokens depend on nothing but its seed, its
logits and its position, whatever else shares the batch. Requests without a seed share
the engine's generator (seeded from ``EngineConfig.seed``).

Cost: one sort of ``[S, V]`` when some row has ``top_p < 1``; no host-device sync here (the
runner reads the result with one ``.tolist()`` per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingBatch", "Sampler"]


@dataclass
class SamplingBatch:
    """Per-row parameters of one step's sampled positions (rows of the logits)."""

    temperatures: torch.Tensor  # [S] float32 (0 = greedy)
    top_ps: torch.Tensor  # [S] float32 in (0, 1]
    generators: list[torch.Generator | None]  # [S]: the row's own generator or None (shared one)
    all_greedy: bool
    any_top_p: bool


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
        greedy = logits.argmax(dim=-1)  # [S]
        if batch.all_greedy:
            return greedy
        temps = batch.temperatures.unsqueeze(1)  # [S, 1]
        # Greedy rows get temperature 1 here (any value works: their result is replaced below).
        probs = torch.softmax(logits / torch.where(temps > 0, temps, torch.ones_like(temps)), dim=-1)
        if batch.any_top_p:
            probs = _top_p(probs, batch.top_ps)
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


def _top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zeroes the tail beyond the smallest prefix (by descending probability) whose mass
    reaches top_p; the most likely token always survives. probs [S, V]; top_ps [S]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [S, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
    drop = mass_before >= top_ps.unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
