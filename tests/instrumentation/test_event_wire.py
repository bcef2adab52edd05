"""The pipe's form of recorded items gives back the same items, types included."""

from __future__ import annotations

import pickle

from sightline.instrumentation.event_wire import from_wire, to_wire
from sightline.instrumentation.gpu_records import KernelActivity, StepLaunchFacts
from sightline.instrumentation.lifecycle import (Detokenized, Queued, RemoteParent,
                                                 RequestAttributes, RequestEnd, RequestStart,
                                                 Startup, StartupPhase, Step, Tokenized)
from sightline.instrumentation.sm_probe import LaunchFacts


def test_every_item_comes_back_equal_and_of_its_type_through_pickle():
    parent = RemoteParent(1 << 100, 7, 1, (("vendor", "x"),))
    items = [
        RequestStart(1, 10, 1 << 120, 5, parent, "POST", "/v1/completions", "tiny", "text_completion",
                     "cmpl-1", 0, {"gen_ai.request.max_tokens": 8}),
        Tokenized(1, 11, 12), RequestAttributes(1, {"k": "v"}), Queued(1, 13),
        Step(0, 14, 15, 1 << 127, 9, (1, None), 2, (), (1,), 5, 1, 1, 1, 3, 100, None,
             {"sightline.step.trace_reason": "sampled"}),
        KernelActivity(b"\x00\x01"),   # a GPU record: passed through as it is
        StepLaunchFacts(0, [LaunchFacts("k", 2, 1, 2, 5, 3e-8, 2e-8, 1.5, 100, 130)]),
        Detokenized(1, 16, 17),
        RequestEnd(1, 18, 200, "length", 5, 8, 0.1, 0.01, 0.0, 0.2, 0, None),
        (0, "a plain tuple item"),     # not a lifecycle event, whatever it looks like
        Startup(1 << 90, 11, 1, 9, (StartupPhase("load_weights", 1, 4, {"a": 1}),
                                    StartupPhase("warmup_prefill", 4, 9, None)), {"b": 2.5}),
    ]
    wire = to_wire(items)
    assert all(type(item) is tuple for item in wire)
    back = from_wire(pickle.loads(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)))
    assert [type(b) for b in back] == [type(i) for i in items]
    for got, want in zip(back, items):
        assert got == want
    assert type(back[0].parent) is RemoteParent
    assert [type(p) for p in back[-1].phases] == [StartupPhase, StartupPhase]
