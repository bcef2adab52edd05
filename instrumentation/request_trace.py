"""The span handles behind :mod:`sightline.instrumentation.tracing`: one request's trace
(:class:`RequestTrace`: the server span and its phase spans) and one engine step's span
(:class:`StepTrace`). Made by :class:`~sightline.instrumentation.tracing.Telemetry`, never
directly.

Guarantees and costs:

- Every public method catches, logs once per call site (:func:`report_error`) and carries
  on: a broken trace is lost, the request is not.
- The span assembler drives both from one thread at a time; a :class:`RequestTrace` keeps
  a lock for callers of the public ``Telemetry`` facade that share one across threads.
- ``link_step`` only appends a shared ``Link`` to a list; phase spans are made, links and
  all, when they close (see :class:`_Phase`). Phase and step spans are built finished
  (:mod:`.finished_spans`): the live SDK span's per-link validation was the largest part
  of tracing's cost to the engine loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from . import semconv

if TYPE_CHECKING:
    from .tracing import Telemetry

__all__ = ["RequestTrace", "StepTrace"]

# The facade's logger: one name to configure for all of tracing.
logger = logging.getLogger("sightline.instrumentation.tracing")

_LINKED_PHASES = (semconv.SPAN_PREFILL, semconv.SPAN_DECODE)
_UNSET = Status(StatusCode.UNSET)
_reported: set[str] = set()
_reported_lock = threading.Lock()


def report_error(where: str) -> None:
    """Logs the exception being handled, once per call site, and swallows it."""
    with _reported_lock:
        first = where not in _reported
        _reported.add(where)
    if first:
        logger.exception("telemetry error in %s (logged once; tracing continues)", where)


class _Phase:
    """An open phase. Its span is made when the phase closes, with every link at once.

    Why deferred: a decode phase rides hundreds of steps; a live span's ``add_link`` per
    step costs the engine loop ~6 µs per request per step, while appending a shared
    ``Link`` costs well under one, and the span is built finished, links and all, when the
    phase closes. Phase spans have no children, so nothing needs their span id while they
    are open.
    """

    __slots__ = ("name", "start_ns", "attributes", "links", "links_dropped", "events", "open")

    def __init__(self, name: str, start_ns: int, attributes: Mapping[str, Any] | None) -> None:
        self.name = name
        self.start_ns = start_ns
        self.attributes = attributes
        self.links: list[Link] = []
        self.links_dropped = 0
        self.events: list[tuple[str, dict | None, int]] | None = None
        self.open = True

class StepTrace:
    """One ``engine.step`` span (a root span, linked to the requests it served).

    Built finished when it ends (:class:`~.finished_spans.FinishedSpans`): until then it
    is its ids, attributes and links. ``start_time_ns`` / ``end_time_ns`` are Unix-epoch
    ns; ``duration_s`` is None until ended. ``context`` is the OTel context to parent
    kernel spans on.
    """

    __slots__ = ("_spans", "step_id", "span_context", "start_time_ns", "end_time_ns",
                 "link", "_attributes", "_links", "_emitted")

    def __init__(self, spans, span_context: SpanContext, step_id: int, start_time_ns: int,
                 attributes: dict[str, Any], links: list[Link]) -> None:
        self._spans = spans
        self.step_id = step_id
        self.span_context: SpanContext = span_context
        self.link = Link(span_context)  # shared by the phase spans that rode this step
        self.start_time_ns = start_time_ns
        self.end_time_ns: int | None = None
        self._attributes = attributes
        self._links = links
        self._emitted = False

    @property
    def span(self):
        """A non-recording handle on the step span (its context only)."""
        return trace.NonRecordingSpan(self.span_context)

    @property
    def context(self) -> Context:
        return trace.set_span_in_context(self.span, Context())

    @property
    def duration_s(self) -> float | None:
        if self.end_time_ns is None:
            return None
        return (self.end_time_ns - self.start_time_ns) / 1e9

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        try:
            if self.end_time_ns is None:
                self._attributes.update(attributes)
        except Exception:
            report_error("StepTrace.set_attributes")

    def end(self, attributes: Mapping[str, Any] | None = None, end_time_ns: int | None = None,
            emit: bool = True) -> None:
        """Ends the step span (idempotent); ``emit=False`` keeps it for links still to come
        (:meth:`add_link`) until :meth:`emit`."""
        try:
            if self.end_time_ns is not None:
                return
            self.end_time_ns = end_time_ns if end_time_ns is not None else time.time_ns()
            if attributes:
                self._attributes.update(attributes)
            if emit:
                self.emit()
        except Exception:
            report_error("StepTrace.end")

    def add_link(self, link: Link, cap: int) -> None:
        """Links a request found after the step began (its start arrived later); at most
        ``cap`` links in all, the rest counted in ``sightline.span.links_dropped``."""
        if self._emitted:
            return
        if len(self._links) < cap:
            self._links.append(link)
        else:
            attrs = self._attributes
            attrs[semconv.SPAN_LINKS_DROPPED] = attrs.get(semconv.SPAN_LINKS_DROPPED, 0) + 1

    def emit(self) -> None:
        """Hands the ended span to the exporters (once)."""
        try:
            if self._emitted or self.end_time_ns is None:
                return
            self._emitted = True
            self._spans.emit(semconv.SPAN_ENGINE_STEP, self.span_context, None,
                             self.start_time_ns, self.end_time_ns, self._attributes,
                             self._links)
        except Exception:
            report_error("StepTrace.emit")


class RequestTrace:
    """The spans of one request. Every method is thread-safe and never raises."""

    __slots__ = (
        "_telemetry", "_spans", "_name", "_parent", "_start_ns", "_attributes", "_events",
        "_ctx", "_lock", "_open", "_finished", "_first_token_seen", "_preemptions",
        "_link_cap", "_full_phase", "request_id", "span_context", "link",
    )

    def __init__(self, telemetry: "Telemetry", name: str, parent: Context, request_id: str,
                 attributes: dict[str, Any], start_ns: int, trace_id: int | None = None,
                 span_id: int | None = None) -> None:
        self._telemetry = telemetry
        self._spans = telemetry.finished_spans
        parent_span = trace.get_current_span(parent).get_span_context()
        self._parent = parent_span if parent_span.is_valid else None
        # the server span is built finished too (at ``finish``); until then it is this
        self.span_context: SpanContext = self._spans.start_context(
            name, self._parent, SpanKind.SERVER, attributes, (), trace_id, span_id)
        self._name = name
        self._start_ns = start_ns
        self._attributes = attributes
        self._events: list[Event] = []
        self._ctx = trace.set_span_in_context(trace.NonRecordingSpan(self.span_context), parent)
        self._lock = threading.Lock()
        self._open: dict[str, _Phase] = {}
        self._finished = False
        self._first_token_seen = False
        self._preemptions = 0
        self._link_cap = min(telemetry.config.max_links_per_span,
                             telemetry.config.max_phase_links)
        self._full_phase: _Phase | None = None   # the open phase whose links are capped
        self.request_id = request_id
        # Made once, shared by every step span that links here (links are immutable).
        self.link = Link(self.span_context)

    # -- context for downstream calls ----------------------------------------------
    @property
    def context(self) -> Context:
        """Context with the server span current (carries the caller's baggage too)."""
        return self._ctx

    @property
    def span(self):
        """A non-recording handle on the server span (its context only)."""
        return trace.NonRecordingSpan(self.span_context)

    @property
    def is_finished(self) -> bool:
        return self._finished

    def inject(self, headers: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
        """Headers that continue this request's trace in a downstream call."""
        try:
            return self._telemetry.propagator.inject(headers, self._ctx)
        except Exception:
            report_error("RequestTrace.inject")
            return {} if headers is None else headers

    # -- phases ---------------------------------------------------------------------
    def start_phase(self, name: str, start_time_ns: int | None = None,
                    attributes: Mapping[str, Any] | None = None) -> None:
        """Opens child span ``name`` (no-op if one of that name is open or the request finished);
        ``attributes`` (not copied: not changed later) go on its span.

        A phase may be opened again after it ended (a preempted request is re-queued and
        recomputed): that makes a second span of the same name.
        """
        try:
            with self._lock:
                if self._finished or name in self._open:
                    return
                self._open[name] = _Phase(
                    name, start_time_ns if start_time_ns is not None else time.time_ns(),
                    attributes)
        except Exception:
            report_error("RequestTrace.start_phase")

    def end_phase(
        self,
        name: str,
        attributes: Mapping[str, Any] | None = None,
        end_time_ns: int | None = None,
    ) -> None:
        """Closes phase ``name`` if open (otherwise no-op)."""
        try:
            with self._lock:
                phase = self._open.pop(name, None)
                if phase is not None:
                    self._close(phase, attributes, end_time_ns)
        except Exception:
            report_error("RequestTrace.end_phase")

    def _close(self, phase: _Phase, attributes: Mapping[str, Any] | None,
               end_time_ns: int | None) -> None:
        """Emits the phase span (caller holds the lock)."""
        phase.open = False
        attrs = dict(phase.attributes) if phase.attributes else None
        if attributes:
            attrs = {**attrs, **attributes} if attrs else dict(attributes)
        if phase.links_dropped:
            attrs = attrs or {}
            attrs[semconv.SPAN_LINKS_DROPPED] = phase.links_dropped
        events = [Event(name, event_attrs, stamp) for name, event_attrs, stamp in phase.events] \
            if phase.events else ()
        spans = self._telemetry.finished_spans
        spans.emit(phase.name, spans.child_context(self.span_context), self.span_context,
                   phase.start_ns, end_time_ns if end_time_ns is not None else time.time_ns(),
                   attrs, phase.links, events)

    def link_step(self, step: "StepTrace | None") -> None:
        """Links the open prefill (else decode) span to ``step``; capped, overflow counted."""
        if step is None:
            return
        full = self._full_phase
        if full is not None and full.open:
            # Its links are capped: only count, without the lock (called once per request
            # per step, so this is most of a long decode's calls; a count racing with the
            # phase's close may be lost, a link never is).
            full.links_dropped += 1
            return
        try:
            with self._lock:
                phase = self._open.get(semconv.SPAN_PREFILL) or self._open.get(semconv.SPAN_DECODE)
                if phase is None:
                    return
                if len(phase.links) < self._link_cap:
                    phase.links.append(step.link)
                else:
                    phase.links_dropped += 1
                    self._full_phase = phase
        except Exception:
            report_error("RequestTrace.link_step")

    # -- events ---------------------------------------------------------------------
    def preempted(self, time_ns: int | None = None) -> None:
        """Records a preemption: an event on the server span and on the open prefill/decode
        span, which is then ended (the recompute opens new phase spans)."""
        try:
            with self._lock:
                if self._finished:
                    return
                self._preemptions += 1
                now = time_ns if time_ns is not None else time.time_ns()
                open_name = ""
                for name in _LINKED_PHASES:
                    phase = self._open.pop(name, None)
                    if phase is not None:
                        open_name = name
                        phase.events = [(semconv.EVENT_PREEMPTED, None, now)]
                        self._close(phase, None, now)
                self._events.append(Event(
                    semconv.EVENT_PREEMPTED,
                    {semconv.PHASE_NAME: open_name, semconv.REQUEST_PREEMPTIONS: self._preemptions},
                    now))
        except Exception:
            report_error("RequestTrace.preempted")

    def first_token(self, time_ns: int | None = None) -> None:
        """Marks the first output token (an event on the server span; once)."""
        try:
            with self._lock:
                if self._finished or self._first_token_seen:
                    return
                self._first_token_seen = True
                self._events.append(Event(
                    semconv.EVENT_FIRST_TOKEN, None,
                    time_ns if time_ns is not None else time.time_ns()))
        except Exception:
            report_error("RequestTrace.first_token")

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Extra attributes on the server span (e.g. sampling parameters)."""
        try:
            with self._lock:
                if not self._finished:
                    self._attributes.update(attributes)
        except Exception:
            report_error("RequestTrace.set_attributes")

    def set_content(self, prompt: str | None, completion: str | None) -> None:
        """Records prompt/completion text; a no-op unless ``capture_content`` (opt-in)."""
        config = self._telemetry.config
        if not config.capture_content:
            return
        try:
            limit = config.content_max_chars
            with self._lock:
                if self._finished:
                    return
                if prompt is not None:
                    self._attributes[semconv.GEN_AI_PROMPT] = prompt[:limit]
                if completion is not None:
                    self._attributes[semconv.GEN_AI_COMPLETION] = completion[:limit]
        except Exception:
            report_error("RequestTrace.set_content")

    # -- the end ------------------------------------------------------------------
    def finish(
        self,
        *,
        status_code: int,
        finish_reason: str | None,
        input_tokens: int,
        output_tokens: int,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        queue_s: float | None = None,
        e2e_s: float | None = None,
        preemptions: int | None = None,
        error_type: str | None = None,
        end_time_ns: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """Ends every open phase and the server span with the request's outcome (once);
        ``cached_tokens``: of the input tokens, those a prefix cache served (None: unknown)."""
        try:
            with self._lock:
                if self._finished:
                    return
                self._finished = True
                now = end_time_ns if end_time_ns is not None else time.time_ns()
                for phase in self._open.values():
                    self._close(phase, None, now)
                self._open.clear()
                attrs: dict[str, Any] = {
                    semconv.HTTP_RESPONSE_STATUS_CODE: int(status_code),
                    semconv.GEN_AI_USAGE_INPUT_TOKENS: int(input_tokens),
                    semconv.GEN_AI_USAGE_OUTPUT_TOKENS: int(output_tokens),
                    semconv.REQUEST_PREEMPTIONS: int(
                        self._preemptions if preemptions is None else preemptions
                    ),
                }
                if cached_tokens is not None:
                    attrs[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = int(cached_tokens)
                if finish_reason is not None:
                    attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (str(finish_reason),)
                if ttft_s is not None:
                    attrs[semconv.REQUEST_TTFT_S] = float(ttft_s)
                if tpot_s is not None:
                    attrs[semconv.REQUEST_TPOT_S] = float(tpot_s)
                if queue_s is not None:
                    attrs[semconv.REQUEST_QUEUE_S] = float(queue_s)
                if e2e_s is not None:
                    attrs[semconv.REQUEST_E2E_S] = float(e2e_s)
                if error_type is not None:
                    attrs[semconv.ERROR_TYPE] = str(error_type)
                self._attributes.update(attrs)
                # Server spans: 5xx is an error, 4xx is the client's (HTTP semconv); an error
                # after a 2xx head (e.g. mid-stream) is ours.
                status = _UNSET
                if status_code >= 500 or (error_type is not None and status_code < 400):
                    status = Status(StatusCode.ERROR, error_type or str(status_code))
                self._spans.emit(self._name, self.span_context, self._parent, self._start_ns,
                                 now, self._attributes, (), self._events, SpanKind.SERVER,
                                 status)
        except Exception:
            report_error("RequestTrace.finish")
