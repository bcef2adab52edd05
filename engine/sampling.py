"""Next-token choice for a batch on the device: allowed ids, penalties, temperature, min-p, top-k, top-p.

Order per row: logits outside ``allowed_token_ids`` to -inf, repetition / presence / frequency
penalties (greedy rows too), argmax for temperature 0; else softmax of logits / temperature, tokens below
``min_p * max prob`` dropped, then all but the ``top_k`` most likely, then the tail past the
smallest prefix whose mass reaches ``top_p`` (the most likely token always survives).
Sampling uses the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` per vocabulary entry,
which equals a draw from ``p`` and needs no ``torch.multinomial`` (that one syncs with the
host). A request with a ``seed`` draws from its own generator, so its tokens depend only on
its seed, logits and position; others share the engine's generator (``EngineConfig.seed``).

Cost: no host-device sync until ``to_host``, one copy of the sampled ids into pinned memory
per step. One sort of ``[S, V]`` when some row has top-k or top-p; penalties build a token
count ``[S, V]`` from the penalized rows' tokens, allowed ids a mask ``[S, V]`` (each a copy per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .request import Request

__all__ = ["Penalties", "SampledTokens", "SamplingBatch", "Sampler"]


@dataclass
class Penalties:
    """Device tensors of the penalized rows' token history (other rows: neutral values)."""

    repetition: torch.Tensor  # [S] float32 (1 = none)
    presence: torch.Tensor  # [S] float32
    frequency: torch.Tensor  # [S] float32
    output_rows: torch.Tensor  # [N] int64: row of each generated token occurrence
    output_ids: torch.Tensor  # [N] int64
    prompt_rows: torch.Tensor  # [P] int64: row of each prompt token (repetition penalty only)
    prompt_ids: torch.Tensor  # [P] int64


@dataclass
class SamplingBatch:
    """Per-row parameters of one step's sampled positions (rows of the logits)."""

    temperatures: torch.Tensor  # [S] float32 (0 = greedy)
    top_ps: torch.Tensor  # [S] float32 in (0, 1]
    generators: list[torch.Generator | None]  # [S]: the row's own generator or None (shared one)
    all_greedy: bool
    any_top_p: bool
    top_ks: torch.Tensor | None = None  # [S] int64 (vocab size = all); None: no row uses it
    min_ps: torch.Tensor | None = None  # [S] float32; None: no row uses it
    penalties: Penalties | None = None
    allowed: torch.Tensor | None = None  # [S, V] bool; None: no row restricts its tokens


class Sampler:
    """Owns the per-request generators (``release`` drops one when its request ends) and the
    pinned buffer the sampled ids come back through."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}
        self._pin = device.type == "cuda"
        # two pinned buffers, alternating: with overlapped scheduling the previous step's
        # copy may still be unread when the next step's copy is issued
        self._host = [torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)]
        self._next_host = 0

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

    # ---- host -> device -------------------------------------------------------------------
    def batch(self, requests: Sequence[Request], vocab_size: int) -> SamplingBatch:
        """The sampling rows of one step (one per request, in logits-row order): at most two
        host-to-device copies (floats, and ints when top-k, penalties or allowed ids are in use)."""
        temps, top_ps, gens = [], [], []
        top_k_rows = min_p_rows = penalized = restricted = False
        for req in requests:
            s = req.sampling
            temps.append(s.temperature)
            top_ps.append(s.top_p)
            gens.append(None if s.temperature == 0 else self.generator_for(req.request_id, s.seed))
            top_k_rows |= s.top_k is not None and s.temperature > 0
            min_p_rows |= s.min_p > 0.0 and s.temperature > 0
            penalized |= s.penalized
            restricted |= s.allowed_token_ids is not None
        floats = temps + top_ps
        if min_p_rows:
            floats += [r.sampling.min_p for r in requests]
        if penalized:
            floats += [r.sampling.repetition_penalty for r in requests]
            floats += [r.sampling.presence_penalty for r in requests]
            floats += [r.sampling.frequency_penalty for r in requests]
        ints: list[int] = []
        if top_k_rows:
            ints += [min(r.sampling.top_k or vocab_size, vocab_size) for r in requests]
        history = _history(requests) if penalized else None
        if history is not None:
            for part in history:
                ints += part
        allowed = _allowed(requests) if restricted else None
        if allowed is not None:
            for part in allowed:
                ints += part
        f = self._to_device(floats, torch.float32)
        # empty when the penalized rows have no history yet (presence/frequency before the first token)
        i = self._to_device(ints, torch.long) if ints else torch.empty(0, dtype=torch.long, device=self.device)
        n = len(requests)
        batch = SamplingBatch(temperatures=f[:n], top_ps=f[n:2 * n], generators=gens,
                              all_greedy=all(t == 0 for t in temps),
                              any_top_p=any(p < 1.0 for p in top_ps))
        off, ioff = 2 * n, 0
        if min_p_rows:
            batch.min_ps, off = f[off:off + n], off + n
        if top_k_rows:
            batch.top_ks, ioff = i[:n], n
        if history is not None:
            lens = [len(part) for part in history]
            views = []
            for length in lens:
                views.append(i[ioff:ioff + length])
                ioff += length
            batch.penalties = Penalties(f[off:off + n], f[off + n:off + 2 * n],
                                        f[off + 2 * n:off + 3 * n], *views)
        if allowed is not None:
            rows, pair_rows, pair_ids = (len(part) for part in allowed)
            restricted_rows = i[ioff:ioff + rows]
            pair_rows_d = i[ioff + rows:ioff + rows + pair_rows]
            pair_ids_d = i[ioff + rows + pair_rows:ioff + rows + pair_rows + pair_ids]
            mask = torch.ones((n, vocab_size), dtype=torch.bool, device=self.device)  # [S, V]
            mask[restricted_rows] = False
            mask[pair_rows_d, pair_ids_d] = True
            batch.allowed = mask
        return batch

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype, pin_memory=self._pin)
        return host.to(self.device, non_blocking=True)

    # ---- sampling ---------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [S, V] (any float dtype) -> token ids [S] int64 (on the logits' device, no
        sync). Masks, penalties and probabilities are computed in float32."""
        if batch.allowed is not None or batch.penalties is not None or not batch.all_greedy:
            logits = logits.float()
        if batch.allowed is not None:
            logits = logits.masked_fill(~batch.allowed, float("-inf"))
        if batch.penalties is not None:
            logits = _apply_penalties(logits, batch.penalties)
        greedy = logits.argmax(dim=-1)  # [S]
        if batch.all_greedy:
            return greedy
        temps = batch.temperatures.unsqueeze(1)  # [S, 1]
        # Greedy rows get temperature 1 here (any value works: their result is replaced below).
        probs = torch.softmax(logits / torch.where(temps > 0, temps, torch.ones_like(temps)), dim=-1)
        if batch.min_ps is not None:
            floor = batch.min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
            probs = probs.masked_fill(probs < floor, 0.0)
        if batch.any_top_p or batch.top_ks is not None:
            probs = _top_k_top_p(probs, batch.top_ks, batch.top_ps if batch.any_top_p else None)
        noise = torch.empty_like(probs)  # [S, V]
        shared_rows = [i for i, g in enumerate(batch.generators) if g is None]
        if shared_rows:
            noise.exponential_(generator=self._shared)
        for i, gen in enumerate(batch.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        # A zero draw would turn 0/0 into NaN, which argmax ranks first.
        sampled = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)  # [S]
        return torch.where(batch.temperatures > 0, sampled, greedy)

    def to_host(self, tokens: torch.Tensor) -> list[int]:
        """The sampled ids [S] on the host: ``start_copy(tokens).wait()``."""
        return self.start_copy(tokens).wait()

    def start_copy(self, tokens: torch.Tensor) -> SampledTokens:
        """The step's one device-to-host copy, issued without waiting: sampled ids [S] into
        pinned memory (two buffers, alternating, so that at most two steps are in flight)."""
        if not self._pin:
            return SampledTokens(tokens, None, None)
        n = tokens.shape[0]
        index, self._next_host = self._next_host, 1 - self._next_host
        if self._host[index].shape[0] < n:
            self._host[index] = torch.empty(max(n, 2 * self._host[index].shape[0]),
                                            dtype=torch.long, pin_memory=True)
        out = self._host[index][:n]
        out.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return SampledTokens(tokens, out, copied)


@dataclass
class SampledTokens:
    """A step's sampled ids: ``device`` [S] (the next step may gather its inputs from it) and,
    on CUDA, their pinned host copy in flight; ``wait()`` waits for that copy alone."""

    device: torch.Tensor
    host: torch.Tensor | None
    copied: object | None   # torch.cuda.Event recorded after the copy

    def wait(self) -> list[int]:
        if self.copied is None:
            return self.device.tolist()
        self.copied.synchronize()
        return self.host.tolist()


def _history(requests: Sequence[Request]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(output rows, output ids, prompt rows, prompt ids) of the penalized rows."""
    out_rows: list[int] = []
    out_ids: list[int] = []
    prompt_rows: list[int] = []
    prompt_ids: list[int] = []
    for row, req in enumerate(requests):
        s = req.sampling
        if s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 or s.repetition_penalty != 1.0:
            out_ids += req.output_token_ids
            out_rows += [row] * req.num_output_tokens
        if s.repetition_penalty != 1.0:
            prompt_ids += req.prompt_token_ids
            prompt_rows += [row] * req.num_prompt_tokens
    return out_rows, out_ids, prompt_rows, prompt_ids


def _allowed(requests: Sequence[Request]) -> tuple[list[int], list[int], list[int]]:
    """(restricted rows, row of each allowed id, allowed ids) of the rows with allowed_token_ids."""
    rows: list[int] = []
    pair_rows: list[int] = []
    ids: list[int] = []
    for row, req in enumerate(requests):
        allowed = req.sampling.allowed_token_ids
        if allowed is not None:
            rows.append(row)
            pair_rows += [row] * len(allowed)
            ids += allowed
    return rows, pair_rows, ids


def _apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition divides positive logits and multiplies negative ones
    of every prompt or output token; frequency subtracts per output occurrence; presence
    subtracts once per distinct output token. logits [S, V] -> new [S, V]."""
    counts = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [S, V]
    counts.index_put_((p.output_rows, p.output_ids),
                      torch.ones_like(p.output_ids, dtype=torch.float32), accumulate=True)
    seen = counts > 0
    seen_any = seen.clone()
    seen_any[p.prompt_rows, p.prompt_ids] = True
    rep = p.repetition.unsqueeze(1)  # [S, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen_any, penalized, logits)
    return logits - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * seen.float()


def _top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor | None,
                 top_ps: torch.Tensor | None) -> torch.Tensor:
    """Zeroes all but each row's ``top_k`` most likely tokens, then the tail beyond the
    smallest prefix (by descending probability) of what is left whose mass reaches
    ``top_p``; the most likely token always survives. probs [S, V]; top_ks/top_ps [S]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [S, V]
    if top_ks is not None:
        ranks = torch.arange(probs.shape[1], device=probs.device)
        sorted_probs = sorted_probs.masked_fill(ranks[None, :] >= top_ks[:, None], 0.0)
    if top_ps is not None:
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
        total = sorted_probs.sum(dim=-1, keepdim=True)  # 1, or less after top-k
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_ps.unsqueeze(1) * total, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
