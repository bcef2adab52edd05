"""What an engine records about its requests and steps: typed lifecycle events, nothing else.

The engine and its HTTP server call :class:`LifecycleRecorder` and :class:`RequestHandle`;
each call builds one small named tuple and offers it to a lock-free
:class:`~.bounded_queue.BoundedQueue`. A :class:`~.span_assembler.SpanAssembler` makes spans
from these events elsewhere: in the telemetry process, or on a thread (:mod:`.telemetry_pipeline`).
Request keys carry their recorder's ``producer_id`` in the bits from ``PRODUCER_KEY_SHIFT``
up, so the keys of several processes feeding one telemetry process never collide.

Guarantee: never blocks, never raises into the caller; a full buffer drops the event and
counts it (``dropped``; a deferred event whose builder raised: ``build_errors``). Cost: O(1) Python operations per request event and per step,
independent of the trace level (above OFF, where the engine holds no recorder at all).
Span and trace ids of server spans are drawn here (exemplars and ``X-Request-Id``
need them in the engine); sampling is decided where the spans are built.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from opentelemetry import trace

from . import semconv
from .bounded_queue import BUILD_ERROR, BoundedQueue
from .config import TelemetryConfig, TraceLevel
from .config_checks import check_range
from .propagation import HeaderPropagator

__all__ = ["LifecycleRecorder", "RequestHandle", "RequestStart", "Tokenized", "RequestAttributes",
           "Queued", "Step", "Detokenized", "RequestEnd", "RemoteParent", "OpenStep", "RankStep",
           "Startup", "StartupPhase", "PRODUCER_KEY_SHIFT", "MAX_PRODUCER_ID", "DROP_BUFFER_FULL"]

# A request key is (producer_id << PRODUCER_KEY_SHIFT) + n, n < 2**48 (from a random start
# below 2**40): every key fits an int64 (msgpack, the engine's own records).
PRODUCER_KEY_SHIFT = 48
MAX_PRODUCER_ID = (1 << 15) - 1
DROP_BUFFER_FULL = "buffer_full"   # the reason of an event refused by a full buffer


class RemoteParent(NamedTuple):
    """The caller's span context from W3C or B3 headers (the server span's parent)."""

    trace_id: int
    span_id: int
    trace_flags: int
    trace_state: tuple[tuple[str, str], ...]


class RequestStart(NamedTuple):
    key: int
    time_ns: int
    trace_id: int
    span_id: int
    parent: RemoteParent | None
    method: str
    route: str
    model: str
    operation: str
    request_id: str
    priority: int
    attributes: Mapping[str, Any] | None


class Tokenized(NamedTuple):
    key: int
    start_ns: int
    end_ns: int


class RequestAttributes(NamedTuple):
    """Attributes added to the server span (sampling parameters, opted-in content)."""

    key: int
    attributes: Mapping[str, Any]


class Queued(NamedTuple):
    key: int
    time_ns: int


class Step(NamedTuple):
    """One engine iteration. Request keys in batch order; None for an untraced request."""

    step_id: int
    start_ns: int
    end_ns: int
    trace_id: int                     # the step span's ids (drawn here, for exemplars)
    span_id: int
    scheduled: tuple[int | None, ...]  # every request of the batch
    batch_size: int                   # requests in the batch, traced or not
    preempted: tuple[int | None, ...]  # sent back to the queue before this step
    prefill_done: tuple[int, ...]     # finished their (re)computed prompt in this step
    prefill_tokens: int
    decode_tokens: int
    prefill_seqs: int
    decode_seqs: int
    kv_blocks_used: int
    kv_blocks_total: int
    error_type: str | None = None
    attributes: Mapping[str, Any] | None = None   # e.g. CUDA graph bucket, kernel trace reason
    # prompt tokens of the requests it admitted served from a prefix cache (None: no cache)
    prefill_cached_tokens: int | None = None


class RankStep(NamedTuple):
    """One tensor-parallel rank's part of step ``step_id``: its forward pass from start to
    end (Unix ns), of which ``collective_ns`` inside collectives (waiting for the other
    ranks, and the transfer) and the rest computing; ``collective_calls`` calls of
    ``collective_bytes`` bytes each."""

    step_id: int
    rank: int
    start_ns: int
    end_ns: int
    compute_ns: int
    collective_ns: int
    collective_calls: int
    collective_bytes: int


class Detokenized(NamedTuple):
    """The engine's final flush of a request's text (the ``detokenize`` phase)."""

    key: int
    start_ns: int
    end_ns: int


class RequestEnd(NamedTuple):
    key: int
    time_ns: int
    status_code: int
    finish_reason: str | None
    input_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    queue_s: float | None
    e2e_s: float | None
    preemptions: int | None
    error_type: str | None
    cached_tokens: int | None = None   # prompt tokens served from a prefix cache (None: unknown)


class StartupPhase(NamedTuple):
    """One phase of the engine's start-up (loading weights, a warm-up family, ...)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] | None


class Startup(NamedTuple):
    """The engine's start-up, recorded once when it is ready: one trace, a span per phase."""

    trace_id: int
    span_id: int
    start_ns: int
    end_ns: int
    phases: tuple[StartupPhase, ...]
    attributes: Mapping[str, Any] | None


class RequestHandle:
    """The engine-side handle on one request's trace: its ids and its key in the events."""

    __slots__ = ("key", "trace_id", "span_id", "request_id", "sampled", "_recorder", "_ended")

    def __init__(self, recorder: "LifecycleRecorder", key: int, trace_id: int, span_id: int,
                 request_id: str) -> None:
        self._recorder = recorder
        self.key = key
        self.trace_id = trace_id
        self.span_id = span_id
        self.request_id = request_id
        self.sampled = True  # False when the caller's context says not to record the trace
        self._ended = False

    @property
    def trace_id_hex(self) -> str:
        return format(self.trace_id, "032x")

    def tokenized(self, start_ns: int, end_ns: int) -> None:
        self._recorder.record(Tokenized(self.key, start_ns, end_ns))

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._recorder.record(RequestAttributes(self.key, dict(attributes)))

    def set_content(self, prompt: str | None, completion: str | None) -> None:
        """Prompt and completion text on the server span: only with ``capture_content``."""
        config = self._recorder.config
        if not config.capture_content:
            return
        limit = config.content_max_chars
        attributes = {}
        if prompt is not None:
            attributes[semconv.GEN_AI_PROMPT] = prompt[:limit]
        if completion is not None:
            attributes[semconv.GEN_AI_COMPLETION] = completion[:limit]
        self.set_attributes(attributes)

    def finish(self, *, status_code: int, finish_reason: str | None, input_tokens: int,
               output_tokens: int, ttft_s: float | None = None, tpot_s: float | None = None,
               queue_s: float | None = None, e2e_s: float | None = None,
               preemptions: int | None = None, error_type: str | None = None,
               end_time_ns: int | None = None, cached_tokens: int | None = None) -> None:
        """The request's outcome; ends its server span. Once: later calls are ignored.
        ``cached_tokens``: of the input tokens, those a prefix cache served."""
        if self._ended:
            return
        self._ended = True
        self._recorder.record(RequestEnd(
            self.key, end_time_ns if end_time_ns is not None else time.time_ns(), status_code,
            finish_reason, input_tokens, output_tokens, ttft_s, tpot_s, queue_s, e2e_s,
            preemptions, error_type, cached_tokens))


class LifecycleRecorder:
    """Appends lifecycle events to a bounded buffer that a pipeline's shipper drains (see module doc).

    ``requests_on`` / ``steps_on`` / ``kernels_on`` mirror the configured level; the
    engine records the same events at every level above OFF (the assembler decides which
    spans they become). ``capacity`` bounds the events waiting for the shipper;
    ``producer_id`` (0 to ``MAX_PRODUCER_ID``) is the high part of this recorder's keys.
    """

    def __init__(self, config: TelemetryConfig, capacity: int = 1 << 16,
                 producer_id: int = 0) -> None:
        check_range("capacity", capacity, 1, 1 << 24, integer=True)
        check_range("producer_id", producer_id, 0, MAX_PRODUCER_ID, integer=True)
        self.config = config
        level = config.level
        self.requests_on = level >= TraceLevel.REQUESTS
        self.steps_on = level >= TraceLevel.STEPS
        self.kernels_on = level >= TraceLevel.KERNELS
        self.capacity = capacity
        # drops by reason: DROP_BUFFER_FULL (refused), BUILD_ERROR (a deferred event's builder raised)
        self.events: BoundedQueue = BoundedQueue(capacity, full_reason=DROP_BUFFER_FULL,
                                                 reasons=(BUILD_ERROR,))
        # The queue's own methods, bound here: the engine thread calls them on every step,
        # and a method of this class around them would cost a Python call each time.
        #: ``record(event)``: appends ``event`` unless the buffer is full (then counts it). Any thread.
        self.record = self.events.offer
        #: ``record_later(build, *args)``: like ``record(build(*args))``, with ``build`` run by
        #: ``drain`` on the shipping thread: O(1) here whatever the event's size. Any thread.
        self.record_later = self.events.offer_later
        #: ``drain(limit)``: takes up to ``limit`` events, oldest first, deferred ones built
        #: (the shipping thread).
        self.drain = self.events.take
        self.producer_id = producer_id
        self._ids = random.Random()
        # from a random point: a producer restarted under the same id does not reuse the keys
        # of its predecessor's requests, which the assembler still remembers for a while
        self._keys = itertools.count((producer_id << PRODUCER_KEY_SHIFT) + 1
                                     + self._ids.getrandbits(40))
        self._propagator = HeaderPropagator(config.propagators)

    @property
    def dropped(self) -> int:
        """Events refused because the buffer was full."""
        return self.events.dropped[DROP_BUFFER_FULL]

    @dropped.setter
    def dropped(self, count: int) -> None:
        self.events.dropped[DROP_BUFFER_FULL] = count

    @property
    def recorded(self) -> int:
        return self.events.accepted

    @property
    def build_errors(self) -> int:
        """Deferred events whose builder raised (the event is lost)."""
        return self.events.dropped[BUILD_ERROR]

    # -- requests (server thread) ---------------------------------------------------
    def start_request(self, *, route: str, headers: Mapping[str, str] | None, model: str,
                      operation: str, request_id: str, priority: int = 0,
                      method: str = "POST", start_time_ns: int | None = None,
                      attributes: Mapping[str, Any] | None = None) -> RequestHandle | None:
        """Records a request's arrival, continuing W3C/B3 context from ``headers``.

        None when request tracing is off. Never raises: odd headers start a new trace."""
        if not self.requests_on:
            return None
        parent = None
        try:
            context = trace.get_current_span(self._propagator.extract(headers)).get_span_context()
            if context.is_valid:
                parent = RemoteParent(context.trace_id, context.span_id, int(context.trace_flags),
                                      tuple(context.trace_state.items()))
        except Exception:
            parent = None
        trace_id = parent.trace_id if parent is not None else self._ids.getrandbits(128) or 1
        handle = RequestHandle(self, next(self._keys), trace_id, self._ids.getrandbits(64) or 1,
                               request_id)
        handle.sampled = parent is None or bool(parent.trace_flags & 1)
        self.record(RequestStart(
            handle.key, start_time_ns if start_time_ns is not None else time.time_ns(), trace_id,
            handle.span_id, parent, method, route, model, operation, request_id, int(priority),
            dict(attributes) if attributes else None))
        return handle

    # -- steps ----------------------------------------------------------------------
    def new_span_ids(self) -> tuple[int, int]:
        """A step span's (trace id, span id)."""
        return self._ids.getrandbits(128) or 1, self._ids.getrandbits(64) or 1

    def name_step(self, step: "OpenStep") -> None:
        """Draws ``step``'s span ids unless it has them: where they are first needed (the
        Step event's builder, or the GPU telemetry of a probed step, which runs before it),
        not on every step of the engine thread."""
        if not step.trace_id:
            step.trace_id, step.span_id = self.new_span_ids()


class OpenStep:
    """The engine thread's record of the step it is running (mutable, one per step).

    Its ids are the step span's (0 until ``LifecycleRecorder.name_step``); ``attributes``
    collects what the step adds to its span (kernel trace reason, CUDA graph bucket) before
    the :class:`Step` event is recorded; ``cupti_recorded``: CUPTI recorded its kernels (its
    wall time carries that cost)."""

    __slots__ = ("step_id", "trace_id", "span_id", "start_ns", "attributes", "cupti_recorded")

    def __init__(self, step_id: int, trace_id: int, span_id: int, start_ns: int) -> None:
        self.step_id = step_id
        self.trace_id = trace_id
        self.span_id = span_id
        self.start_ns = start_ns
        self.attributes: dict[str, Any] | None = None
        self.cupti_recorded = False

    def set_attribute(self, key: str, value: Any) -> None:
        if self.attributes is None:
            self.attributes = {}
        self.attributes[key] = value
