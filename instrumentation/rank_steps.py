"""Tensor-parallel steps joined with their ranks' parts: per-rank arrays and rank spans.

A step whose ranks report their part (its ``Step`` event carries ``sightline.tp.size``) is
held open until every rank's ``RankStep`` has come (from other processes: before or after
the step's own event) or ``max_wait_s`` passed. Then its ``engine.step`` span gets, per rank
(index = rank), the seconds its forward pass spent computing and waiting in collectives
(NaN for a rank that never reported), and each rank that reported gets an
``engine.step.rank`` child span over its forward pass, with its GPU's identity when known.
Guarantee: bounded: at most ``max_pending`` steps held and ``max_early`` reports waiting
for their step (the oldest are let go first, counted in ``stats``). Cost: O(ranks) per step,
where spans are assembled (the telemetry process).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from . import semconv as sc
from .lifecycle import RankStep

__all__ = ["RankJoin", "RankJoinStats"]


@dataclass
class RankJoinStats:
    steps_joined: int = 0        # every rank reported
    steps_partial: int = 0       # let go with ranks missing (waited too long, or evicted)
    early_evicted: int = 0       # reports whose step never came


@dataclass
class _Held:
    step: object                 # StepTrace
    size: int
    end_ns: int
    end_attributes: dict | None
    since: float
    ready: object = None         # () -> bool: may the span go out when it ends (links to come)
    ranks: dict[int, RankStep] = field(default_factory=dict)


class RankJoin:
    """See the module docstring. ``gpus``: rank -> (gpu id, gpu uuid) as reported."""

    def __init__(self, telemetry, max_wait_s: float = 11.0, max_pending: int = 4096,
                 max_early: int = 16384) -> None:
        self.telemetry = telemetry
        self.max_wait_s, self.max_pending, self.max_early = max_wait_s, max_pending, max_early
        self.stats = RankJoinStats()
        self.gpus: dict[int, tuple[int, str | None]] = {}
        self._held: OrderedDict[int, _Held] = OrderedDict()
        self._early: OrderedDict[tuple[int, int], RankStep] = OrderedDict()

    def hold(self, step_id: int, step, size: int, end_ns: int,
             end_attributes: dict | None = None, ready=None) -> None:
        """Keeps the step open until its ``size`` ranks reported (or the wait ran out);
        ``ready()`` False when it ends: the span waits for links still to come."""
        held = _Held(step, size, end_ns, end_attributes, time.monotonic(), ready)
        for rank in range(size):
            early = self._early.pop((step_id, rank), None)
            if early is not None:
                held.ranks[rank] = early
        if len(held.ranks) >= size:
            self._close(held)
            return
        self._held[step_id] = held
        while len(self._held) > self.max_pending:
            self._close(self._held.popitem(last=False)[1])

    def add(self, report: RankStep) -> None:
        held = self._held.get(report.step_id)
        if held is None:
            self._early[(report.step_id, report.rank)] = report
            while len(self._early) > self.max_early:
                self._early.popitem(last=False)
                self.stats.early_evicted += 1
            return
        held.ranks[report.rank] = report
        if len(held.ranks) >= held.size:
            del self._held[report.step_id]
            self._close(held)

    def poll(self, force: bool = False) -> None:
        """Lets go of the steps that waited ``max_wait_s`` (all of them with ``force``)."""
        now = time.monotonic()
        while self._held:
            step_id, held = next(iter(self._held.items()))
            if not force and now - held.since < self.max_wait_s:
                break
            del self._held[step_id]
            self._close(held)

    def _close(self, held: _Held) -> None:
        step, ranks = held.step, held.ranks
        if len(ranks) >= held.size:
            self.stats.steps_joined += 1
        else:
            self.stats.steps_partial += 1
        compute = [math.nan] * held.size
        wait = [math.nan] * held.size
        spans = self.telemetry.finished_spans
        parent = step.span_context
        for rank, r in sorted(ranks.items()):
            if rank >= held.size:
                continue
            compute[rank], wait[rank] = r.compute_ns / 1e9, r.collective_ns / 1e9
            attributes = {sc.TP_RANK: rank, sc.TP_SIZE: held.size, sc.STEP_ID: r.step_id,
                          sc.RANK_COMPUTE_S: compute[rank], sc.RANK_COLLECTIVE_WAIT_S: wait[rank],
                          sc.RANK_COLLECTIVE_CALLS: r.collective_calls,
                          sc.COLLECTIVE_BYTES: r.collective_bytes}
            gpu = self.gpus.get(rank)
            if gpu is not None:
                attributes[sc.ATTR_GPU_ID] = gpu[0]
                if gpu[1]:
                    attributes[sc.ATTR_GPU_UUID] = gpu[1]
            spans.emit(sc.SPAN_RANK_STEP, spans.child_context(parent), parent, r.start_ns,
                       r.end_ns, attributes)
        attributes = dict(held.end_attributes or {})
        attributes[sc.STEP_RANK_COMPUTE_S] = tuple(compute)   # attribute values: immutable
        attributes[sc.STEP_RANK_COLLECTIVE_WAIT_S] = tuple(wait)
        step.end(attributes, end_time_ns=held.end_ns, emit=held.ready is None or held.ready())
