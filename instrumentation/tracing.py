"""Request and engine-step tracing for an LLM server: the API the engine codes against.

Usable inside any PyTorch server. A request is one trace (or continues the caller's):

    POST /v1/chat/completions (SERVER) > tokenize > queue > prefill > decode > detokenize

where the phases are children of the server span, opened and closed by the server/engine
(:meth:`RequestTrace.start_phase` / :meth:`RequestTrace.end_phase`). Each engine iteration
is one ``engine.step`` root span linked to the request spans it served; prefill/decode
spans link back to the steps they rode (at most ``max_links_per_span`` links per span; the
rest are counted in ``sightline.span.links_dropped``).

Guarantees and costs:

- Level OFF costs one branch: ``telemetry.requests_on`` / ``steps_on`` / ``kernels_on`` are
  plain bools, ``start_request`` / ``start_step`` return None, callers test for None.
- Telemetry errors never reach the caller: every public method catches, logs once per
  call site, and carries on (a broken trace is lost, the request is not).
- Thread-safe: a :class:`RequestTrace` is guarded by its own lock (the asyncio thread and
  the engine thread both touch it); the SDK tracer is thread-safe.
- Costs when on (bench/tracing_overhead.py; bench/results/tracing_overhead_cpu.json): a
  request's six spans cost the CPU of roughly 12-22 bare SDK spans (the SDK's attribute
  checks and sampling dominate); a step costs one span plus a few µs per linked request,
  since ``link_step`` only appends to a list and phase spans are made, links and all, when
  they close. Export runs on the SDK worker thread, never on the caller's.
- Prompt and completion text are recorded only when ``capture_content`` is set.
Timestamps given explicitly are Unix-epoch nanoseconds (``time.time_ns()``).

Use in a server (any framework; ``headers`` is any str->str mapping)::

    telemetry = Telemetry.start(TelemetryConfig.from_env())      # once, at start-up
    trace = telemetry.start_request(route="/v1/completions", headers=request.headers,
                                    model=name, operation="text_completion",
                                    request_id=rid, priority=0)   # None when off
    if trace is not None:
        trace.start_phase("queue")
    ...                                                           # engine loop thread:
    step = telemetry.start_step(step_id, requests=traces, attributes={...})
    if step is not None:
        for t in traces:
            if t is not None:
                t.link_step(step)
    ...
    if trace is not None:
        trace.finish(status_code=200, finish_reason="stop", input_tokens=n_in,
                     output_tokens=n_out, ttft_s=ttft, tpot_s=tpot, queue_s=q, e2e_s=e2e)
    telemetry.shutdown()                                          # flushes, bounded
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from sightline.instrumentation import semconv
from sightline.instrumentation.config import TelemetryConfig, TraceLevel
from sightline.instrumentation.propagation import HeaderPropagator

__all__ = ["TraceLevel", "TelemetryConfig", "Telemetry", "RequestTrace", "StepTrace"]

logger = logging.getLogger(__name__)

_ROUTE_SPAN_NAMES = {
    "/v1/completions": semconv.SPAN_HTTP_COMPLETIONS,
    "/v1/chat/completions": semconv.SPAN_HTTP_CHAT_COMPLETIONS,
}
_LINKED_PHASES = (semconv.SPAN_PREFILL, semconv.SPAN_DECODE)
_reported: set[str] = set()
_reported_lock = threading.Lock()


def _report(where: str) -> None:
    """Logs the exception being handled, once per call site, and swallows it."""
    with _reported_lock:
        first = where not in _reported
        _reported.add(where)
    if first:
        logger.exception("telemetry error in %s (logged once; tracing continues)", where)


def span_name_for(method: str, route: str) -> str:
    """Server span name per the HTTP semantic conventions: ``{method} {route}``."""
    if method == "POST":
        known = _ROUTE_SPAN_NAMES.get(route)
        if known is not None:
            return known
    return f"{method} {route}"


class _Phase:
    """An open phase. Its span is made when the phase closes, with every link at once.

    Why deferred: a decode phase rides hundreds of steps; ``Span.add_link`` per step costs
    the engine loop ~6 µs per request per step, while passing the collected links to
    ``start_span`` at close costs about half that, off the per-step path. Phase spans have
    no children, so nothing needs their span id while they are open.
    """

    __slots__ = ("name", "start_ns", "links", "links_dropped", "events")

    def __init__(self, name: str, start_ns: int) -> None:
        self.name = name
        self.start_ns = start_ns
        self.links: list[Link] = []
        self.links_dropped = 0
        self.events: list[tuple[str, dict | None, int]] | None = None

class StepTrace:
    """One ``engine.step`` span (a root span, linked to the requests it served).

    ``start_time_ns`` / ``end_time_ns`` are Unix-epoch ns; ``duration_s`` is None until ended.
    ``context`` is the OTel context to parent kernel spans on.
    """

    __slots__ = ("_span", "step_id", "span_context", "context", "start_time_ns", "end_time_ns",
                 "link")

    def __init__(self, span, step_id: int, start_time_ns: int) -> None:
        self._span = span
        self.step_id = step_id
        self.span_context: SpanContext = span.get_span_context()
        self.link = Link(self.span_context)  # shared by the phase spans that rode this step
        self.context: Context = trace.set_span_in_context(span, Context())
        self.start_time_ns = start_time_ns
        self.end_time_ns: int | None = None

    @property
    def span(self):
        return self._span

    @property
    def duration_s(self) -> float | None:
        if self.end_time_ns is None:
            return None
        return (self.end_time_ns - self.start_time_ns) / 1e9

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        try:
            self._span.set_attributes(attributes)
        except Exception:
            _report("StepTrace.set_attributes")

    def end(self, attributes: Mapping[str, Any] | None = None, end_time_ns: int | None = None) -> None:
        """Ends the step span (idempotent)."""
        try:
            if self.end_time_ns is not None:
                return
            self.end_time_ns = end_time_ns if end_time_ns is not None else time.time_ns()
            if attributes:
                self._span.set_attributes(attributes)
            self._span.end(end_time=self.end_time_ns)
        except Exception:
            _report("StepTrace.end")


class RequestTrace:
    """The spans of one request. Every method is thread-safe and never raises."""

    __slots__ = (
        "_telemetry", "_tracer", "_span", "_ctx", "_lock", "_open", "_finished",
        "_first_token_seen", "_preemptions", "_link_cap", "request_id", "span_context",
        "link",
    )

    def __init__(self, telemetry: "Telemetry", span, parent: Context, request_id: str) -> None:
        self._telemetry = telemetry
        self._tracer = telemetry.tracer
        self._span = span
        self._ctx = trace.set_span_in_context(span, parent)
        self._lock = threading.Lock()
        self._open: dict[str, _Phase] = {}
        self._finished = False
        self._first_token_seen = False
        self._preemptions = 0
        self._link_cap = telemetry.config.max_links_per_span
        self.request_id = request_id
        self.span_context: SpanContext = span.get_span_context()
        # Made once, shared by every step span that links here (links are immutable).
        self.link = Link(self.span_context)

    # -- context for downstream calls ----------------------------------------------
    @property
    def context(self) -> Context:
        """Context with the server span current (carries the caller's baggage too)."""
        return self._ctx

    @property
    def span(self):
        return self._span

    @property
    def is_finished(self) -> bool:
        return self._finished

    def inject(self, headers: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
        """Headers that continue this request's trace in a downstream call."""
        try:
            return self._telemetry.propagator.inject(headers, self._ctx)
        except Exception:
            _report("RequestTrace.inject")
            return {} if headers is None else headers

    # -- phases ---------------------------------------------------------------------
    def start_phase(self, name: str, start_time_ns: int | None = None) -> None:
        """Opens child span ``name`` (no-op if one of that name is open or the request finished).

        A phase may be opened again after it ended (a preempted request is re-queued and
        recomputed): that makes a second span of the same name.
        """
        try:
            with self._lock:
                if self._finished or name in self._open:
                    return
                self._open[name] = _Phase(
                    name, start_time_ns if start_time_ns is not None else time.time_ns())
        except Exception:
            _report("RequestTrace.start_phase")

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
            _report("RequestTrace.end_phase")

    def _close(self, phase: _Phase, attributes: Mapping[str, Any] | None,
               end_time_ns: int | None) -> None:
        """Emits the phase span (caller holds the lock)."""
        attrs = dict(attributes) if attributes else None
        if phase.links_dropped:
            attrs = attrs or {}
            attrs[semconv.SPAN_LINKS_DROPPED] = phase.links_dropped
        span = self._tracer.start_span(
            phase.name, context=self._ctx, attributes=attrs, links=phase.links or None,
            start_time=phase.start_ns,
        )
        if phase.events:
            for name, event_attrs, stamp in phase.events:
                span.add_event(name, event_attrs, timestamp=stamp)
        span.end(end_time=end_time_ns if end_time_ns is not None else time.time_ns())

    def link_step(self, step: "StepTrace | None") -> None:
        """Links the open prefill (else decode) span to ``step``; capped, overflow counted."""
        if step is None:
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
        except Exception:
            _report("RequestTrace.link_step")

    # -- events ---------------------------------------------------------------------
    def preempted(self) -> None:
        """Records a preemption: an event on the server span and on the open prefill/decode
        span, which is then ended (the recompute opens new phase spans)."""
        try:
            with self._lock:
                if self._finished:
                    return
                self._preemptions += 1
                now = time.time_ns()
                open_name = ""
                for name in _LINKED_PHASES:
                    phase = self._open.pop(name, None)
                    if phase is not None:
                        open_name = name
                        phase.events = [(semconv.EVENT_PREEMPTED, None, now)]
                        self._close(phase, None, now)
                self._span.add_event(
                    semconv.EVENT_PREEMPTED,
                    {semconv.PHASE_NAME: open_name, semconv.REQUEST_PREEMPTIONS: self._preemptions},
                    timestamp=now,
                )
        except Exception:
            _report("RequestTrace.preempted")

    def first_token(self, time_ns: int | None = None) -> None:
        """Marks the first output token (an event on the server span; once)."""
        try:
            with self._lock:
                if self._finished or self._first_token_seen:
                    return
                self._first_token_seen = True
                self._span.add_event(
                    semconv.EVENT_FIRST_TOKEN,
                    timestamp=time_ns if time_ns is not None else time.time_ns(),
                )
        except Exception:
            _report("RequestTrace.first_token")

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Extra attributes on the server span (e.g. sampling parameters)."""
        try:
            with self._lock:
                if not self._finished:
                    self._span.set_attributes(attributes)
        except Exception:
            _report("RequestTrace.set_attributes")

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
                    self._span.set_attribute(semconv.GEN_AI_PROMPT, prompt[:limit])
                if completion is not None:
                    self._span.set_attribute(semconv.GEN_AI_COMPLETION, completion[:limit])
        except Exception:
            _report("RequestTrace.set_content")

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
    ) -> None:
        """Ends every open phase and the server span with the request's outcome (once)."""
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
                self._span.set_attributes(attrs)
                # Server spans: 5xx is an error, 4xx is the client's (HTTP semconv); an error
                # after a 2xx head (e.g. mid-stream) is ours.
                if status_code >= 500 or (error_type is not None and status_code < 400):
                    self._span.set_status(Status(StatusCode.ERROR, error_type or str(status_code)))
                self._span.end(end_time=now)
        except Exception:
            _report("RequestTrace.finish")


class Telemetry:
    """One tracing pipeline: providers, propagator, and the request/step span factories.

    Create with :meth:`start` (builds providers and exporters per ``config``) or
    :meth:`disabled`. Independent instances may coexist (no global SDK state is set).
    """

    def __init__(self, config: TelemetryConfig, providers=None) -> None:
        self.config = config
        self._providers = providers
        level = config.level if providers is not None else TraceLevel.OFF
        self.level = level
        self.requests_on: bool = level >= TraceLevel.REQUESTS
        self.steps_on: bool = level >= TraceLevel.STEPS
        self.kernels_on: bool = level >= TraceLevel.KERNELS
        self.propagator = HeaderPropagator(config.propagators)
        if providers is not None:
            self.tracer = providers.tracer_provider.get_tracer(semconv.INSTRUMENTATION_SCOPE)
            self.meter = (
                providers.meter_provider.get_meter(semconv.INSTRUMENTATION_SCOPE)
                if providers.meter_provider is not None
                else otel_metrics.NoOpMeter(semconv.INSTRUMENTATION_SCOPE)
            )
        else:
            self.tracer = trace.NoOpTracer()
            self.meter = otel_metrics.NoOpMeter(semconv.INSTRUMENTATION_SCOPE)
        self._link_cap = config.max_links_per_span
        self._shutdown = False

    # -- construction -------------------------------------------------------------
    @classmethod
    def start(
        cls,
        config: TelemetryConfig | None = None,
        *,
        registry=None,
        span_exporters: Iterable = (),
        metric_readers: Iterable = (),
    ) -> "Telemetry":
        """Starts a pipeline for ``config`` (default: :meth:`TelemetryConfig.from_env`).

        ``registry``: the prometheus_client registry for the ``sightline_telemetry_*``
        counters (default: a private one, see :attr:`registry`). ``span_exporters`` /
        ``metric_readers`` are added next to the OTLP exporter. Never raises for pipeline
        trouble: if the SDK cannot be set up, the error is logged and telemetry is off.
        """
        if config is None:
            config = TelemetryConfig.from_env()
        if config.level == TraceLevel.OFF:
            return cls.disabled(config)
        try:
            from sightline.instrumentation.otel_setup import build_providers

            providers = build_providers(
                config, registry=registry, span_exporters=span_exporters,
                metric_readers=metric_readers,
            )
        except Exception:
            logger.exception("telemetry set-up failed; tracing is off")
            return cls.disabled(config)
        return cls(config, providers)

    @classmethod
    def disabled(cls, config: TelemetryConfig | None = None) -> "Telemetry":
        """A Telemetry whose every switch is off; costs nothing but the branch."""
        if config is None:
            config = TelemetryConfig(level=TraceLevel.OFF, exporter="none")
        return cls(config, None)

    # -- introspection -------------------------------------------------------------
    @property
    def providers(self):
        return self._providers

    @property
    def tracer_provider(self):
        return None if self._providers is None else self._providers.tracer_provider

    @property
    def meter_provider(self):
        return None if self._providers is None else self._providers.meter_provider

    @property
    def registry(self):
        """The prometheus_client registry holding the ``sightline_telemetry_*`` counters."""
        return None if self._providers is None else self._providers.counters.registry

    def dropped_spans(self) -> int:
        """Spans lost so far (queue full + failed exports + after shutdown)."""
        return 0 if self._providers is None else self._providers.counters.dropped_total()

    def export_failures(self) -> int:
        return 0 if self._providers is None else self._providers.counters.failures_total()

    def exported_spans(self) -> int:
        return 0 if self._providers is None else self._providers.counters.spans_exported

    # -- requests -----------------------------------------------------------------
    def start_request(
        self,
        *,
        route: str,
        headers: Mapping[str, str] | None,
        model: str,
        operation: str,
        request_id: str,
        priority: int = 0,
        method: str = "POST",
        start_time_ns: int | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> RequestTrace | None:
        """Opens the SERVER span of one request, continuing W3C or B3 context in ``headers``.

        Returns None when request tracing is off (or on an internal error, logged once).
        ``operation`` is the gen_ai operation ("chat" | "text_completion").
        """
        if not self.requests_on:
            return None
        try:
            parent = self.propagator.extract(headers)
        except Exception:  # odd header values (bytes, None): trace the request anyway
            _report("Telemetry.start_request extract")
            parent = Context()
        try:
            attrs: dict[str, Any] = {
                semconv.HTTP_REQUEST_METHOD: method,
                semconv.HTTP_ROUTE: route,
                semconv.URL_PATH: route,
                semconv.GEN_AI_SYSTEM: semconv.GEN_AI_SYSTEM_VALUE,
                semconv.GEN_AI_OPERATION_NAME: operation,
                semconv.GEN_AI_REQUEST_MODEL: model,
                semconv.REQUEST_ID: request_id,
                semconv.REQUEST_PRIORITY: int(priority),
            }
            if attributes:
                attrs.update(attributes)
            span = self.tracer.start_span(
                span_name_for(method, route),
                context=parent,
                kind=SpanKind.SERVER,
                attributes=attrs,
                start_time=start_time_ns if start_time_ns is not None else time.time_ns(),
            )
            return RequestTrace(self, span, parent, request_id)
        except Exception:
            _report("Telemetry.start_request")
            return None

    # -- steps ----------------------------------------------------------------------
    def start_step(
        self,
        step_id: int,
        *,
        requests: Sequence[RequestTrace | None],
        attributes: Mapping[str, Any] | None = None,
        start_time_ns: int | None = None,
    ) -> StepTrace | None:
        """Opens one ``engine.step`` root span linked to the server spans of ``requests``.

        None entries (requests not traced) are skipped; links beyond the cap are counted in
        ``sightline.span.links_dropped``. Returns None when step tracing is off.
        """
        if not self.steps_on:
            return None
        try:
            cap = self._link_cap
            links = []
            dropped = 0
            for request in requests:
                if request is None:
                    continue
                if len(links) < cap:
                    links.append(request.link)
                else:
                    dropped += 1
            attrs: dict[str, Any] = {
                semconv.STEP_ID: int(step_id),
                semconv.STEP_BATCH_SIZE: len(requests),
            }
            if attributes:
                attrs.update(attributes)
            if dropped:
                attrs[semconv.SPAN_LINKS_DROPPED] = dropped
            start = start_time_ns if start_time_ns is not None else time.time_ns()
            span = self.tracer.start_span(
                semconv.SPAN_ENGINE_STEP,
                context=Context(),  # a root: a batch has many parents, so links instead
                kind=SpanKind.INTERNAL,
                attributes=attrs,
                links=links,
                start_time=start,
            )
            return StepTrace(span, int(step_id), start)
        except Exception:
            _report("Telemetry.start_step")
            return None

    # -- lifecycle ------------------------------------------------------------------
    def inject(self, headers: MutableMapping[str, str] | None = None,
               context: Context | None = None) -> MutableMapping[str, str]:
        """Client side: writes the configured propagation headers for ``context``."""
        try:
            return self.propagator.inject(headers, context)
        except Exception:
            _report("Telemetry.inject")
            return {} if headers is None else headers

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Exports what is queued now (blocking up to about ``timeout_s``)."""
        if self._providers is None:
            return True
        try:
            return self._providers.force_flush(timeout_s)
        except Exception:
            _report("Telemetry.force_flush")
            return False

    def shutdown(self) -> None:
        """Flushes and closes the pipeline (bounded by ``config.shutdown_timeout_s``); idempotent."""
        if self._shutdown:
            return
        self._shutdown = True
        self.requests_on = self.steps_on = self.kernels_on = False
        if self._providers is not None:
            try:
                self._providers.shutdown(self.config.shutdown_timeout_s)
            except Exception:
                _report("Telemetry.shutdown")
