"""A bounded store of recent traces, indexed for request roots, steps and span links.

Each span is kept as its own protobuf bytes plus the few fields navigation needs (ids,
name, times, links); attributes are decoded only for the spans a query returns.

Guarantees: at most ``max_traces`` traces, ``max_spans_per_trace`` spans in any one
trace and ``max_spans`` spans in all; when a bound is reached the *oldest trace* (by
first arrival) is evicted whole, and spans beyond a trace's own bound are counted in
``Trace.dropped_spans`` rather than kept. Memory is therefore about
``max_spans * (~450 B + the span's encoded size)``: the defaults (200,000 spans of
~300 B) stay under ~150 MiB.

Links are followed both ways: a request's prefill/decode spans link to the steps they
rode, and every ``engine.step`` span links back to the request spans it served, so the
store keeps ``linked[trace] -> traces`` in both directions from whichever side arrives.
A link to a trace that was evicted (or never arrived) is simply not returned.

Cost per span: one ``SerializeToString`` and a few dict operations; the caller holds
the lock (the aggregator's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from sightline.instrumentation import semconv

__all__ = ["SpanRecord", "StoredSpan", "Trace", "TraceStore", "TraceStoreConfig", "any_value", "REQUEST_SPAN_NAMES"]

# Zipkin-born spans often arrive lower-cased, so both spellings name a request root.
REQUEST_SPAN_NAMES = frozenset(n for name in (semconv.SPAN_HTTP_COMPLETIONS, semconv.SPAN_HTTP_CHAT_COMPLETIONS)
                               for n in (name, name.lower()))


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
    """One span decoded for output (hex ids; times in Unix nanoseconds)."""

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


class StoredSpan:
    """A span as kept: its trace id, name and links (what indexing needs at ingest), the
    rest as the span's own protobuf bytes, decoded on first access (a query) and cached.
    Ids are raw bytes."""

    __slots__ = ("trace_id", "name", "links", "raw", "service_name", "e2e_s", "_span", "_record")

    def __init__(self, span, service_name: str = "", e2e_s: float | None = None) -> None:
        self.trace_id: bytes = span.trace_id
        self.name: str = span.name
        self.links: tuple[tuple[bytes, bytes], ...] = (
            tuple((link.trace_id, link.span_id) for link in span.links) if len(span.links) else ())
        self.raw: bytes = span.SerializeToString()
        self.service_name = service_name
        self.e2e_s = e2e_s
        self._span = None
        self._record: SpanRecord | None = None

    def _proto(self):
        if self._span is None:
            self._span = Span.FromString(self.raw)
        return self._span

    @property
    def span_id(self) -> bytes:
        return self._proto().span_id

    @property
    def parent_span_id(self) -> bytes:
        return self._proto().parent_span_id

    @property
    def start_time_unix_nano(self) -> int:
        return self._proto().start_time_unix_nano

    @property
    def end_time_unix_nano(self) -> int:
        return self._proto().end_time_unix_nano

    @property
    def duration_s(self) -> float:
        span = self._proto()
        return max(0, span.end_time_unix_nano - span.start_time_unix_nano) / 1e9

    def record(self) -> SpanRecord:
        """The decoded span (cached)."""
        if self._record is None:
            span = self._proto()
            self._record = SpanRecord(
                trace_id=self.trace_id.hex(), span_id=span.span_id.hex(),
                parent_span_id=span.parent_span_id.hex(), name=self.name, kind=int(span.kind),
                start_time_unix_nano=int(span.start_time_unix_nano),
                end_time_unix_nano=int(span.end_time_unix_nano), status_code=int(span.status.code),
                attributes={kv.key: any_value(kv.value) for kv in span.attributes},
                links=tuple((t.hex(), s.hex()) for t, s in self.links), service_name=self.service_name)
        return self._record

    @property
    def attributes(self) -> dict[str, Any]:
        return self.record().attributes


@dataclass
class Trace:
    trace_id: bytes
    spans: list[StoredSpan] = field(default_factory=list)
    dropped_spans: int = 0
    request_root: StoredSpan | None = None
    step_spans: list[StoredSpan] = field(default_factory=list)


class TraceStore:
    """Recent traces by id, oldest evicted first; see the module docstring."""

    def __init__(self, config: TraceStoreConfig | None = None) -> None:
        self.config = config or TraceStoreConfig()
        self._traces: OrderedDict[bytes, Trace] = OrderedDict()
        self._linked: dict[bytes, set[bytes]] = {}
        self._num_spans = 0
        self.evicted_traces = 0
        self.dropped_spans = 0

    # -- writing --------------------------------------------------------------------
    def add(self, span, service_name: str = "", e2e_s: float | None = None) -> None:
        """Keeps one OTLP ``Span`` (``e2e_s``: a request root's latency, for ranking)."""
        trace_id = span.trace_id
        trace = self._traces.get(trace_id)
        if trace is None:
            trace = Trace(trace_id)
            self._traces[trace_id] = trace
        if len(trace.spans) >= self.config.max_spans_per_trace:
            trace.dropped_spans += 1
            self.dropped_spans += 1
            return
        stored = StoredSpan(span, service_name, e2e_s)
        trace.spans.append(stored)
        self._num_spans += 1
        name = stored.name
        if name in REQUEST_SPAN_NAMES:
            trace.request_root = stored
        elif name == semconv.SPAN_ENGINE_STEP:
            trace.step_spans.append(stored)
        for linked_trace, _ in stored.links:
            if linked_trace != trace_id:
                self._link(trace_id, linked_trace)
                self._link(linked_trace, trace_id)
        if len(self._traces) > self.config.max_traces or self._num_spans > self.config.max_spans:
            self._evict()

    # -- reading --------------------------------------------------------------------
    def get(self, trace_id: str | bytes) -> Trace | None:
        if isinstance(trace_id, str):
            try:
                trace_id = bytes.fromhex(trace_id)
            except ValueError:
                return None
        return self._traces.get(trace_id)

    def request_roots(self) -> list[StoredSpan]:
        return [t.request_root for t in self._traces.values() if t.request_root is not None]

    def linked(self, trace_id: bytes) -> list[Trace]:
        """Traces present in the store that link to, or are linked from, ``trace_id``."""
        out = []
        for other in sorted(self._linked.get(trace_id, ())):
            trace = self._traces.get(other)
            if trace is not None:
                out.append(trace)
        return out

    def __len__(self) -> int:
        return len(self._traces)

    @property
    def num_spans(self) -> int:
        return self._num_spans

    # -- internals ------------------------------------------------------------------
    def _link(self, a: bytes, b: bytes) -> None:
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
