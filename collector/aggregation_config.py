"""The aggregator's configuration: windows, cardinality limits, trace store bounds.

Frozen dataclasses whose fields are declared once with ``setting`` (default, allowed range,
help): the range checks and ``sightline collector run``'s flags both come from there, and an
error names the bad value and the allowed range. Standard library only, so that the CLI can
build its flags without importing numpy or protobuf; the modules that use these configs
(:mod:`.windows`, :mod:`.trace_store`, :mod:`.aggregator`) re-export them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..instrumentation import check_range, check_settings, setting

__all__ = ["AggregationConfig", "ContentionConfig", "StragglerConfig", "TraceStoreConfig", "WindowConfig"]

# what collector/contention.py compares a CTA's duration with: the other SMs' P90
REFERENCE_QUANTILE = 0.9


@dataclass(frozen=True)
class WindowConfig:
    """Shape of every sliding window: ``num_slots`` slots of ``slot_s`` seconds."""

    slot_s: float = setting(10.0, "length of one window slot: the time resolution of heatmaps and "
                                  "quantiles", lo=0.01, hi=3600.0, metavar="SECONDS")
    num_slots: int = setting(18, "slots kept per series; slots x slot length is the horizon, older data "
                                 "is refused", lo=1, hi=1440, flag="--window-slots", metavar="N")
    max_buckets: int = setting(1024, "buckets per exponential histogram before its scale is lowered",
                               lo=32, hi=8192, metavar="N")
    initial_scale: int = setting(6, "scale (resolution) a new exponential histogram starts at",
                                 lo=0, hi=20, metavar="SCALE")
    flush_every: int = setting(256, "values buffered per series before they are folded into its "
                                    "histogram", lo=1, hi=65536, metavar="N")

    def __post_init__(self) -> None:
        check_settings(self)

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

    def slot_start(self, t_s: float) -> float:
        """When the slot holding ``t_s`` began (Unix seconds): at ``now``, the open slot's start."""
        return self.epoch(t_s) * self.slot_s


@dataclass(frozen=True)
class ContentionConfig:
    """Thresholds of the per-SM contention tests (collector/contention.py says how they are
    used); errors name the bad value."""

    alpha: float = setting(1e-3, "chance that one (kernel, slot) flags any SM with nothing wrong",
                           lo=0.0, hi=0.5, lo_open=True)
    # a slow SM: at least this share of its CTAs above the others' P90 (by chance: 1 - 0.9)
    slow_share: float = setting(0.3, "an SM is slow when at least this share of its CTAs ran longer than the "
                                     "other SMs' P90", lo=round(1 - REFERENCE_QUANTILE, 6), hi=1.0, lo_open=True)
    starve_ratio: float = setting(0.7, "an SM is starved below this share of its expected CTAs",
                                  lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    # effect floors: a neighbour on an SM halves or worse what it gets; P90s within a tenth or
    # two of each other, or an SM whose share swings with the launch mix, are not that
    slow_factor: float = setting(1.3, "an SM is slow only when its CTA P90 is at least this many times the "
                                      "other SMs'", lo=1.0, hi=100.0)
    usual_starve_ratio: float = setting(0.5, "an SM that usually gets fewer CTAs is starved below this share "
                                             "of its own lowest", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    # a GPU's block scheduler may give some SMs a fraction of the even split launch after
    # launch: until each SM's usual share is known, such an SM looks like a neighbour's victim
    starve_before_usual: bool = setting(False, "test SMs for starvation against the even split before the "
                                               "ring holds 4 quiet slots that give each SM's usual share")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class TraceStoreConfig:
    """Bounds of the recent-trace store (see :mod:`.trace_store` for what each costs)."""

    # deferred: queue each request as it arrived (its encoding), index on the first query
    # (ingest O(1) per request); eager: index each request as it arrives (several µs per
    # span on the ingest path: more than all of the aggregation); off: no store.
    mode: Literal["deferred", "eager", "off"] = setting(
        "deferred", "recent-trace store behind explain and /api/v1/traces: indexed on the first query "
                    "(deferred, cheapest ingest), as spans arrive (eager), or none", flag="--trace-store")
    max_traces: int = setting(20_000, "traces kept, oldest evicted first", lo=1, hi=10_000_000, metavar="N")
    max_spans_per_trace: int = setting(4_096, "spans kept per trace", lo=1, hi=1_000_000, metavar="N")
    max_spans: int = setting(200_000, "spans kept in all", lo=1, hi=100_000_000, metavar="N")
    max_bytes: int = setting(48 * 1024 * 1024, "encoded bytes of the export requests kept in all",
                             lo=1024, hi=1 << 40, metavar="BYTES")
    index_chunk_spans: int = setting(20_000, "spans indexed per lock hold while catching up",
                                     lo=1, hi=10_000_000, metavar="N")

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def defer_index(self) -> bool:
        return self.mode == "deferred"


@dataclass(frozen=True)
class StragglerConfig:
    """When a tensor-parallel rank is named the straggler (see :mod:`.stragglers`).

    A step names one when its ranks' collective waits spread by at least
    ``min_spread_ratio`` of its slowest rank's window and by ``min_spread_s``; a window
    slot names the rank that at least ``min_slot_share`` of its steps named."""

    min_spread_ratio: float = setting(0.2, "a tensor-parallel step names a straggler rank when its ranks' "
                                           "collective waits spread by at least this share of the slowest "
                                           "rank's window", lo=0.0, hi=10.0)
    min_spread_s: float = setting(100e-6, "... and by at least this many seconds", lo=0.0, hi=60.0,
                                  metavar="SECONDS")
    min_slot_share: float = setting(0.5, "a window slot names the rank that at least this share of its "
                                         "tensor-parallel steps named", lo=0.0, hi=1.0, lo_open=True)
    max_instances: int = setting(1_024, "producers with tensor-parallel steps (more: overflow)",
                                 lo=1, hi=1_000_000, metavar="N")
    max_ranks: int = setting(64, "tensor-parallel ranks per producer", lo=1, hi=4096, metavar="N")
    max_pending_steps: int = setting(4_096, "tensor-parallel steps whose rank spans have not all come yet",
                                     lo=1, hi=10_000_000, metavar="N")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class AggregationConfig:
    """Limits and windows of the aggregator; every bound is checked on construction."""

    window: WindowConfig = setting(factory=WindowConfig)
    gauge_window_s: float = setting(60.0, "window of the per-SM P99 gauges and hotspot ratios, and of the "
                                          "contention gauges (slots that closed within it), at most the "
                                          "horizon", lo=0.0, lo_open=True, metavar="SECONDS")
    # Per-SM series (instance, gpu, sm, kernel), shared equally among the GPUs present
    # (64 GPUs x 132 SMs x 20 kernels, or 8 GPUs x 132 SMs x 170 kernels); see sm_store.
    max_sm_series: int = setting(180_000, "(instance, gpu, SM, kernel) series, shared equally among the "
                                          "GPUs present; a kernel past its GPU's share is refused, counted, "
                                          "and its heatmap names this limit", lo=1, hi=1_000_000, metavar="N")
    max_gpus: int = setting(256, "(instance, gpu) identities with per-SM data", lo=1, hi=1_000_000, metavar="N")
    max_kernel_series: int = setting(1_024, "(gpu, kernel) series from kernel spans", lo=1, hi=1_000_000,
                                     metavar="N")
    max_request_series: int = setting(512, "(model, priority) series from request spans", lo=1, hi=1_000_000,
                                      metavar="N")
    max_step_series: int = setting(16, "step-phase series from engine.step spans", lo=1, hi=1_000_000,
                                   metavar="N")
    # Per-SM classic histograms: 19 exposition lines per (instance, gpu, SM, kernel) instead
    # of one P99 gauge. Off (the default) leaves the gauges and the per-GPU summaries.
    expose_sm_histograms: bool = setting(False, "per-SM CTA histograms on /metrics (19 lines per GPU x SM x "
                                                "kernel); off keeps the per-SM P99 gauges and the per-GPU "
                                                "summaries")
    trace_store: TraceStoreConfig = setting(factory=TraceStoreConfig)
    contention: ContentionConfig = setting(factory=ContentionConfig)
    stragglers: StragglerConfig = setting(factory=StragglerConfig)
    # Slow requests (e2e per output token at least this many times the usual request's) are
    # explained when /metrics is scraped and counted by cause (collector/cause_counter.py); None: off
    slow_request_factor: float | None = setting(1.5, "requests whose end-to-end latency per output token is at "
                                                     "least this many times the usual request's are explained "
                                                     "at each scrape and counted by cause", lo=1.0, hi=1000.0)

    def __post_init__(self) -> None:
        check_settings(self)
        check_range("gauge_window_s", self.gauge_window_s, 0.0, self.window.horizon_s, lo_open=True,
                    hint="(the window horizon)")

    @property
    def store_traces(self) -> bool:
        return self.trace_store.mode != "off"
