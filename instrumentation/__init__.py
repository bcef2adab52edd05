"""sightline.instrumentation: telemetry for an LLM inference server, usable in any PyTorch server.

``__all__`` is the room's public surface: other rooms import these names from here (and
telemetry names from ``semconv``), never from the modules behind them. Each name is loaded
on first use, so importing the package pulls in neither torch nor the OpenTelemetry SDK:
the collector imports histogram math from here on a machine without either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import semconv
    from .bounded_queue import BoundedQueue, WaitingQueue, WeightedQueue
    from .capture import META_SIGNAL, read_capture, read_capture_meta
    from .config import TelemetryConfig, TraceLevel
    from .config_checks import check_range
    from .event_wire import from_wire, to_wire
    from .exit_guard import cancel_stop_at_exit, stop_at_exit
    from .exphist import (MAX_SCALE, MIN_SCALE, ExpHistogram, bucket_indices, bucket_point, fit_shift,
                          quantiles, rebin, relative_error)
    from .gpu_telemetry import GpuTelemetry
    from .lifecycle import (Detokenized, LifecycleRecorder, OpenStep, Queued, RankStep, Startup,
                            StartupPhase, Step)
    from .nvml import NvmlCollector
    from .rank_recorder import RankRecorder
    from .otlp_json_ids import base64_to_hex, convert_ids
    from .settings import (add_flags, check_settings, env_values, flag_names, from_flags, given_flags,
                           setting, undeclared)
    from .sm_probe import (PROBE_OFF, ProbedLaunches, SmProbe, launch_facts, probe_begin,
                           probe_cta_index, probe_end)
    from .telemetry_pipeline import TelemetryPipeline
    from .tracing import Telemetry

_MODULE_OF = {
    "BoundedQueue": "bounded_queue", "WaitingQueue": "bounded_queue", "WeightedQueue": "bounded_queue",
    "read_capture": "capture", "read_capture_meta": "capture", "META_SIGNAL": "capture",
    "TelemetryConfig": "config", "TraceLevel": "config",
    "check_range": "config_checks",
    "from_wire": "event_wire", "to_wire": "event_wire",
    "cancel_stop_at_exit": "exit_guard", "stop_at_exit": "exit_guard",
    "MAX_SCALE": "exphist", "MIN_SCALE": "exphist", "ExpHistogram": "exphist",
    "relative_error": "exphist", "bucket_indices": "exphist", "bucket_point": "exphist",
    "fit_shift": "exphist", "quantiles": "exphist", "rebin": "exphist",
    "GpuTelemetry": "gpu_telemetry",
    "Detokenized": "lifecycle", "LifecycleRecorder": "lifecycle", "OpenStep": "lifecycle", "Queued": "lifecycle", "Step": "lifecycle",
    "RankStep": "lifecycle",
    "Startup": "lifecycle", "StartupPhase": "lifecycle",
    "NvmlCollector": "nvml",
    "RankRecorder": "rank_recorder",
    "base64_to_hex": "otlp_json_ids", "convert_ids": "otlp_json_ids",
    "add_flags": "settings", "check_settings": "settings", "env_values": "settings",
    "flag_names": "settings", "from_flags": "settings", "given_flags": "settings", "setting": "settings",
    "undeclared": "settings",
    "PROBE_OFF": "sm_probe", "ProbedLaunches": "sm_probe", "SmProbe": "sm_probe",
    "launch_facts": "sm_probe",
    "probe_begin": "sm_probe", "probe_cta_index": "sm_probe", "probe_end": "sm_probe",
    "TelemetryPipeline": "telemetry_pipeline",
    "Telemetry": "tracing",
}

__all__ = ["semconv", *_MODULE_OF]


def __getattr__(name: str) -> Any:
    if name == "semconv":
        return importlib.import_module(".semconv", __name__)
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
