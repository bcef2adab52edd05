"""The engine's Prometheus series (``/metrics``), named in ``instrumentation/semconv.py``.

Each engine owns a ``CollectorRegistry`` (several engines may live in one test process).
Updates are plain prometheus_client calls, thread-safe, O(1) each; the engine loop records
per step, the server records request errors. Histogram buckets come from semconv, so the
dashboards and rules read the same boundaries the engine writes.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sightline.instrumentation import semconv as sc

__all__ = ["EngineMetrics"]


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

    def exposition(self, extra: Iterable[CollectorRegistry | None] = ()) -> bytes:
        """The registry in Prometheus text format, followed by ``extra`` registries (e.g. the
        tracer's ``sightline_telemetry_*`` counters)."""
        parts = [generate_latest(self.registry)]
        parts += [generate_latest(r) for r in extra if r is not None]
        return b"".join(parts)
