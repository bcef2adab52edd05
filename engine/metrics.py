"""The engine's Prometheus series (``/metrics``), named in ``instrumentation/semconv.py``.

Each engine owns a ``CollectorRegistry`` (several engines may live in one test process).
Updates are plain prometheus_client calls, thread-safe, O(1) each; the engine loop records
per step (and one inter-token latency per generated token), the server records request
errors. Histogram buckets come from semconv, so the dashboards and rules read the same
boundaries the engine writes. TTFT, ITL and end-to-end observations of a sampled request
carry its trace id as an exemplar; ``exposition`` serves them when the scraper accepts
OpenMetrics (the classic text format has no exemplars).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from sightline.instrumentation import semconv as sc

__all__ = ["EngineMetrics", "trace_exemplar"]

_OPENMETRICS_EOF = b"# EOF\n"


def trace_exemplar(trace) -> dict[str, str] | None:
    """Exemplar labels that point at a request's trace: ``{trace_id: 32 hex digits}`` for
    the handle ``Telemetry.start_request`` returned, when that trace is sampled (an unsampled
    one is stored nowhere); None otherwise. The one place that reads the handle."""
    context = getattr(trace, "span_context", None)
    if context is None or not context.is_valid or not context.trace_flags.sampled:
        return None
    return {sc.EXEMPLAR_TRACE_ID_LABEL: format(context.trace_id, "032x")}


class EngineMetrics:
    """All engine series for one served model name."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, [sc.LABEL_MODEL]
        self.requests = Counter(sc.ENGINE_REQUESTS_TOTAL, "Finished requests by finish reason.",
                                m + [sc.LABEL_FINISH_REASON], registry=r)
        self.request_errors = Counter(sc.ENGINE_REQUEST_ERRORS_TOTAL,
                                      "Requests refused or failed, by HTTP status code.",
                                      m + [sc.LABEL_CODE], registry=r)
        self.ttft = Histogram(sc.ENGINE_TTFT_SECONDS, "Time from arrival to the first token.", m,
                              buckets=sc.TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram(sc.ENGINE_TPOT_SECONDS, "Mean time per output token after the first.",
                              m, buckets=sc.TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram(sc.ENGINE_E2E_SECONDS, "Time from arrival to the last token.", m,
                             buckets=sc.REQUEST_DURATION_BUCKETS_S, registry=r)
        self.queue = Histogram(sc.ENGINE_QUEUE_SECONDS, "Time from arrival to first scheduling.", m,
                               buckets=sc.REQUEST_DURATION_BUCKETS_S, registry=r)
        self.running = Gauge(sc.ENGINE_RUNNING, "Requests holding KV blocks.", m, registry=r)
        self.waiting = Gauge(sc.ENGINE_WAITING, "Requests in the waiting queue.", m, registry=r)
        self.kv_usage = Gauge(sc.ENGINE_KV_USAGE, "Fraction of KV cache blocks in use (0..1).", m,
                              registry=r)
        self.preemptions = Counter(sc.ENGINE_PREEMPTIONS_TOTAL, "Requests preempted (recompute).",
                                   m, registry=r)
        self.step = Histogram(sc.ENGINE_STEP_SECONDS, "Duration of one engine step.", m,
                              buckets=sc.STEP_BUCKETS_S, registry=r)
        self.step_tokens = Histogram(sc.ENGINE_STEP_TOKENS, "Tokens computed per engine step.", m,
                                     buckets=sc.TOKENS_PER_STEP_BUCKETS, registry=r)
        self.prompt_tokens = Counter(sc.ENGINE_PROMPT_TOKENS_TOTAL, "Prompt tokens of finished requests.",
                                     m, registry=r)
        self.generation_tokens = Counter(sc.ENGINE_GENERATION_TOKENS_TOTAL, "Tokens generated.", m,
                                         registry=r)
        self.itl = Histogram(sc.ENGINE_ITL_SECONDS, "Time between consecutive tokens of a request "
                             "(one observation per token after the first).", m, buckets=sc.ITL_BUCKETS_S,
                             registry=r)
        self.request_prompt_tokens = Histogram(sc.ENGINE_REQUEST_PROMPT_TOKENS, "Prompt tokens per finished "
                                               "request.", m, buckets=sc.REQUEST_TOKENS_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(sc.ENGINE_REQUEST_GENERATION_TOKENS, "Generated tokens "
                                                   "per finished request.", m, buckets=sc.REQUEST_TOKENS_BUCKETS,
                                                   registry=r)
        self.prefill = Histogram(sc.ENGINE_PREFILL_SECONDS, "Time from first scheduling to the first token.",
                                 m, buckets=sc.REQUEST_DURATION_BUCKETS_S, registry=r)
        self.decode = Histogram(sc.ENGINE_DECODE_SECONDS, "Time from the first token to the last.", m,
                                buckets=sc.REQUEST_DURATION_BUCKETS_S, registry=r)
        # Bound children: label lookup once here, not per observation.
        self._requests = {}
        self._errors = {}
        self.c_ttft, self.c_tpot = self.ttft.labels(model), self.tpot.labels(model)
        self.c_e2e, self.c_queue = self.e2e.labels(model), self.queue.labels(model)
        self.c_running, self.c_waiting = self.running.labels(model), self.waiting.labels(model)
        self.c_kv_usage = self.kv_usage.labels(model)
        self.c_preemptions = self.preemptions.labels(model)
        self.c_step, self.c_step_tokens = self.step.labels(model), self.step_tokens.labels(model)
        self.c_prompt_tokens = self.prompt_tokens.labels(model)
        self.c_generation_tokens = self.generation_tokens.labels(model)
        self.c_itl = self.itl.labels(model)
        self.c_request_prompt_tokens = self.request_prompt_tokens.labels(model)
        self.c_request_generation_tokens = self.request_generation_tokens.labels(model)
        self.c_prefill, self.c_decode = self.prefill.labels(model), self.decode.labels(model)
        for reason in ("stop", "length", "abort"):  # present at 0 from the start: rate() works
            self.finished(reason)
        self.c_running.set(0)
        self.c_waiting.set(0)
        self.c_kv_usage.set(0)

    def finished(self, reason: str):
        child = self._requests.get(reason)
        if child is None:
            child = self._requests[reason] = self.requests.labels(self.model, reason)
        return child

    def error(self, code: int) -> None:
        child = self._errors.get(code)
        if child is None:
            child = self._errors[code] = self.request_errors.labels(self.model, str(code))
        child.inc()

    def watch_gpu(self, device_index: int) -> str | None:
        """Adds GPU memory and CUDA-context gauges (NVML) for ``device_index`` to this
        registry, read at scrape time. Returns why they are unavailable, or None."""
        from sightline.instrumentation.nvml import NvmlCollector

        collector = NvmlCollector([device_index])
        if not collector.available:
            return collector.unavailable_reason
        self.registry.register(collector)
        return None

    def request_finished(self, reason: str, *, e2e_s: float, queue_s: float | None, ttft_s: float | None,
                         tpot_s: float | None, prefill_s: float | None, decode_s: float | None,
                         prompt_tokens: int, generation_tokens: int,
                         exemplar: dict[str, str] | None = None) -> None:
        """Every per-request series of one finished request (None: the phase never happened)."""
        self.finished(reason).inc()
        self.c_e2e.observe(e2e_s, exemplar)
        self.c_request_prompt_tokens.observe(prompt_tokens)
        self.c_request_generation_tokens.observe(generation_tokens)
        for child, value in ((self.c_queue, queue_s), (self.c_tpot, tpot_s), (self.c_prefill, prefill_s),
                             (self.c_decode, decode_s)):
            if value is not None:
                child.observe(value)
        if ttft_s is not None:
            self.c_ttft.observe(ttft_s, exemplar)

    def exposition(self, extra: Iterable[CollectorRegistry | None] = (),
                   accept: str = "") -> tuple[bytes, str]:
        """(body, content type): the registry followed by ``extra`` registries (e.g. the
        tracer's ``sightline_telemetry_*`` counters), in the format ``accept`` (an HTTP
        Accept header) prefers: OpenMetrics, with exemplars, or the classic text format."""
        encode, content_type = choose_encoder(accept)
        parts = [encode(r) for r in (self.registry, *extra) if r is not None]
        if content_type.startswith("application/openmetrics-text"):  # one "# EOF", at the very end
            parts = [p.removesuffix(_OPENMETRICS_EOF) for p in parts] + [_OPENMETRICS_EOF]
        return b"".join(parts), content_type
