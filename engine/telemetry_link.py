"""Where each process of a served engine records its telemetry: one place to change it.

The engine core starts the telemetry pipeline (it owns the telemetry process and the GPU
telemetry, which stay where the CUDA context is) and names its endpoint in ``Ready``. An API
server joins it with its own producer id, so that its request keys are unique over all
producers and the core's Queued and Step events for those keys join its request spans.
Until ``TelemetryPipeline.join`` exists, an API server's events are forwarded to the core
(``ForwardedTelemetry``: pickled batches over the core's socket, sent before the request
they start, so that they precede the core's events for it) and the core records them into
its own pipeline: a few µs of the core's loop per request.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable

from ..instrumentation import (LifecycleRecorder, TelemetryConfig, TelemetryPipeline, TraceLevel,
                               from_wire, to_wire)
from .config import EngineConfig

__all__ = ["ForwardedTelemetry", "start_core_pipeline", "join_pipeline", "record_forwarded"]

_PRODUCER_SHIFT = 40   # a producer's request keys: producer_id << 40, +1, +2, ...


def start_core_pipeline(config: EngineConfig) -> tuple[TelemetryPipeline | None, str | None]:
    """The core's pipeline (None when tracing is off) and the endpoint API servers join."""
    if config.telemetry is None:
        return None, None
    pipeline = TelemetryPipeline.start(config.telemetry, mode=config.telemetry_mode)
    return pipeline, getattr(pipeline, "endpoint", None)


def join_pipeline(config: EngineConfig, endpoint: str | None, producer_id: int,
                  forward: Callable[[bytes], None]):
    """API server ``producer_id``'s telemetry: the core's pipeline joined at ``endpoint``, or
    (until that can be joined) a ``ForwardedTelemetry`` sending through ``forward``."""
    telemetry: TelemetryConfig | None = config.telemetry
    if telemetry is None or telemetry.level == TraceLevel.OFF:
        return None
    join = getattr(TelemetryPipeline, "join", None)
    if join is not None and endpoint is not None:
        return join(telemetry, endpoint, producer_id)
    return ForwardedTelemetry(telemetry, producer_id, forward)


class ForwardedTelemetry:
    """An API server's recorder whose events the core records (see the module docstring).

    ``flush`` sends what was recorded; the API server calls it before each request it hands
    to the core and on a timer. The pipeline's surface the server uses: ``recorder``,
    ``start_request``, ``registry``, ``force_flush``, ``shutdown``."""

    def __init__(self, config: TelemetryConfig, producer_id: int,
                 forward: Callable[[bytes], None]) -> None:
        self.config = config
        self.recorder = LifecycleRecorder(config)
        # keys unique over the producers of one telemetry process
        self.recorder._keys = itertools.count((producer_id << _PRODUCER_SHIFT) + 1)
        self.registry = None
        self._forward = forward

    def start_request(self, **kwargs):
        return self.recorder.start_request(**kwargs)

    def flush(self) -> None:
        events = self.recorder.drain()
        if events:
            self._forward(pickle.dumps(to_wire(events), protocol=pickle.HIGHEST_PROTOCOL))

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        self.flush()
        return True

    def shutdown(self, timeout_s: float | None = None) -> None:
        self.flush()


def record_forwarded(pipeline: TelemetryPipeline | None, payload: bytes) -> None:
    """In the core: an API server's forwarded events, into the core's recorder."""
    if pipeline is None:
        return
    record = pipeline.recorder.record
    for event in from_wire(pickle.loads(payload)):
        record(event)
