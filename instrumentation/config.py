"""Telemetry configuration: one typed dataclass, filled from arguments, ``OTEL_*`` env, defaults.

Precedence is argument beats environment variable beats default, as in the OpenTelemetry
SDK (:meth:`TelemetryConfig.from_env` lists the variables it reads). Every field is
validated in ``__post_init__``; an error names the bad value and the allowed values or
range (and the variable it came from), so a typo in a deployment manifest fails at
start-up with a sentence rather than a silent default.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from . import semconv
from .config_checks import check_range

__all__ = [
    "TraceLevel",
    "TelemetryConfig",
    "PROTOCOLS",
    "SAMPLERS",
    "PROPAGATORS",
]

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
PROPAGATORS = ("tracecontext", "baggage", "b3", "b3multi", "none")
EXPORTERS = ("otlp", "none")
TEMPORALITIES = ("delta", "cumulative")

Protocol = Literal["grpc", "http/protobuf"]


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


def _default_endpoint(protocol: str) -> str:
    return "http://localhost:4317" if protocol == "grpc" else "http://localhost:4318"


@dataclass(frozen=True)
class TelemetryConfig:
    """Everything :class:`~sightline.instrumentation.tracing.Telemetry` needs to start.

    Endpoints: ``otlp_endpoint`` is the base endpoint (gRPC ``host:port`` URL, or the HTTP base
    to which ``/v1/traces`` and ``/v1/metrics`` are appended); ``otlp_traces_endpoint`` and
    ``otlp_metrics_endpoint``, when set, are used verbatim, as the OTLP spec says.
    """

    level: TraceLevel = TraceLevel.REQUESTS
    exporter: Literal["otlp", "none"] = "otlp"
    otlp_endpoint: str | None = None
    otlp_traces_endpoint: str | None = None
    otlp_metrics_endpoint: str | None = None
    otlp_protocol: Protocol = "grpc"
    otlp_headers: Mapping[str, str] = field(default_factory=dict)
    otlp_insecure: bool = True
    export_timeout_s: float = 10.0
    service_name: str = semconv.SERVICE_NAME_ENGINE
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    sampler: str = "parentbased_always_on"
    sampler_arg: float = 1.0
    propagators: tuple[str, ...] = ("tracecontext", "baggage")
    capture_content: bool = False
    content_max_chars: int = 4096
    # Steps whose kernels become spans (besides those after a slow step). The engine only
    # copies their raw CUPTI buffers; decoding and spans happen in the telemetry process.
    kernel_sample_ratio: float = 0.01
    # Kernel spans of a traced step: "attention" (each attention launch its own span, other
    # kernels one span per name) or "all" (every launch; for debugging).
    kernel_span_detail: str = "attention"
    # At level kernels: the per-CTA SM probe in our attention kernels and the per-SM
    # histograms it feeds (off leaves kernel spans without per-SM facts).
    sm_probe: bool = True
    # Steps whose probe records feed the per-SM histograms: every Nth step (and every step
    # with kernel spans). The kernels probe every step; the records of the others are not read.
    # A probed step costs the engine thread a device copy and its bookkeeping; the CTAs a
    # second that 1 in 32 still gives the histograms are in bench/results/overhead_http.md.
    sm_probe_every: int = 32
    # CUPTI detached between traced steps (no cost to untraced steps' CUDA calls; a traced
    # step pays the attach), else attached with its activity kinds off (the default).
    cupti_detach: bool = False
    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    schedule_delay_s: float = 1.0
    max_links_per_span: int = 128
    # A prefill/decode span links to at most this many of the steps it rode (the first
    # ones; the rest are counted). Each step span links to all of its requests, so every
    # step stays reachable from a request; the cap bounds the links a long decode costs.
    max_phase_links: int = 16
    metrics_enabled: bool = True
    metric_export_interval_s: float = 10.0
    metrics_temporality: Literal["delta", "cumulative"] = "delta"
    shutdown_timeout_s: float = 5.0
    capture_path: str | None = None
    # The telemetry process's nice value (0..19): it yields the CPU to the engine it shares
    # CPUs with and catches up in idle time; falling behind drops records, counted.
    process_nice: int = 10
    # With several producer processes (API servers and the engine core), a request's events
    # that reach the telemetry process before its start are held this long (at most this
    # many of them) before they count as orphans; a request's end waits as long at most for
    # the other producers' earlier events (at most as many again).
    hold_unstarted_s: float = 2.0
    max_held_events: int = 65536

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", TraceLevel.parse(self.level))
        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter {self.exporter!r} is not one of {'|'.join(EXPORTERS)}")
        if self.otlp_protocol not in PROTOCOLS:
            raise ValueError(
                f"otlp_protocol {self.otlp_protocol!r} is not one of {'|'.join(PROTOCOLS)}"
            )
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler {self.sampler!r} is not one of {'|'.join(SAMPLERS)}")
        for name in self.propagators:
            if name not in PROPAGATORS:
                raise ValueError(f"propagator {name!r} is not one of {'|'.join(PROPAGATORS)}")
        object.__setattr__(self, "propagators", tuple(self.propagators))
        object.__setattr__(self, "otlp_headers", dict(self.otlp_headers))
        object.__setattr__(self, "resource_attributes", dict(self.resource_attributes))
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
        if self.metrics_temporality not in TEMPORALITIES:
            raise ValueError(
                f"metrics_temporality {self.metrics_temporality!r} is not one of "
                f"{'|'.join(TEMPORALITIES)}"
            )
        check_range("sampler_arg", self.sampler_arg, 0.0, 1.0)
        check_range("kernel_sample_ratio", self.kernel_sample_ratio, 0.0, 1.0)
        check_range("sm_probe_every", self.sm_probe_every, 1, 1_000_000, integer=True)
        check_range("process_nice", self.process_nice, 0, 19, integer=True)
        check_range("hold_unstarted_s", self.hold_unstarted_s, 0.0, 600.0)
        check_range("max_held_events", self.max_held_events, 1, 1 << 24, integer=True)
        if self.kernel_span_detail not in ("attention", "all"):
            raise ValueError(f"kernel_span_detail {self.kernel_span_detail!r} is not one of "
                             "attention|all")
        check_range("export_timeout_s", self.export_timeout_s, 0.001, 600.0)
        check_range("schedule_delay_s", self.schedule_delay_s, 0.001, 3600.0)
        check_range("metric_export_interval_s", self.metric_export_interval_s, 0.01, 3600.0)
        check_range("shutdown_timeout_s", self.shutdown_timeout_s, 0.0, 600.0)
        check_range("max_queue_size", self.max_queue_size, 1, 10_000_000, integer=True)
        check_range("max_export_batch_size", self.max_export_batch_size, 1, self.max_queue_size, integer=True)
        check_range("max_links_per_span", self.max_links_per_span, 0, 100_000, integer=True)
        check_range("max_phase_links", self.max_phase_links, 0, 100_000, integer=True)
        check_range("content_max_chars", self.content_max_chars, 0, 10_000_000, integer=True)
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

        Reads ``SIGHTLINE_TRACE_LEVEL`` (off|requests|steps|kernels), ``OTEL_SDK_DISABLED``,
        ``OTEL_TRACES_EXPORTER`` (otlp|none), ``OTEL_EXPORTER_OTLP_ENDPOINT``,
        ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``,
        ``OTEL_EXPORTER_OTLP_PROTOCOL`` (+ ``_TRACES_``), ``OTEL_EXPORTER_OTLP_HEADERS``,
        ``OTEL_EXPORTER_OTLP_TIMEOUT`` (ms), ``OTEL_EXPORTER_OTLP_INSECURE``,
        ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` (+ ``_ARG``),
        ``OTEL_PROPAGATORS``, ``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_SCHEDULE_DELAY``,
        ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, ``OTEL_BSP_EXPORT_TIMEOUT``,
        ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``,
        ``SIGHTLINE_CAPTURE_CONTENT``, ``SIGHTLINE_KERNEL_SAMPLE_RATIO``,
        ``SIGHTLINE_KERNEL_SPANS`` (attention|all), ``SIGHTLINE_SM_PROBE``,
        ``SIGHTLINE_SM_PROBE_EVERY``, ``SIGHTLINE_CUPTI_DETACH``, ``SIGHTLINE_CAPTURE_PATH``,
        ``SIGHTLINE_TELEMETRY_NICE``. Raises ValueError naming the
        variable and its bad value.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}  # field -> the variable it came from, for error messages

        def get(name: str) -> str | None:
            value = env.get(name)
            if value is None or value.strip() == "":
                return None
            return value.strip()

        def put(key: str, var: str, convert=lambda s: s) -> None:
            raw = get(var)
            if raw is None:
                return
            try:
                values[key] = convert(raw)
            except ValueError as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from None
            sources[key] = f"{var}={raw!r}"

        put("level", "SIGHTLINE_TRACE_LEVEL", TraceLevel.parse)
        if (get("OTEL_SDK_DISABLED") or "").lower() == "true":
            values["level"] = TraceLevel.OFF
        put("exporter", "OTEL_TRACES_EXPORTER", lambda s: s.split(",")[0].strip().lower())
        put("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT")
        put("otlp_traces_endpoint", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        put("otlp_metrics_endpoint", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
        put("otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL")
        put("otlp_protocol", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        put("otlp_headers", "OTEL_EXPORTER_OTLP_HEADERS",
            lambda s: _parse_key_values(s, "headers"))
        put("otlp_insecure", "OTEL_EXPORTER_OTLP_INSECURE", _parse_bool)
        put("export_timeout_s", "OTEL_EXPORTER_OTLP_TIMEOUT", lambda s: _parse_float(s) / 1000.0)
        put("service_name", "OTEL_SERVICE_NAME")
        put("resource_attributes", "OTEL_RESOURCE_ATTRIBUTES",
            lambda s: _parse_key_values(s, "resource attributes"))
        put("sampler", "OTEL_TRACES_SAMPLER", str.lower)
        put("sampler_arg", "OTEL_TRACES_SAMPLER_ARG", _parse_float)
        put("propagators", "OTEL_PROPAGATORS",
            lambda s: tuple(p.strip().lower() for p in s.split(",") if p.strip()))
        put("max_queue_size", "OTEL_BSP_MAX_QUEUE_SIZE", _parse_int)
        put("max_export_batch_size", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _parse_int)
        put("schedule_delay_s", "OTEL_BSP_SCHEDULE_DELAY", lambda s: _parse_float(s) / 1000.0)
        put("metric_export_interval_s", "OTEL_METRIC_EXPORT_INTERVAL",
            lambda s: _parse_float(s) / 1000.0)
        put("metrics_temporality", "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", str.lower)
        put("capture_content", "SIGHTLINE_CAPTURE_CONTENT", _parse_bool)
        put("kernel_sample_ratio", "SIGHTLINE_KERNEL_SAMPLE_RATIO", _parse_float)
        put("kernel_span_detail", "SIGHTLINE_KERNEL_SPANS", str)
        put("sm_probe", "SIGHTLINE_SM_PROBE", _parse_bool)
        put("sm_probe_every", "SIGHTLINE_SM_PROBE_EVERY", _parse_int)
        put("cupti_detach", "SIGHTLINE_CUPTI_DETACH", _parse_bool)
        put("capture_path", "SIGHTLINE_CAPTURE_PATH")
        put("process_nice", "SIGHTLINE_TELEMETRY_NICE", _parse_int)
        # OTEL_BSP_EXPORT_TIMEOUT bounds one export; the exporter timeout is the closer knob.
        if get("OTEL_EXPORTER_OTLP_TIMEOUT") is None:
            put("export_timeout_s", "OTEL_BSP_EXPORT_TIMEOUT", lambda s: _parse_float(s) / 1000.0)
        # The service name set in OTEL_RESOURCE_ATTRIBUTES counts when OTEL_SERVICE_NAME is absent.
        attrs = values.get("resource_attributes", {})
        if "service_name" not in values and "service.name" in attrs:
            values["service_name"] = attrs["service.name"]
        if values.get("propagators") == ("none",):
            values["propagators"] = ()
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


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (true|false|1|0|yes|no|on|off)")


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
