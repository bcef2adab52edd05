"""Where each process of a served engine records its telemetry: one place to change it.

The engine core starts the telemetry pipeline (it owns the telemetry process and the GPU
telemetry, which stay where the CUDA context is) and names its producer endpoint in
``Ready``. Each API server joins that telemetry process with its own producer id (its index
+ 1; the core is 0), from inside its own process, so that its request keys are unique over
all producers and the core's Queued and Step events for those keys join its request spans
there. The API server records RequestStart, Tokenized, RequestAttributes, Detokenized and
RequestEnd; the core Queued and Step. Drop counts of a joined producer are the only figures
that cross the core's socket (``TelemetryDrops``, on change, at most once a second), so
that the core's series on ``/metrics`` count every producer's drops once.
Cost: none on the core's loop per request; one ZMQ send per ship tick in each API server.
"""

from __future__ import annotations

from ..instrumentation import TelemetryPipeline, TraceLevel
from .config import EngineConfig

__all__ = ["start_core_pipeline", "join_pipeline"]


def start_core_pipeline(config: EngineConfig) -> tuple[TelemetryPipeline | None, str | None]:
    """The core's pipeline (None when tracing is off) and the endpoint API servers join."""
    if config.telemetry is None:
        return None, None
    pipeline = TelemetryPipeline.start(config.telemetry, mode=config.telemetry_mode)
    if pipeline is None:
        return None, None
    return pipeline, pipeline.producer_endpoint


def join_pipeline(config: EngineConfig, endpoint: str | None, producer_id: int):
    """API server ``producer_id``'s telemetry: the core's telemetry process joined at
    ``endpoint`` (None when tracing is off). Call it in the API server's own process: ZMQ
    contexts do not survive a fork."""
    telemetry = config.telemetry
    if telemetry is None or telemetry.level == TraceLevel.OFF or endpoint is None:
        return None
    return TelemetryPipeline.join(telemetry, endpoint, producer_id)
