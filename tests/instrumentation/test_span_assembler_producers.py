"""Several producers, one span assembler: events out of order across processes still make one
trace per request, tagged with the process that recorded each span.

Events are fed as the telemetry process gets them (batches per producer, with watermarks);
spans go to the OTel SDK's in-memory exporter. Exact counts of held and orphaned events.
"""

from __future__ import annotations

import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sightline.instrumentation import semconv as sc
from sightline.instrumentation.config import TelemetryConfig
from sightline.instrumentation.lifecycle import (PRODUCER_KEY_SHIFT, Detokenized, LifecycleRecorder,
                                                 Queued, RequestEnd, RequestStart, Step, Tokenized)
from sightline.instrumentation.producer_link import ProducerIdentity
from sightline.instrumentation.span_assembler import SpanAssembler
from sightline.instrumentation.tracing import Telemetry

API = ProducerIdentity(1, sc.PROCESS_ROLE_API_SERVER, 1111)
CORE = ProducerIdentity(0, sc.PROCESS_ROLE_ENGINE_CORE, 2222)
KEY = (1 << PRODUCER_KEY_SHIFT) + 7
T0 = 1_700_000_000_000_000_000
MS = 1_000_000


def _assembler(**kwargs):
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.start(TelemetryConfig(level="steps", exporter="none",
                                                metrics_enabled=False, schedule_delay_s=0.01),
                                span_exporters=[exporter])
    return SpanAssembler(telemetry, **kwargs), telemetry, exporter


def _start(key=KEY, t=T0, request_id="r1"):
    return RequestStart(key, t, 0xABC, 0xDEF, None, "POST", "/v1/completions", "tiny",
                        "text_completion", request_id, 0, None)


def _step(step_id, start_ns, end_ns, scheduled=(KEY,), prefill_done=()):
    return Step(step_id, start_ns, end_ns, 0x100 + step_id, 0x200 + step_id, scheduled,
                len(scheduled), (), prefill_done, 3, 1, 1, 1, 4, 64)


def _end(t, key=KEY):
    return RequestEnd(key, t, 200, "length", 3, 2, None, None, None, None, 0, None)


def _spans(telemetry, exporter):
    telemetry.force_flush()
    return exporter.get_finished_spans()


def _by_name(spans):
    out = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_engine_core_events_before_the_request_start_are_held_and_applied_in_order():
    assembler, telemetry, exporter = _assembler()
    core_batch = [Queued(KEY, T0 + 2 * MS), _step(1, T0 + 3 * MS, T0 + 5 * MS, prefill_done=(KEY,)),
                  _step(2, T0 + 5 * MS, T0 + 6 * MS)]
    assembler.handle(core_batch, CORE, T0 + 7 * MS)
    # Queued, step 1 (scheduled + prefill done), step 2 (scheduled): 4 held, none lost
    assert (assembler.held_events, assembler.orphan_events) == (4, 0)
    assert _spans(telemetry, exporter) == ()      # the step spans wait for their request
    assembler.handle([_start(), Tokenized(KEY, T0, T0 + MS)], API, T0 + 8 * MS)
    assembler.handle([Detokenized(KEY, T0 + 9 * MS, T0 + 10 * MS), _end(T0 + 11 * MS)], API,
                     T0 + 12 * MS)
    assembler.handle([], CORE, T0 + 20 * MS)       # the core's next (empty) batch
    assert (assembler.held_events, assembler.orphan_events) == (4, 0)
    spans = _by_name(_spans(telemetry, exporter))
    assert sorted(spans) == sorted([sc.SPAN_HTTP_COMPLETIONS, sc.SPAN_TOKENIZE, sc.SPAN_QUEUE,
                                    sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_DETOKENIZE,
                                    sc.SPAN_ENGINE_STEP])
    server = spans[sc.SPAN_HTTP_COMPLETIONS][0]
    steps = sorted(spans[sc.SPAN_ENGINE_STEP], key=lambda s: s.attributes[sc.STEP_ID])
    assert len(steps) == 2 and all(len(v) == 1 for k, v in spans.items() if k != sc.SPAN_ENGINE_STEP)
    roles = {}
    for name, (span, *_) in spans.items():
        if name != sc.SPAN_ENGINE_STEP:
            assert span.context.trace_id == server.context.trace_id
            assert span.parent is None or span.parent.span_id == server.context.span_id
        roles[name] = (span.attributes[sc.PROCESS_ROLE], span.attributes[sc.PROCESS_PID])
    api, core = (sc.PROCESS_ROLE_API_SERVER, 1111), (sc.PROCESS_ROLE_ENGINE_CORE, 2222)
    assert roles == {sc.SPAN_HTTP_COMPLETIONS: api, sc.SPAN_TOKENIZE: api, sc.SPAN_QUEUE: core,
                     sc.SPAN_PREFILL: core, sc.SPAN_DECODE: core, sc.SPAN_DETOKENIZE: api,
                     sc.SPAN_ENGINE_STEP: core}
    # the phases in their recorded times, each step linked both ways
    times = {n: (s[0].start_time - T0, s[0].end_time - T0) for n, s in spans.items()
             if n != sc.SPAN_ENGINE_STEP}
    assert times == {sc.SPAN_HTTP_COMPLETIONS: (0, 11 * MS), sc.SPAN_TOKENIZE: (0, MS),
                     sc.SPAN_QUEUE: (2 * MS, 3 * MS), sc.SPAN_PREFILL: (3 * MS, 5 * MS),
                     sc.SPAN_DECODE: (5 * MS, 9 * MS), sc.SPAN_DETOKENIZE: (9 * MS, 10 * MS)}
    assert [[link.context.span_id for link in s.links] for s in steps] == \
        [[server.context.span_id]] * 2
    assert [link.context.span_id for link in spans[sc.SPAN_PREFILL][0].links] == [0x201]
    assert [link.context.span_id for link in spans[sc.SPAN_DECODE][0].links] == [0x202]
    assert spans[sc.SPAN_DECODE][0].events == () and \
        [e.name for e in server.events] == [sc.EVENT_FIRST_TOKEN]
    telemetry.shutdown()


def test_held_events_whose_start_never_comes_expire_as_orphans():
    assembler, telemetry, exporter = _assembler(hold_s=0.05)
    lost = KEY + 1
    assembler.handle([Queued(lost, T0), _step(1, T0 + MS, T0 + 2 * MS, scheduled=(lost,)),
                      Tokenized(lost, T0, T0 + 1)], CORE, T0 + 3 * MS)
    assert (assembler.held_events, assembler.orphan_events) == (3, 0)
    assembler.poll(time.monotonic())               # not yet due
    assert assembler.orphan_events == 0 and _spans(telemetry, exporter) == ()
    assembler.poll(time.monotonic() + 0.06)
    assert (assembler.held_events, assembler.orphan_events) == (3, 3)
    # the step span goes out without the link it waited for
    (step,) = _spans(telemetry, exporter)
    assert step.name == sc.SPAN_ENGINE_STEP and step.links == ()
    assembler.handle([_start(lost)], API, T0 + 4 * MS)    # too late: nothing is applied
    assert assembler.orphan_events == 3
    telemetry.shutdown()


def test_events_whose_producer_has_shipped_past_them_without_a_start_are_orphans_at_once():
    """After a telemetry process restart the API server's frames come with watermarks past
    the core's events of requests started before: those starts will never come."""
    assembler, telemetry, exporter = _assembler()
    assembler.handle([], API, T0 + 10 * MS)        # the API server shipped all it had then
    assembler.handle([Queued(KEY, T0 + 2 * MS), _step(1, T0 + 3 * MS, T0 + 4 * MS),
                      Queued(KEY + 1, T0 + 11 * MS)], CORE, T0 + 12 * MS)
    assert (assembler.held_events, assembler.orphan_events) == (1, 2)   # KEY + 1 may still start
    (step,) = _spans(telemetry, exporter)          # not held back for a request that never starts
    assert step.name == sc.SPAN_ENGINE_STEP and step.links == ()
    telemetry.shutdown()


def test_held_events_are_bounded_in_number_and_the_oldest_expire_first():
    assembler, telemetry, _ = _assembler(max_held_events=3)
    assembler.handle([Queued(KEY + i, T0 + i) for i in range(5)], CORE, T0 + 10)
    assert (assembler.held_events, assembler.orphan_events) == (5, 2)
    assembler.handle([_start(KEY + i, request_id=f"r{i}") for i in range(5)], API, T0 + 20)
    assert assembler.orphan_events == 2            # keys 2..4 found their Queued
    assembler.flush()
    assert assembler.orphan_events == 2
    telemetry.shutdown()


def test_a_request_end_waits_for_the_engine_core_steps_recorded_before_it():
    """The API server's RequestEnd can overtake the core's last step: it waits until the core's
    watermark passes its time (or until the hold ends), so the decode span gets every link."""
    assembler, telemetry, exporter = _assembler()
    assembler.handle([_start()], API, T0 + MS)
    assembler.handle([Queued(KEY, T0 + 2 * MS), _step(1, T0 + 3 * MS, T0 + 4 * MS, prefill_done=(KEY,))],
                     CORE, T0 + 5 * MS)
    assembler.handle([Detokenized(KEY, T0 + 8 * MS, T0 + 9 * MS), _end(T0 + 10 * MS)], API, T0 + 11 * MS)
    names = [s.name for s in _spans(telemetry, exporter)]
    assert sc.SPAN_DECODE not in names and sc.SPAN_HTTP_COMPLETIONS not in names
    assembler.handle([_step(2, T0 + 5 * MS, T0 + 7 * MS)], CORE, T0 + 30 * MS)
    spans = _by_name(_spans(telemetry, exporter))
    decode = spans[sc.SPAN_DECODE][0]
    assert [link.context.span_id for link in decode.links] == [0x202]
    assert (decode.start_time - T0, decode.end_time - T0) == (4 * MS, 8 * MS)
    assert sc.SPAN_HTTP_COMPLETIONS in spans and assembler.orphan_events == 0
    assert assembler.held_events == 0
    telemetry.shutdown()


def test_a_silent_producer_holds_nothing_back_for_longer_than_the_hold():
    assembler, telemetry, exporter = _assembler(hold_s=0.05)
    assembler.handle([], CORE, T0)                 # the core is known, then goes quiet
    assembler.handle([_start(), _end(T0 + 10 * MS)], API, T0 + 11 * MS)
    assert _spans(telemetry, exporter) == ()
    assembler.poll(time.monotonic() + 0.06)
    assert [s.name for s in _spans(telemetry, exporter)] == [sc.SPAN_HTTP_COMPLETIONS]
    assert assembler.orphan_events == 0
    telemetry.shutdown()


def test_a_producers_last_frame_releases_what_waits_for_it_at_once():
    """At a stop nothing waits out the hold: the core's last frame releases the API server's
    request end (held for the core's steps), the API server's last frame orphans the core's
    events of a request it never started (every start it recorded has arrived)."""
    assembler, telemetry, exporter = _assembler(hold_s=60.0)
    assembler.handle([Queued(KEY + 1, T0 + 2 * MS)], CORE, T0 + 3 * MS)
    assembler.handle([_start(), _end(T0 + 10 * MS)], API, T0 + 11 * MS)
    assert _spans(telemetry, exporter) == () and assembler.held_events == 1
    assembler.handle([], CORE, T0 + 4 * MS, done=True)
    assert [s.name for s in _spans(telemetry, exporter)] == [sc.SPAN_HTTP_COMPLETIONS]
    assert assembler.orphan_events == 0
    assembler.handle([], API, T0 + 12 * MS, done=True)
    assert (assembler.held_events, assembler.orphan_events) == (1, 1)
    # a frame after the last one: the producer restarted, it holds the others back again
    assembler.handle([], CORE, T0 + 20 * MS)
    assembler.handle([_start(KEY + 2, T0 + 21 * MS, "r2"), _end(T0 + 30 * MS, KEY + 2)], API,
                     T0 + 31 * MS)
    assert len(_spans(telemetry, exporter)) == 1
    telemetry.shutdown()


def test_a_step_that_serves_a_request_already_ended_is_no_orphan():
    """Overlapped scheduling plans a step before the previous step's finish is seen."""
    assembler, telemetry, _ = _assembler()
    assembler.handle([_start(), _end(T0 + MS)], CORE, T0 + 2 * MS)
    assembler.handle([_step(1, T0 + 2 * MS, T0 + 3 * MS, prefill_done=(KEY,))], CORE, T0 + 4 * MS)
    assert (assembler.held_events, assembler.orphan_events) == (0, 0)
    assembler.handle([Queued(KEY, T0 + 5 * MS)], CORE, T0 + 6 * MS)   # but this is one
    assert assembler.orphan_events == 1
    telemetry.shutdown()


def test_request_keys_carry_their_producer_and_never_collide():
    config = TelemetryConfig(level="requests", exporter="none", metrics_enabled=False)
    keys = {}
    for producer_id in (0, 1, 2, 2):       # a producer restarted under the same id
        recorder = LifecycleRecorder(config, producer_id=producer_id)
        for i in range(100):
            handle = recorder.start_request(route="/v1/completions", headers={}, model="m",
                                            operation="text_completion", request_id=str(i))
            assert handle.key >> PRODUCER_KEY_SHIFT == producer_id and handle.key < 2**63
            keys[handle.key] = producer_id
    assert len(keys) == 400
