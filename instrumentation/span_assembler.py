"""Builds request, phase and step spans from lifecycle events (:mod:`.lifecycle`).

The phase machine lives here, not in the engine: a request's ``queue`` opens when it is
queued (and again when preempted), ``prefill`` when a step first schedules it, ``decode``
when a step finishes its prompt, ``detokenize`` around the engine's final flush. Step spans
link to the requests they served; prefill/decode spans link back (capped, counted).
Spans are made by the same :class:`~.tracing.Telemetry` builders the in-process path
used, with the engine's timestamps and ids, so the span trees are the same. A tensor-parallel
step waits for its ranks' parts before its span ends (:mod:`.rank_steps`).

Guarantee: an event for an unknown request (its start was dropped, or the telemetry
process restarted) is counted in ``orphan_events`` and ignored; at most
``max_live_requests`` requests are tracked (the oldest beyond it are dropped, counted).
Cost: O(1) per event plus O(batch) per step event, in the assembling process.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, TraceFlags, TraceState

from . import semconv as sc
from .lifecycle import (Detokenized, Queued, RankStep, RequestAttributes, RequestEnd,
                        RequestStart, Step, Tokenized)
from .rank_steps import RankJoin
from .request_trace import RequestTrace, StepTrace

__all__ = ["SpanAssembler"]

logger = logging.getLogger(__name__)


class _Request:
    __slots__ = ("trace", "phase")

    def __init__(self, trace: RequestTrace) -> None:
        self.trace = trace
        self.phase = ""          # the open one of queue | prefill | decode, or ""


class SpanAssembler:
    """Turns lifecycle events into spans through ``telemetry`` (a started Telemetry)."""

    def __init__(self, telemetry, max_live_requests: int = 65536) -> None:
        self.telemetry = telemetry
        self.max_live_requests = max_live_requests
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self.steps: OrderedDict[int, StepTrace] = OrderedDict()   # recent, for kernel spans
        self.max_recent_steps = 4096
        self.orphan_events = 0
        self.evicted_requests = 0
        self.events = 0
        self.ranks = RankJoin(telemetry)
        self._handlers = {
            RequestStart: self._start, Tokenized: self._tokenized,
            RequestAttributes: self._attributes, Queued: self._queued, Step: self._step,
            Detokenized: self._detokenized, RequestEnd: self._end, RankStep: self.ranks.add,
        }

    def handle(self, events) -> None:
        """Applies ``events`` in order; unknown event types are ignored (logged once)."""
        handlers = self._handlers
        for event in events:
            self.events += 1
            handler = handlers.get(type(event))
            if handler is None:
                continue
            try:
                handler(event)
            except Exception:
                logger.exception("lifecycle event %s could not be turned into spans",
                                 type(event).__name__)

    # -- requests -------------------------------------------------------------------
    def _start(self, e: RequestStart) -> None:
        parent = Context()
        if e.parent is not None:
            remote = SpanContext(e.parent.trace_id, e.parent.span_id, True,
                                 TraceFlags(e.parent.trace_flags), TraceState(list(e.parent.trace_state)))
            parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        handle = self.telemetry.start_request(
            route=e.route, headers=None, model=e.model, operation=e.operation,
            request_id=e.request_id, priority=e.priority, method=e.method,
            start_time_ns=e.time_ns, attributes=e.attributes, trace_id=e.trace_id,
            span_id=e.span_id, parent=parent)
        if handle is None:
            return
        self._requests[e.key] = _Request(handle)
        while len(self._requests) > self.max_live_requests:
            self._requests.popitem(last=False)
            self.evicted_requests += 1

    def _get(self, key: int) -> _Request | None:
        request = self._requests.get(key)
        if request is None:
            self.orphan_events += 1
        return request

    def _tokenized(self, e: Tokenized) -> None:
        request = self._get(e.key)
        if request is not None:
            request.trace.start_phase(sc.SPAN_TOKENIZE, e.start_ns)
            request.trace.end_phase(sc.SPAN_TOKENIZE, end_time_ns=e.end_ns)

    def _attributes(self, e: RequestAttributes) -> None:
        request = self._get(e.key)
        if request is not None:
            request.trace.set_attributes(e.attributes)

    def _queued(self, e: Queued) -> None:
        request = self._get(e.key)
        if request is not None:
            self._enter(request, sc.SPAN_QUEUE, e.time_ns)

    def _enter(self, request: _Request, phase: str, time_ns: int) -> None:
        if request.phase:
            request.trace.end_phase(request.phase, end_time_ns=time_ns)
        request.phase = phase
        request.trace.start_phase(phase, time_ns)

    def _detokenized(self, e: Detokenized) -> None:
        request = self._get(e.key)
        if request is None:
            return
        if request.phase:
            request.trace.end_phase(request.phase, end_time_ns=e.start_ns)
            request.phase = ""
        request.trace.start_phase(sc.SPAN_DETOKENIZE, e.start_ns)
        request.trace.end_phase(sc.SPAN_DETOKENIZE, end_time_ns=e.end_ns)

    def _end(self, e: RequestEnd) -> None:
        request = self._requests.pop(e.key, None)
        if request is None:
            self.orphan_events += 1
            return
        request.trace.finish(
            status_code=e.status_code, finish_reason=e.finish_reason,
            input_tokens=e.input_tokens, output_tokens=e.output_tokens, ttft_s=e.ttft_s,
            tpot_s=e.tpot_s, queue_s=e.queue_s, e2e_s=e.e2e_s, preemptions=e.preemptions,
            error_type=e.error_type, end_time_ns=e.time_ns)

    # -- steps ----------------------------------------------------------------------
    def _step(self, e: Step) -> None:
        requests = self._requests
        for key in e.preempted:
            request = requests.get(key)
            if request is not None:
                request.trace.preempted(e.start_ns)    # ends the open prefill/decode span
                request.phase = sc.SPAN_QUEUE
                request.trace.start_phase(sc.SPAN_QUEUE, e.start_ns)
        served = [requests.get(key) for key in e.scheduled]
        for request in served:
            if request is not None and request.phase == sc.SPAN_QUEUE:
                self._enter(request, sc.SPAN_PREFILL, e.start_ns)
        step = self._step_span(e, served)
        for key in e.prefill_done:
            request = requests.get(key)
            if request is not None and request.phase == sc.SPAN_PREFILL:
                request.trace.end_phase(sc.SPAN_PREFILL, end_time_ns=e.end_ns)
                request.trace.first_token(e.end_ns)
                request.phase = sc.SPAN_DECODE
                request.trace.start_phase(sc.SPAN_DECODE, e.end_ns)
        if step is not None:
            self.steps[e.step_id] = step
            while len(self.steps) > self.max_recent_steps:
                self.steps.popitem(last=False)

    def _step_span(self, e: Step, served: list[_Request | None]) -> StepTrace | None:
        if not self.telemetry.steps_on:
            return None
        traces = [r.trace if r is not None else None for r in served]
        traces += [None] * (e.batch_size - len(traces))     # untraced requests count too
        attributes: dict[str, Any] = {
            sc.STEP_PREFILL_TOKENS: e.prefill_tokens,
            sc.STEP_DECODE_TOKENS: e.decode_tokens,
            sc.STEP_NUM_PREFILL_SEQS: e.prefill_seqs,
            sc.STEP_NUM_DECODE_SEQS: e.decode_seqs,
            sc.STEP_KV_BLOCKS_USED: e.kv_blocks_used,
            sc.STEP_KV_BLOCKS_TOTAL: e.kv_blocks_total,
        }
        if e.attributes:
            attributes.update(e.attributes)
        step = self.telemetry.start_step(e.step_id, requests=traces, attributes=attributes,
                                         start_time_ns=e.start_ns, trace_id=e.trace_id,
                                         span_id=e.span_id)
        if step is None:
            return None
        for t in traces:
            if t is not None:
                t.link_step(step)
        end = {sc.ERROR_TYPE: e.error_type} if e.error_type else None
        size = e.attributes.get(sc.TP_SIZE) if e.attributes else None
        if size and e.error_type is None:   # its ranks' parts come from other processes
            self.ranks.hold(e.step_id, step, int(size), e.end_ns, end)
        else:
            step.end(end, end_time_ns=e.end_ns)
        return step
