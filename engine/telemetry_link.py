"""Where each process of a served engine records its telemetry: one place to change it.

The engine core starts the telemetry pipeline (it owns the telemetry process and the GPU
telemetry, which stay where the CUDA context is) and names its endpoint in ``Ready``. An API
server joins it with its own producer id, so that its request keys are unique over all
producers and the core's Queued and Step events for those keys join its request spans.
Until ``TelemetryPipeline.join`` exists, an API server starts a pipeline of its own: its
request spans are whole but for the phases the core records (queue, prefill, decode) and
the step links, which the core's telemetry process cannot join to them.
"""

from __future__ import annotations

import logging

from ..instrumentation import TelemetryConfig, TelemetryPipeline, TraceLevel
from .config import EngineConfig

__all__ = ["start_core_pipeline", "join_pipeline"]

log = logging.getLogger(__name__)


def start_core_pipeline(config: EngineConfig) -> tuple[TelemetryPipeline | None, str | None]:
    """The core's pipeline (None when tracing is off) and the endpoint API servers join."""
    if config.telemetry is None:
        return None, None
    pipeline = TelemetryPipeline.start(config.telemetry, mode=config.telemetry_mode)
    return pipeline, getattr(pipeline, "endpoint", None)


def join_pipeline(config: EngineConfig, endpoint: str | None,
                  producer_id: int) -> TelemetryPipeline | None:
    """API server ``producer_id``'s pipeline: the core's, joined at ``endpoint``."""
    telemetry: TelemetryConfig | None = config.telemetry
    if telemetry is None or telemetry.level == TraceLevel.OFF:
        return None
    join = getattr(TelemetryPipeline, "join", None)
    if join is not None and endpoint is not None:
        return join(telemetry, endpoint, producer_id)
    log.warning("API server %d: the core's telemetry cannot be joined yet; request spans go "
                "through a pipeline of this process", producer_id)
    return TelemetryPipeline.start(telemetry, mode=config.telemetry_mode)
