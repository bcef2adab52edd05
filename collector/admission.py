"""Admission of one decoded export request: span checks, duplicates, the queue, the counters.

Every receiver (OTLP gRPC, OTLP HTTP, Zipkin) hands its decoded request to
``Intake.accept``, which either admits it or raises ``IngestError``:

- traces: every span id is checked (:func:`.span_ids.span_fingerprints`, 400 on a bad one) and
  spans already admitted within the window (:class:`.span_ids.SpanWindow`: exporters
  retry after timeouts, so one span can arrive twice) are removed from the request and
  counted in ``sightline_collector_dropped_total{reason="duplicate"}``;
- the pipeline either queues the rest or refuses (429 queue full, 503 shutting down);
- only then are the ids remembered (a refused request's retry is not a duplicate) and the
  items counted as received. So, for everything acknowledged: received = aggregated + dropped.
``Intake.decode``: the gRPC receiver's decoding (:mod:`.decoding`: capped, off the loop).

Cost: see :mod:`.span_ids` for traces; metrics pay one queue offer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .decoding import Decoded, decode_protobuf, off_loop
from .ingest import IngestError
from .pipeline import Admission, Batch, Pipeline, Signal
from .request_shape import RequestLimits
from .self_metrics import SelfMetrics
from .span_ids import SpanWindow, remove_spans, span_fingerprints, with_variants

__all__ = ["Intake", "admit"]


def admit(pipeline: Pipeline, batch: Batch | None) -> None:
    """Offers ``batch``; raises the 429/503 IngestError when the pipeline refuses it.

    ``batch=None`` only raises the refusal (the caller already knows there is no room).
    """
    if batch is None:
        verdict = Admission.CLOSED if not pipeline.accepting else Admission.FULL
    else:
        verdict = pipeline.offer(batch)
    if verdict is Admission.ACCEPTED:
        return
    if verdict is Admission.FULL:
        raise IngestError(429, "over_capacity", "collector queue is full; retry later")
    raise IngestError(503, "shutting_down", "collector is shutting down")


class Intake:
    """What the receivers share downstream of decoding (event-loop thread only)."""

    def __init__(self, pipeline: Pipeline, metrics: SelfMetrics, window: SpanWindow,
                 limits: RequestLimits | None = None) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.window = window
        self.limits = limits or RequestLimits()
        self._decoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sightline-intake-decode")

    async def decode(self, body: bytes, signal: Signal) -> Decoded:
        """``body`` (an encoded export request) walked, checked against ``limits`` and parsed,
        on a decoder thread unless it is small; IngestError 413/400."""
        return await off_loop(self._decoder, len(body), decode_protobuf, body, signal, self.limits)

    def close(self) -> None:
        self._decoder.shutdown(wait=False, cancel_futures=True)

    def check_room(self, size_bytes: int) -> None:
        """The cheap refusal before a body is read: raises 429/503 when there is no room."""
        if not self.pipeline.has_room(size_bytes):
            admit(self.pipeline, None)

    def accept(self, receiver: str, signal: Signal, decoded: Decoded) -> None:
        """Admits ``decoded`` (its ``items`` spans or data points) or raises IngestError. Its
        ``fingerprints`` are computed here when the decoder left them out (variants mixed in:
        :func:`.span_ids.with_variants`)."""
        request, items, encoded_bytes = decoded.message, decoded.items, decoded.encoded_bytes
        repeats = 0
        seen = None
        if signal == "traces":
            fingerprints = decoded.fingerprints
            if fingerprints is None:
                fingerprints = with_variants(span_fingerprints(request), decoded.variants)
            seen = self.window.lookup(fingerprints)
            repeats = len(seen.repeats)
            if repeats:
                remove_spans(request, seen.repeats)
                encoded_bytes = None  # no longer the size of the request's encoding
        # a batch of nothing but repeats is counted as acknowledged, never queued
        admit(self.pipeline, Batch(signal, request, items - repeats, decoded.parsed_bytes, receiver, encoded_bytes,
                                   repeats))
        if seen is not None:
            self.window.remember(seen.kept)
            self.metrics.accepted(receiver, items, 0)
        else:
            self.metrics.accepted(receiver, 0, items)
        if repeats:
            self.metrics.dropped("duplicate", repeats)
