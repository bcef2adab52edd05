"""A bounded store of recent traces, indexed for request roots, steps and span links.

``add_request`` takes a decoded export request (:mod:`.decoded_traces`: the one parse); with
``defer_index`` (the default) it only queues it, and the index (trace id -> spans, request
roots, steps, links both ways) is built when a query first needs it (:meth:`TraceStore.read`).
A kept span is its decoded request's own span: nothing is parsed or encoded again.

Guarantees: at most ``max_traces`` traces, ``max_spans_per_trace`` spans in any one trace,
``max_spans`` indexed spans, and ``max_bytes`` of requests (their encoded size) queued or
holding a kept span (a kept span holds its whole request); when a bound is reached the
*oldest trace* (by first indexing) is evicted whole, then the oldest queued requests; spans
past a trace's own bound count in ``dropped_spans``. A link to a trace evicted (or never
received) is not returned. Cost: memory: the decoded requests (~2.5x ``max_bytes``) plus an
index object per kept span; per span a few field reads and dict operations, on the first
query (``defer_index``; ingest: a deque append) or on ingest. Thread-safe: one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from ..instrumentation import semconv
from .aggregation_config import TraceStoreConfig
from .decoded_traces import as_decoded, attributes
from .otlp_points import resource_instance

__all__ = ["SpanRecord", "StoredSpan", "Trace", "TraceStore", "TraceStoreConfig", "REQUEST_SPAN_NAMES"]

# Zipkin-born spans often arrive lower-cased, so both spellings name a request root.
REQUEST_SPAN_NAMES = frozenset(n for name in (semconv.SPAN_HTTP_COMPLETIONS, semconv.SPAN_HTTP_CHAT_COMPLETIONS)
                               for n in (name, name.lower()))


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
    status_message: str = ""
    events: tuple[dict[str, Any], ...] = ()  # {"name", "time_unix_nano", "attributes"}

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
            "status_message": self.status_message, "attributes": self.attributes,
            "events": list(self.events),
            "links": [{"trace_id": t, "span_id": s} for t, s in self.links],
        }


class _HeldRequest:
    """A decoded request the store holds: its encoded size (what ``max_bytes`` counts) and
    how many of its spans are kept (a kept span holds the whole request's memory)."""

    __slots__ = ("size", "kept")

    def __init__(self, size: int) -> None:
        self.size = size
        self.kept = 0


class StoredSpan:
    """A kept span: its trace id, name and links (what indexing needs) and the decoded span
    itself (a message of its request, read when a query asks). Nothing read is cached (but a
    root's e2e and output tokens, two numbers), so queries never grow the store's memory. Ids are bytes."""

    __slots__ = ("trace_id", "name", "links", "span", "held", "service_name", "instance", "_e2e_s",
                 "_output_tokens")

    def __init__(self, span, held: _HeldRequest, service_name: str = "", instance: str = "unknown") -> None:
        self.trace_id: bytes = span.trace_id
        self.name: str = span.name
        self.links: tuple[tuple[bytes, bytes], ...] = (
            tuple((link.trace_id, link.span_id) for link in span.links) if len(span.links) else ())
        self.span = span
        self.held = held  # the store's record of the export request the span came in
        self.service_name = service_name
        self.instance = instance  # the producer: service.instance.id, else host.name
        self._e2e_s: float | None = None
        self._output_tokens = 0

    @property
    def span_id(self) -> bytes:
        return self.span.span_id

    @property
    def parent_span_id(self) -> bytes:
        return self.span.parent_span_id

    @property
    def start_time_unix_nano(self) -> int:
        return self.span.start_time_unix_nano

    @property
    def end_time_unix_nano(self) -> int:
        return self.span.end_time_unix_nano

    @property
    def duration_s(self) -> float:
        span = self.span
        return max(0, span.end_time_unix_nano - span.start_time_unix_nano) / 1e9

    @property
    def e2e_s(self) -> float:
        """A request root's e2e latency: its ``sightline.request.e2e_s``, else its duration."""
        if self._e2e_s is None:
            self._read_request_numbers()
        return self._e2e_s

    @property
    def output_tokens(self) -> int:
        """A request root's ``gen_ai.usage.output_tokens`` (0 where absent)."""
        if self._e2e_s is None:
            self._read_request_numbers()
        return self._output_tokens

    def _read_request_numbers(self) -> None:
        values = attributes(self.span.attributes)
        try:
            self._e2e_s = float(values.get(semconv.REQUEST_E2E_S, self.duration_s))
        except (TypeError, ValueError):
            self._e2e_s = self.duration_s
        try:
            self._output_tokens = max(0, int(values.get(semconv.GEN_AI_USAGE_OUTPUT_TOKENS, 0)))
        except (TypeError, ValueError):
            self._output_tokens = 0

    def record(self) -> SpanRecord:
        """The span as a record (hex ids, attributes as plain values)."""
        span = self.span
        return SpanRecord(
            trace_id=self.trace_id.hex(), span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(), name=self.name, kind=int(span.kind),
            start_time_unix_nano=int(span.start_time_unix_nano),
            end_time_unix_nano=int(span.end_time_unix_nano), status_code=int(span.status.code),
            attributes=attributes(span.attributes),
            links=tuple((t.hex(), s.hex()) for t, s in self.links), service_name=self.service_name,
            status_message=span.status.message,
            events=tuple({"name": e.name, "time_unix_nano": int(e.time_unix_nano),
                          "attributes": attributes(e.attributes)}
                         for e in span.events))

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


T = TypeVar("T")


class TraceStore:
    """Recent traces by id, oldest evicted first; see the module docstring."""

    def __init__(self, config: TraceStoreConfig | None = None) -> None:
        self.config = config or TraceStoreConfig()
        self._lock = threading.Lock()
        self._pending: deque[tuple[object, int]] = deque()  # (request, encoded size) waiting (defer_index)
        self._traces: OrderedDict[bytes, Trace] = OrderedDict()
        self._linked: dict[bytes, set[bytes]] = {}
        self._num_spans = 0
        self.held_bytes = 0  # encoded size of the queued requests and of those holding a kept span
        self.evicted_traces = 0
        self.dropped_spans = 0
        self.dropped_requests = 0  # queued requests evicted (bytes bound) before indexing

    # -- writing --------------------------------------------------------------------
    def add_request(self, request, encoded_bytes: int | None = None) -> None:
        """Takes a :data:`~.decoded_traces.DecodedTraceRequest` (a stock message is converted):
        indexed now, or with ``defer_index`` queued, to be indexed on the next query.
        ``encoded_bytes``: the size of the encoding it was decoded from, when the caller knows
        it (else the message is asked: one size pass)."""
        request = as_decoded(request)
        size = encoded_bytes if encoded_bytes is not None else request.ByteSize()
        if self.config.defer_index:
            # ingest then costs a deque append; read() indexes a bounded chunk per lock hold,
            # so a long backlog never holds the lock for long
            with self._lock:
                self._pending.append((request, size))
                self.held_bytes += size
                self._evict()
        else:
            with self._lock:
                self._index_request(request, size)

    # -- reading --------------------------------------------------------------------
    def read(self, fn: Callable[[TraceStore], T]) -> T:
        """Indexes what is queued (a chunk per lock hold), then runs ``fn(store)`` under the
        lock; what ``fn`` returns must not reference the store's records mutably."""
        while True:
            with self._lock:
                if self._index_some(self.config.index_chunk_spans):
                    return fn(self)

    def get(self, trace_id: str | bytes) -> Trace | None:
        if isinstance(trace_id, str):
            try:
                trace_id = bytes.fromhex(trace_id)
            except ValueError:
                return None
        return self._traces.get(trace_id)

    def traces(self) -> list[Trace]:
        """Every indexed trace, oldest first (a copy of the list; the traces are the store's)."""
        return list(self._traces.values())

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

    # -- internals (under the lock) -------------------------------------------------------
    def _index_some(self, budget: int) -> bool:
        """Indexes queued requests until about ``budget`` spans are done; True when none is left."""
        while self._pending and budget > 0:
            request, size = self._pending.popleft()
            self.held_bytes -= size  # counted again once one of its spans is kept
            budget -= self._index_request(request, size)
        return not self._pending

    def _index_request(self, request, size: int) -> int:
        held = _HeldRequest(size)
        n = 0
        for rs in request.resource_spans:
            service = ""
            for kv in rs.resource.attributes:
                if kv.key == semconv.RESOURCE_SERVICE_NAME:
                    service = kv.value.string_value
                    break
            instance = resource_instance(rs.resource)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self._add(span, service, instance, held)
                    n += 1
        return n

    def _add(self, span, service_name: str, instance: str, held: _HeldRequest) -> None:
        trace_id = span.trace_id
        trace = self._traces.get(trace_id)
        if trace is None:
            trace = Trace(trace_id)
            self._traces[trace_id] = trace
        if len(trace.spans) >= self.config.max_spans_per_trace:
            trace.dropped_spans += 1
            self.dropped_spans += 1
            return
        stored = StoredSpan(span, held, service_name, instance)
        trace.spans.append(stored)
        self._num_spans += 1
        if not held.kept:
            self.held_bytes += held.size
        held.kept += 1
        name = stored.name
        if name in REQUEST_SPAN_NAMES and span.kind != Span.SPAN_KIND_CLIENT:  # a caller's half is not the root
            trace.request_root = stored
        elif name == semconv.SPAN_ENGINE_STEP:
            trace.step_spans.append(stored)
        for linked_trace, _ in stored.links:
            if linked_trace != trace_id:
                self._link(trace_id, linked_trace)
                self._link(linked_trace, trace_id)
        cfg = self.config
        if len(self._traces) > cfg.max_traces or self._num_spans > cfg.max_spans or self.held_bytes > cfg.max_bytes:
            self._evict()

    def _link(self, a: bytes, b: bytes) -> None:
        # Called both ways: a request's prefill/decode spans link to the steps they rode, and
        # every engine.step span links back to the request spans it served, so linked[trace]
        # is complete from whichever side arrives first.
        peers = self._linked.get(a)
        if peers is None:
            peers = self._linked[a] = set()
        if len(peers) < self.config.max_spans_per_trace:
            peers.add(b)

    def _evict(self) -> None:
        cfg = self.config
        # Queued requests are newer than anything indexed: indexed traces go first.
        while self._traces and (len(self._traces) > cfg.max_traces or self._num_spans > cfg.max_spans
                                or self.held_bytes > cfg.max_bytes):
            self._evict_oldest_trace()
        while self.held_bytes > cfg.max_bytes and len(self._pending) > 1:
            self.held_bytes -= self._pending.popleft()[1]
            self.dropped_requests += 1

    def _evict_oldest_trace(self) -> None:
        trace_id, trace = self._traces.popitem(last=False)
        self._num_spans -= len(trace.spans)
        for stored in trace.spans:
            held = stored.held
            held.kept -= 1
            if not held.kept:  # its request's last kept span: the request can go
                self.held_bytes -= held.size
        self.evicted_traces += 1
        for peer in self._linked.pop(trace_id, ()):
            peers = self._linked.get(peer)
            if peers is not None:
                peers.discard(trace_id)
                if not peers and peer not in self._traces:
                    del self._linked[peer]
