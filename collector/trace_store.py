"""A bounded store of recent traces, indexed for request roots, steps and span links.

Guarantees: at most ``max_traces`` traces, ``max_spans_per_trace`` spans in any one
trace and ``max_spans`` spans in all; when a bound is reached the *oldest trace* (by
first arrival) is evicted whole, and spans beyond a trace's own bound are counted in
``Trace.dropped_spans`` rather than kept. Memory is therefore about
``max_spans * (~600 B + attributes)``: the defaults (200,000 spans) stay under ~200 MiB
even with kernel spans' dozen attributes.

Links are followed both ways: a request's prefill/decode spans link to the steps they
rode, and every ``engine.step`` span links back to the request spans it served, so the
store keeps ``linked[trace] -> traces`` in both directions from whichever side arrives.
A link to a trace that was evicted (or never arrived) is simply not returned.

Cost per span: one small record (the attributes copied into a dict) and a few dict
operations; the caller holds the lock (the aggregator's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sightline.instrumentation import semconv

__all__ = ["SpanRecord", "Trace", "TraceStore", "TraceStoreConfig", "any_value", "REQUEST_SPAN_NAMES"]

REQUEST_SPAN_NAMES = frozenset({semconv.SPAN_HTTP_COMPLETIONS, semconv.SPAN_HTTP_CHAT_COMPLETIONS})


@dataclass(frozen=True)
class TraceStoreConfig:
    max_traces: int = 20_000
    max_spans_per_trace: int = 4_096
    max_spans: int = 200_000

    def __post_init__(self) -> None:
        if not 1 <= self.max_traces <= 10_000_000:
            raise ValueError(f"max_traces={self.max_traces} is outside [1, 10000000]")
        if not 1 <= self.max_spans_per_trace <= 1_000_000:
            raise ValueError(f"max_spans_per_trace={self.max_spans_per_trace} is outside [1, 1000000]")
        if not 1 <= self.max_spans <= 100_000_000:
            raise ValueError(f"max_spans={self.max_spans} is outside [1, 100000000]")


def any_value(value) -> Any:
    """An OTLP ``AnyValue`` as a plain Python value (arrays as lists)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, which)


@dataclass(slots=True)
class SpanRecord:
    """One span as kept by the store (hex ids; times in Unix nanoseconds)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_time_unix_nano: int
    end_time_unix_nano: int
    status_code: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]
    service_name: str = ""

    @property
    def duration_s(self) -> float:
        return max(0, self.end_time_unix_nano - self.start_time_unix_nano) / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id, "span_id": self.span_id,
            "parent_span_id": self.parent_span_id, "name": self.name, "kind": self.kind,
            "start_time_unix_nano": self.start_time_unix_nano,
            "end_time_unix_nano": self.end_time_unix_nano, "duration_s": self.duration_s,
            "status_code": self.status_code, "service_name": self.service_name,
            "attributes": self.attributes,
            "links": [{"trace_id": t, "span_id": s} for t, s in self.links],
        }

    @classmethod
    def from_proto(cls, span, service_name: str = "") -> SpanRecord:
        return cls(
            trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(), name=span.name, kind=int(span.kind),
            start_time_unix_nano=int(span.start_time_unix_nano),
            end_time_unix_nano=int(span.end_time_unix_nano), status_code=int(span.status.code),
            attributes={kv.key: any_value(kv.value) for kv in span.attributes},
            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
            service_name=service_name,
        )


@dataclass
class Trace:
    trace_id: str
    spans: list[SpanRecord] = field(default_factory=list)
    dropped_spans: int = 0
    request_root: SpanRecord | None = None
    step_spans: list[SpanRecord] = field(default_factory=list)


class TraceStore:
    """Recent traces by id, oldest evicted first; see the module docstring."""

    def __init__(self, config: TraceStoreConfig | None = None) -> None:
        self.config = config or TraceStoreConfig()
        self._traces: OrderedDict[str, Trace] = OrderedDict()
        self._linked: dict[str, set[str]] = {}
        self._num_spans = 0
        self.evicted_traces = 0
        self.dropped_spans = 0

    # -- writing --------------------------------------------------------------------
    def add(self, record: SpanRecord) -> None:
        trace = self._traces.get(record.trace_id)
        if trace is None:
            trace = Trace(record.trace_id)
            self._traces[record.trace_id] = trace
        if len(trace.spans) >= self.config.max_spans_per_trace:
            trace.dropped_spans += 1
            self.dropped_spans += 1
            return
        trace.spans.append(record)
        self._num_spans += 1
        if record.name in REQUEST_SPAN_NAMES:
            trace.request_root = record
        elif record.name == semconv.SPAN_ENGINE_STEP:
            trace.step_spans.append(record)
        for linked_trace, _ in record.links:
            if linked_trace != record.trace_id:
                self._link(record.trace_id, linked_trace)
                self._link(linked_trace, record.trace_id)
        self._evict()

    # -- reading --------------------------------------------------------------------
    def get(self, trace_id: str) -> Trace | None:
        return self._traces.get(trace_id.lower())

    def request_roots(self) -> list[SpanRecord]:
        return [t.request_root for t in self._traces.values() if t.request_root is not None]

    def linked(self, trace_id: str) -> list[Trace]:
        """Traces present in the store that link to, or are linked from, ``trace_id``."""
        out = []
        for other in sorted(self._linked.get(trace_id, ())):
            trace = self._traces.get(other)
            if trace is not None:
                out.append(trace)
        return out

    def children(self, trace: Trace, span_id: str) -> list[SpanRecord]:
        return [s for s in trace.spans if s.parent_span_id == span_id]

    def __len__(self) -> int:
        return len(self._traces)

    @property
    def num_spans(self) -> int:
        return self._num_spans

    # -- internals ------------------------------------------------------------------
    def _link(self, a: str, b: str) -> None:
        peers = self._linked.get(a)
        if peers is None:
            peers = self._linked[a] = set()
        if len(peers) < self.config.max_spans_per_trace:
            peers.add(b)

    def _evict(self) -> None:
        while (len(self._traces) > self.config.max_traces
               or self._num_spans > self.config.max_spans) and len(self._traces) > 1:
            trace_id, trace = self._traces.popitem(last=False)
            self._num_spans -= len(trace.spans)
            self.evicted_traces += 1
            for peer in self._linked.pop(trace_id, ()):
                peers = self._linked.get(peer)
                if peers is not None:
                    peers.discard(trace_id)
                    if not peers and peer not in self._traces:
                        del self._linked[peer]
