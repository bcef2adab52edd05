"""Next-token choice for a batch on the device: allowed ids, penalties, temperature, min-p, top-k, top-p.

Order per row: logits outside ``allowed_token_ids`` to -inf, repetition / presence / frequency
penalties (greedy rows too), argmax for temperature 0; else softmax of (logits - max) / temperature,
tokens below ``min_p * max prob`` dropped, then all but the ``top_k`` most likely, then the tail
past the smallest prefix whose mass reaches ``top_p``. The most likely token always survives and
penalized logits are clamped to the float32 range, so no row is all zero or NaN. Draws use the
exponential race ``argmax(p / E)``, ``E ~ Exp(1)``: a draw from ``p`` without ``torch.multinomial``
(it syncs with the host); a request with a ``seed`` has its own generator.

Cost: no host-device sync until ``to_host``; per step at most two small host-to-device copies,
O(rows) Python work and one sort of ``[S, V]`` when some row has top-k or top-p. What a request
keeps for its life is on the device from its first sampled token until ``release``: allowed ids
as a ``[V]`` float32 row of 0 and -inf, added to its logits; for penalties its prompt as a ``[V]`` bool row and its output as ``[V]``
float32 counts, which ``sample`` updates on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .request import Request

__all__ = ["Penalties", "SampledTokens", "SamplingBatch", "Sampler"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class Penalties:
    """The penalized rows of one step (rows not listed here are not penalized)."""

    rows: torch.Tensor  # [P] int64: their rows of the logits
    repetition: torch.Tensor  # [P] float32 (1 = none)
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    counts: torch.Tensor  # [P, V] float32: occurrences of each id in the output so far
    prompt_seen: torch.Tensor  # [P, V] bool: ids of the prompt (all False without repetition penalty)
    pool_rows: torch.Tensor  # [P] int64: their rows of the sampler's counts, which sample() updates


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
    allowed_bias: torch.Tensor | None = None  # [R, V] float32, 0 or -inf; None: no row restricts its ids
    allowed_rows: torch.Tensor | None = None  # [R] int64: the restricted rows of the logits


class _RowPool:
    """Device rows ``[V]`` lent to requests, one tensor per (dtype, value of a fresh row);
    grows by doubling."""

    def __init__(self, device: torch.device, vocab_size: int, kinds: tuple[tuple[torch.dtype, float], ...]) -> None:
        self.device, self.vocab_size, self.fresh = device, vocab_size, [value for _, value in kinds]
        self.tensors = [torch.zeros((0, vocab_size), dtype=d, device=device) for d, _ in kinds]  # [cap, V]
        self._free: list[int] = []

    def take(self) -> int:
        if not self._free:
            old = self.tensors[0].shape[0]
            new = max(4, 2 * old)
            grown = []
            for t in self.tensors:
                g = torch.zeros((new, self.vocab_size), dtype=t.dtype, device=self.device)
                g[:old] = t
                grown.append(g)
            self.tensors = grown
            self._free = list(range(new - 1, old - 1, -1))
        row = self._free.pop()
        for t, value in zip(self.tensors, self.fresh):
            t[row].fill_(value)
        return row

    def give(self, row: int) -> None:
        self._free.append(row)


@dataclass
class _Rows:
    """A request's rows in the pools, and the request they were built for (an id may be reused)."""

    request: Request
    allowed: int | None
    penalty: int | None


class Sampler:
    """Owns the per-request generators and device rows (``release`` drops them when the
    request ends) and the pinned buffer the sampled ids come back through."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}
        self._rows: dict[str, _Rows] = {}
        self._allowed_pool: _RowPool | None = None  # [cap, V] float32: 0 allowed, -inf not
        self._penalty_pool: _RowPool | None = None  # [cap, V] float32 counts, [cap, V] bool prompt ids
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
        self._give_rows(self._rows.pop(request_id, None))

    @property
    def num_generators(self) -> int:
        return len(self._per_request)

    @property
    def num_device_rows(self) -> int:
        """Requests holding device rows (allowed ids or penalties)."""
        return len(self._rows)

    def _give_rows(self, rows: _Rows | None) -> None:
        if rows is not None and rows.allowed is not None:
            self._allowed_pool.give(rows.allowed)
        if rows is not None and rows.penalty is not None:
            self._penalty_pool.give(rows.penalty)

    def _pools_for(self, vocab_size: int) -> None:
        """Pools of ``vocab_size`` columns (a new width drops every request's rows)."""
        if self._allowed_pool is None or self._allowed_pool.vocab_size != vocab_size:
            self._rows.clear()
            self._allowed_pool = _RowPool(self.device, vocab_size, ((torch.float32, float("-inf")),))
            self._penalty_pool = _RowPool(self.device, vocab_size, ((torch.float32, 0.0), (torch.bool, 0.0)))

    def _rows_for(self, req: Request, fills: list[tuple[_RowPool, int, int, list[int], float]]) -> _Rows:
        """The request's pool rows, taken at its first sampled token; ``fills`` gets what to
        write into new ones once the step's ids are on the device: (pool, which of its
        tensors, row, ids, value). A pool may grow meanwhile, so tensors are looked up late."""
        rows = self._rows.get(req.request_id)
        if rows is not None and rows.request is req:
            return rows
        self._give_rows(rows)
        s = req.sampling
        rows = _Rows(req, None, None)
        if s.allowed_token_ids is not None:
            rows.allowed = self._allowed_pool.take()
            fills.append((self._allowed_pool, 0, rows.allowed, list(s.allowed_token_ids), 0.0))
        if s.penalized:
            rows.penalty = self._penalty_pool.take()
            # outputs it already has (a new request has none); stand-ins of tokens in flight are not ids
            fills.append((self._penalty_pool, 0, rows.penalty, [t for t in req.output_token_ids if t >= 0], 1.0))
            if s.repetition_penalty != 1.0:
                fills.append((self._penalty_pool, 1, rows.penalty, req.prompt_token_ids, True))
        self._rows[req.request_id] = rows
        return rows

    # ---- host -> device -------------------------------------------------------------------
    def batch(self, requests: Sequence[Request], vocab_size: int) -> SamplingBatch:
        """The sampling rows of one step (one per request, in logits-row order): at most two
        host-to-device copies (floats, and ints when top-k, penalties or allowed ids are in use).
        A request's allowed ids and prompt cross once, at its first sampled token."""
        self._pools_for(vocab_size)
        temps, top_ps, gens = [], [], []
        top_k_rows = min_p_rows = False
        restricted: list[tuple[int, int]] = []  # (logits row, pool row)
        penalized: list[tuple[int, int]] = []
        fills: list[tuple[_RowPool, int, int, list[int], float]] = []
        for row, req in enumerate(requests):
            s = req.sampling
            temps.append(s.temperature)
            top_ps.append(s.top_p)
            gens.append(None if s.temperature == 0 else self.generator_for(req.request_id, s.seed))
            top_k_rows |= s.top_k is not None and s.temperature > 0
            min_p_rows |= s.min_p > 0.0 and s.temperature > 0
            if s.allowed_token_ids is not None or s.penalized:
                rows = self._rows_for(req, fills)
                if rows.allowed is not None:
                    restricted.append((row, rows.allowed))
                if rows.penalty is not None:
                    penalized.append((row, rows.penalty))
        floats = temps + top_ps
        if min_p_rows:
            floats += [r.sampling.min_p for r in requests]
        for row, _ in penalized:
            s = requests[row].sampling
            floats += (s.repetition_penalty, s.presence_penalty, s.frequency_penalty)
        ints: list[int] = []
        if top_k_rows:
            ints += [min(r.sampling.top_k or vocab_size, vocab_size) for r in requests]
        for pairs in (restricted, penalized):
            ints += [row for row, _ in pairs]
            ints += [pool_row for _, pool_row in pairs]
        for *_, ids, _ in fills:
            ints += ids
        f = self._to_device(floats, torch.float32)
        i = self._to_device(ints, torch.long) if ints else None
        n = len(requests)
        batch = SamplingBatch(temperatures=f[:n], top_ps=f[n:2 * n], generators=gens,
                              all_greedy=all(t == 0 for t in temps),
                              any_top_p=any(p < 1.0 for p in top_ps))
        off, ioff = 2 * n, 0
        if min_p_rows:
            batch.min_ps, off = f[off:off + n], off + n
        if top_k_rows:
            batch.top_ks, ioff = i[:n], n
        views = []
        for pairs in (restricted, penalized):
            k = len(pairs)
            views.append((i[ioff:ioff + k], i[ioff + k:ioff + 2 * k]) if k else None)
            ioff += 2 * k
        for pool, which, pool_row, ids, value in fills:  # new requests' rows, before they are read
            if ids:
                tensor = pool.tensors[which]
                accumulate = pool is self._penalty_pool and which == 0  # counts; else set
                tensor[pool_row].index_put_((i[ioff:ioff + len(ids)],),
                                            torch.tensor(value, dtype=tensor.dtype, device=self.device),
                                            accumulate=accumulate)
            ioff += len(ids)
        if views[0] is not None:
            batch.allowed_rows, pool_rows = views[0]
            batch.allowed_bias = self._allowed_pool.tensors[0][pool_rows]  # [R, V]
        if views[1] is not None:
            rows, pool_rows = views[1]
            values = f[off:].view(-1, 3)  # [P, 3]
            counts, prompt = self._penalty_pool.tensors
            batch.penalties = Penalties(rows, values[:, 0], values[:, 1], values[:, 2],
                                        counts[pool_rows], prompt[pool_rows], pool_rows)
        return batch

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype, pin_memory=self._pin)
        return host.to(self.device, non_blocking=True)

    # ---- sampling ---------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [S, V] (any float dtype) -> token ids [S] int64 (on the logits' device, no
        sync). Masks, penalties and probabilities are computed in float32; float32 logits are
        edited in place (rows with allowed ids or penalties: O(rows x V), not O(S x V)). The
        penalized rows' sampled ids are counted in their output counts: sample a batch once."""
        if batch.allowed_bias is not None or batch.penalties is not None or not batch.all_greedy:
            logits = logits.float()
        if batch.allowed_bias is not None:
            logits.index_add_(0, batch.allowed_rows, batch.allowed_bias)  # disallowed ids: -inf
        if batch.penalties is not None:
            p = batch.penalties
            logits[p.rows] = _penalized(logits[p.rows], p)
        tokens = self._choose(logits, batch)
        if batch.penalties is not None:
            p = batch.penalties
            counts = self._penalty_pool.tensors[0]
            counts.index_put_((p.pool_rows, tokens[p.rows]),
                              torch.ones((), dtype=torch.float32, device=counts.device), accumulate=True)
        return tokens

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)  # [S]
        if batch.all_greedy:
            return greedy
        temps = batch.temperatures.unsqueeze(1)  # [S, 1]
        # Greedy rows get temperature 1 here (any value works: their result is replaced below).
        # Shifted by the row's max first, (logits - max) / T <= 0 cannot overflow however small T is.
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(shifted / torch.where(temps > 0, temps, torch.ones_like(temps)), dim=-1)
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


def _penalized(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition divides positive logits and multiplies negative ones
    of every prompt or output token; frequency subtracts per output occurrence; presence
    subtracts once per distinct output token. logits [P, V] of the penalized rows -> new
    [P, V], clamped to the float32 range (a tiny repetition penalty overflows the division)."""
    seen = p.counts > 0  # [P, V]
    rep = p.repetition.unsqueeze(1)  # [P, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen | p.prompt_seen, penalized, logits)
    logits = logits - p.frequency.unsqueeze(1) * p.counts - p.presence.unsqueeze(1) * seen.float()
    return logits.clamp_(max=_FLOAT32_MAX)  # -inf stays: those are the disallowed ids


def _apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """``_penalized`` on the penalized rows of logits [S, V]; a new [S, V]."""
    out = logits.float().clone()
    out[p.rows] = _penalized(out[p.rows], p)
    return out


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
        drop = mass_before >= top_ps.unsqueeze(1) * total  # [S, V]; top_p 1e-300 is 0 in float32
        drop[:, 0] = False  # the most likely token survives whatever top_p is
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
