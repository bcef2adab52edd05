"""GPU records an engine hands to its telemetry process: raw, compact, picklable.

The engine process only copies what the GPU and CUPTI produced (a CUPTI buffer's valid
bytes, a traced step's per-launch facts reduced on the GPU from its probe records, the
per-SM histograms of an export interval); the telemetry process decodes them (:mod:`.kernel_spans`). Each carries the
tensor-parallel rank of the process that recorded it (0 without tensor parallelism): CUPTI
correlation ids and kernel name pointers mean something only within that process. No torch
here: the telemetry process never imports it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["KernelActivity", "KernelNames", "StepLaunchFacts", "CtaHistograms", "GpuIdentity",
           "UNTRACED_EXTERNAL_ID"]

# The external correlation id of a step launched while CUPTI still records the traced step
# before it: its kernels are recorded, belong to no traced step and are dropped, counted.
# A traced step's id is ``step_id + 1``, never 0.
UNTRACED_EXTERNAL_ID = 0


class KernelActivity(NamedTuple):
    """One completed CUPTI activity buffer, its valid bytes as CUPTI wrote them."""

    buffer: bytes
    rank: int = 0


class KernelNames(NamedTuple):
    """Kernel names for the name pointers CUPTI records carry (valid in the engine only)."""

    names: dict[int, str]
    rank: int = 0


class StepLaunchFacts(NamedTuple):
    """A traced step's probed launches, each reduced on its GPU to one ``sm_probe.LaunchFacts``
    (CTAs, SMs used, waves, slowest SM, max and median CTA time, first start, last end)."""

    step_id: int
    facts: list[Any]
    rank: int = 0


class CtaHistograms(NamedTuple):
    """Per-(gpu, SM, kernel) CTA-duration histograms and exemplars of one interval."""

    histograms: dict[tuple[int, int, str], Any]
    exemplars: dict[tuple[int, int, str], Any]
    start_ns: int
    end_ns: int
    rank: int = 0
    # per (gpu, kernel): (CTAs of launches wide enough to cover every SM, all CTAs), and the
    # GPU's SM count (semconv.METRIC_CTA_WIDE); None from producers that do not count them
    launch_mix: dict[tuple[int, str], tuple[int, int]] | None = None
    num_sms: int | None = None
    # per (gpu, SM, kernel): the CTAs the GPU's dispatch order deals that SM (semconv.
    # METRIC_CTA_DEALT); None where the order is not known
    dealt: dict[tuple[int, int, str], int] | None = None


class GpuIdentity(NamedTuple):
    """The GPU the engine runs on: its local index and, where NVML answers, its UUID."""

    gpu_id: int
    uuid: str | None
    rank: int = 0
