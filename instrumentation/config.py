"""Telemetry configuration: one typed dataclass, filled from arguments, ``OTEL_*`` env, defaults.

Precedence is argument beats environment variable beats default, as in the OpenTelemetry
SDK. Each field is declared once (``settings.setting``) with its range, its flag and its
variable; :meth:`TelemetryConfig.from_env` reads the variables. Every field is validated
in ``__post_init__``; an error names the bad value and the allowed values or range (and
the variable it came from), so a typo in a deployment manifest fails at start-up with a
sentence rather than a silent default.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import typing
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from . import semconv
from .config_checks import check_range
from .settings import check_settings, env_values, setting

__all__ = [
    "TraceLevel",
    "TelemetryConfig",
    "PROTOCOLS",
    "SAMPLERS",
    "PROPAGATORS",
]

Protocol = Literal["grpc", "http/protobuf"]
Sampler = Literal["always_on", "always_off", "traceidratio", "parentbased_always_on",
                  "parentbased_always_off", "parentbased_traceidratio"]
PROTOCOLS = typing.get_args(Protocol)
SAMPLERS = typing.get_args(Sampler)
PROPAGATORS = ("tracecontext", "baggage", "b3", "b3multi", "none")


class TraceLevel(enum.IntEnum):
    """How deep tracing goes; each level includes the ones below it."""

    OFF = 0
    REQUESTS = 1
    STEPS = 2
    KERNELS = 3

    @classmethod
    def parse(cls, value: "str | int | TraceLevel") -> "TraceLevel":
        """Accepts a level, its int, or its name (case-insensitive: off|requests|steps|kernels)."""
        if isinstance(value, TraceLevel):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                raise ValueError(f"trace level {value!r} is not one of 0..3") from None
        if isinstance(value, str):
            name = value.strip().upper()
            if name in cls.__members__:
                return cls[name]
        allowed = "|".join(m.name.lower() for m in cls)
        raise ValueError(f"trace level {value!r} is not one of {allowed}")


def _parse_key_values(text: str, what: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` (W3C-baggage-like, percent-decoded) as used by OTEL_RESOURCE_ATTRIBUTES."""
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: item {item!r} is not key=value")
        out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return out


def _headers(text: str) -> dict[str, str]:
    return _parse_key_values(text, "headers")


def _resource_attributes(text: str) -> dict[str, str]:
    return _parse_key_values(text, "resource attributes")


def _first_lower(text: str) -> str:
    """The first of a comma-separated list (OTEL_TRACES_EXPORTER may name several)."""
    return text.split(",")[0].strip().lower()


def _propagators(text: str) -> tuple[str, ...]:
    names = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    return () if names == ("none",) else names


def _millis(text: str) -> float:
    """OTel's milliseconds as seconds."""
    try:
        return float(text) / 1000.0
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def _default_endpoint(protocol: str) -> str:
    return "http://localhost:4317" if protocol == "grpc" else "http://localhost:4318"


@dataclass(frozen=True)
class TelemetryConfig:
    """Everything :class:`~sightline.instrumentation.tracing.Telemetry` needs to start.

    Endpoints: ``otlp_endpoint`` is the base endpoint (gRPC ``host:port`` URL, or the HTTP base
    to which ``/v1/traces`` and ``/v1/metrics`` are appended); ``otlp_traces_endpoint`` and
    ``otlp_metrics_endpoint``, when set, are used verbatim, as the OTLP spec says. Each field
    is declared once (``setting``): its range, flag and variable come from there.
    """

    level: TraceLevel = setting(TraceLevel.REQUESTS, "tracing depth", flag="--trace-level",
                                env="SIGHTLINE_TRACE_LEVEL", parse=TraceLevel.parse,
                                metavar="{off,requests,steps,kernels}")
    exporter: Literal["otlp", "none"] = setting("otlp", "span and metric exporter (none: built, not sent)",
                                                env="OTEL_TRACES_EXPORTER", parse=_first_lower)
    otlp_endpoint: str | None = setting(None, "OTLP endpoint URL", flag="--otlp-endpoint",
                                        env="OTEL_EXPORTER_OTLP_ENDPOINT")
    otlp_traces_endpoint: str | None = setting(None, "OTLP traces URL, used verbatim",
                                               flag="--otlp-traces-endpoint",
                                               env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    otlp_metrics_endpoint: str | None = setting(None, "OTLP metrics URL, used verbatim",
                                                flag="--otlp-metrics-endpoint",
                                                env="OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    otlp_protocol: Protocol = setting("grpc", "OTLP transport", flag="--otlp-protocol",
                                      env=("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"))
    otlp_headers: Mapping[str, str] = setting(help="headers sent with every export", factory=dict,
                                              flag="--otlp-headers", env="OTEL_EXPORTER_OTLP_HEADERS",
                                              parse=_headers, metavar="KEY=VALUE,...")
    otlp_insecure: bool = setting(True, "plaintext gRPC where the endpoint's scheme does not say",
                                  flag="--otlp-insecure", env="OTEL_EXPORTER_OTLP_INSECURE")
    export_timeout_s: float = setting(10.0, "seconds one export may take", lo=0.001, hi=600.0,
                                      env=("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_BSP_EXPORT_TIMEOUT"),
                                      env_parse=_millis)
    service_name: str = setting(semconv.SERVICE_NAME_ENGINE, "service.name of the spans and metrics",
                                env="OTEL_SERVICE_NAME")
    resource_attributes: Mapping[str, str] = setting(help="resource attributes of the spans and metrics",
                                                     factory=dict, env="OTEL_RESOURCE_ATTRIBUTES",
                                                     parse=_resource_attributes, metavar="KEY=VALUE,...")
    sampler: Sampler = setting("parentbased_always_on", "trace sampler (" + "|".join(typing.get_args(Sampler))
                               + ")", env="OTEL_TRACES_SAMPLER", parse=str.lower, metavar="NAME")
    sampler_arg: float = setting(1.0, "the ratio of the traceidratio samplers", lo=0.0, hi=1.0,
                                 env="OTEL_TRACES_SAMPLER_ARG")
    propagators: tuple[str, ...] = setting(("tracecontext", "baggage"), "context propagators, comma-"
                                           "separated (" + "|".join(PROPAGATORS) + ")", env="OTEL_PROPAGATORS",
                                           parse=_propagators, metavar="NAME,...")
    capture_content: bool = setting(False, "record prompt and completion text on spans",
                                    flag="--capture-content", env="SIGHTLINE_CAPTURE_CONTENT")
    content_max_chars: int = setting(4096, "captured text per span, at most (characters)", lo=0, hi=10_000_000)
    # Steps whose kernels become spans (besides those after a slow step). The engine only
    # copies their raw CUPTI buffers; decoding and spans happen in the telemetry process.
    kernel_sample_ratio: float = setting(0.01, "at --trace-level kernels: fraction of engine steps whose "
                                               "CUDA kernels become spans, besides the step after any slow "
                                               "one", lo=0.0, hi=1.0, flag="--kernel-sample-ratio",
                                         env="SIGHTLINE_KERNEL_SAMPLE_RATIO")
    # While the engine runs slow (3 decode-only steps within 64 over 1.5x the recent median),
    # steps are sampled at this ratio for a second: a stall that hits a minority of steps is
    # then seen in enough traced steps to say whether the host or the GPU held them (0: never).
    kernel_sample_ratio_slow: float = setting(0.1, "at --trace-level kernels: fraction of engine steps "
                                                   "whose CUDA kernels become spans for a second after 6 "
                                                   "decode steps within 64 ran 1.5x the recent median, more "
                                                   "than the engine's own rate of such steps gives by chance "
                                                   "(when higher than --kernel-sample-ratio)", lo=0.0, hi=1.0,
                                              flag="--kernel-sample-ratio-slow",
                                              env="SIGHTLINE_KERNEL_SAMPLE_RATIO_SLOW")
    # Kernel spans of a traced step: "attention" (each attention launch its own span, other
    # kernels one span per name) or "all" (every launch; for debugging).
    kernel_span_detail: Literal["attention", "all"] = setting(
        "attention", "a traced step's kernel spans: each attention launch and one per other kernel "
                     "name (attention), or every launch (all)", flag="--kernel-spans",
        env="SIGHTLINE_KERNEL_SPANS")
    # At level kernels: the per-CTA SM probe in our attention kernels and the per-SM
    # histograms it feeds (off leaves kernel spans without per-SM facts).
    sm_probe: bool = setting(True, "at --trace-level kernels: per-CTA SM timing in the attention kernels "
                                   "and per-SM histograms", flag="--sm-probe", env="SIGHTLINE_SM_PROBE")
    # Steps whose probe records feed the per-SM histograms: every Nth step (and every step
    # with kernel spans). The kernels probe every step; the records of the others are not read.
    # A probed step costs the engine thread a device copy and its bookkeeping; the CTAs a
    # second that 1 in 32 still gives the histograms are in bench/results/overhead_http.md.
    sm_probe_every: int = setting(32, "per-SM histograms take the CTAs of every Nth step and of every step "
                                      "with kernel spans", lo=1, hi=1_000_000, flag="--sm-probe-every",
                                  env="SIGHTLINE_SM_PROBE_EVERY", metavar="N")
    # CUPTI detached between traced steps (no cost to untraced steps' CUDA calls; a traced
    # step pays the attach), else attached with its activity kinds off (the default).
    cupti_detach: bool = setting(False, "at --trace-level kernels: detach CUPTI between traced steps, so "
                                        "that untraced steps pay nothing for it and each traced step pays "
                                        "an attach of about 16 ms", flag="--cupti-detach",
                                 env="SIGHTLINE_CUPTI_DETACH")
    max_queue_size: int = setting(2048, "spans waiting for export, at most", lo=1, hi=10_000_000,
                                  env="OTEL_BSP_MAX_QUEUE_SIZE")
    # its upper bound is max_queue_size (checked in __post_init__)
    max_export_batch_size: int = setting(512, "spans per export, at most (<= max_queue_size)", lo=1,
                                         env="OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
    schedule_delay_s: float = setting(1.0, "seconds between span exports", lo=0.001, hi=3600.0,
                                      env="OTEL_BSP_SCHEDULE_DELAY", env_parse=_millis)
    max_links_per_span: int = setting(128, "links per span, at most", lo=0, hi=100_000)
    # A prefill/decode span links to at most this many of the steps it rode (the first
    # ones; the rest are counted). Each step span links to all of its requests, so every
    # step stays reachable from a request; the cap bounds the links a long decode costs.
    max_phase_links: int = setting(16, "step links of a prefill or decode span, at most", lo=0, hi=100_000)
    metrics_enabled: bool = setting(True, "export metrics")
    metric_export_interval_s: float = setting(10.0, "seconds between metric exports", lo=0.01, hi=3600.0,
                                              env="OTEL_METRIC_EXPORT_INTERVAL", env_parse=_millis)
    metrics_temporality: Literal["delta", "cumulative"] = setting(
        "delta", "aggregation temporality of exported metrics",
        env="OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", parse=str.lower)
    shutdown_timeout_s: float = setting(5.0, "seconds the last export may take at shutdown", lo=0.0, hi=600.0)
    capture_path: str | None = setting(None, "also write every span and metric to this capture file",
                                       env="SIGHTLINE_CAPTURE_PATH", metavar="FILE")
    # The telemetry process's nice value (0..19): it yields the CPU to the engine it shares
    # CPUs with and catches up in idle time; falling behind drops records, counted.
    process_nice: int = setting(10, "nice value of the telemetry process: it yields the CPU to the engine",
                                lo=0, hi=19, flag="--telemetry-nice", env="SIGHTLINE_TELEMETRY_NICE",
                                metavar="N")
    # With several producer processes (API servers and the engine core), a request's events
    # that reach the telemetry process before its start are held this long (at most this
    # many of them) before they count as orphans; a request's end waits as long at most for
    # the other producers' earlier events (at most as many again).
    hold_unstarted_s: float = setting(2.0, "seconds a request's events that arrive before its start are "
                                           "held", lo=0.0, hi=600.0)
    max_held_events: int = setting(65536, "events held for requests not started yet, at most", lo=1,
                                   hi=1 << 24)

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", TraceLevel.parse(self.level))
        object.__setattr__(self, "propagators", tuple(self.propagators))
        object.__setattr__(self, "otlp_headers", dict(self.otlp_headers))
        object.__setattr__(self, "resource_attributes", dict(self.resource_attributes))
        check_settings(self)
        for name in self.propagators:
            if name not in PROPAGATORS:
                raise ValueError(f"propagator {name!r} is not one of {'|'.join(PROPAGATORS)}")
        for endpoint_name in ("otlp_endpoint", "otlp_traces_endpoint", "otlp_metrics_endpoint"):
            value = getattr(self, endpoint_name)
            if value is not None and "://" not in value:
                # "collector:4317" as the gRPC exporters accept it: plaintext http.
                value = "http://" + value
                object.__setattr__(self, endpoint_name, value)
            if value is not None:
                parsed = urllib.parse.urlparse(value)
                if parsed.scheme not in ("http", "https") or not parsed.netloc:
                    raise ValueError(
                        f"{endpoint_name} {value!r} is not an http:// or https:// URL with a host"
                    )
        check_range("max_export_batch_size", self.max_export_batch_size, 1, self.max_queue_size, integer=True)
        if not self.service_name:
            raise ValueError("service_name '' must not be empty")

    # -- derived -------------------------------------------------------------------
    @property
    def traces_endpoint(self) -> str:
        """The URL the span exporter talks to (gRPC: scheme+host+port; HTTP: full path)."""
        if self.otlp_traces_endpoint:
            return self.otlp_traces_endpoint
        base = self.otlp_endpoint or _default_endpoint(self.otlp_protocol)
        if self.otlp_protocol == "grpc":
            return base
        return base.rstrip("/") + "/v1/traces"

    @property
    def metrics_endpoint(self) -> str:
        if self.otlp_metrics_endpoint:
            return self.otlp_metrics_endpoint
        base = self.otlp_endpoint or _default_endpoint(self.otlp_protocol)
        if self.otlp_protocol == "grpc":
            return base
        return base.rstrip("/") + "/v1/metrics"

    def replace(self, **changes: Any) -> "TelemetryConfig":
        return dataclasses.replace(self, **changes)

    # -- environment ---------------------------------------------------------------
    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> "TelemetryConfig":
        """Builds a config: ``overrides`` (not None) beat ``env`` (default ``os.environ``) beat defaults.

        Reads each field's declared variable (``SIGHTLINE_TRACE_LEVEL``, the ``OTEL_*`` ones of
        the OpenTelemetry SDK, ``SIGHTLINE_*`` for the rest; ``sightline engine serve --help``
        lists them), and two rules across fields: ``OTEL_SDK_DISABLED=true`` turns tracing off,
        and ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` counts when ``OTEL_SERVICE_NAME``
        is absent. Raises ValueError naming the variable and its bad value.
        """
        env = os.environ if env is None else env
        sources: dict[str, str] = {}  # field -> the variable it came from, for error messages
        values = env_values(cls, env, sources)
        if (env.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
            values["level"] = TraceLevel.OFF
        attrs = values.get("resource_attributes", {})
        if "service_name" not in values and "service.name" in attrs:
            values["service_name"] = attrs["service.name"]
        for key, value in overrides.items():
            if value is None:
                continue
            if not any(f.name == key for f in dataclasses.fields(cls)):
                names = ", ".join(f.name for f in dataclasses.fields(cls))
                raise TypeError(f"unknown TelemetryConfig field {key!r}; fields are {names}")
            values[key] = value
            sources.pop(key, None)
        try:
            return cls(**values)
        except ValueError as exc:
            field_name = re.split(r"[ =]", str(exc), maxsplit=1)[0]
            if field_name in sources:
                raise ValueError(f"{sources[field_name]}: {exc}") from None
            raise
