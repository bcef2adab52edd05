"""Builds request, phase and step spans from lifecycle events (:mod:`.lifecycle`).

The engine's start-up becomes one trace (a root and a span per phase). Requests' phases:
``queue`` opens when queued (and again when preempted), ``prefill`` when a step first
schedules it, ``decode`` when a step finishes its prompt, ``detokenize`` around the final
flush of its text. Step spans link to the requests they served, prefill/decode spans link
back (capped, counted); a tensor-parallel step's span ends when its ranks' parts came
(:mod:`.rank_steps`). Spans carry the recording process (``sightline.process.role``,
``process.pid``). With several producers (:mod:`.event_order`), an event whose request has
not started is held up to ``hold_s`` and applied when the start arrives (a step span is built
at once, its links added then); ``Detokenized`` / ``RequestEnd`` wait for the other producers.
A producer's last frame ("done") releases what waits for it at once. Guarantee: an event
unmatched after ``hold_s``, or once its producer shipped past it, counts in ``orphan_events``; at most ``max_live_requests`` requests are tracked (the oldest beyond
dropped, counted). Cost: O(1) per event plus O(batch) per step event.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, TraceFlags, TraceState

from . import semconv as sc
from .config_checks import check_range
from .event_order import HeldEvents, Watermarks
from .lifecycle import (PRODUCER_KEY_SHIFT, Detokenized, Queued, RankStep, RequestAttributes, RequestEnd,
                        RequestStart, Startup, Step, Tokenized)
from .producer_link import ProducerIdentity
from .rank_steps import RankJoin
from .request_trace import RequestTrace, StepTrace

__all__ = ["SpanAssembler"]

logger = logging.getLogger(__name__)

# A producer's clock is this process's clock (one host); the slack covers a step's event
# recorded just after its outputs left the engine core.
_ORDER_SLACK_NS = 5_000_000


class _Request:
    __slots__ = ("trace", "phase")

    def __init__(self, trace: RequestTrace) -> None:
        self.trace = trace
        self.phase = ""          # the open one of queue | prefill | decode, or ""


class _PendingStep:
    """A step span waiting for the requests it served whose start has not arrived."""

    __slots__ = ("step", "missing")

    def __init__(self, step: StepTrace) -> None:
        self.step = step
        self.missing = 0

    def settle(self) -> None:
        self.missing -= 1
        if self.missing == 0:
            self.step.emit()


class SpanAssembler:
    """Turns lifecycle events into spans through ``telemetry`` (a started Telemetry)."""

    def __init__(self, telemetry, max_live_requests: int = 65536, hold_s: float = 2.0,
                 max_held_events: int = 65536) -> None:
        check_range("max_live_requests", max_live_requests, 1, 1 << 24, integer=True)
        self.telemetry = telemetry
        self.max_live_requests = max_live_requests
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self.steps: OrderedDict[int, StepTrace] = OrderedDict()   # recent, for kernel spans
        self.max_recent_steps = 4096
        self.orphan_events = 0
        self.held_events = 0         # events that waited for their request's start
        self.evicted_requests = 0
        self.events = 0
        self._held = HeldEvents(hold_s, max_held_events)          # by request key
        # recently finished requests: a step planned before a request's end was seen may
        # still serve it (overlapped scheduling); that is no orphan
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._max_finished = max_live_requests
        self._closing = HeldEvents(hold_s, max_held_events)       # waiting for other producers
        self._watermarks = Watermarks(hold_s)
        self._origins: dict[ProducerIdentity, dict] = {}
        self._local: ProducerIdentity | None = None
        self.ranks = RankJoin(telemetry)
        self._handlers = {
            RequestStart: self._start, Tokenized: self._tokenized,
            RequestAttributes: self._attributes, Queued: self._queued, Step: self._step,
            Detokenized: self._detokenized, RequestEnd: self._end, Startup: self._startup,
            RankStep: self._rank_step,
        }

    def handle(self, events, producer: ProducerIdentity | None = None,
               watermark_ns: int | None = None, done: bool = False) -> None:
        """Applies ``events`` of ``producer`` (default: this process, as the engine core) in
        order; ``watermark_ns``: the producer recorded them all before it; ``done``: its
        last frame (it records nothing more). Unknown event types are ignored."""
        if producer is None:
            producer = self._local_producer()
        origin = self._origins.get(producer)
        if origin is None:
            origin = self._origins[producer] = producer.attributes
        now = time.monotonic()
        handlers, pid = self._handlers, producer.producer_id
        for event in events:
            self.events += 1
            handler = handlers.get(type(event))
            if handler is None:
                continue
            try:
                handler(event, origin, pid, now)
            except Exception:
                logger.exception("lifecycle event %s could not be turned into spans",
                                 type(event).__name__)
        if watermark_ns is not None and self._watermarks.note(pid, watermark_ns, now, done):
            self._release_closing(now)
        if done:
            # its requests' starts have all arrived: the events still waiting for one never
            # meet it (the other producers' held closing events were released above)
            held = self._held
            self._expired([item for key in held.keys() if key >> PRODUCER_KEY_SHIFT == pid
                           for item in held.take(key)])

    def poll(self, now: float | None = None) -> None:
        """Applies closing events held past ``hold_s`` and counts expired held events."""
        now = time.monotonic() if now is None else now
        self._release_closing(now)
        for item in self._closing.expire(now):
            self._apply(item[0], item[1], item[2], now, item[5])
        self._expired(self._held.expire(now))

    def flush(self) -> None:
        """At shutdown: applies every held closing event; what still waits is orphaned."""
        now = time.monotonic()
        for item in self._closing.expire_all():
            self._apply(item[0], item[1], item[2], now, item[5])
        self._expired(self._held.expire_all())

    def _local_producer(self) -> ProducerIdentity:
        if self._local is None:
            self._local = ProducerIdentity(0, sc.PROCESS_ROLE_ENGINE_CORE, os.getpid())
        return self._local

    # -- ordering -----------------------------------------------------------------
    def _keyed(self, key: int, fn, args: tuple, pid: int, now: float, time_ns: int | None,
               close_ns: int | None = None) -> None:
        """Applies ``fn(request, *args)`` (an event of ``time_ns``) to ``key``'s request, now
        or once it may; ``close_ns``: a closing event's time (waits for other producers)."""
        closing = self._closing
        if key in closing:
            # behind a held closing event of its producer: keep that producer's order
            if close_ns is not None or closing.head(key)[3] == pid:
                self._hold_closing(key, fn, args, pid, time_ns, close_ns, now)
                return
        elif close_ns is not None and not self._watermarks.caught_up(
                pid, close_ns + _ORDER_SLACK_NS, now):
            self._hold_closing(key, fn, args, pid, time_ns, close_ns, now)
            return
        self._apply(key, fn, args, now, time_ns)

    def _hold_closing(self, key, fn, args, pid, time_ns, close_ns, now) -> None:
        for item in self._closing.add(key, (key, fn, args, pid, close_ns, time_ns), now):
            self._apply(item[0], item[1], item[2], now, item[5])

    def _apply(self, key: int, fn, args: tuple, now: float, time_ns: int | None) -> None:
        request = self._requests.get(key)
        if request is None:
            if key in self._finished:
                self._expired([(fn, args)], finished=True)
                return
            if time_ns is not None and self._watermarks.passed(key >> PRODUCER_KEY_SHIFT,
                                                               time_ns):
                # its producer has shipped all it recorded before this event, the request's
                # start included (recorded first): there is no start to wait for
                self._expired([(fn, args)])
                return
            self.held_events += 1
            self._expired(self._held.add(key, (fn, args), now))
            return
        try:
            fn(request, *args)
        except Exception:
            logger.exception("a lifecycle event could not be turned into spans")

    def _release_closing(self, now: float) -> None:
        closing, caught_up = self._closing, self._watermarks.caught_up
        for key in closing.keys():
            while key in closing:
                _, fn, args, pid, close_ns, time_ns = closing.head(key)
                if close_ns is not None and not caught_up(pid, close_ns + _ORDER_SLACK_NS, now):
                    break
                closing.pop_head(key)
                self._apply(key, fn, args, now, time_ns)

    def _expired(self, items: list, finished: bool = False) -> None:
        """Held items that will never meet their request, counted as orphans; ``finished``:
        their request ended already, and a step's effects on it are no orphans (a step
        planned before the request's end was seen may still serve it)."""
        for fn, args in items:
            if fn is _scheduled and args[0] is not None:
                args[0].settle()       # the step span goes out without that request's link
            if not (finished and fn in _STEP_EFFECTS):
                self.orphan_events += 1

    # -- requests -------------------------------------------------------------------
    def _start(self, e: RequestStart, origin: dict, pid: int, now: float) -> None:
        parent = Context()
        if e.parent is not None:
            remote = SpanContext(e.parent.trace_id, e.parent.span_id, True,
                                 TraceFlags(e.parent.trace_flags), TraceState(list(e.parent.trace_state)))
            parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        attributes = {**e.attributes, **origin} if e.attributes else origin
        handle = self.telemetry.start_request(
            route=e.route, headers=None, model=e.model, operation=e.operation,
            request_id=e.request_id, priority=e.priority, method=e.method,
            start_time_ns=e.time_ns, attributes=attributes, trace_id=e.trace_id,
            span_id=e.span_id, parent=parent)
        if handle is None:
            return
        request = self._requests[e.key] = _Request(handle)
        self._finished.pop(e.key, None)      # a producer restarted with the same id
        while len(self._requests) > self.max_live_requests:
            self._requests.popitem(last=False)
            self.evicted_requests += 1
        for fn, args in self._held.take(e.key):   # what arrived before its start, in order
            try:
                fn(request, *args)
            except Exception:
                logger.exception("a held lifecycle event could not be turned into spans")

    def _tokenized(self, e: Tokenized, origin: dict, pid: int, now: float) -> None:
        self._keyed(e.key, self._phase, (sc.SPAN_TOKENIZE, e.start_ns, e.end_ns, origin), pid, now,
                    e.start_ns)

    def _attributes(self, e: RequestAttributes, origin: dict, pid: int, now: float) -> None:
        self._keyed(e.key, _set_attributes, (e.attributes,), pid, now, None)

    def _queued(self, e: Queued, origin: dict, pid: int, now: float) -> None:
        self._keyed(e.key, _enter, (sc.SPAN_QUEUE, e.time_ns, origin), pid, now, e.time_ns)

    def _detokenized(self, e: Detokenized, origin: dict, pid: int, now: float) -> None:
        self._keyed(e.key, self._phase, (sc.SPAN_DETOKENIZE, e.start_ns, e.end_ns, origin), pid,
                    now, e.start_ns, close_ns=e.start_ns)

    def _end(self, e: RequestEnd, origin: dict, pid: int, now: float) -> None:
        self._keyed(e.key, self._finish, (e,), pid, now, e.time_ns, close_ns=e.time_ns)

    @staticmethod
    def _phase(request: _Request, name: str, start_ns: int, end_ns: int, origin: dict) -> None:
        """A phase of its own (tokenize, detokenize); detokenize ends the open one."""
        if name == sc.SPAN_DETOKENIZE and request.phase:
            request.trace.end_phase(request.phase, end_time_ns=start_ns)
            request.phase = ""
        request.trace.start_phase(name, start_ns, origin)
        request.trace.end_phase(name, end_time_ns=end_ns)

    def _finish(self, request: _Request, e: RequestEnd) -> None:
        if self._requests.get(e.key) is request:
            del self._requests[e.key]
            self._finished[e.key] = None
            if len(self._finished) > self._max_finished:
                self._finished.popitem(last=False)
        request.trace.finish(
            status_code=e.status_code, finish_reason=e.finish_reason,
            input_tokens=e.input_tokens, output_tokens=e.output_tokens, ttft_s=e.ttft_s,
            tpot_s=e.tpot_s, queue_s=e.queue_s, e2e_s=e.e2e_s, preemptions=e.preemptions,
            error_type=e.error_type, end_time_ns=e.time_ns, cached_tokens=e.cached_tokens)

    # -- the engine's start-up --------------------------------------------------------
    def _startup(self, e: Startup, origin: dict, pid: int, now: float) -> None:
        """One trace: the ``engine.startup`` root and a child span per phase."""
        spans = self.telemetry.finished_spans
        if spans is None:
            return
        attributes = {**origin, **(e.attributes or {})}
        root = spans.root_context(sc.SPAN_ENGINE_STARTUP, attributes, (), e.trace_id, e.span_id)
        for phase in e.phases:
            spans.emit(sc.SPAN_STARTUP_PHASE_PREFIX + phase.name, spans.child_context(root), root,
                       phase.start_ns, phase.end_ns, {**origin, **(phase.attributes or {})})
        spans.emit(sc.SPAN_ENGINE_STARTUP, root, None, e.start_ns, e.end_ns, attributes)

    # -- steps ----------------------------------------------------------------------
    def _rank_step(self, e: RankStep, origin: dict, pid: int, now: float) -> None:
        self.ranks.add(e)

    def _step(self, e: Step, origin: dict, pid: int, now: float) -> None:
        requests = self._requests
        for key in e.preempted:
            if key is not None:
                self._keyed(key, _preempted, (e.start_ns, origin), pid, now, e.start_ns)
        served = [requests.get(key) if key is not None else None for key in e.scheduled]
        for request in served:
            if request is not None and request.phase == sc.SPAN_QUEUE:
                _enter(request, sc.SPAN_PREFILL, e.start_ns, origin)
        step = self._step_span(e, served, origin)
        pending = None
        if None in served:            # untraced requests, or ones whose start has not arrived
            pending = _PendingStep(step) if step is not None else None
            for key, request in zip(e.scheduled, served):
                if request is None and key is not None:
                    if pending is not None:
                        pending.missing += 1
                    self._apply(key, _scheduled, (pending, e.start_ns, origin,
                                                     self.telemetry.config.max_links_per_span),
                                now, e.start_ns)
        for key in e.prefill_done:
            self._keyed(key, _prefill_done, (e.end_ns, origin), pid, now, e.end_ns)
        if step is not None:
            end = {sc.ERROR_TYPE: e.error_type} if e.error_type else None
            size = e.attributes.get(sc.TP_SIZE) if e.attributes else None
            if size and e.error_type is None:   # its ranks' parts come from other processes
                self.ranks.hold(e.step_id, step, int(size), e.end_ns, end,
                                ready=None if pending is None else lambda: pending.missing == 0)
            else:
                step.end(end, end_time_ns=e.end_ns, emit=pending is None or pending.missing == 0)
            self.steps[e.step_id] = step
            while len(self.steps) > self.max_recent_steps:
                self.steps.popitem(last=False)

    def _step_span(self, e: Step, served: list[_Request | None], origin: dict) -> StepTrace | None:
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
            **origin,
        }
        if e.prefill_cached_tokens is not None:
            attributes[sc.STEP_PREFILL_CACHED_TOKENS] = e.prefill_cached_tokens
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
        return step


def _set_attributes(request: _Request, attributes) -> None:
    request.trace.set_attributes(attributes)


def _preempted(request: _Request, time_ns: int, origin: dict) -> None:
    request.trace.preempted(time_ns)    # ends the open prefill/decode span
    request.phase = sc.SPAN_QUEUE
    request.trace.start_phase(sc.SPAN_QUEUE, time_ns, origin)


def _prefill_done(request: _Request, end_ns: int, origin: dict) -> None:
    if request.phase == sc.SPAN_PREFILL:
        request.trace.end_phase(sc.SPAN_PREFILL, end_time_ns=end_ns)
        request.trace.first_token(end_ns)
        request.phase = sc.SPAN_DECODE
        request.trace.start_phase(sc.SPAN_DECODE, end_ns, origin)


def _enter(request: _Request, phase: str, time_ns: int, origin: dict) -> None:
    if request.phase:
        request.trace.end_phase(request.phase, end_time_ns=time_ns)
    request.phase = phase
    request.trace.start_phase(phase, time_ns, origin)


def _scheduled(request: _Request, pending: _PendingStep | None, start_ns: int, origin: dict,
               link_cap: int) -> None:
    """A step's effect on a request whose start came after the step."""
    if request.phase == sc.SPAN_QUEUE:
        _enter(request, sc.SPAN_PREFILL, start_ns, origin)
    if pending is not None:
        request.trace.link_step(pending.step)
        pending.step.add_link(request.trace.link, link_cap)
        pending.settle()


_STEP_EFFECTS = (_preempted, _prefill_done, _scheduled)
