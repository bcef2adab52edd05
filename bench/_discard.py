"""A span exporter that encodes and forgets: it stands where the OTLP exporter would be,
so a bench measures the instrumentation's cost — including the OTLP protobuf encoding the
real exporter does on its thread, in this process — but not the network's."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["DiscardExporter"]


class DiscardExporter(SpanExporter):
    """Encodes spans as the OTLP exporter would (unless ``encode=False``), then drops the
    bytes; ``spans`` counts how many it was given and ``bytes`` what they encoded to (no lock: the SDK's batch processor
    calls ``export`` from its one worker thread)."""

    def __init__(self, encode: bool = True) -> None:
        self.encode = encode     # False: forget at once (a calling-thread microbenchmark)
        self.spans = 0
        self.bytes = 0

    def export(self, spans):
        self.spans += len(spans)
        if self.encode:
            self.bytes += len(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass
