"""A span exporter that counts and forgets: it stands where the OTLP exporter would be, so a
bench measures the instrumentation's cost and not the network's."""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["DiscardExporter"]


class DiscardExporter(SpanExporter):
    """Accepts and forgets spans; ``spans`` counts how many it was given (no lock: the SDK's
    batch processor calls ``export`` from its one worker thread)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans):
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass
