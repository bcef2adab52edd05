"""The bounded queue: admission by items, progress for an oversized batch, drain, errors counted."""

from __future__ import annotations

import threading
import time

from sightline.collector.pipeline import Admission, Batch, Pipeline
from sightline.collector.self_metrics import SelfMetrics


class _Sink:
    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.gate, self.fail, self.seen = gate, fail, []

    def consume_traces(self, request, encoded=None) -> int:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("aggregator bug")
        self.seen.append(request)
        return request

    def consume_metrics(self, request) -> int:
        return self.consume_traces(request)


def _batch(items: int, signal: str = "traces") -> Batch:
    return Batch(signal, items, items, 100 * items, "test")


def test_admission_drain_and_summary():
    gate = threading.Event()
    sink = _Sink(gate)
    pipeline = Pipeline(sink, SelfMetrics(), max_items=10, max_bytes=10_000)
    assert pipeline.offer(_batch(25)) is Admission.ACCEPTED  # larger than the queue, but it is empty
    deadline = time.monotonic() + 10
    while pipeline.depth:   # until the worker has taken it, and holds it at the gate
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert pipeline.wait_idle(0.2) is False
    assert pipeline.offer(_batch(6)) is Admission.ACCEPTED
    assert pipeline.offer(_batch(5)) is Admission.FULL  # 6 + 5 > 10
    assert pipeline.offer(_batch(4, "metrics")) is Admission.ACCEPTED
    gate.set()
    summary = pipeline.close(10)
    assert pipeline.offer(_batch(1)) is Admission.CLOSED
    assert sorted(sink.seen) == [4, 6, 25]
    assert (summary.spans_acknowledged, summary.spans_processed, summary.spans_aggregated) == (31, 31, 31)
    assert (summary.data_points_acknowledged, summary.data_points_aggregated) == (4, 4)
    assert summary.dropped == 0 and summary.drained_cleanly and summary.acknowledged_by_receiver == {"test": 35}


def test_an_aggregator_error_is_counted_as_dropped_and_the_worker_goes_on():
    pipeline = Pipeline(_Sink(fail=True), SelfMetrics(), max_items=10, max_bytes=10_000)
    assert pipeline.offer(_batch(3)) is Admission.ACCEPTED
    assert pipeline.wait_idle(10) and pipeline.workers_alive()
    summary = pipeline.close(10)
    assert summary.dropped == 3 and summary.spans_processed == 0
