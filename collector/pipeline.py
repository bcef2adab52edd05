"""The bounded queue between the receivers and the aggregator, and its worker threads.

Guarantees:
- A receiver acknowledges a request only after ``Pipeline.offer`` returned ACCEPTED; from
  then on the batch is either aggregated or counted in ``sightline_collector_dropped_total``
  (aggregator raised, or the shutdown drain ran past its timeout, the batch a worker was
  still aggregating included): nothing acknowledged disappears silently. ``close`` drains
  everything queued and returns a ``PipelineSummary`` whose acknowledged counts are /metrics'
  received counts: acknowledged = processed + duplicate + dropped, exactly.
- Memory: at most ``max_items`` spans+data points and ``max_bytes`` of parsed requests
  queued (a single larger batch is admitted into an empty queue, see ``offer``).
- ``offer`` never blocks: over capacity it answers FULL at once (429 / RESOURCE_EXHAUSTED).

Cost: ``offer`` is a lock and an append (:mod:`sightline.instrumentation.bounded_queue`); the
aggregator runs on ``workers`` threads (1 suits the GIL; more helps only a sink releasing it).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from ..instrumentation import WeightedQueue
from .self_metrics import SelfMetrics

__all__ = ["Admission", "Batch", "DiscardSink", "Pipeline", "PipelineSummary", "Sink"]

log = logging.getLogger(__name__)

Signal = Literal["traces", "metrics"]


class Sink(Protocol):
    """What the pipeline feeds: the aggregator (or ``DiscardSink`` in benchmarks)."""

    def consume_traces(self, request: Any, encoded_bytes: int | None = None) -> int: ...

    def consume_metrics(self, request: Any) -> int: ...


class DiscardSink:
    """Accepts and forgets (reports 0 aggregated). The counterpart of rotel's blackhole exporter."""

    def consume_traces(self, request: Any, encoded_bytes: int | None = None) -> int:
        return 0

    def consume_metrics(self, request: Any) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class Batch:
    """One acknowledged export request on its way to the aggregator.

    ``request`` is the parsed ExportTraceServiceRequest / ExportMetricsServiceRequest;
    ``items`` its span or data-point count (counted once, by the receiver);
    ``size_bytes`` the decoded payload size, the queue's memory accounting unit;
    ``encoded_bytes`` the size of the protobuf body ``request`` was decoded from (None for
    JSON and Zipkin), handed to the sink: the trace store's bound counts it;
    ``repeats`` the spans acknowledged with it as repeats of spans already admitted (removed
    from ``request``: a batch of nothing but repeats is counted, never queued).
    """

    signal: Signal
    request: Any
    items: int
    size_bytes: int
    receiver: str
    encoded_bytes: int | None = None
    repeats: int = 0


class Admission(enum.Enum):
    ACCEPTED = "accepted"
    FULL = "full"
    CLOSED = "closed"


@dataclass
class PipelineSummary:
    """Totals since start; written as JSON on exit (``--summary-file``) for checking."""

    # acknowledged: what the clients were told was taken, repeats included (the receivers'
    # *_received_total on /metrics) = processed + duplicate + dropped
    spans_acknowledged: int = 0
    data_points_acknowledged: int = 0
    spans_processed: int = 0  # in batches the aggregator finished without raising
    data_points_processed: int = 0
    spans_aggregated: int = 0  # what the aggregator's consume_* returned
    data_points_aggregated: int = 0
    spans_duplicate: int = 0  # repeats of spans already admitted (an exporter's retry): kept once
    dropped: int = 0  # acknowledged, then lost (aggregator error / drain timeout)
    acknowledged_by_receiver: dict[str, int] = field(default_factory=dict)
    drained_cleanly: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Pipeline:
    """Bounded, weighted queue + worker threads; see the module docstring."""

    def __init__(self, sink: Sink, metrics: SelfMetrics, *, max_items: int, max_bytes: int,
                 workers: int = 1) -> None:
        self._sink = sink
        self._metrics = metrics
        self._max_items = max_items
        self._max_bytes = max_bytes
        # weighed in spans + data points and payload bytes; its owner's lock is self._lock
        self._queue: WeightedQueue[Batch] = WeightedQueue(max_items, max_bytes)
        self._closed = False
        self._busy = 0  # batches taken by workers and not yet finished
        self._aggregating_items: dict[int, int] = {}  # those batches (by id) and their items: see close
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self.summary = PipelineSummary()
        self._threads = [
            threading.Thread(target=self._work, name=f"sightline-pipeline-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    # -- receivers' side ----------------------------------------------------------------
    def offer(self, batch: Batch) -> Admission:
        """Queue ``batch`` if it fits; never blocks. ACCEPTED means: acknowledge it."""
        with self._lock:
            if self._closed:
                return Admission.CLOSED
            # an empty queue admits even a batch larger than max_items, so progress stays
            # possible (request bodies are capped separately: its bytes are still bounded)
            if batch.items:
                if not self._queue.offer(batch, batch.items, batch.size_bytes):
                    return Admission.FULL
                self._not_empty.notify()
            s = self.summary
            acknowledged = batch.items + batch.repeats
            if batch.signal == "traces":
                s.spans_acknowledged += acknowledged
                s.spans_duplicate += batch.repeats
            else:
                s.data_points_acknowledged += acknowledged
            by = s.acknowledged_by_receiver
            by[batch.receiver] = by.get(batch.receiver, 0) + acknowledged
            depth = self._queue.weight
        self._metrics.queue_depth.set(depth)
        return Admission.ACCEPTED

    def has_room(self, size_bytes: int) -> bool:
        """A lock-free hint (may be stale): is there room for ``size_bytes`` more?

        Receivers call it before reading and parsing a body, so that overload is
        answered cheaply; ``offer`` still makes the binding decision.
        """
        if self._closed:
            return False
        queue = self._queue
        if queue.weight == 0:
            return True
        return queue.weight < self._max_items and queue.size_bytes + size_bytes <= self._max_bytes

    @property
    def depth(self) -> int:
        """Spans + data points waiting (not counting batches being aggregated now)."""
        return self._queue.weight

    @property
    def queued_bytes(self) -> int:
        """Parsed bytes of the batches queued now."""
        return self._queue.size_bytes

    @property
    def accepting(self) -> bool:
        return not self._closed

    def workers_alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until the queue is empty and no batch is being aggregated (tests, benches)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    # -- shutdown -----------------------------------------------------------------------
    def close(self, timeout_s: float) -> PipelineSummary:
        """Stops admission, drains the queue into the sink, joins the workers.

        Whatever is still queued after ``timeout_s``, and every batch a worker is still
        aggregating, is counted as dropped (``shutdown_timeout``) and
        ``summary.drained_cleanly`` becomes False: the summary is final when this returns (a
        worker that finishes such a batch later counts nothing).
        """
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = sum(b.items for b in self._queue.take())
            left += sum(self._aggregating_items.values())
            self._aggregating_items.clear()  # abandoned: their workers will count nothing
            if left or any(t.is_alive() for t in self._threads):
                self.summary.drained_cleanly = False
            self.summary.dropped += left
        if left:
            self._metrics.dropped("shutdown_timeout", left)
            log.error("shutdown drain timed out: %d acknowledged items not aggregated", left)
        self._metrics.queue_depth.set(0)
        return self.summary

    # -- workers -------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._not_empty.wait()
                if not self._queue:  # closed and drained
                    self._idle.notify_all()
                    return
                batch = self._queue.take_one()
                self._busy += 1
                self._aggregating_items[id(batch)] = batch.items
                depth = self._queue.weight
            self._metrics.queue_depth.set(depth)
            self._process(batch)
            with self._lock:
                self._busy -= 1
                if not self._queue and not self._busy:
                    self._idle.notify_all()

    def _process(self, batch: Batch) -> None:
        started = time.perf_counter()
        try:
            if batch.signal == "traces":
                if batch.encoded_bytes is None:
                    counted = self._sink.consume_traces(batch.request)
                else:
                    counted = self._sink.consume_traces(batch.request, batch.encoded_bytes)
            else:
                counted = self._sink.consume_metrics(batch.request)
        except Exception:  # the aggregator's bug must not kill the worker
            log.exception("aggregator failed on a %s batch of %d items", batch.signal, batch.items)
            with self._lock:
                if self._aggregating_items.pop(id(batch), None) is None:
                    return  # counted by close(): the drain gave up on it
                self.summary.dropped += batch.items
            self._metrics.dropped("aggregator_error", batch.items)
            return
        self._metrics.processed(batch.signal, time.perf_counter() - started)
        with self._lock:
            if self._aggregating_items.pop(id(batch), None) is None:
                return  # counted by close() as dropped: the summary was final already
            s = self.summary
            if batch.signal == "traces":
                s.spans_processed += batch.items
                s.spans_aggregated += int(counted or 0)
            else:
                s.data_points_processed += batch.items
                s.data_points_aggregated += int(counted or 0)
