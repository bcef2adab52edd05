"""Request and engine-step spans: the builders the telemetry worker drives (and tests use).

A request is one trace, continuing the caller's W3C or B3 context: ``POST /v1/...`` (SERVER)
> tokenize > queue > prefill > decode > detokenize. Each engine iteration is one
``engine.step`` root span linked to the requests it served; prefill/decode spans link back
to the first ``max_phase_links`` steps they rode (the rest counted in
``sightline.span.links_dropped``). An engine does not call these in its loop: it records
lifecycle events (:mod:`.lifecycle`) and :mod:`.span_assembler` calls them elsewhere.

Guarantees: level OFF costs one branch (``requests_on`` / ``steps_on`` / ``kernels_on``);
telemetry errors are logged once per call site and never raised; the handles are
thread-safe. Spans are built finished (:mod:`.finished_spans`) and exported by the SDK's
batch processors on their own thread. Prompt and completion text only with
``capture_content``. Explicit timestamps are Unix-epoch ns (``time.time_ns()``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.context import Context

from . import semconv
from .config import TelemetryConfig, TraceLevel
from .finished_spans import FinishedSpans
from .propagation import HeaderPropagator
from .request_trace import RequestTrace, StepTrace
from .request_trace import report_error as _report

__all__ = ["TraceLevel", "TelemetryConfig", "Telemetry", "RequestTrace", "StepTrace"]

logger = logging.getLogger(__name__)

_ROUTE_SPAN_NAMES = {
    "/v1/completions": semconv.SPAN_HTTP_COMPLETIONS,
    "/v1/chat/completions": semconv.SPAN_HTTP_CHAT_COMPLETIONS,
}


def span_name_for(method: str, route: str) -> str:
    """Server span name per the HTTP semantic conventions: ``{method} {route}``."""
    if method == "POST":
        known = _ROUTE_SPAN_NAMES.get(route)
        if known is not None:
            return known
    return f"{method} {route}"


class Telemetry:
    """One tracing pipeline: providers, propagator, and the request/step span factories.

    Create with :meth:`start` (builds providers and exporters per ``config``) or
    :meth:`disabled`. Independent instances may coexist (no global SDK state is set).
    """

    def __init__(self, config: TelemetryConfig, providers=None) -> None:
        self.config = config
        self._providers = providers
        level = config.level if providers is not None else TraceLevel.OFF
        self.level = level
        self.requests_on: bool = level >= TraceLevel.REQUESTS
        self.steps_on: bool = level >= TraceLevel.STEPS
        self.kernels_on: bool = level >= TraceLevel.KERNELS
        self.propagator = HeaderPropagator(config.propagators)
        if providers is not None:
            self.tracer = providers.tracer_provider.get_tracer(semconv.INSTRUMENTATION_SCOPE)
            self.finished_spans = FinishedSpans(providers.tracer_provider,
                                                providers.span_processors,
                                                semconv.INSTRUMENTATION_SCOPE)
            self.meter = (
                providers.meter_provider.get_meter(semconv.INSTRUMENTATION_SCOPE)
                if providers.meter_provider is not None
                else otel_metrics.NoOpMeter(semconv.INSTRUMENTATION_SCOPE)
            )
        else:
            self.tracer = trace.NoOpTracer()
            self.finished_spans = None
            self.meter = otel_metrics.NoOpMeter(semconv.INSTRUMENTATION_SCOPE)
        self._link_cap = config.max_links_per_span
        self._shutdown = False

    # -- construction -------------------------------------------------------------
    @classmethod
    def start(
        cls,
        config: TelemetryConfig | None = None,
        *,
        registry=None,
        span_exporters: Iterable = (),
        metric_readers: Iterable = (),
    ) -> "Telemetry":
        """Starts a pipeline for ``config`` (default: :meth:`TelemetryConfig.from_env`).

        ``registry``: the prometheus_client registry for the ``sightline_telemetry_*``
        counters (default: a private one, see :attr:`registry`). ``span_exporters`` /
        ``metric_readers`` are added next to the OTLP exporter. Never raises for pipeline
        trouble: if the SDK cannot be set up, the error is logged and telemetry is off.
        """
        if config is None:
            config = TelemetryConfig.from_env()
        if config.level == TraceLevel.OFF:
            return cls.disabled(config)
        try:
            from .otel_setup import build_providers

            providers = build_providers(
                config, registry=registry, span_exporters=span_exporters,
                metric_readers=metric_readers,
            )
        except Exception:
            logger.exception("telemetry set-up failed; tracing is off")
            return cls.disabled(config)
        return cls(config, providers)

    @classmethod
    def disabled(cls, config: TelemetryConfig | None = None) -> "Telemetry":
        """A Telemetry whose every switch is off; costs nothing but the branch."""
        if config is None:
            config = TelemetryConfig(level=TraceLevel.OFF, exporter="none")
        return cls(config, None)

    # -- introspection -------------------------------------------------------------
    @property
    def providers(self):
        return self._providers

    @property
    def tracer_provider(self):
        return None if self._providers is None else self._providers.tracer_provider

    @property
    def meter_provider(self):
        return None if self._providers is None else self._providers.meter_provider

    @property
    def registry(self):
        """The prometheus_client registry holding the ``sightline_telemetry_*`` counters."""
        return None if self._providers is None else self._providers.counters.registry

    def dropped_spans(self) -> int:
        """Spans lost so far (queue full + failed exports + after shutdown)."""
        return 0 if self._providers is None else self._providers.counters.dropped_total()

    def export_failures(self) -> int:
        return 0 if self._providers is None else self._providers.counters.failures_total()

    def exported_spans(self) -> int:
        return 0 if self._providers is None else self._providers.counters.spans_exported

    # -- requests -----------------------------------------------------------------
    def start_request(
        self,
        *,
        route: str,
        headers: Mapping[str, str] | None,
        model: str,
        operation: str,
        request_id: str,
        priority: int = 0,
        method: str = "POST",
        start_time_ns: int | None = None,
        attributes: Mapping[str, Any] | None = None,
        trace_id: int | None = None,
        span_id: int | None = None,
        parent: Context | None = None,
    ) -> RequestTrace | None:
        """Opens the SERVER span of one request, continuing W3C or B3 context in ``headers``.

        Returns None when request tracing is off (or on an internal error, logged once).
        ``operation`` is the gen_ai operation ("chat" | "text_completion").
        """
        if not self.requests_on:
            return None
        if parent is None:
            try:
                parent = self.propagator.extract(headers)
            except Exception:  # odd header values (bytes, None): trace the request anyway
                _report("Telemetry.start_request extract")
                parent = Context()
        try:
            attrs: dict[str, Any] = {
                semconv.HTTP_REQUEST_METHOD: method,
                semconv.HTTP_ROUTE: route,
                semconv.URL_PATH: route,
                semconv.GEN_AI_SYSTEM: semconv.GEN_AI_SYSTEM_VALUE,
                semconv.GEN_AI_OPERATION_NAME: operation,
                semconv.GEN_AI_REQUEST_MODEL: model,
                semconv.REQUEST_ID: request_id,
                semconv.REQUEST_PRIORITY: int(priority),
            }
            if attributes:
                attrs.update(attributes)
            return RequestTrace(self, span_name_for(method, route), parent, request_id, attrs,
                                start_time_ns if start_time_ns is not None else time.time_ns(),
                                trace_id, span_id)
        except Exception:
            _report("Telemetry.start_request")
            return None

    # -- steps ----------------------------------------------------------------------
    def start_step(
        self,
        step_id: int,
        *,
        requests: Sequence[RequestTrace | None],
        attributes: Mapping[str, Any] | None = None,
        start_time_ns: int | None = None,
        trace_id: int | None = None,
        span_id: int | None = None,
    ) -> StepTrace | None:
        """Opens one ``engine.step`` root span linked to the server spans of ``requests``.

        None entries (requests not traced) are skipped; links beyond the cap are counted in
        ``sightline.span.links_dropped``. Returns None when step tracing is off.
        """
        if not self.steps_on:
            return None
        try:
            cap = self._link_cap
            links = []
            dropped = 0
            for request in requests:
                if request is None:
                    continue
                if len(links) < cap:
                    links.append(request.link)
                else:
                    dropped += 1
            attrs: dict[str, Any] = {
                semconv.STEP_ID: int(step_id),
                semconv.STEP_BATCH_SIZE: len(requests),
            }
            if attributes:
                attrs.update(attributes)
            if dropped:
                attrs[semconv.SPAN_LINKS_DROPPED] = dropped
            start = start_time_ns if start_time_ns is not None else time.time_ns()
            # a root: a batch has many parents, so links instead
            context = self.finished_spans.root_context(semconv.SPAN_ENGINE_STEP, attrs, links,
                                                       trace_id, span_id)
            return StepTrace(self.finished_spans, context, int(step_id), start, attrs, links)
        except Exception:
            _report("Telemetry.start_step")
            return None

    # -- lifecycle ------------------------------------------------------------------
    def inject(self, headers: MutableMapping[str, str] | None = None,
               context: Context | None = None) -> MutableMapping[str, str]:
        """Client side: writes the configured propagation headers for ``context``."""
        try:
            return self.propagator.inject(headers, context)
        except Exception:
            _report("Telemetry.inject")
            return {} if headers is None else headers

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Exports what is queued now (blocking up to about ``timeout_s``)."""
        if self._providers is None:
            return True
        try:
            return self._providers.force_flush(timeout_s)
        except Exception:
            _report("Telemetry.force_flush")
            return False

    def shutdown(self) -> None:
        """Flushes and closes the pipeline (bounded by ``config.shutdown_timeout_s``); idempotent."""
        if self._shutdown:
            return
        self._shutdown = True
        self.requests_on = self.steps_on = self.kernels_on = False
        if self._providers is not None:
            try:
                self._providers.shutdown(self.config.shutdown_timeout_s)
            except Exception:
                _report("Telemetry.shutdown")
