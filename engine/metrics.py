"""The engine's Prometheus series (``/metrics``), named in ``instrumentation/semconv.py``.

Each engine owns a ``CollectorRegistry`` (several engines may live in one test process).
Updates are plain prometheus_client calls, thread-safe, O(1) each; the engine loop records
per step, the server records request errors. Histogram buckets come from semconv, so the
dashboards and rules read the same boundaries the engine writes.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..instrumentation import semconv as sc

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """All engine series for one served model name.

    Each attribute is the series bound to this model (label lookup done once here, not per
    observation); the families live in ``registry``.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry(auto_describe=True)
        m = [sc.LABEL_MODEL]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, m, registry=r).labels(model)

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
        self._requests = {}
        self._errors = {}
        for reason in ("stop", "length", "abort"):  # present at 0 from the start: rate() works
            self.finished(reason)
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0)

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

    def watch_gpu(self, device_index: int) -> str | None:
        """Adds GPU memory and CUDA-context gauges (NVML) for ``device_index`` to this
        registry, read at scrape time. Returns why they are unavailable, or None."""
        from ..instrumentation import NvmlCollector

        collector = NvmlCollector([device_index])
        if not collector.available:
            return collector.unavailable_reason
        self.registry.register(collector)
        return None

    def exposition(self, extra: Iterable[CollectorRegistry | None] = ()) -> bytes:
        """The registry in Prometheus text format, followed by ``extra`` registries (e.g. the
        tracer's ``sightline_telemetry_*`` counters)."""
        parts = [generate_latest(self.registry)]
        parts += [generate_latest(r) for r in extra if r is not None]
        return b"".join(parts)
