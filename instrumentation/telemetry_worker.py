"""Everything telemetry does after the engine recorded it: spans, kernel spans, SM metrics.

A :class:`TelemetryWorker` takes batches of recorded items (lifecycle events and GPU
records, in recording order), each from one producer process, and drives a started
:class:`~.tracing.Telemetry`: request, phase and step spans (:mod:`.span_assembler`), kernel
spans of traced steps (:mod:`.kernel_spans`) and the per-SM CTA histograms as OTLP metrics
(:mod:`.cta_metrics`). It runs in the telemetry process (:mod:`.telemetry_process`), or on a
thread of the engine's process for tests and embedded use (:mod:`.telemetry_pipeline`).

Tensor parallelism: GPU records carry the rank whose process recorded them; each rank has
its own kernel span builder (CUPTI ids and name pointers are per process), and a traced
step's collective kernels give each rank's part of it (:mod:`.rank_steps`).

Guarantee: an item that cannot be processed is logged once per type and counted
(``errors``); processing goes on. Cost: proportional to the items, off the engine thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import semconv
from .cta_metrics import build_cta_metrics, metric_exporters_from, resource_of
from .gpu_records import CtaHistograms, GpuIdentity, KernelActivity, KernelNames, StepLaunchFacts
from .kernel_spans import KernelSpanBuilder, KernelSpanConfig
from .lifecycle import Step
from .producer_link import ProducerIdentity
from .span_assembler import SpanAssembler

__all__ = ["TelemetryWorker"]

logger = logging.getLogger(__name__)


class TelemetryWorker:
    """Consumes recorded items; ``poll()`` emits kernel spans whose records have settled.

    ``request_names(pointers)`` asks the engine process for kernel names (the answer comes
    back as a :class:`~.gpu_records.KernelNames` item)."""

    def __init__(self, telemetry, request_names: Callable[[list[int]], None],
                 kernel_config: KernelSpanConfig | None = None) -> None:
        self.telemetry = telemetry
        config = telemetry.config
        self.assembler = SpanAssembler(telemetry, hold_s=config.hold_unstarted_s,
                                       max_held_events=config.max_held_events)
        if kernel_config is None:
            kernel_config = KernelSpanConfig(detail=config.kernel_span_detail)
        self._kernel_config = kernel_config
        self.kernels = KernelSpanBuilder(telemetry, self._step_span, request_names,
                                         config=kernel_config, on_rank=self.assembler.ranks.add)
        self._ranks: dict[int, KernelSpanBuilder] = {0: self.kernels}   # by tensor-parallel rank
        self._metric_exporters: list | None = None
        self._gpu_ranks: dict[int, tuple[int, str | None]] = {}   # gpu id -> (rank, uuid)
        self.errors = 0
        self.metric_exports = 0
        self.metric_export_failures = 0
        self._reported: set[type] = set()
        self._gpu = {
            KernelActivity: lambda item: self._rank(item.rank).add_buffer(item.buffer),
            KernelNames: lambda item: self._rank(item.rank).add_names(item.names),
            StepLaunchFacts: lambda item: self._rank(item.rank).add_launch_facts(item.step_id, item.facts),
            CtaHistograms: self._histograms,
            GpuIdentity: self._identity,
        }

    def handle(self, items, producer: ProducerIdentity | None = None,
               watermark_ns: int | None = None, done: bool = False) -> None:
        """``items`` recorded by ``producer`` (default: this process) before ``watermark_ns``;
        ``done``: its last batch."""
        lifecycle = []
        for item in items:
            handler = self._gpu.get(type(item))
            if handler is None:
                lifecycle.append(item)
                if type(item) is Step and item.attributes and \
                        semconv.STEP_TRACE_REASON in item.attributes:
                    for builder in self._ranks.values():
                        builder.expect_step(item.step_id, item.attributes.get(semconv.COLLECTIVE_BYTES))
                continue
            if lifecycle:
                self.assembler.handle(lifecycle, producer)
                lifecycle = []
            try:
                handler(item)
            except Exception:
                self.errors += 1
                if type(item) not in self._reported:
                    self._reported.add(type(item))
                    logger.exception("telemetry item %s could not be processed",
                                     type(item).__name__)
        if lifecycle or watermark_ns is not None or done:
            self.assembler.handle(lifecycle, producer, watermark_ns, done)

    def poll(self, force: bool = False) -> None:
        """Emits what is due: held events past their time, kernel spans that settled
        (``force``: every kernel span now)."""
        try:
            self.assembler.poll()
            for builder in self._ranks.values():
                builder.poll(force)
            self.assembler.ranks.poll(force)
        except Exception:
            self.errors += 1
            logger.exception("kernel spans could not be emitted")

    def _rank(self, rank: int) -> KernelSpanBuilder:
        """Rank ``rank``'s kernel span builder. A worker rank's kernel names come unasked
        (:mod:`.rank_recorder`): its builder asks nobody."""
        builder = self._ranks.get(rank)
        if builder is None:
            builder = self._ranks[rank] = KernelSpanBuilder(
                self.telemetry, self._step_span, lambda pointers: None,
                config=self._kernel_config, rank=rank, on_rank=self.assembler.ranks.add)
            for step_id, collective_bytes in self.kernels.expected_steps():
                builder.expect_step(step_id, collective_bytes)
        return builder

    def close(self) -> None:
        """At shutdown: applies or orphans every held event, emits every kernel span."""
        try:
            self.assembler.flush()
        except Exception:
            self.errors += 1
            logger.exception("held lifecycle events could not be flushed")
        self.poll(force=True)

    def _step_span(self, step_id: int):
        step = self.assembler.steps.get(step_id)
        if step is None or not step.span_context.trace_flags.sampled:
            return None
        return step

    def _identity(self, item: GpuIdentity) -> None:
        builder = self._rank(item.rank)
        builder.gpu_id, builder.gpu_uuid = item.gpu_id, item.uuid
        self.assembler.ranks.gpus[item.rank] = (item.gpu_id, item.uuid)
        self._gpu_ranks[item.gpu_id] = (item.rank, item.uuid)

    def _histograms(self, item: CtaHistograms) -> None:
        if self._metric_exporters is None:
            self._metric_exporters = metric_exporters_from(self.telemetry)
        if not self._metric_exporters or not item.histograms:
            return
        data = build_cta_metrics(item.histograms, item.exemplars, item.start_ns, item.end_ns,
                                 resource_of(self.telemetry), item.launch_mix, item.num_sms,
                                 gpu_ranks=self._gpu_ranks, dealt=item.dealt)
        for exporter in self._metric_exporters:
            try:
                result = exporter.export(data)
                ok = getattr(result, "name", "SUCCESS") == "SUCCESS"
            except Exception:
                logger.exception("exporting %s failed", semconv.METRIC_CTA_DURATION)
                ok = False
            self.metric_exports += 1
            if not ok:
                self.metric_export_failures += 1

    def stats(self) -> dict:
        """Counters for the engine's /metrics (spans exported, dropped, kernel spans)."""
        counters = getattr(getattr(self.telemetry, "providers", None), "counters", None)
        stats = [b.stats for b in self._ranks.values()]
        joined = self.assembler.ranks.stats
        out = {"kernel_spans": sum(st.kernel_spans for st in stats),
               "kernels_seen": sum(st.kernels_seen for st in stats),
               "kernels_unmatched": sum(st.kernels_unmatched for st in stats),
               "kernels_untraced": sum(st.kernels_untraced for st in stats),
               "steps_traced": self.kernels.stats.steps_traced,
               "tp_steps_joined": joined.steps_joined, "tp_steps_partial": joined.steps_partial,
               "orphan_events": self.assembler.orphan_events,
               "held_events": self.assembler.held_events, "errors": self.errors,
               "metric_exports": self.metric_exports}
        if counters is not None:
            with counters._lock:
                out["spans_exported"] = counters.spans_exported
                out["spans_dropped"] = dict(counters.spans_dropped)
                out["export_failures"] = dict(counters.export_failures)
        return out
