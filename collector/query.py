"""What the heatmaps and ``explain`` read: two small typed interfaces, not the aggregator.

:class:`SmQuery` is the per-SM data (implemented by :class:`~.sm_store.SmStore`);
:class:`TraceQuery` the recent-trace store (:class:`~.trace_store.TraceStore`);
:class:`Sources` is anything holding both and an engine timeline (the
:class:`~.aggregator.Aggregator`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from ..instrumentation import ExpHistogram
    from .aggregation_config import WindowConfig
    from .contention import SlotContention
    from .engine_timeline import EngineTimeline
    from .sm_store import GpuKey, Refusal, SmKey
    from .trace_store import TraceStore
    from .windows import Exemplar

__all__ = ["SmQuery", "Sources", "TraceQuery"]

T = TypeVar("T")


class SmQuery(Protocol):
    window: WindowConfig

    def now(self) -> float: ...

    def gpus(self) -> list[dict]: ...

    def resolve(self, gpu: str, kernel: str, instance: str | None = None) -> SmKey: ...

    def refusal(self, key: GpuKey) -> Refusal | None: ...

    def refusals(self) -> dict[GpuKey, Refusal]: ...

    def refusals_of(self, gpu: str, instance: str | None = None, limit: int = 8) -> list[tuple[GpuKey, Refusal]]: ...

    def histograms(self, key: SmKey, now_s: float, last_s: float) -> dict[str, ExpHistogram]: ...

    def histograms_between(self, start_s: float, end_s: float) -> dict[SmKey, dict[str, ExpHistogram]]: ...

    def slot_cells(self, key: SmKey, now_s: float, last_s: float) -> tuple: ...

    def exemplar_for_spans(self, span_ids: set[bytes]) -> tuple[SmKey, str, Exemplar] | None: ...

    def num_sms(self, key: GpuKey) -> int: ...

    def contention(self, key: SmKey, now_s: float, last_s: float) -> list[tuple[int, SlotContention]]: ...


class TraceQuery(Protocol):
    def read(self, fn: Callable[[TraceStore], T]) -> T: ...


class Sources(Protocol):
    store: TraceQuery
    sm: SmQuery
    timeline: EngineTimeline  # read and refreshed only inside ``store.read``
