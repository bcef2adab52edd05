"""Spans built already finished, for the hot paths: request, phase, step and kernel spans.

Their whole content (times, attributes, links) is known when they end, so they are made as
the SDK's ``ReadableSpan`` (what the SDK itself hands to span processors) and given to the
pipeline's span processors directly. A live SDK ``Span`` re-validates every link and
attribute, and an engine step links to every request in its batch: building it finished
skips that per-link and per-attribute work (no stored measurement isolates the saving).

Kept from the SDK: ids from the provider's id generator; the provider's sampler decides for
root spans (step spans) and children follow their parent's sampled flag (as every
``parentbased_*`` sampler does); the provider's resource and scope. Not repeated: attribute
validation and limits (these attributes are ours, typed in ``semconv``) and ``on_start``
(the pipeline's batch processors do nothing there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import INVALID_SPAN_CONTEXT

__all__ = ["FinishedSpans"]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = Status(StatusCode.UNSET)


class FinishedSpans:
    """Makes span contexts and emits finished spans into ``processors``. Thread-safe (the
    id generator and the processors are)."""

    def __init__(self, tracer_provider, processors: Sequence, scope_name: str) -> None:
        self._resource = tracer_provider.resource
        self._sampler = tracer_provider.sampler
        self._ids = tracer_provider.id_generator
        self._processors = tuple(processors)
        self._scope = InstrumentationScope(scope_name)

    def root_context(self, name: str, attributes: Mapping[str, Any] | None = None,
                     links: Sequence[Link] = (), trace_id: int | None = None,
                     span_id: int | None = None) -> SpanContext:
        """A new trace's root span context, sampled as the provider's sampler decides."""
        return self.start_context(name, None, SpanKind.INTERNAL, attributes, links,
                                  trace_id, span_id)

    def start_context(self, name: str, parent: SpanContext | None, kind: SpanKind,
                      attributes: Mapping[str, Any] | None = None,
                      links: Sequence[Link] = (), trace_id: int | None = None,
                      span_id: int | None = None) -> SpanContext:
        """The context of a span starting under ``parent`` (None or invalid: a new trace),
        sampled as the provider's sampler decides — what ``Tracer.start_span`` does.
        ``trace_id`` (new traces only) and ``span_id``: ids drawn by the recording side."""
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            parent_ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent))
        else:
            trace_id = trace_id or self._ids.generate_trace_id()
            parent_ctx = None
        result = self._sampler.should_sample(parent_ctx, trace_id, name, kind, attributes,
                                             links)
        flags = _SAMPLED if result.decision.is_sampled() else _NOT_SAMPLED
        return SpanContext(trace_id, span_id or self._ids.generate_span_id(), False, flags,
                           result.trace_state)

    def child_context(self, parent: SpanContext) -> SpanContext:
        """A child of ``parent``: same trace, sampled when the parent is."""
        if parent is None or not parent.is_valid:
            return INVALID_SPAN_CONTEXT
        return SpanContext(parent.trace_id, self._ids.generate_span_id(), False,
                           parent.trace_flags, parent.trace_state)

    def emit(self, name: str, context: SpanContext, parent: SpanContext | None,
             start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None,
             links: Sequence[Link] = (), events: Sequence[Event] = (),
             kind: SpanKind = SpanKind.INTERNAL, status: Status = _UNSET) -> None:
        """Hands one finished span to every processor (nothing when not sampled)."""
        if not context.trace_flags.sampled:
            return
        span = ReadableSpan(name=name, context=context, parent=parent,
                            resource=self._resource, attributes=attributes, events=events,
                            links=links, kind=kind, status=status, start_time=start_ns,
                            end_time=end_ns, instrumentation_scope=self._scope)
        for processor in self._processors:
            processor.on_end(span)
