"""Replays an OTLP capture file into a running collector or an in-process aggregator.

A capture (JSON Lines of OTLP/JSON export requests with the time each was written, after
an optional metadata line: ``instrumentation/capture.py``) is read line by line; each export
is POSTed as OTLP/HTTP protobuf to a collector's ingest port or handed to an
:class:`~.aggregator.Aggregator`. With ``rebase`` (the default) the capture happens now and
keeps its spacing (:class:`TimeMap`); spans keep their durations, so a child stays inside
its parent. ``signals`` replays one kind only; a later replay of the rest may pass the
first one's ``time_map`` so both land on the same clock.

Guarantee: every export is delivered or the replay stops with an error naming its line
(429/503 are retried after ``Retry-After``, at most ``max_retries`` times). Memory: one
export at a time, plus one pass over the file's times first.
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
from ..instrumentation import META_SIGNAL
from ..instrumentation import semconv as sc

__all__ = ["AggregatorSink", "HttpSink", "ReplayConfig", "ReplayResult", "TimeMap", "metric_points",
           "rebase_request", "replay"]

_PATHS = {"traces": "/v1/traces", "metrics": "/v1/metrics"}
# span attributes that are instants (Unix ns): they move with their span, or a step's launch
# end would land days before the step it ended and the collector's GPU/host split would not use it
_INSTANT_ATTRIBUTES = frozenset((sc.KERNEL_LAUNCH_END_NS, sc.STEP_WAIT_START_NS))


@dataclass(frozen=True)
class ReplayConfig:
    speed: float = 0.0  # 0: as fast as possible; N: N times the recorded pace, time compressed
    rebase: bool = True
    max_retries: int = 20
    signals: tuple[str, ...] = ("traces", "metrics")  # replay only these
    # > 0 (with speed 0): shifted by whole ``slot_s`` slots of the collector, never after
    # now: each slot then holds what it held live, the same way on every run (else the
    # slots' phase depends on when the replay starts, and a slot's exports with it)
    align_slot_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.signals or set(self.signals) - set(_PATHS):
            raise ValueError(f"signals={self.signals} must be a non-empty subset of {tuple(_PATHS)}")
        check_range("speed", self.speed, 0, 1000, hint="(0 = as fast as possible)")
        check_range("max_retries", self.max_retries, 0, 1000, integer=True)
        check_range("align_slot_s", self.align_slot_s, 0, 3600)


@dataclass(frozen=True)
class TimeMap:
    """Where an instant of the capture lands: ``origin + (t - first) / speed`` when paced,
    ``t + (origin - first)`` otherwise (speed 0: ``first`` is then the capture's last export)."""

    # speed 0 sends as fast as the sink accepts, every timestamp shifted by one offset so that
    # the last export lands at the moment replay starts: a 3-minute capture fills the
    # collector's last 3 minutes of windows at once. speed N paces the exports at N times the
    # recorded rate and compresses time to match, so what arrives is stamped with the wall
    # time it arrives at. Without rebase timestamps are untouched (old captures then fall
    # outside any live window).

    first_ns: int = 0
    origin_ns: int = 0
    speed: float = 0.0

    @property
    def shift_ns(self) -> int:
        """The offset added at ``first_ns`` (the whole shift when speed is 0)."""
        return self.origin_ns - self.first_ns

    def __call__(self, t_ns: int) -> int:
        if self.speed > 0:
            return max(0, self.origin_ns + int(round((t_ns - self.first_ns) / self.speed)))
        return max(0, t_ns + self.origin_ns - self.first_ns)


@dataclass
class ReplayResult:
    exports: int = 0
    spans: int = 0
    data_points: int = 0
    retries: int = 0
    duration_s: float = 0.0
    time_map: TimeMap = TimeMap()

    @property
    def shift_ns(self) -> int:
        return self.time_map.shift_ns


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
                    record = json.loads(line)
                    if record.get("signal") == META_SIGNAL:
                        continue
                    t = int(record["time_unix_nano"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    break
                first = t if first is None else first
                last = t
    except EOFError:  # a gzip stream cut short
        pass
    return None if first is None else (first, last)


def _slot_aligned(last_ns: int, now_ns: int, slot_ns: int) -> int:
    """The latest anchor <= ``now_ns`` for ``TimeMap(last_ns, anchor)`` that shifts the
    capture by whole slots: each point lands in the slot that held it live."""
    return now_ns - (now_ns - last_ns % slot_ns) % slot_ns


def rebase_request(signal: str, request, time_map) -> None:
    """Maps every timestamp of an export request through ``time_map`` (in place): a
    :class:`TimeMap`, or an int offset in ns. Spans, their events and their instant
    attributes (``_INSTANT_ATTRIBUTES``) keep their offsets from the span's start."""
    if isinstance(time_map, int):
        if not time_map:
            return
        time_map = TimeMap(0, time_map)
    if signal == "traces":
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    start = span.start_time_unix_nano
                    new_start = time_map(start)
                    span.start_time_unix_nano = new_start
                    span.end_time_unix_nano = max(0, new_start + span.end_time_unix_nano - start)
                    for event in span.events:
                        event.time_unix_nano = max(0, new_start + event.time_unix_nano - start)
                    for kv in span.attributes:
                        if kv.key in _INSTANT_ATTRIBUTES and kv.value.HasField("int_value") and kv.value.int_value:
                            kv.value.int_value = max(0, new_start + kv.value.int_value - start)
        return
    for _, point in metric_points(request):
        if point.start_time_unix_nano:
            point.start_time_unix_nano = time_map(point.start_time_unix_nano)
        point.time_unix_nano = time_map(point.time_unix_nano)
        for ex in getattr(point, "exemplars", ()):
            ex.time_unix_nano = time_map(ex.time_unix_nano)


def metric_points(request):
    """Every ``(metric, data point)`` of a metrics export request, of any metric type."""
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                if kind is not None:
                    for point in getattr(metric, kind).data_points:
                        yield metric, point


def replay(path: str | Path, sink, config: ReplayConfig | None = None,
           clock_ns=time.time_ns, time_map: TimeMap | None = None) -> ReplayResult:
    """Sends every export of the capture at ``path`` to ``sink``; see the module docstring.
    ``time_map``: that of an earlier replay of the same capture (e.g. its metrics first,
    then its spans), instead of one anchored now."""
    from ..instrumentation import read_capture
    from .decoding import count_data_points, count_spans

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
    if time_map is not None:
        result.time_map = time_map
    elif config.rebase and config.speed > 0:
        result.time_map = TimeMap(first_ns, now_ns, config.speed)
    elif config.rebase:
        anchor_ns = now_ns
        if config.align_slot_s > 0:
            anchor_ns = _slot_aligned(last_ns, now_ns, int(config.align_slot_s * 1e9))
        result.time_map = TimeMap(last_ns, anchor_ns)
    start_ns = now_ns if time_map is None else time_map(first_ns)
    for line_no, (signal, t_ns, request) in enumerate(read_capture(path, config.signals), start=1):
        if config.speed > 0:
            due = start_wall + (start_ns - now_ns) / 1e9 + (t_ns - first_ns) / 1e9 / config.speed
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        if config.rebase:
            rebase_request(signal, request, result.time_map)
        try:
            sink.send(signal, request, config.max_retries)
        except Exception as exc:
            raise RuntimeError(f"capture export {line_no} ({signal}): {exc}") from exc
        result.exports += 1
        if signal == "traces":
            result.spans += count_spans(request)
        else:
            result.data_points += count_data_points(request)
    result.retries = sink.retries
    result.duration_s = time.monotonic() - start_wall
    return result
