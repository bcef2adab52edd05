"""The local Sightline stack as supervised processes (``sightline up``, the demo, the tests).

::

    engine ──OTLP gRPC──► rotel (sidecar) ──OTLP gRPC──► collector ◄──scrape── Prometheus
      ▲ /metrics ◄───────────────────────────────────────────────────scrape──┘     │ alerts
      └ OpenAI API (clients, ``sightline load``)                         Alertmanager ◄┘

Every component is a real process; configuration is rendered into ``<run_dir>`` and every
log lands in ``<run_dir>/logs/``. Ports come from the config, else the documented default
when ``prefer_default_ports`` and it is free, else a free port. Guarantees: start-up in
dependency order, each component waited for through its health check; shutdown in reverse,
so the engine's spans reach rotel and rotel's the collector before either stops. Cost: the
engine's start (torch import and model build) dominates.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..instrumentation import check_range
from .processes import HealthCheck, ProcessFailedError, ProcessSpec, Supervisor, free_ports

__all__ = [
    "DEFAULT_PORTS",
    "COMPONENTS",
    "StackConfig",
    "StackPorts",
    "Stack",
    "cuda_present",
    "default_rules_files",
    "format_urls",
]

Component = Literal["engine", "rotel", "collector", "prometheus", "alertmanager"]
COMPONENTS: tuple[Component, ...] = ("collector", "rotel", "alertmanager", "prometheus", "engine")

# The documented defaults (ARCHITECTURE.md, collector/config.py, Prometheus, Alertmanager).
# rotel listens next to the engine on ports of its own, since the collector owns 4317/4318.
DEFAULT_PORTS: dict[str, int] = {
    "engine": 8000,
    "rotel_grpc": 14317,
    "rotel_http": 14318,
    "collector_grpc": 4317,
    "collector_http": 4318,
    "collector_zipkin": 9411,
    "collector_api": 8889,
    "prometheus": 9090,
    "alertmanager": 9093,
}

_REPO_ROOT = Path(__file__).resolve().parent.parent


def default_rules_files() -> tuple[Path, ...]:
    """The project's alerting and recording rules, when the checkout has them."""
    rules = _REPO_ROOT / "deploy" / "prometheus" / "sightline-rules.yml"
    return (rules,) if rules.is_file() else ()


def cuda_present() -> bool:
    """A cheap check for an NVIDIA GPU (no torch import): the driver's device nodes."""
    return os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None


@dataclass(frozen=True)
class StackConfig:
    """The stack to run. Ports of 0 are chosen at start (see the module docstring)."""

    run_dir: Path = Path("sightline-out")
    host: str = "127.0.0.1"
    components: tuple[Component, ...] = COMPONENTS
    prefer_default_ports: bool = False
    ports: dict[str, int] = field(default_factory=dict)  # keys of DEFAULT_PORTS
    # engine
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: str | None = None  # None: "tiny" on the CPU, "llama-1b" on a GPU
    trace_level: str | None = None  # None: "steps" on the CPU, "kernels" on a GPU
    engine_args: tuple[str, ...] = ()
    collector_args: tuple[str, ...] = ()  # extra `sightline collector run` flags
    telemetry_export_interval_s: float = 1.0
    # prometheus / alertmanager
    scrape_interval_s: float = 1.0
    rules_files: tuple[Path, ...] | None = None  # None: default_rules_files()
    alert_webhook_url: str | None = None
    alertmanager_config: Callable[[StackPorts], str] | None = None  # YAML text; None: rendered
    fresh_data: bool = False  # wipe Prometheus' and Alertmanager's data of earlier runs
    health_timeout_s: float = 180.0
    stop_timeout_s: float = 15.0
    echo_logs: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"StackConfig.components has {sorted(unknown)}; allowed {COMPONENTS}")
        bad = set(self.ports) - set(DEFAULT_PORTS)
        if bad:
            raise ValueError(f"StackConfig.ports has unknown keys {sorted(bad)}; "
                             f"allowed {sorted(DEFAULT_PORTS)}")
        for key, port in self.ports.items():
            check_range(f"StackConfig.ports[{key!r}]", port, 0, 65535, integer=True)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"StackConfig.device={self.device!r} must be auto, cpu or cuda")
        check_range("StackConfig.scrape_interval_s", self.scrape_interval_s, 0.1, 60)
        check_range("StackConfig.telemetry_export_interval_s", self.telemetry_export_interval_s,
                    0.1, 60)
        check_range("StackConfig.health_timeout_s", self.health_timeout_s, 1, 3600)
        check_range("StackConfig.stop_timeout_s", self.stop_timeout_s, 0.5, 600)

    @property
    def resolved_device(self) -> Literal["cpu", "cuda"]:
        if self.device == "auto":
            return "cuda" if cuda_present() else "cpu"
        return self.device

    @property
    def resolved_model(self) -> str:
        return self.model or ("llama-1b" if self.resolved_device == "cuda" else "tiny")

    @property
    def resolved_trace_level(self) -> str:
        return self.trace_level or ("kernels" if self.resolved_device == "cuda" else "steps")

    def resolve_ports(self, defaults: Mapping[str, int] = DEFAULT_PORTS) -> StackPorts:
        """Concrete ports: given > documented default (if preferred and free) > free."""
        chosen: dict[str, int] = {}
        needed = [k for k in DEFAULT_PORTS if self.ports.get(k, 0) == 0]
        for key, port in self.ports.items():
            if port:
                chosen[key] = port
        if self.prefer_default_ports:
            for key in list(needed):
                if _port_free(self.host, defaults[key]):
                    chosen[key] = defaults[key]
                    needed.remove(key)
        for key, port in zip(needed, free_ports(len(needed), self.host) if needed else []):
            chosen[key] = port
        return StackPorts(host=self.host, **chosen)


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class StackPorts:
    """Where everything listens, and the URLs derived from it."""

    host: str
    engine: int
    rotel_grpc: int
    rotel_http: int
    collector_grpc: int
    collector_http: int
    collector_zipkin: int
    collector_api: int
    prometheus: int
    alertmanager: int

    def _url(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    @property
    def engine_url(self) -> str:
        return self._url(self.engine)

    @property
    def collector_url(self) -> str:
        return self._url(self.collector_api)

    @property
    def prometheus_url(self) -> str:
        return self._url(self.prometheus)

    @property
    def alertmanager_url(self) -> str:
        return self._url(self.alertmanager)

    @property
    def rotel_grpc_endpoint(self) -> str:
        return self._url(self.rotel_grpc)

    @property
    def collector_grpc_endpoint(self) -> str:
        return self._url(self.collector_grpc)


def _sightline_argv(*words: str) -> tuple[str, ...]:
    # The same interpreter as ours, so the stack runs from any venv without PATH tricks.
    return (sys.executable, "-m", "sightline.deploy.cli", *words)


def _rotel_binary() -> str:
    try:
        import rotel  # the PyPI package ships the agent binary next to its module
    except ImportError as exc:
        raise RuntimeError("rotel is not installed: pip install rotel") from exc
    path = Path(rotel.__file__).parent / "rotel-agent"
    if not path.is_file():
        raise RuntimeError(f"rotel's agent binary is missing at {path}")
    return str(path)


def _need_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (Debian package; scripts/setup.sh installs it)")
    return path


class Stack:
    """Runs a ``StackConfig``: ``with Stack(config) as stack: stack.ports.engine_url``.

    ``start()`` returns once every component answers its health check, or raises
    ``ProcessFailedError`` with the failing component's log tail (having stopped the
    others). ``stop()`` is idempotent.
    """

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.ports = config.resolve_ports()
        self.supervisor: Supervisor | None = None

    # -- rendering ---------------------------------------------------------------------
    def rules_files(self) -> tuple[Path, ...]:
        files = self.config.rules_files
        return tuple(Path(p).resolve() for p in (default_rules_files() if files is None else files))

    def render_prometheus_config(self) -> str:
        """prometheus.yml: scrape the engine and the collector, rules, Alertmanager."""
        from .prometheus_config import render_prometheus_config
        from .prometheus_rules import JOB_COLLECTOR, JOB_ENGINE

        p = self.ports
        targets = {}
        if "engine" in self.config.components:
            targets[JOB_ENGINE] = f"{p.host}:{p.engine}"
        if "collector" in self.config.components:
            targets[JOB_COLLECTOR] = f"{p.host}:{p.collector_api}"
        alertmanagers = ([f"{p.host}:{p.alertmanager}"]
                         if "alertmanager" in self.config.components else [])
        return render_prometheus_config(
            targets=targets, rule_files=[str(f) for f in self.rules_files()],
            alertmanagers=alertmanagers, scrape_interval_s=self.config.scrape_interval_s,
            evaluation_interval_s=self.config.scrape_interval_s)

    def render_alertmanager_config(self) -> str:
        if self.config.alertmanager_config is not None:
            return self.config.alertmanager_config(self.ports)
        from .alertmanager_config import render_alertmanager_config

        return render_alertmanager_config(webhook_url=self.config.alert_webhook_url)

    # -- process specs -----------------------------------------------------------------
    def specs(self) -> list[ProcessSpec]:
        """The processes to start, in start order."""
        builders: dict[str, Callable[[], ProcessSpec]] = {
            "collector": self._collector_spec, "rotel": self._rotel_spec,
            "alertmanager": self._alertmanager_spec, "prometheus": self._prometheus_spec,
            "engine": self._engine_spec,
        }
        return [builders[name]() for name in COMPONENTS if name in self.config.components]

    def _spec(self, name: str, argv: tuple[str, ...], health: HealthCheck,
              env: dict[str, str] | None = None) -> ProcessSpec:
        return ProcessSpec(name=name, argv=argv, env=env or {}, health=health,
                           stop_timeout_s=self.config.stop_timeout_s)

    def _collector_spec(self) -> ProcessSpec:
        p = self.ports
        return self._spec("collector", _sightline_argv(
            "collector", "run",
            "--otlp-grpc", f"{p.host}:{p.collector_grpc}",
            "--otlp-http", f"{p.host}:{p.collector_http}",
            "--zipkin", f"{p.host}:{p.collector_zipkin}",
            "--http", f"{p.host}:{p.collector_api}", *self.config.collector_args),
            HealthCheck(http_url=f"{p.collector_url}/readyz", timeout_s=self.config.health_timeout_s))

    def _rotel_spec(self) -> ProcessSpec:
        p = self.ports
        return self._spec("rotel", (
            _rotel_binary(), "start",
            "--otlp-grpc-endpoint", f"{p.host}:{p.rotel_grpc}",
            "--otlp-http-endpoint", f"{p.host}:{p.rotel_http}",
            # rotel wants a URL here (a bare host:port fails to parse).
            "--otlp-exporter-endpoint", p.collector_grpc_endpoint,
            "--otlp-exporter-protocol", "grpc",
            "--batch-timeout", "200ms"),
            # rotel has no health route: its gRPC port accepting is the signal.
            HealthCheck(tcp_address=(p.host, p.rotel_grpc), timeout_s=self.config.health_timeout_s),
            env={"NO_COLOR": "1"})

    def _alertmanager_spec(self) -> ProcessSpec:
        p, folder = self.ports, self.run_dir / "alertmanager"
        return self._spec("alertmanager", (
            _need_binary("prometheus-alertmanager"),
            f"--config.file={folder / 'alertmanager.yml'}",
            f"--storage.path={folder / 'data'}",
            f"--web.listen-address={p.host}:{p.alertmanager}",
            "--cluster.listen-address="),  # a single local instance: no gossip port
            HealthCheck(http_url=f"{p.alertmanager_url}/-/ready",
                        timeout_s=self.config.health_timeout_s))

    def _prometheus_spec(self) -> ProcessSpec:
        p, folder = self.ports, self.run_dir / "prometheus"
        return self._spec("prometheus", (
            _need_binary("prometheus"),
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={p.host}:{p.prometheus}",
            "--enable-feature=exemplar-storage",
            "--web.enable-lifecycle"),
            HealthCheck(http_url=f"{p.prometheus_url}/-/ready",
                        timeout_s=self.config.health_timeout_s))

    def _engine_spec(self) -> ProcessSpec:
        p, c = self.ports, self.config
        exporter = p.rotel_grpc_endpoint if "rotel" in c.components else p.collector_grpc_endpoint
        interval_ms = str(int(c.telemetry_export_interval_s * 1000))
        telemetry_sink = "collector" in c.components or "rotel" in c.components
        env = {
            "SIGHTLINE_TRACE_LEVEL": c.resolved_trace_level if telemetry_sink else "off",
            "OTEL_EXPORTER_OTLP_ENDPOINT": exporter,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            # Short export intervals: a local run wants its spans at the collector in ~1 s.
            "OTEL_BSP_SCHEDULE_DELAY": interval_ms,
            "OTEL_METRIC_EXPORT_INTERVAL": interval_ms,
        }
        return self._spec("engine", _sightline_argv(
            "engine", "serve", "--host", p.host, "--port", str(p.engine),
            "--model", c.resolved_model, "--device", c.resolved_device, *c.engine_args),
            HealthCheck(http_url=f"{p.engine_url}/health", timeout_s=c.health_timeout_s),
            env=env)

    # -- lifecycle ---------------------------------------------------------------------
    def prepare(self) -> None:
        """Creates the run folder and writes the rendered configuration files."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.fresh_data:
            # An earlier run's series (other ports, so other instance labels) would still
            # answer instant queries for 5 minutes after a restart.
            for name in ("prometheus", "alertmanager"):
                shutil.rmtree(self.run_dir / name / "data", ignore_errors=True)
        if "prometheus" in self.config.components:
            folder = self.run_dir / "prometheus"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "prometheus.yml").write_text(self.render_prometheus_config())
        if "alertmanager" in self.config.components:
            folder = self.run_dir / "alertmanager"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "alertmanager.yml").write_text(self.render_alertmanager_config())

    def start(self, on_started: Callable[[str, float], None] | None = None) -> StackPorts:
        """Starts every component in order; returns the ports once all are healthy."""
        self.prepare()
        self.supervisor = Supervisor(self.log_dir, echo=sys.stderr if self.config.echo_logs else None)
        try:
            for spec in self.specs():
                proc = self.supervisor.start(spec, wait=False)
                seconds = proc.wait_healthy()
                if on_started is not None:
                    on_started(spec.name, seconds)
        except BaseException:
            self.stop()
            raise
        return self.ports

    def check(self) -> None:
        """Raises ``ProcessFailedError`` naming any component that has exited."""
        if self.supervisor is None:
            return
        dead = self.supervisor.failed()
        if dead:
            proc = dead[0]
            raise ProcessFailedError(f"{proc.name} exited with code {proc.returncode}; "
                                     f"log {proc.log_path}:\n{proc.log_tail()}")

    def stop(self) -> dict[str, int | None]:
        if self.supervisor is None:
            return {}
        supervisor, self.supervisor = self.supervisor, None
        codes = supervisor.stop_all()
        supervisor.close()
        return codes

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def urls(self) -> dict[str, str]:
        """Human-facing addresses of the running components."""
        p, on = self.ports, set(self.config.components)
        out = {}
        if "engine" in on:
            out["engine (OpenAI API)"] = f"{p.engine_url}/v1"
            out["engine metrics"] = f"{p.engine_url}/metrics"
        if "rotel" in on:
            out["rotel OTLP gRPC"] = f"{p.host}:{p.rotel_grpc}"
        if "collector" in on:
            out["collector OTLP gRPC"] = f"{p.host}:{p.collector_grpc}"
            out["collector OTLP HTTP"] = f"{p.host}:{p.collector_http}"
            out["collector Zipkin"] = f"{p.host}:{p.collector_zipkin}"
            out["collector API"] = f"{p.collector_url}/api/v1/"
            out["collector metrics"] = f"{p.collector_url}/metrics"
        if "prometheus" in on:
            out["Prometheus"] = p.prometheus_url
        if "alertmanager" in on:
            out["Alertmanager"] = p.alertmanager_url
        out["logs"] = str(self.log_dir)
        return out


def format_urls(urls: dict[str, str]) -> str:
    width = max(len(k) for k in urls)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in urls.items())

