"""Span-derived distributions: the name dispatch, the handlers that read request, step and
kernel spans, and the per-series batches they feed.

Spans are dispatched on their name alone: request SERVER spans give TTFT, TPOT, e2e and
queue time by (model, priority: clamped to semconv's documented range); ``engine.step``
spans give step durations by phase; ``kernel ...`` spans give kernel durations by (gpu,
kernel); ``engine.step.rank`` spans give each tensor-parallel step's straggler
(:mod:`.stragglers`), per producing instance. Memory is bounded whatever arrives: at most
``max_{request,kernel,step}_series + 1`` series each (the extra one absorbs every new key past
the limit, counted in ``overflow``); a full table first lets go of its series idle past the
window horizon (counted in ``evicted``). Future timestamps are clamped to the collector's
clock. Not thread-safe: the owner (:class:`~.aggregator.Aggregator`) holds its lock around
every call and read. Spans are read from the decoded request (:mod:`.decoded_traces`: each
attribute still encoded). Cost per span: one dict lookup on the name; a kernel or step span
reads two cached attributes where they were last found; values fold in once per request.
"""
from __future__ import annotations

import enum
import functools
import logging
import math
from bisect import bisect_left
from collections.abc import Callable


from ..instrumentation import semconv as sc
from .aggregation_config import AggregationConfig, WindowConfig
from .decoded_traces import decode_attribute
from .otlp_points import (MAX_LABEL_CHARS as _MAX_LABEL_CHARS, clamped_time_s, label as _label, num as _num,
                          resource_instance)
from .stragglers import StragglerSeries
from .trace_store import REQUEST_SPAN_NAMES
from .windows import ClassicHistogram, Exemplar, SlidingHistogram

__all__ = ["SpanRole", "SpanSeries"]

log = logging.getLogger(__name__)
OVERFLOW = sc.OVERFLOW_LABEL_VALUE

_MAX_DISPATCH_NAMES = 4_096  # span names whose handler (or none) is remembered
# Caches keyed by what a client sends hold keys of at most this many bytes (characters for
# span names): a longer name or attribute is read each time it comes, never remembered, so
# the caches stay under ~4,096 x 512 bytes each whatever arrives.
_MAX_CACHED_KEY_BYTES = 512


class SpanRole(enum.IntEnum):
    """Which of Sightline's spans a span is (request, step, kernel, rank, or none of them),
    told from its name alone: what it feeds (an int: it indexes the handler tuples). Not
    OTel's ``SpanKind`` (server, client, internal), which the collector does not read."""

    NONE = 0
    REQUEST = 1
    STEP = 2
    KERNEL = 3
    RANK = 4


_REQUEST, _STEP, _KERNEL, _RANK = SpanRole.REQUEST, SpanRole.STEP, SpanRole.KERNEL, SpanRole.RANK
_RANK_KEYS = {sc.TP_RANK: "rank", sc.TP_SIZE: "size", sc.RANK_COMPUTE_S: "compute",
              sc.RANK_COLLECTIVE_WAIT_S: "wait"}
# Exemplar(...) goes through NamedTuple's Python-level __new__ (~0.6 us); this is ~0.25 us.
_exemplar = functools.partial(tuple.__new__, Exemplar)
# finish_reason values the counter keeps; anything else is "other" (bounded cardinality)
_FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "unknown", "tool_calls", "content_filter"})


def _priority_label(value) -> str:
    """A request priority's label: an integer clamped to the documented range, else "other"."""
    number = _num(value)
    if number is None or not math.isfinite(number) or number != int(number):
        return sc.PRIORITY_LABEL_OTHER
    return str(int(min(max(number, sc.REQUEST_PRIORITY_MIN), sc.REQUEST_PRIORITY_MAX)))


def _phase(prefill_tokens, decode_tokens) -> str:
    """A step's phase, from its token counts."""
    return "mixed" if prefill_tokens and decode_tokens else ("prefill" if prefill_tokens else "decode")


class _LatencySeries:
    """A classic histogram for Prometheus and a window for quantile queries.

    Spans of one export request are gathered per series (``add``: two list appends, the
    span kept for its ids) and folded in by ``flush`` at the end of that request, or when
    a span falls into another window slot: one window call per batch, and exemplar objects
    only for the classic buckets the batch touched (the latest span of each) and for the
    window (the slowest span) -- the same state as recording each span on its own."""

    __slots__ = ("window", "classic", "values", "spans", "epoch")

    def __init__(self, config: WindowConfig, bounds: tuple[float, ...]) -> None:
        self.window = SlidingHistogram(config)
        self.classic = ClassicHistogram(bounds)
        self.values: list[float] = []  # pending, in arrival order, all in slot ``epoch``
        self.spans: list = []  # the span of each pending value (its ids become exemplars)
        self.epoch = -1

    def flush(self) -> None:
        values, spans = self.values, self.spans
        if not values:
            return
        self.values, self.spans = [], []
        classic = self.classic
        bounds, counts = classic.bounds, classic.counts
        total = classic.sum
        latest: dict[int, int] = {}  # classic bucket -> index of its latest value
        best_i, best = 0, values[0]
        for i, value in enumerate(values):
            b = bisect_left(bounds, value)  # Prometheus buckets are "<= le"
            counts[b] += 1
            total += value
            latest[b] = i
            if value >= best:
                best_i, best = i, value
        classic.sum = total
        classic.count += len(values)
        exemplars = classic.exemplars
        for b, i in latest.items():
            span = spans[i]
            exemplars[b] = _exemplar((values[i], span.trace_id, span.span_id, span.end_time_unix_nano))
        i = latest.get(bisect_left(bounds, best))
        if i != best_i:
            span = spans[best_i]
            slowest = _exemplar((best, span.trace_id, span.span_id, span.end_time_unix_nano))
        else:
            slowest = exemplars[bisect_left(bounds, best)]
        self.window.record_many(values, self.epoch, slowest)


# What a request span's series read (in _on_request_attributes), each with whether it is a
# label: label values repeat, so their decoded form is cached by their encoding; latencies
# are unique and decoded each time. Adding a request attribute: one line here, and its use.
_REQUEST_ATTRIBUTES = {sc.GEN_AI_REQUEST_MODEL: True, sc.GEN_AI_RESPONSE_MODEL: True, sc.REQUEST_PRIORITY: True,
                       sc.GEN_AI_RESPONSE_FINISH_REASONS: True, sc.ERROR_TYPE: True, sc.REQUEST_TTFT_S: False,
                       sc.REQUEST_TPOT_S: False, sc.REQUEST_QUEUE_S: False, sc.REQUEST_E2E_S: False}
_REQUEST_KEYS = frozenset(_REQUEST_ATTRIBUTES)
_REQUEST_KEY_BYTES = frozenset(key.encode() for key in _REQUEST_KEYS)
_LABEL_KEYS = frozenset(key for key, is_label in _REQUEST_ATTRIBUTES.items() if is_label)
_MODEL, _RESPONSE_MODEL, _PRIORITY = sc.GEN_AI_REQUEST_MODEL, sc.GEN_AI_RESPONSE_MODEL, sc.REQUEST_PRIORITY
_PREFILL_TOKENS, _DECODE_TOKENS = sc.STEP_PREFILL_TOKENS, sc.STEP_DECODE_TOKENS
_KERNEL_NAME, _GPU_ID = sc.CUDA_KERNEL_NAME, sc.HW_GPU_ID
_KERNEL_PREFIX_CHARS = len(sc.SPAN_KERNEL_PREFIX)
# Attributes whose decoded form is cached by their encoding (values repeat: kernel names,
# GPU ids, token counts), with what the handlers read from each.
_HOT_ATTRIBUTES: dict[str, Callable] = {
    sc.CUDA_KERNEL_NAME: lambda v: v.string_value[:_MAX_LABEL_CHARS], sc.HW_GPU_ID: _label,
    sc.CUDA_DEVICE: _label, _PREFILL_TOKENS: lambda v: _num(v) or 0.0, _DECODE_TOKENS: lambda v: _num(v) or 0.0}
_HOT_KEY_BYTES = frozenset(key.encode() for key in _HOT_ATTRIBUTES)
_MAX_ATTRIBUTE_CACHE = 4_096  # entries; cleared when full (a few hundred bytes each)
_REQUEST_FAMILIES = (("ttft", sc.REQUEST_TTFT_S), ("tpot", sc.REQUEST_TPOT_S), ("queue", sc.REQUEST_QUEUE_S),
                     ("e2e", sc.REQUEST_E2E_S))
# Physical bounds: a span that feeds a distribution ends between 2000 and 2100 and lasts at
# most a day, and a latency attribute is within 0..1 day; anything else is refused and
# counted (dropped reason "span_out_of_range"): one absurd value would poison a sum for good.
_MIN_END_NS, _MAX_END_NS = 946_684_800 * 10**9, 4_102_444_800 * 10**9  # 2000-01-01, 2100-01-01 UTC
_MAX_SPAN_NS = 86_400 * 10**9
_MAX_LATENCY_S = 86_400.0
_CLIENT = 3  # Span.SPAN_KIND_CLIENT: a caller's view of a request (Zipkin's other half), not the request


class SpanSeries:
    """The span-derived series (``requests``, ``requests_total``, ``kernels``, ``steps``) and
    the handlers that fill them. ``overflow`` and ``dropped`` are the owner's counters, passed
    in and added to here (families ``request``/``kernel``/``step``; reasons ``malformed_span``, ``span_out_of_range``).
    """

    def __init__(self, config: AggregationConfig, overflow: dict[str, int], dropped: dict[str, int],
                 evicted: dict[str, int] | None = None) -> None:
        self.config = config
        wc = config.window
        self._wc = wc
        self.overflow = overflow
        self.dropped = dropped
        self.evicted = evicted if evicted is not None else {}
        # per family: before this data time no series of its full table can be idle (no scan)
        self._no_idle_before: dict[str, float] = {}
        self.kernels: dict[tuple[str, str], _LatencySeries] = {}
        self.requests: dict[tuple[str, str], dict[str, _LatencySeries]] = {}
        self.requests_total: dict[tuple[str, str, str], int] = {}
        self.steps: dict[str, _LatencySeries] = {}
        self.newest_data_s = 0.0  # newest span end time taken (clamped to the clock)
        # Span name -> handler, or None for the names no distribution needs (most spans:
        # queue, prefill, decode, ...). REQUEST_SPAN_NAMES holds the lower-cased spellings
        # Zipkin-born spans arrive with; kernel names are learnt as they come (bounded).
        self._dispatch: dict[str, int] = {name: _REQUEST for name in REQUEST_SPAN_NAMES}
        self._dispatch[sc.SPAN_ENGINE_STEP] = _STEP
        self._dispatch[sc.SPAN_RANK_STEP] = _RANK
        self.stragglers = StragglerSeries(config.stragglers, config.window, dropped, overflow)
        self._handlers = (None, self._on_request, self._on_step, self._on_kernel, self._on_rank)  # by kind
        # the export request being consumed and the index of the resource whose spans are
        # read now, for the handlers that need the producer
        self._request = None
        self._resource_index = 0
        self._instances: dict[int, str] = {}
        self._slot_s = wc.slot_s
        self._touched: dict[_LatencySeries, None] = {}  # series with pending values (this request)
        # Where the attributes read on hot spans were last found: producers write them in
        # one order, so one indexed read usually hits; a miss scans (and learns).
        self._kernel_pos = self._gpu_pos = 0
        self._prefill_pos, self._decode_pos = 0, 1
        self._attr_cache: dict[bytes, tuple[str, object]] = {}  # encoded KeyValue -> (key, decoded)
        self._label_cache: dict[bytes, tuple[str, object]] = {}  # encoded KeyValue -> (key, AnyValue)

    def consume(self, request, now: float) -> int:
        """Takes every span of ``request`` (a :data:`~.decoded_traces.DecodedTraceRequest`);
        returns the number of spans seen. Pending values are flushed before returning, even
        when an error escapes."""
        handlers = self._handlers
        cache = self._attr_cache
        n = 0
        dispatch = self._dispatch
        on_kernel, on_step = handlers[_KERNEL], handlers[_STEP]
        kernels, steps = self.kernels, self.steps
        slot_s = self._slot_s
        touched = self._touched = {}
        newest = self.newest_data_s
        self._request = request
        self._instances = {}
        try:
            for ri, rs in enumerate(request.resource_spans):
                self._resource_index = ri
                for ss in rs.scope_spans:
                    spans = ss.spans
                    n += len(spans)
                    for span in spans:
                        name = span.name
                        try:
                            kind = dispatch[name]
                        except KeyError:
                            kind = self._learn_name(name)
                        if not kind:
                            continue
                        try:
                            if kind == _REQUEST:
                                handlers[kind](span, now)
                                continue
                            # Kernel and step spans (most of the spans that feed a series): the
                            # handlers and _record_duration inlined for the usual case, the two
                            # attributes where they were last found; anything else goes to the
                            # handler, which scans (and learns the positions).
                            attrs = span.attributes
                            k = len(attrs)
                            if kind == _KERNEL:
                                i, j = self._kernel_pos, self._gpu_pos
                                if i >= k or j >= k:
                                    on_kernel(span, now)
                                    continue
                                hit = cache.get(attrs[i])
                                if hit is None or hit[0] != _KERNEL_NAME or not hit[1]:
                                    on_kernel(span, now)
                                    continue
                                kernel = hit[1]
                                hit = cache.get(attrs[j])
                                if hit is None or hit[0] != _GPU_ID or not hit[1]:
                                    on_kernel(span, now)
                                    continue
                                series = kernels.get((hit[1], kernel))
                                if series is None:
                                    on_kernel(span, now)
                                    continue
                            else:
                                if kind == _RANK:
                                    self._on_rank(span, now)
                                    continue
                                i, j = self._prefill_pos, self._decode_pos
                                if i >= k or j >= k:
                                    on_step(span, now)
                                    continue
                                hit, hit2 = cache.get(attrs[i]), cache.get(attrs[j])
                                if (hit is None or hit2 is None or hit[0] != _PREFILL_TOKENS
                                        or hit2[0] != _DECODE_TOKENS):
                                    on_step(span, now)
                                    continue
                                series = steps.get(_phase(hit[1], hit2[1]))
                                if series is None:
                                    on_step(span, now)
                                    continue
                            end_ns = span.end_time_unix_nano
                            duration = end_ns - span.start_time_unix_nano
                            if not _MIN_END_NS <= end_ns <= _MAX_END_NS or duration > _MAX_SPAN_NS:
                                self._drop("span_out_of_range")
                                continue
                            t = end_ns / 1e9
                            if t > now or t <= 0:
                                t = now
                            if t > newest:
                                newest = t
                            epoch = int(t // slot_s)
                            if epoch != series.epoch:
                                series.flush()
                                series.epoch = epoch
                            values = series.values
                            if not values:
                                touched[series] = None
                            values.append((duration if duration > 0 else 0) / 1e9)
                            series.spans.append(span)
                        except Exception:  # one odd span must not cost the rest of the batch
                            self._drop("malformed_span")
                            log.debug("span %r refused", name, exc_info=True)
        finally:
            if newest > self.newest_data_s:
                self.newest_data_s = newest
            for series in self._touched:  # one batch per touched series (see _LatencySeries)
                series.flush()
            self._touched = {}
        return n

    def _on_rank(self, span, now: float) -> None:
        """A tensor-parallel rank's part of a step: to the stragglers."""
        got = {}
        for raw in span.attributes:
            key, value = decode_attribute(raw)
            name = _RANK_KEYS.get(key)
            if name is not None:
                got[name] = _num(value)
        if any(got.get(name) is None for name in _RANK_KEYS.values()):
            self._drop("malformed_span")
            return
        self.stragglers.add_rank(self._instance(), bytes(span.trace_id), int(got["rank"]),
                                 int(got["size"]), got["compute"], got["wait"],
                                 self._time(span.end_time_unix_nano, now))

    def _instance(self) -> str:
        """The producer of the resource being read (service.instance.id, else host.name)."""
        ri = self._resource_index
        instance = self._instances.get(ri)
        if instance is None:
            instance = self._instances[ri] = resource_instance(self._request.resource_spans[ri].resource)
        return instance

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def _evict_idle(self, family: str, now: float) -> bool:
        """Lets go of every series of the full ``family`` table ("request" or "kernel") with no
        data within the window horizon (the overflow series stays); True if one went. One
        scan of the table at most until the next series could have become idle."""
        horizon = self._wc.horizon_s
        if now < self._no_idle_before.get(family, 0.0):
            return False
        table = self.requests if family == "request" else self.kernels
        touched = self._touched  # series with values pending in this request stay
        newest = {key: (max(s.epoch for s in series.values()) if family == "request" else series.epoch)
                  for key, series in table.items() if key != (OVERFLOW, OVERFLOW)
                  and not any(s in touched for s in (series.values() if family == "request" else (series,)))}
        idle_from = int((now - horizon) // self._slot_s)  # a series whose newest slot is before this is idle
        idle = [key for key, epoch in newest.items() if epoch < idle_from]
        for key in idle:
            del table[key]
        if idle and family == "request":
            gone = set(idle)
            for total_key in [k for k in self.requests_total if k[:2] in gone]:
                del self.requests_total[total_key]
        if idle:
            self.evicted[family] = self.evicted.get(family, 0) + len(idle)
            return True
        oldest = min(newest.values(), default=None)
        self._no_idle_before[family] = (now + horizon if oldest is None
                                        else (oldest + 1) * self._slot_s + horizon)
        return False

    # -- spans ----------------------------------------------------------------------
    def _learn_name(self, name: str) -> int:
        handler = _KERNEL if name.startswith(sc.SPAN_KERNEL_PREFIX) else SpanRole.NONE
        # past the count (or for a long name), names are tested each time
        if len(self._dispatch) < _MAX_DISPATCH_NAMES and len(name) <= _MAX_CACHED_KEY_BYTES:
            self._dispatch[name] = handler
        return handler

    def _time(self, unix_nano: int, now: float) -> float:
        t = clamped_time_s(unix_nano, now)
        if t > self.newest_data_s:
            self.newest_data_s = t
        return t

    def _on_request(self, span, now: float) -> None:
        if span.kind == _CLIENT:
            return
        got: dict[str, object] = {}
        cache = self._label_cache
        for raw in span.attributes:  # encoded KeyValues: decode the wanted ones
            if raw[:1] == b"\n" and len(raw) > 1 and raw[1] < 0x80 and raw[2:2 + raw[1]] not in _REQUEST_KEY_BYTES:
                continue  # key first and short (the encoders' way): not wanted, told from its bytes
            hit = cache.get(raw)
            if hit is not None:
                got[hit[0]] = hit[1]
                continue
            key, value = decode_attribute(raw)
            if key in _REQUEST_KEYS:
                got[key] = value
                if key in _LABEL_KEYS and len(raw) <= _MAX_CACHED_KEY_BYTES:  # model, priority: repeated
                    if len(cache) >= _MAX_ATTRIBUTE_CACHE:
                        cache.clear()
                    cache[raw] = (key, value)
        self._on_request_attributes(span, now, got)

    def _on_request_attributes(self, span, now: float, got: dict[str, object]) -> None:
        end_ns, start_ns = span.end_time_unix_nano, span.start_time_unix_nano
        if not _MIN_END_NS <= end_ns <= _MAX_END_NS or end_ns - start_ns > _MAX_SPAN_NS:
            self._drop("span_out_of_range")
            return
        latencies: dict[str, float] = {}
        for family, attr in _REQUEST_FAMILIES:
            if attr in got:
                value = _num(got[attr])
                if value is None:
                    continue  # not a number: as if absent
                if not 0 <= value <= _MAX_LATENCY_S:  # NaN too
                    self._drop("span_out_of_range")
                    return
                latencies[family] = value
        if "e2e" not in latencies:
            latencies["e2e"] = max(0, end_ns - start_ns) / 1e9
        value = got.get(_MODEL)
        if value is None:
            value = got.get(_RESPONSE_MODEL)
        model = _label(value) if value is not None else "unknown"
        value = got.get(_PRIORITY)
        key = (model, _priority_label(value) if value is not None else "unknown")
        series = self.requests.get(key)
        if series is None:
            if len(self.requests) >= self.config.max_request_series and not self._evict_idle("request", now):
                key = (OVERFLOW, OVERFLOW)
                self.overflow["request"] = self.overflow.get("request", 0) + 1
                series = self.requests.get(key)
            if series is None:
                wc = self._wc
                series = self.requests[key] = {
                    "ttft": _LatencySeries(wc, sc.COLLECTOR_LATENCY_BUCKETS_S),
                    "tpot": _LatencySeries(wc, sc.TPOT_BUCKETS_S),
                    "e2e": _LatencySeries(wc, sc.COLLECTOR_LATENCY_BUCKETS_S),
                    "queue": _LatencySeries(wc, sc.COLLECTOR_LATENCY_BUCKETS_S),
                }
        epoch = int(self._time(end_ns, now) // self._slot_s)
        for family, value in latencies.items():
            self._pend(series[family], value, epoch, span)
        error = _label(got[sc.ERROR_TYPE]) if sc.ERROR_TYPE in got else None
        if error == sc.ERROR_TYPE_CLIENT_DISCONNECTED:
            reason = "abort"  # as the engine counts it
        elif error is not None or span.status.code == 2:
            reason = "error"
        elif sc.GEN_AI_RESPONSE_FINISH_REASONS in got:
            reason = _label(got[sc.GEN_AI_RESPONSE_FINISH_REASONS]) or "unknown"
            if reason not in _FINISH_REASONS:
                reason = "other"
        else:
            reason = "unknown"
        total_key = (key[0], key[1], reason if key[0] != OVERFLOW else OVERFLOW)
        self.requests_total[total_key] = self.requests_total.get(total_key, 0) + 1

    def _on_step(self, span, now: float) -> None:
        # The slow path of consume's inlined one (which tried the positions already): a scan
        # that learns where the token counts are.
        prefill, decode, at_prefill, at_decode, _ = self._scan_pair(span.attributes, _PREFILL_TOKENS, _DECODE_TOKENS)
        if at_prefill >= 0:
            self._prefill_pos = at_prefill
        if at_decode >= 0:
            self._decode_pos = at_decode
        self._on_step_phase(span, now, prefill, decode)

    def _on_step_phase(self, span, now: float, prefill, decode) -> None:
        phase = _phase(prefill, decode)
        series = self.steps.get(phase)
        if series is None:
            if len(self.steps) >= self.config.max_step_series:  # only with odd phases
                phase = OVERFLOW
                self.overflow["step"] = self.overflow.get("step", 0) + 1
            series = self.steps.get(phase)
            if series is None:
                series = self.steps[phase] = _LatencySeries(self._wc, sc.STEP_BUCKETS_S)
        self._record_duration(series, span, now)

    def _on_kernel(self, span, now: float) -> None:
        # The slow path of consume's inlined one: a position missed, an odd value, or a new
        # series. Scans (learning positions and caching attributes).
        gpu, kernel = self._scan_kernel(span.attributes)
        self._on_kernel_labels(span, now, gpu, kernel)

    def _on_kernel_labels(self, span, now: float, gpu: str, kernel: str | None) -> None:
        key = (gpu, kernel or span.name[_KERNEL_PREFIX_CHARS:_KERNEL_PREFIX_CHARS + _MAX_LABEL_CHARS])
        series = self.kernels.get(key)
        if series is None:
            if len(self.kernels) >= self.config.max_kernel_series and not self._evict_idle("kernel", now):
                key = (OVERFLOW, OVERFLOW)
                self.overflow["kernel"] = self.overflow.get("kernel", 0) + 1
                series = self.kernels.get(key)
            if series is None:
                series = self.kernels[key] = _LatencySeries(self._wc, sc.CTA_BUCKETS_S + (
                    0.2, 0.5, 1.0))
        self._record_duration(series, span, now)

    def _scan_kernel(self, attrs) -> tuple[str, str | None]:
        gpu, kernel, at_gpu, at_kernel, device = self._scan_pair(attrs, _GPU_ID, _KERNEL_NAME, sc.CUDA_DEVICE)
        if at_gpu >= 0:
            self._gpu_pos = at_gpu
        if at_kernel >= 0:
            self._kernel_pos = at_kernel
        return gpu or device or "unknown", kernel

    def _scan_pair(self, attrs, first_key: str, second_key: str, also_key: str | None = None):
        """``(first, second, first_at, second_at, also)``: the values of two attributes of an
        encoded span, stopping once both are seen; ``*_at`` is the position the key was last
        found at (-1: absent), for the position fast paths; ``also`` is ``also_key``'s value
        if it came before the stop."""
        first = second = also = None
        first_at = second_at = -1
        hot = self._hot_attribute
        for k, raw in enumerate(attrs):
            if raw[:1] == b"\n" and len(raw) > 1 and raw[1] < 0x80 and raw[2:2 + raw[1]] not in _HOT_KEY_BYTES:
                continue  # not a hot key, told from its bytes (as _hot_attribute would, without the call)
            key, value = hot(raw)
            if key == first_key:
                first, first_at = value, k
                if second is not None:
                    break
            elif key == second_key:
                second, second_at = value, k
                if first is not None:
                    break
            elif key == also_key:
                also = value
        return first, second, first_at, second_at, also

    def _hot_attribute(self, raw: bytes) -> tuple[str, object]:
        """``(key, what the handlers read)`` of an encoded attribute, cached for the keys in
        ``_HOT_ATTRIBUTES`` (``(key, None)`` for the others)."""
        hit = self._attr_cache.get(raw)
        if hit is None:
            # Key first, short (the encoders' way): a key that is not hot is told from its
            # bytes, without decoding (unique values such as ids would only churn the cache).
            if raw[:1] == b"\n" and len(raw) > 1 and raw[1] < 0x80 and raw[2:2 + raw[1]] not in _HOT_KEY_BYTES:
                return "", None
            key, value = decode_attribute(raw)
            read = _HOT_ATTRIBUTES.get(key)
            if read is None:
                return key, None
            hit = (key, read(value))
            if len(raw) > _MAX_CACHED_KEY_BYTES:
                return hit
            if len(self._attr_cache) >= _MAX_ATTRIBUTE_CACHE:
                self._attr_cache.clear()
            self._attr_cache[raw] = hit
        return hit

    def _record_duration(self, series: _LatencySeries, span, now: float) -> None:
        end_ns = span.end_time_unix_nano
        duration = end_ns - span.start_time_unix_nano
        if not _MIN_END_NS <= end_ns <= _MAX_END_NS or duration > _MAX_SPAN_NS:
            self._drop("span_out_of_range")
            return
        duration = max(0, duration) / 1e9
        t = end_ns / 1e9  # self._time inlined: most recorded spans pass here
        if t > now or t <= 0:
            t = now
        if t > self.newest_data_s:
            self.newest_data_s = t
        epoch = int(t // self._slot_s)
        if epoch != series.epoch:
            series.flush()
            series.epoch = epoch
        values = series.values
        if not values:
            self._touched[series] = None
        values.append(duration)
        series.spans.append(span)

    def _pend(self, series: _LatencySeries, value: float, epoch: int, span) -> None:
        if epoch != series.epoch:
            series.flush()
            series.epoch = epoch
        values = series.values
        if not values:
            self._touched[series] = None
        values.append(value)
        series.spans.append(span)
