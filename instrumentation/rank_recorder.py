"""A tensor-parallel worker's recorder: what its rank records, tagged, for the engine core.

A worker process has no telemetry pipeline of its own: ``RankRecorder`` buffers what it
records (its ``RankStep`` timings; at level kernels on CUDA, its ``GpuTelemetry``'s records)
and the worker sends the buffer to the core, which records it into its own pipeline. GPU
records get the worker's rank (their CUPTI ids and kernel name pointers mean something only
in this process), and kernel names go with the first CUPTI buffer that holds them, unasked:
the telemetry process cannot ask a worker. Guarantee: never blocks, never raises; past
``capacity`` items are dropped and counted. Cost: one append per item; one numpy decode of
each CUPTI buffer's name pointers (traced steps only).
"""

from __future__ import annotations

import logging
import random

from .bounded_queue import FULL, BoundedQueue
from .config import TelemetryConfig, TraceLevel
from .gpu_records import CtaHistograms, GpuIdentity, KernelActivity, KernelNames, StepLaunchFacts

__all__ = ["RankRecorder"]

logger = logging.getLogger(__name__)

_TAGGED = (KernelActivity, KernelNames, StepLaunchFacts, CtaHistograms, GpuIdentity)


class RankRecorder:
    """The recorder interface ``GpuTelemetry`` uses (``record``, ``name_step``, ``config``,
    ``kernels_on``), buffering for the worker's pipe (``drain``)."""

    def __init__(self, rank: int, config: TelemetryConfig | None, capacity: int = 1 << 16) -> None:
        self.rank = rank
        self.config = config
        level = config.level if config is not None else TraceLevel.OFF
        self.kernels_on = level >= TraceLevel.KERNELS
        self.capacity = capacity
        self.stopped = False
        self._items: BoundedQueue = BoundedQueue(capacity)
        self.drain = self._items.take   # what the worker sends the core, oldest first
        self._named: set[int] = set()
        self._ids = random.Random()

    def record(self, item) -> None:
        if type(item) in _TAGGED:
            item = item._replace(rank=self.rank)
            if type(item) is KernelActivity:
                self._name_kernels(item.buffer)
        self._items.offer(item)

    @property
    def dropped(self) -> int:
        """Items refused because the buffer was full."""
        return self._items.dropped[FULL]

    def name_step(self, step) -> None:
        """Rank 0 names the steps whose records point at their span; a fallback here."""
        if not step.trace_id:
            step.trace_id, step.span_id = self._ids.getrandbits(128) or 1, self._ids.getrandbits(64) or 1

    def gpu_telemetry(self, device):
        """This rank's GpuTelemetry on ``device`` (at level kernels on CUDA), or None."""
        if not self.kernels_on or device.type != "cuda":
            return None
        from .gpu_telemetry import GpuTelemetry
        return GpuTelemetry.create(self, device.index)

    def _name_kernels(self, buffer: bytes) -> None:
        """Names of the kernels in ``buffer`` not named yet, recorded ahead of it."""
        try:
            from .cupti_records import decode_buffer
            from .cupti_tracer import CuptiTracer
            pointers = {int(p) for p in decode_buffer(buffer).kernels["name_ptr"]} - self._named
            if pointers:
                self._named |= pointers
                self.record(KernelNames(CuptiTracer.resolve_names(pointers)))
        except Exception:   # the spans then wait for names that never come, and say <unknown>
            logger.exception("kernel names of rank %d could not be read", self.rank)
