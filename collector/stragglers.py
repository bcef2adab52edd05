"""Which tensor-parallel rank the others waited for: per step, per window slot, per producer.

The ranks leave a collective at about the same moment, so the rank that arrived last waited
least in it. ``straggler(waits, windows)``: in a step whose ranks' collective waits spread by
at least ``min_spread_ratio`` of its slowest rank's window (compute + wait: the imbalance
must cost the step that much, not only the compute) and by ``min_spread_s``, the rank with
the least wait (the lowest on a tie); else None. ``slot_straggler``: the rank named by at least ``min_slot_share`` of a
window slot's steps. :class:`StragglerSeries` gathers each step's ranks from its
``engine.step.rank`` spans (a step is its own trace: grouped by trace id) per producing
instance, with per-slot counts over the window and counters for /metrics.

Guarantee: exact on what arrives (a step counts once all its ranks came); bounded: at most
``max_pending_steps`` partial steps (the oldest let go, counted), ``max_instances``
producers (later ones share the overflow one), ``max_ranks`` ranks a step, ``num_slots``
slots per producer. Cost: O(ranks) per step. Not thread-safe (the aggregator's lock).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..instrumentation import semconv as sc
from .aggregation_config import StragglerConfig, WindowConfig

__all__ = ["SlotVerdict", "StragglerSeries", "slot_straggler", "straggler"]


def straggler(waits: Sequence[float], windows: Sequence[float],
              config: StragglerConfig) -> int | None:
    """The rank the others waited for in one step (see the module docstring), or None.
    ``waits[r]``, ``windows[r]``: rank r's seconds in collectives, and in its whole window."""
    if len(waits) < 2 or not all(map(math.isfinite, (*waits, *windows))):
        return None
    least = min(waits)
    spread = max(waits) - least
    if spread < config.min_spread_s or spread < config.min_spread_ratio * max(windows):
        return None
    return list(waits).index(least)


@dataclass
class SlotVerdict:
    """One window slot of one producer: its steps, how often each rank was named, and the
    straggler it names (None: none) with the share of steps that named that rank."""

    epoch: int
    start_s: float
    steps: int
    named: dict[int, int]
    straggler: int | None
    share: float


def slot_straggler(steps: int, named: dict[int, int], config: StragglerConfig) -> tuple[int | None, float]:
    """(the rank at least ``min_slot_share`` of ``steps`` named, its share), or (None, the
    most named rank's share)."""
    if not steps or not named:
        return None, 0.0
    rank = min(named, key=lambda r: (-named[r], r))
    share = named[rank] / steps
    return (rank if share >= config.min_slot_share else None), share


@dataclass
class _Step:
    size: int
    parts: dict[int, tuple[float, float]] = field(default_factory=dict)   # rank -> (compute, wait)
    end_s: float = 0.0


@dataclass
class _Producer:
    steps: int = 0
    named: dict[int, int] = field(default_factory=dict)
    compute_s: dict[int, float] = field(default_factory=dict)
    wait_s: dict[int, float] = field(default_factory=dict)
    slots: dict[int, list] = field(default_factory=dict)   # epoch -> [steps, {rank: named}]


class StragglerSeries:
    """See the module docstring. ``dropped``: the owner's refusal counters (reasons
    ``partial_tp_step``, ``malformed_span``), added to here."""

    def __init__(self, config: StragglerConfig, window: WindowConfig, dropped: dict[str, int],
                 overflow: dict[str, int]) -> None:
        self.config, self.window = config, window
        self.dropped, self.overflow = dropped, overflow
        self.producers: dict[str, _Producer] = {}
        self._pending: OrderedDict[tuple[str, bytes], _Step] = OrderedDict()

    def add_rank(self, instance: str, trace_id: bytes, rank: int, size: int,
                 compute_s: float, wait_s: float, end_s: float) -> None:
        """One rank's part of the step whose trace is ``trace_id``."""
        if not (0 <= rank < size <= self.config.max_ranks) or not (
                math.isfinite(compute_s) and math.isfinite(wait_s)):
            self.dropped["malformed_span"] = self.dropped.get("malformed_span", 0) + 1
            return
        key = (instance, trace_id)
        step = self._pending.get(key)
        if step is None:
            step = self._pending[key] = _Step(size)
            while len(self._pending) > self.config.max_pending_steps:
                self._pending.popitem(last=False)
                self.dropped["partial_tp_step"] = self.dropped.get("partial_tp_step", 0) + 1
        step.parts[rank] = (compute_s, wait_s)
        step.end_s = max(step.end_s, end_s)
        if len(step.parts) >= step.size:
            del self._pending[key]
            self._add_step(instance, step)

    def _add_step(self, instance: str, step: _Step) -> None:
        producer = self.producers.get(instance)
        if producer is None:
            if len(self.producers) >= self.config.max_instances:
                instance = sc.OVERFLOW_LABEL_VALUE
                self.overflow["tp"] = self.overflow.get("tp", 0) + 1
            producer = self.producers.setdefault(instance, _Producer())
        ranks = range(step.size)
        waits = [step.parts[r][1] for r in ranks]
        named = straggler(waits, [step.parts[r][0] + step.parts[r][1] for r in ranks], self.config)
        producer.steps += 1
        for r in ranks:
            producer.compute_s[r] = producer.compute_s.get(r, 0.0) + step.parts[r][0]
            producer.wait_s[r] = producer.wait_s.get(r, 0.0) + step.parts[r][1]
        epoch = self.window.epoch(step.end_s)
        slot = producer.slots.get(epoch)
        if slot is None:
            slot = producer.slots[epoch] = [0, {}]
            oldest = epoch - self.window.num_slots
            for old in [e for e in producer.slots if e <= oldest]:
                del producer.slots[old]
        slot[0] += 1
        if named is not None:
            producer.named[named] = producer.named.get(named, 0) + 1
            slot[1][named] = slot[1].get(named, 0) + 1

    # -- reading ------------------------------------------------------------------------
    def slots(self, instance: str | None = None) -> dict[str, list[SlotVerdict]]:
        """Per producer (or the one named), its slots oldest first, each with its verdict."""
        out = {}
        for name, producer in self.producers.items():
            if instance is not None and name != instance:
                continue
            verdicts = []
            for epoch in sorted(producer.slots):
                steps, named = producer.slots[epoch]
                rank, share = slot_straggler(steps, named, self.config)
                verdicts.append(SlotVerdict(epoch, epoch * self.window.slot_s, steps, dict(named),
                                            rank, share))
            out[name] = verdicts
        return out

    def snapshot(self, now_s: float) -> dict:
        """For /metrics: per producer its counters, and the verdict of its newest complete
        slot with steps (before ``now_s``'s slot, within the window; None: no such slot)."""
        current = self.window.epoch(now_s)
        out = {}
        for name, producer in self.producers.items():
            verdict = None
            complete = [e for e in producer.slots if e < current]
            if complete:
                steps, named = producer.slots[max(complete)]
                verdict = slot_straggler(steps, named, self.config)
            out[name] = {"steps": producer.steps, "named": dict(producer.named),
                         "compute_s": dict(producer.compute_s), "wait_s": dict(producer.wait_s),
                         "last_slot": verdict}
        return out
