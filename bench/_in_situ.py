"""Wall time spent inside the tracing calls an engine makes, timed where they are made.

A benchmark's whole-run comparison (telemetry off vs on) drowns small costs in run-to-run
noise; this times the calls themselves during a real run, so their share of the engine
loop is known to within the wrapper's own cost.
"""

from __future__ import annotations

import time

__all__ = ["InSituTimer"]


class InSituTimer:
    """Times every tracing call the engine makes, in place (wall ns inside the calls).

    Patches the public methods of Telemetry, RequestTrace and StepTrace with a timing
    wrapper for the duration of a ``with`` block. The wrapper's own cost (two
    ``perf_counter_ns`` calls, ~0.1-0.3 µs) is included, so the figure is an upper bound.
    """

    METHODS = {
        "Telemetry": ("start_request", "start_step"),
        "RequestTrace": ("start_phase", "end_phase", "link_step", "preempted", "first_token",
                         "finish"),
        "StepTrace": ("end",),
    }

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self._saved: list[tuple[type, str, object]] = []

    def __enter__(self) -> "InSituTimer":
        from sightline.instrumentation import tracing

        for class_name, names in self.METHODS.items():
            cls = getattr(tracing, class_name)
            for name in names:
                original = getattr(cls, name)
                self._saved.append((cls, name, original))
                setattr(cls, name, self._wrap(original))
        return self

    def _wrap(self, fn):
        timer = self
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.ns += clock() - t0
                timer.calls += 1

        return timed

    def __exit__(self, *exc) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()
