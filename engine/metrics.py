"""The engine's Prometheus series (``/metrics``), named in ``instrumentation/semconv.py``.

Each API server owns one ``EngineMetrics`` (several may live in one test process), fed by
its ``OutputProcessor``: request series per request, one inter-token latency per token, the
step series from the core's per-step stats; the server records request errors. Updates are
plain prometheus_client calls, O(1) each. Several API server processes write
prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``) and each exposes
the sums (gauges: the live maximum; one server writes them); exemplars need one process. Histogram buckets come from semconv, so the dashboards and rules read the same
boundaries the engine writes. TTFT, ITL and end-to-end observations of a sampled request
carry its trace id as an exemplar; ``exposition`` serves them when the scraper accepts
OpenMetrics (the classic text format has no exemplars).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from ..instrumentation import semconv as sc
from .http_limits import CLOSE_REASONS

__all__ = ["CoreMetrics", "EngineMetrics", "trace_exemplar"]

_OPENMETRICS_EOF = b"# EOF\n"


def trace_exemplar(trace) -> dict[str, str] | None:
    """Exemplar labels that point at a request's trace, ``{trace_id: 32 hex digits}``, from
    the handle ``start_request`` returned; None without one, or when its trace is not
    sampled (stored nowhere). The one place that reads the handle."""
    if trace is None or not getattr(trace, "sampled", True):
        return None
    return {sc.EXEMPLAR_TRACE_ID_LABEL: trace.trace_id_hex}


class EngineMetrics:
    """All engine series for one served model name.

    Each attribute is the series bound to this model (label lookup done once here, not per
    observation); the families live in ``registry``.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.collected = CollectorRegistry(auto_describe=True)   # read at scrape time (NVML)
        m = [sc.LABEL_MODEL]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            # one API server sets them; the others' zeros never win the maximum
            return Gauge(name, doc, m, registry=r, multiprocess_mode="livemax").labels(model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=r).labels(model)

        self._requests_by_reason = Counter(sc.ENGINE_REQUESTS_TOTAL,
                                           "Finished requests by finish reason.",
                                           m + [sc.LABEL_FINISH_REASON], registry=r)
        self._errors_by_code = Counter(sc.ENGINE_REQUEST_ERRORS_TOTAL,
                                       "Requests refused or failed, by HTTP status code.",
                                       m + [sc.LABEL_CODE], registry=r)
        self.ttft = histogram(sc.ENGINE_TTFT_SECONDS, "Time from arrival to the first token.",
                              sc.TTFT_BUCKETS_S)
        self.tpot = histogram(sc.ENGINE_TPOT_SECONDS, "Mean time per output token after the first.",
                              sc.TPOT_BUCKETS_S)
        self.e2e = histogram(sc.ENGINE_E2E_SECONDS, "Time from arrival to the last token.",
                             sc.REQUEST_DURATION_BUCKETS_S)
        self.queue = histogram(sc.ENGINE_QUEUE_SECONDS, "Time from arrival to first scheduling.",
                               sc.REQUEST_DURATION_BUCKETS_S)
        self.running = gauge(sc.ENGINE_RUNNING, "Requests holding KV blocks.")
        self.waiting = gauge(sc.ENGINE_WAITING, "Requests in the waiting queue.")
        self.kv_usage = gauge(sc.ENGINE_KV_USAGE, "Fraction of KV cache blocks in use (0..1).")
        self.preemptions = counter(sc.ENGINE_PREEMPTIONS_TOTAL, "Requests preempted (recompute).")
        self.step = histogram(sc.ENGINE_STEP_SECONDS, "Duration of one engine step.",
                              sc.STEP_BUCKETS_S)
        self.step_tokens = histogram(sc.ENGINE_STEP_TOKENS, "Tokens computed per engine step.",
                                     sc.TOKENS_PER_STEP_BUCKETS)
        self.prompt_tokens = counter(sc.ENGINE_PROMPT_TOKENS_TOTAL,
                                     "Prompt tokens of finished requests.")
        self.generation_tokens = counter(sc.ENGINE_GENERATION_TOKENS_TOTAL, "Tokens generated.")
        self.itl = histogram(sc.ENGINE_ITL_SECONDS, "Time between consecutive tokens of a request (one "
                             "observation per token after the first).", sc.ITL_BUCKETS_S)
        self.request_prompt_tokens = histogram(sc.ENGINE_REQUEST_PROMPT_TOKENS,
                                               "Prompt tokens per finished request.", sc.REQUEST_TOKENS_BUCKETS)
        self.request_generation_tokens = histogram(sc.ENGINE_REQUEST_GENERATION_TOKENS,
                                                   "Generated tokens per finished request.",
                                                   sc.REQUEST_TOKENS_BUCKETS)
        self.prefill = histogram(sc.ENGINE_PREFILL_SECONDS, "Time from first scheduling to the first token.",
                                 sc.REQUEST_DURATION_BUCKETS_S)
        self.decode = histogram(sc.ENGINE_DECODE_SECONDS, "Time from the first token to the last.",
                                sc.REQUEST_DURATION_BUCKETS_S)
        self.prefix_cache_queries = counter(sc.ENGINE_PREFIX_CACHE_QUERIES_TOTAL,
                                            "Tokens of admitted requests looked up in the prefix cache.")
        self.prefix_cache_hits = counter(sc.ENGINE_PREFIX_CACHE_HITS_TOTAL,
                                         "Of the looked-up tokens, those whose KV the prefix cache held.")
        self.prefix_cache_evictions = counter(sc.ENGINE_PREFIX_CACHE_EVICTIONS_TOTAL,
                                              "Cached KV blocks taken for other content.")
        self.prefix_cache_blocks = gauge(sc.ENGINE_PREFIX_CACHE_BLOCKS,
                                         "KV blocks in the prefix cache, held or evictable.")
        ttft_by_cache = Histogram(sc.ENGINE_PREFIX_CACHE_TTFT_SECONDS,
                                  "Time to first token by prefix cache outcome (hit: some prompt "
                                  "tokens were served from the cache).", m + [sc.LABEL_PREFIX_CACHE],
                                  buckets=sc.TTFT_BUCKETS_S, registry=r)
        self.ttft_cache_hit = ttft_by_cache.labels(model, sc.PREFIX_CACHE_HIT)
        self.ttft_cache_miss = ttft_by_cache.labels(model, sc.PREFIX_CACHE_MISS)
        closed = Counter(sc.ENGINE_HTTP_CONNECTIONS_CLOSED_TOTAL, "Connections the HTTP server closed, by reason.",
                         m + [sc.LABEL_REASON], registry=r)
        self._closed = {reason: closed.labels(model, reason) for reason in CLOSE_REASONS}
        self._requests = {}
        self._errors = {}
        for reason in ("stop", "length", "abort"):  # present at 0 from the start: rate() works
            self.finished(reason)
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0)
        self.prefix_cache_blocks.set(0)

    def finished(self, reason: str):
        child = self._requests.get(reason)
        if child is None:
            child = self._requests[reason] = self._requests_by_reason.labels(self.model, reason)
        return child

    def error(self, code: int) -> None:
        child = self._errors.get(code)
        if child is None:
            child = self._errors[code] = self._errors_by_code.labels(self.model, str(code))
        child.inc()

    def connection_closed(self, reason: str) -> None:
        """For ``LimitedSite(on_closed=...)``: one connection closed by the server."""
        self._closed[reason].inc()

    def watch_gpu(self, device_index: int) -> str | None:
        """Adds GPU memory and CUDA-context gauges (NVML) for ``device_index`` to this
        registry, read at scrape time. Returns why they are unavailable, or None."""
        from ..instrumentation import NvmlCollector

        collector = NvmlCollector([device_index])
        if not collector.available:
            return collector.unavailable_reason
        self.collected.register(collector)
        return None

    def request_finished(self, reason: str, *, e2e_s: float, queue_s: float | None, ttft_s: float | None,
                         tpot_s: float | None, prefill_s: float | None, decode_s: float | None,
                         prompt_tokens: int, generation_tokens: int, cached_tokens: int = 0,
                         exemplar: dict[str, str] | None = None) -> None:
        """Every per-request series of one finished request (None: the phase never happened);
        ``cached_tokens``: its prompt tokens served from the prefix cache."""
        self.finished(reason).inc()
        self.e2e.observe(e2e_s, exemplar)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        for series, value in ((self.queue, queue_s), (self.tpot, tpot_s), (self.prefill, prefill_s),
                              (self.decode, decode_s)):
            if value is not None:
                series.observe(value)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, exemplar)
            (self.ttft_cache_hit if cached_tokens else self.ttft_cache_miss).observe(ttft_s, exemplar)

    def prefix_cache_step(self, stats) -> None:
        """The prefix cache's counts from one batch's ``StepStats``."""
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.prefix_cache_evictions:
            self.prefix_cache_evictions.inc(stats.prefix_cache_evictions)
        self.prefix_cache_blocks.set(stats.prefix_cache_blocks)

    def exposition(self, extra: Iterable[CollectorRegistry | None] = (), accept: str = "",
                   encoded: Iterable[bytes] = ()) -> tuple[bytes, str]:
        """(body, content type): the registry followed by ``extra`` registries (e.g. the
        tracer's ``sightline_telemetry_*`` counters) and ``encoded`` ones (another process's,
        in the same format), in the format ``accept`` (an HTTP Accept header) prefers:
        OpenMetrics, with exemplars, or the classic text format."""
        encode, content_type = choose_encoder(accept)
        parts = [encode(r) for r in (_series(self.registry), self.collected, *extra) if r is not None]
        parts += [part for part in encoded if part]
        if content_type.startswith("application/openmetrics-text"):  # one "# EOF", at the very end
            parts = [p.removesuffix(_OPENMETRICS_EOF) for p in parts] + [_OPENMETRICS_EOF]
        return b"".join(parts), content_type


class CoreMetrics:
    """The engine core's own series: start-up by phase, and kernel variants met while
    serving. One core per engine, so the API servers serve these as the core encodes them
    (a utility call per scrape): each compile is counted once, however many API servers."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry(auto_describe=True)
        m = [sc.LABEL_MODEL]
        self._jit_compiles = Counter(
            sc.ENGINE_JIT_COMPILES_TOTAL, "Kernel variants met for the first time while serving "
            "(compiled, loaded from the disk cache, or autotuned): each is a defect of the warm-up.",
            m + [sc.LABEL_KERNEL, sc.LABEL_COMPILE_KIND], registry=r)
        self._startup_phases = Gauge(sc.ENGINE_STARTUP_SECONDS, "Seconds each start-up phase took.",
                                     m + [sc.LABEL_PHASE], registry=r)
        self._startup_total = Gauge(sc.ENGINE_STARTUP_TOTAL_SECONDS, "Seconds from process start "
                                    "(or the engine's construction) to ready.", m, registry=r)

    def record_startup(self, report) -> None:
        """The start-up's phase durations and total (a ``StartupReport``)."""
        for phase in report.phases:
            self._startup_phases.labels(self.model, phase.name).set(phase.duration_s)
        self._startup_total.labels(self.model).set(report.total_s)

    def jit_compiled(self, events) -> None:
        """Kernel variants met while serving (``CompileEvent``s), by kernel and kind."""
        for event in events:
            self._jit_compiles.labels(self.model, event.kernel, event.source).inc()

    def encode(self, accept: str = "") -> str:
        """The series in the format the Accept header ``accept`` asks for."""
        return choose_encoder(accept)[0](self.registry).decode()


def _series(registry: CollectorRegistry) -> CollectorRegistry:
    """``registry``, or with several API server processes, the sums of all their files."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return registry
    from prometheus_client import multiprocess

    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged, path)
    return merged
