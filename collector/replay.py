"""Replays an OTLP capture file into a running collector or an in-process aggregator.

A capture (``instrumentation/capture.py``: JSON Lines of OTLP/JSON export requests with
the time each was written) is read line by line and each export is either POSTed as
OTLP/HTTP protobuf to a collector's ingest port (``/v1/traces``, ``/v1/metrics``) or
handed to an :class:`~.aggregator.Aggregator` directly.

Timing: ``speed=0`` sends as fast as the sink accepts; ``speed=1`` keeps the recorded
gaps between exports (``2`` halves them). Timestamps: with ``rebase`` (the default) every
timestamp in the data (span start/end, events, links are untouched; metric point
start/time and exemplars) is shifted by one offset so the capture appears to happen
now: its last export lands at the moment replay starts when sending as fast as
possible, its first export at the start when pacing. Without ``rebase`` the collector's
windows see the original times, which fall outside any live window for old captures.

Back-pressure: an HTTP 429/503 answer is retried after its ``Retry-After`` (at most
``max_retries`` times); any other non-2xx answer stops the replay with an error naming
the line. Memory: one export at a time (plus one pass over the file's times when
rebasing an as-fast-as-possible replay).
"""

from __future__ import annotations

import gzip
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..instrumentation import check_range

__all__ = ["AggregatorSink", "HttpSink", "ReplayConfig", "ReplayResult", "rebase_request", "replay"]

_PATHS = {"traces": "/v1/traces", "metrics": "/v1/metrics"}


@dataclass(frozen=True)
class ReplayConfig:
    speed: float = 0.0  # 0: as fast as possible; 1: the recorded pace
    rebase: bool = True
    max_retries: int = 20

    def __post_init__(self) -> None:
        check_range("speed", self.speed, 0, 1000, hint="(0 = as fast as possible)")
        check_range("max_retries", self.max_retries, 0, 1000, integer=True)


@dataclass
class ReplayResult:
    exports: int = 0
    spans: int = 0
    data_points: int = 0
    retries: int = 0
    duration_s: float = 0.0
    shift_ns: int = 0


class HttpSink:
    """POSTs OTLP/HTTP protobuf to ``base_url`` (e.g. ``http://127.0.0.1:4318``)."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.retries = 0

    def send(self, signal: str, request, max_retries: int) -> None:
        body = request.SerializeToString()
        url = self.base_url + _PATHS[signal]
        for attempt in range(max_retries + 1):
            req = urllib.request.Request(url, data=body, method="POST", headers={
                "Content-Type": "application/x-protobuf", **self.headers})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as response:
                    response.read()
                    return
            except urllib.error.HTTPError as exc:
                if exc.code not in (429, 503) or attempt == max_retries:
                    detail = exc.read()[:300].decode("utf-8", "replace")
                    raise RuntimeError(f"{url} answered {exc.code}: {detail}") from None
                self.retries += 1
                try:
                    wait_s = float(exc.headers.get("Retry-After", "1"))
                except ValueError:
                    wait_s = 1.0
                time.sleep(min(max(wait_s, 0.05), 5.0))


class AggregatorSink:
    """Feeds an in-process aggregator (``sightline replay FILE`` without ``--collector``)."""

    def __init__(self, aggregator) -> None:
        self.aggregator = aggregator
        self.retries = 0

    def send(self, signal: str, request, max_retries: int) -> None:
        if signal == "traces":
            self.aggregator.consume_traces(request)
        else:
            self.aggregator.consume_metrics(request)


def _capture_times(path: Path) -> tuple[int, int] | None:
    """First and last ``time_unix_nano`` of a capture (stops at a truncated tail)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    first = last = None
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                try:
                    t = int(json.loads(line)["time_unix_nano"])
                except (ValueError, KeyError, TypeError):
                    break
                first = t if first is None else first
                last = t
    except EOFError:  # a gzip stream cut short
        pass
    return None if first is None else (first, last)


def rebase_request(signal: str, request, shift_ns: int) -> None:
    """Shifts every timestamp of an export request by ``shift_ns`` (in place)."""
    if not shift_ns:
        return
    if signal == "traces":
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    span.start_time_unix_nano = max(0, span.start_time_unix_nano + shift_ns)
                    span.end_time_unix_nano = max(0, span.end_time_unix_nano + shift_ns)
                    for event in span.events:
                        event.time_unix_nano = max(0, event.time_unix_nano + shift_ns)
        return
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                if kind is None:
                    continue
                for point in getattr(metric, kind).data_points:
                    if point.start_time_unix_nano:
                        point.start_time_unix_nano = max(0, point.start_time_unix_nano + shift_ns)
                    point.time_unix_nano = max(0, point.time_unix_nano + shift_ns)
                    for ex in getattr(point, "exemplars", ()):
                        ex.time_unix_nano = max(0, ex.time_unix_nano + shift_ns)


def replay(path: str | Path, sink, config: ReplayConfig | None = None,
           clock_ns=time.time_ns) -> ReplayResult:
    """Sends every export of the capture at ``path`` to ``sink``; see the module docstring."""
    from sightline.collector.otlp_http import count_data_points, count_spans
    from sightline.instrumentation.capture import read_capture

    config = config or ReplayConfig()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"capture {path} does not exist")
    result = ReplayResult()
    start_wall = time.monotonic()
    now_ns = clock_ns()
    times = _capture_times(path)
    if times is None:
        return result
    first_ns, last_ns = times
    if config.rebase:
        result.shift_ns = now_ns - (first_ns if config.speed > 0 else last_ns)
    for line_no, (signal, t_ns, request) in enumerate(read_capture(path), start=1):
        if config.speed > 0:
            due = start_wall + (t_ns - first_ns) / 1e9 / config.speed
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        rebase_request(signal, request, result.shift_ns)
        try:
            sink.send(signal, request, config.max_retries)
        except Exception as exc:
            raise RuntimeError(f"capture line {line_no} ({signal}): {exc}") from exc
        result.exports += 1
        if signal == "traces":
            result.spans += count_spans(request)
        else:
            result.data_points += count_data_points(request)
    result.retries = sink.retries
    result.duration_s = time.monotonic() - start_wall
    return result
