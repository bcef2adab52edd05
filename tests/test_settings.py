"""Each setting is declared once: every config field has exactly one flag, and the flags,
the defaults, the environment variables and the range checks all come from that declaration."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from sightline.collector.aggregation_config import AggregationConfig
from sightline.collector.config import CollectorConfig
from sightline.deploy.cli import build_parser
from sightline.engine.cli import engine_config
from sightline.engine.config import EngineConfig, HttpLimits
from sightline.engine.scheduler import SchedulerConfig
from sightline.instrumentation import (TelemetryConfig, TraceLevel, add_flags, check_settings, env_values,
                                       flag_names, from_flags, setting, undeclared)

# (config, the command whose parser carries its flags); EngineConfig nests the scheduler's,
# the HTTP limits' and the telemetry's settings
CONFIGS = [(CollectorConfig, ["collector", "run"]), (AggregationConfig, ["collector", "run"]),
           (EngineConfig, ["engine", "serve"])]
ENGINE_PARTS = {"scheduler": SchedulerConfig, "http": HttpLimits, "telemetry": TelemetryConfig}


def _subparser(path: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("config, command", CONFIGS, ids=[c.__name__ for c, _ in CONFIGS])
def test_every_config_field_has_exactly_one_flag(config, command):
    assert undeclared(config) == []
    flags = flag_names(config)
    options = collections.Counter(o for a in _subparser(command)._actions for o in a.option_strings)
    assert {path: options[flag] for path, flag in flags.items()} == {path: 1 for path in flags}
    assert len(set(flags.values())) == len(flags)


def test_every_engine_and_telemetry_field_is_a_flag():
    """Every field of the engine's configs, none set in code only; and each of the engine's
    flags (but the two of the command itself) is one of them."""
    flags = flag_names(EngineConfig)
    expected = {f.name for f in dataclasses.fields(EngineConfig) if f.name not in ENGINE_PARTS}
    expected |= {f"{part}.{f.name}" for part, cls in ENGINE_PARTS.items() for f in dataclasses.fields(cls)}
    assert set(flags) == expected
    options = {o for a in _subparser(["engine", "serve"])._actions for o in a.option_strings
               if o.startswith("--") and not o.startswith("--no-")}
    assert options - set(flags.values()) == {"--help", "--api-server-count", "--log-level"}


# flags that scripts, manifests and the README use: their names and fields stay
ENGINE_FLAGS = {
    "model": "--model", "served_model_name": "--served-model-name", "host": "--host", "port": "--port",
    "device": "--device", "dtype": "--dtype", "kv_cache_gib": "--kv-cache-gib",
    "gpu_memory_utilization": "--gpu-memory-utilization", "block_size": "--block-size",
    "max_model_len": "--max-model-len", "scheduler.max_num_seqs": "--max-num-seqs",
    "scheduler.max_num_batched_tokens": "--max-num-batched-tokens", "scheduler.max_waiting": "--max-waiting",
    "scheduler.aging_s": "--aging-s", "attention_backend": "--attention-backend",
    "enforce_eager": "--enforce-eager", "warmup": "--warmup", "warmup_limit_s": "--warmup-limit",
    "compile_cache_dir": "--compile-cache-dir", "async_scheduling": "--async-scheduling",
    "tensor_parallel_size": "--tensor-parallel-size", "enable_prefix_caching": "--enable-prefix-caching",
    "cpu_threads": "--cpu-threads", "seed": "--seed", "shutdown_timeout_s": "--shutdown-timeout",
    "http.header_timeout_s": "--http-header-timeout", "http.body_timeout_s": "--http-body-timeout",
    "http.keepalive_timeout_s": "--http-keepalive-timeout", "http.max_connections": "--http-max-connections",
    "http.peer_share": "--http-peer-share", "telemetry.level": "--trace-level",
    "telemetry.otlp_endpoint": "--otlp-endpoint", "telemetry.otlp_protocol": "--otlp-protocol",
    "telemetry.capture_content": "--capture-content", "telemetry.kernel_sample_ratio": "--kernel-sample-ratio",
    "telemetry.kernel_sample_ratio_slow": "--kernel-sample-ratio-slow",
    "telemetry.kernel_span_detail": "--kernel-spans", "telemetry.sm_probe": "--sm-probe",
    "telemetry.sm_probe_every": "--sm-probe-every", "telemetry.cupti_detach": "--cupti-detach",
    "telemetry.process_nice": "--telemetry-nice", "telemetry_mode": "--telemetry-mode",
}


def test_the_engine_keeps_its_flag_names():
    flags = flag_names(EngineConfig)
    assert {path: flags[path] for path in ENGINE_FLAGS} == ENGINE_FLAGS


@pytest.mark.parametrize("config, command", CONFIGS[:2], ids=[c.__name__ for c, _ in CONFIGS[:2]])
def test_no_flags_give_the_declared_defaults(config, command):
    assert from_flags(config, _subparser(command).parse_args([])) == config()


def _engine(*argv: str, env=None, monkeypatch) -> tuple[EngineConfig, bool]:
    for name in [n for n in os.environ if n.startswith(("OTEL_", "SIGHTLINE_"))]:
        monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return engine_config(_subparser(["engine", "serve"]).parse_args(list(argv)))


def test_engine_serve_without_flags_gives_the_declared_defaults(monkeypatch):
    # the telemetry is on (the declared TelemetryConfig) and the core sizes the token budget
    assert _engine(monkeypatch=monkeypatch) == (EngineConfig(telemetry=TelemetryConfig()), True)
    assert _engine("--device", "cpu", monkeypatch=monkeypatch)[1] is False


def test_engine_serve_flags_beat_variables_beat_defaults(monkeypatch):
    config, from_device = _engine(
        "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--http-header-timeout", "2.5",
        "--trace-level", "steps", "--kernel-spans", "all", "--no-sm-probe", "--telemetry-nice", "3",
        "--enforce-eager", "--telemetry-max-queue-size", "1000",
        env={"SIGHTLINE_TRACE_LEVEL": "kernels", "SIGHTLINE_SM_PROBE_EVERY": "8",
             "OTEL_BSP_SCHEDULE_DELAY": "250", "OTEL_SDK_DISABLED": "false"},
        monkeypatch=monkeypatch)
    assert from_device is False
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (4, 64)
    assert config.http == HttpLimits(header_timeout_s=2.5) and config.enforce_eager is True
    telemetry = config.telemetry
    assert (telemetry.level, telemetry.kernel_span_detail, telemetry.sm_probe, telemetry.process_nice) == (
        TraceLevel.STEPS, "all", False, 3)
    assert (telemetry.sm_probe_every, telemetry.schedule_delay_s, telemetry.max_queue_size) == (8, 0.25, 1000)
    # OTEL_SDK_DISABLED turns tracing off unless a flag asks for a level
    assert _engine(env={"OTEL_SDK_DISABLED": "true"}, monkeypatch=monkeypatch)[0].telemetry.level is TraceLevel.OFF


def test_engine_serve_bad_values_name_the_flag_or_the_variable(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _engine("--trace-level", "verbose", monkeypatch=monkeypatch)
    assert ("argument --trace-level: trace level 'verbose' is not one of off|requests|steps|kernels"
            in capsys.readouterr().err)
    with pytest.raises(ValueError, match=r"^SIGHTLINE_TELEMETRY_NICE='20': process_nice=20 is not an "
                                         r"integer in \[0, 19\]$"):
        _engine(env={"SIGHTLINE_TELEMETRY_NICE": "20"}, monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match=r"^max_num_seqs=0 is not an integer in \[1, inf\]$"):
        _engine("--max-num-seqs", "0", monkeypatch=monkeypatch)


@dataclass(frozen=True)
class _Inner:
    depth: int = setting(3, "how deep", lo=1, hi=8)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class _Example:
    rate: float = setting(0.5, "a fraction", lo=0.0, hi=1.0, env="EXAMPLE_RATE")
    mode: Literal["a", "b"] = setting("a", "which")
    on: bool = setting(False, "a switch")
    path: Path | None = setting(None, "a file")
    inner: _Inner = setting(factory=_Inner)

    def __post_init__(self) -> None:
        check_settings(self)


def _parse(*argv: str, env=None) -> _Example:
    parser = argparse.ArgumentParser()
    add_flags(parser, _Example)
    return from_flags(_Example, parser.parse_args(list(argv)), env=env or {})


def test_flag_beats_environment_beats_default():
    assert _parse() == _Example()
    assert _parse(env={"EXAMPLE_RATE": "0.25"}).rate == 0.25
    assert _parse("--rate", "0.75", env={"EXAMPLE_RATE": "0.25"}).rate == 0.75
    assert _parse("--mode", "b", "--on", "--path", "/x", "--inner-depth", "5") == _Example(
        0.5, "b", True, Path("/x"), _Inner(5))


def test_one_error_sentence_names_field_value_and_range():
    with pytest.raises(ValueError, match=r"^rate=1\.5 is not a number in \[0\.0, 1\.0\]$"):
        _Example(rate=1.5)
    with pytest.raises(ValueError, match=r"^depth=9 is not an integer in \[1, 8\]$"):
        _Inner(9)
    with pytest.raises(ValueError, match=r"^mode='c' is not one of a\|b$"):
        _Example(mode="c")
    with pytest.raises(ValueError, match=r"^EXAMPLE_RATE='fast': "):
        env_values(_Example, {"EXAMPLE_RATE": "fast"})


def test_the_gpu_telemetry_takes_its_user_settings_defaults_from_their_one_declaration():
    from sightline.instrumentation.config import TelemetryConfig
    from sightline.instrumentation.gpu_telemetry import GpuTelemetryConfig

    gpu, user = GpuTelemetryConfig(), TelemetryConfig()
    assert (gpu.kernel_sample_ratio, gpu.slow_sample_ratio, gpu.probe, gpu.probe_every_steps, gpu.cupti_detach,
            gpu.export_interval_s) == (
        user.kernel_sample_ratio, user.kernel_sample_ratio_slow, user.sm_probe, user.sm_probe_every,
        user.cupti_detach, user.metric_export_interval_s)
