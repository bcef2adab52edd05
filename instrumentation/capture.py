"""OTLP capture files: what an engine exported, recorded for replay into the collector.

Format (JSON Lines; gzip when the file name ends in ``.gz``), one export per line::

    {"signal": "traces"|"metrics", "time_unix_nano": <int>, "request": <OTLP/JSON>}

An optional first line, ``{"signal": "meta", "meta": {...}}``, says what the recording was
(:func:`read_capture_meta` returns it, :func:`read_capture` skips it). ``request`` is
OTLP/JSON as the OTLP specification defines it (hex ids), so it can be POSTed as-is to any
OTLP/HTTP JSON receiver.

Guarantees: writes are serialized by a lock (exporter threads may share a writer); each
line is flushed as it is written, so a capture cut short by a crash loses at most the line
being written — :func:`read_capture` stops cleanly at a truncated tail. Cost: one protobuf
→ dict → JSON conversion per export batch, on the exporter's thread, never on a request.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import io
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from .otlp_json_ids import base64_to_hex, convert_ids

__all__ = [
    "CaptureRecord",
    "CaptureWriter",
    "CaptureSpanExporter",
    "CaptureMetricExporter",
    "read_capture",
    "read_capture_meta",
    "META_SIGNAL",
    "to_otlp_json",
    "from_otlp_json",
]

logger = logging.getLogger(__name__)

Signal = Literal["traces", "metrics"]
SIGNALS: tuple[str, ...] = ("traces", "metrics")
META_SIGNAL = "meta"
_REQUEST_TYPES = {"traces": ExportTraceServiceRequest, "metrics": ExportMetricsServiceRequest}


class CaptureRecord(NamedTuple):
    """One line of a capture: the signal, when it was written, the OTLP request."""

    signal: str
    time_unix_nano: int
    request: ExportTraceServiceRequest | ExportMetricsServiceRequest


def _id_to_base64(key: str, value: str) -> str:
    # OTLP/JSON ids are hex; accept protobuf-JSON base64 too (other writers emit it).
    if len(value) in (16, 32):
        try:
            return base64.b64encode(bytes.fromhex(value)).decode("ascii")
        except ValueError:
            pass
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"id {value!r} is neither hex nor base64") from None
    return value


def to_otlp_json(request: ExportTraceServiceRequest | ExportMetricsServiceRequest) -> dict:
    """The OTLP/JSON dict of an OTLP request (hex ids, integer enums, camelCase keys)."""
    # OTLP/JSON, not protobuf-JSON: the OTLP specification requires trace and span ids as hex
    # strings where protobuf's JSON mapping writes base64, so that a capture line's request can
    # be POSTed as-is to any OTLP/HTTP JSON receiver.
    as_dict = json_format.MessageToDict(request, use_integers_for_enums=True)
    return convert_ids(as_dict, base64_to_hex)


def from_otlp_json(signal: str, data: dict) -> ExportTraceServiceRequest | ExportMetricsServiceRequest:
    """Parses an OTLP/JSON dict (hex or base64 ids) into the request proto of ``signal``."""
    if signal not in _REQUEST_TYPES:
        raise ValueError(f"signal {signal!r} is not one of {'|'.join(SIGNALS)}")
    message = _REQUEST_TYPES[signal]()
    json_format.ParseDict(convert_ids(json.loads(json.dumps(data)), _id_to_base64), message,
                          ignore_unknown_fields=True)
    return message


def _open_text(path: Path, mode: str) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


class CaptureWriter:
    """Appends OTLP requests to a capture file; thread-safe; ``close()`` when done."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = _open_text(self.path, "a")
        self.lines_written = 0

    def write(self, signal: Signal,
              request: ExportTraceServiceRequest | ExportMetricsServiceRequest,
              time_unix_nano: int | None = None) -> None:
        if signal not in _REQUEST_TYPES:
            raise ValueError(f"signal {signal!r} is not one of {'|'.join(SIGNALS)}")
        if not isinstance(request, _REQUEST_TYPES[signal]):
            raise TypeError(
                f"{signal} capture needs {_REQUEST_TYPES[signal].__name__}, got {type(request).__name__}"
            )
        line = json.dumps(
            {
                "signal": signal,
                "time_unix_nano": int(time.time_ns() if time_unix_nano is None else time_unix_nano),
                "request": to_otlp_json(request),
            },
            separators=(",", ":"),
        )
        self._write_line(line)

    def _write_line(self, line: str) -> None:
        with self._lock:
            if self._file is None:
                raise ValueError(f"capture {self.path} is closed")
            self._file.write(line + "\n")
            self._file.flush()
            self.lines_written += 1

    def write_traces(self, request: ExportTraceServiceRequest, time_unix_nano: int | None = None) -> None:
        self.write("traces", request, time_unix_nano)

    def write_metrics(self, request: ExportMetricsServiceRequest, time_unix_nano: int | None = None) -> None:
        self.write("metrics", request, time_unix_nano)

    def write_meta(self, meta: dict) -> None:
        """Writes the metadata line; only as the file's first line (read_capture_meta)."""
        # What the recording was: tool, device, what was planted and when.
        if self.lines_written:
            raise ValueError(f"capture {self.path}: metadata must be its first line")
        line = json.dumps({"signal": META_SIGNAL, "meta": meta}, separators=(",", ":"), sort_keys=True)
        self._write_line(line)

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "CaptureWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CaptureSpanExporter(SpanExporter):
    """A SpanExporter that writes each batch as one ``traces`` capture line.

    Give it a :class:`CaptureWriter` (shared; the caller closes it) or a path (owned; closed
    on ``shutdown``). Write errors are logged and reported as FAILURE, never raised.
    """

    def __init__(self, writer: CaptureWriter | str | Path) -> None:
        self._owns = not isinstance(writer, CaptureWriter)
        self.writer = CaptureWriter(writer) if self._owns else writer

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            self.writer.write_traces(encode_spans(spans))
            return SpanExportResult.SUCCESS
        except Exception:
            logger.exception("could not write %d spans to capture %s", len(spans), self.writer.path)
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        if self._owns:
            self.writer.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class CaptureMetricExporter(MetricExporter):
    """A MetricExporter that writes each collection as one ``metrics`` capture line."""

    def __init__(self, writer: CaptureWriter | str | Path, preferred_temporality=None,
                 preferred_aggregation=None) -> None:
        super().__init__(preferred_temporality=preferred_temporality,
                         preferred_aggregation=preferred_aggregation)
        self._owns = not isinstance(writer, CaptureWriter)
        self.writer = CaptureWriter(writer) if self._owns else writer

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        try:
            self.writer.write_metrics(encode_metrics(metrics_data))
            return MetricExportResult.SUCCESS
        except Exception:
            logger.exception("could not write metrics to capture %s", self.writer.path)
            return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        if self._owns:
            self.writer.close()


def read_capture(path: str | Path, signals: Sequence[str] = SIGNALS) -> Iterator[CaptureRecord]:
    """Yields every record of a capture whose signal is in ``signals``, in file order (the
    others are not decoded).

    A truncated last line (a writer killed mid-write) ends the iteration with a warning;
    a malformed line elsewhere raises ValueError naming the file and line number.
    """
    path = Path(path)
    with _open_text(path, "r") as handle:
        lineno = 0
        while True:
            try:
                line = handle.readline()
            except (EOFError, gzip.BadGzipFile) as exc:  # cut-off gzip stream
                logger.warning("capture %s ends early after line %d: %s", path, lineno, exc)
                return
            if not line:
                return
            lineno += 1
            if not line.endswith("\n"):
                logger.warning("capture %s: line %d is truncated; stopping", path, lineno)
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                signal = obj["signal"]
                if signal == META_SIGNAL or (signal in SIGNALS and signal not in signals):
                    continue
                stamp = int(obj["time_unix_nano"])
                request = from_otlp_json(signal, obj["request"])
            except (ValueError, KeyError, TypeError, json_format.ParseError) as exc:
                raise ValueError(f"{path}:{lineno}: not a capture record: {exc}") from None
            yield CaptureRecord(signal, stamp, request)


def read_capture_meta(path: str | Path) -> dict | None:
    """The capture's metadata (its first line, when that is a metadata line), else None."""
    path = Path(path)
    with _open_text(path, "r") as handle:
        try:
            first = handle.readline()
        except (EOFError, gzip.BadGzipFile):
            return None
    try:
        obj = json.loads(first)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("signal") != META_SIGNAL:
        return None
    meta = obj.get("meta")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}:1: metadata line without a 'meta' object")
    return meta
