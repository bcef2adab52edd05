"""The lifecycle recorder's buffer: events kept in order, deferred events built at drain on
the sink's thread, a full buffer or a failing builder counted, never raised."""

from __future__ import annotations

import threading

from sightline.instrumentation.config import TelemetryConfig
from sightline.instrumentation.lifecycle import LifecycleRecorder


def test_deferred_events_are_built_at_drain_in_their_place():
    recorder = LifecycleRecorder(TelemetryConfig(level="steps", exporter="none"))
    built_on = []

    def build(a, b):
        built_on.append(threading.current_thread().name)
        return ("built", a + b)

    recorder.record(("first",))
    recorder.record_later(build, 2, 3)
    recorder.record(("last",))
    assert built_on == []                      # nothing built on the recording thread
    drained = []
    sink = threading.Thread(target=lambda: drained.extend(recorder.drain()), name="sink")
    sink.start()
    sink.join()
    assert drained == [("first",), ("built", 5), ("last",)] and built_on == ["sink"]


def test_a_failing_builder_loses_only_its_event_and_is_counted():
    recorder = LifecycleRecorder(TelemetryConfig(level="steps", exporter="none"), capacity=3)
    recorder.record_later(lambda: 1 / 0)
    recorder.record(("kept",))
    recorder.record(("also kept",))
    recorder.record(("over capacity",))
    assert recorder.drain() == [("kept",), ("also kept",)]
    assert recorder.build_errors == 1 and recorder.dropped == 1 and recorder.recorded == 3
