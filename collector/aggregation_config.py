"""The aggregator's configuration: windows, cardinality limits, trace store bounds.

Frozen dataclasses, each bound range-checked on construction (errors name the bad value
and the allowed range). Standard library only, so that ``sightline collector run`` can
build its flags and defaults from these without importing numpy or protobuf; the modules
that use them (:mod:`.windows`, :mod:`.trace_store`, :mod:`.aggregator`) re-export them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["AggregationConfig", "StragglerConfig", "TraceStoreConfig", "WindowConfig"]


@dataclass(frozen=True)
class WindowConfig:
    """Shape of every sliding window: ``num_slots`` slots of ``slot_s`` seconds."""

    slot_s: float = 10.0
    num_slots: int = 18
    max_buckets: int = 1024
    initial_scale: int = 6
    flush_every: int = 256

    def __post_init__(self) -> None:
        if not 0.01 <= self.slot_s <= 3600.0:
            raise ValueError(f"slot_s={self.slot_s} is outside [0.01, 3600]")
        if not 1 <= self.num_slots <= 1440:
            raise ValueError(f"num_slots={self.num_slots} is outside [1, 1440]")
        if not 32 <= self.max_buckets <= 8192:
            raise ValueError(f"max_buckets={self.max_buckets} is outside [32, 8192]")
        if not 0 <= self.initial_scale <= 20:
            raise ValueError(f"initial_scale={self.initial_scale} is outside [0, 20]")
        if not 1 <= self.flush_every <= 65536:
            raise ValueError(f"flush_every={self.flush_every} is outside [1, 65536]")

    def new_histogram(self):
        """An empty ``ExpHistogram`` at the initial scale (numpy imported here, not at
        module level: the CLI reads these configs without the heavy imports)."""
        from ..instrumentation import ExpHistogram

        return ExpHistogram(scale=self.initial_scale, max_buckets=self.max_buckets)

    @property
    def horizon_s(self) -> float:
        return self.slot_s * self.num_slots

    def epoch(self, t_s: float) -> int:
        """The slot number (since the Unix epoch) holding time ``t_s``."""
        return int(math.floor(t_s / self.slot_s))



@dataclass(frozen=True)
class TraceStoreConfig:
    """Bounds of the recent-trace store (see :mod:`.trace_store` for what each costs)."""

    max_traces: int = 20_000
    max_spans_per_trace: int = 4_096
    max_spans: int = 200_000
    max_bytes: int = 48 * 1024 * 1024  # encoded size of the export requests held
    # True: queue each request as it arrived (its encoding), index on the first query
    # (ingest O(1) per request). False: index each request as it arrives (several µs per
    # span on the ingest path: more than all of the aggregation).
    defer_index: bool = True
    index_chunk_spans: int = 20_000  # spans indexed per lock hold while catching up

    def __post_init__(self) -> None:
        if not 1 <= self.max_traces <= 10_000_000:
            raise ValueError(f"max_traces={self.max_traces} is outside [1, 10000000]")
        if not 1 <= self.max_spans_per_trace <= 1_000_000:
            raise ValueError(f"max_spans_per_trace={self.max_spans_per_trace} is outside [1, 1000000]")
        if not 1 <= self.max_spans <= 100_000_000:
            raise ValueError(f"max_spans={self.max_spans} is outside [1, 100000000]")
        if not 1024 <= self.max_bytes <= 1 << 40:
            raise ValueError(f"max_bytes={self.max_bytes} is outside [1024, 2**40]")
        if not 1 <= self.index_chunk_spans <= 10_000_000:
            raise ValueError(f"index_chunk_spans={self.index_chunk_spans} is outside [1, 10000000]")



@dataclass(frozen=True)
class StragglerConfig:
    """When a tensor-parallel rank is named the straggler (see :mod:`.stragglers`).

    A step names one when its ranks' collective waits spread by at least
    ``min_spread_ratio`` of its slowest rank's window and by ``min_spread_s``; a window
    slot names the rank that at least ``min_slot_share`` of its steps named."""

    min_spread_ratio: float = 0.2
    min_spread_s: float = 100e-6
    min_slot_share: float = 0.5
    max_instances: int = 1_024      # producers with tensor-parallel steps (more: overflow)
    max_ranks: int = 64
    max_pending_steps: int = 4_096  # steps whose rank spans have not all come yet

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_spread_ratio <= 10.0:
            raise ValueError(f"min_spread_ratio={self.min_spread_ratio} is outside [0, 10]")
        if not 0.0 <= self.min_spread_s <= 60.0:
            raise ValueError(f"min_spread_s={self.min_spread_s} is outside [0, 60]")
        if not 0.0 < self.min_slot_share <= 1.0:
            raise ValueError(f"min_slot_share={self.min_slot_share} is outside (0, 1]")
        for name, high in (("max_instances", 1_000_000), ("max_ranks", 4096),
                           ("max_pending_steps", 10_000_000)):
            value = getattr(self, name)
            if not 1 <= value <= high:
                raise ValueError(f"{name}={value} is outside [1, {high}]")


@dataclass(frozen=True)
class AggregationConfig:
    """Limits and windows of the aggregator; every bound is checked on construction."""

    window: WindowConfig = field(default_factory=WindowConfig)
    gauge_window_s: float = 60.0
    # Per-SM series (instance, gpu, sm, kernel), shared equally among the GPUs present
    # (64 GPUs x 132 SMs x 20 kernels, or 8 GPUs x 132 SMs x 170 kernels); see sm_store.
    max_sm_series: int = 180_000
    max_gpus: int = 256
    max_kernel_series: int = 1_024
    max_request_series: int = 512
    max_step_series: int = 16
    store_traces: bool = True
    # Per-SM classic histograms: 19 exposition lines per (instance, gpu, SM, kernel) instead
    # of one P99 gauge. Off (the default) leaves the gauges and the per-GPU summaries.
    expose_sm_histograms: bool = False
    trace_store: TraceStoreConfig = field(default_factory=TraceStoreConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)

    def __post_init__(self) -> None:
        if not 0 < self.gauge_window_s <= self.window.horizon_s:
            raise ValueError(f"gauge_window_s={self.gauge_window_s} is outside "
                             f"(0, {self.window.horizon_s}] (the window horizon)")
        for name in ("max_sm_series", "max_gpus", "max_kernel_series", "max_request_series", "max_step_series"):
            value = getattr(self, name)
            if not 1 <= value <= 1_000_000:
                raise ValueError(f"{name}={value} is outside [1, 1000000]")
