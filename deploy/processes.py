"""A small process supervisor: start children, log them to one folder, health-check, stop.

Guarantees: every child runs in its own session, so stopping it (SIGTERM to the group,
SIGKILL after ``stop_timeout_s``) also stops its own children; ``Supervisor.stop_all()``
stops children in reverse start order (a producer flushes its telemetry before the
collector it exports to stops) and is idempotent; on Linux each child also gets
``PR_SET_PDEATHSIG=SIGTERM``, so it stops even when the supervisor is SIGKILLed. Health
checks are HTTP GETs answering 2xx or TCP connects; a child that exits before it is
healthy fails the check at once, with the tail of its log in the error.

Logs: each child's stdout and stderr go, line by line, to ``<log_dir>/<name>.log`` and to
``<log_dir>/combined.log`` prefixed with ``[name]``. Cost: one reader thread per child and
one pipe hop per line.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..instrumentation import check_range

__all__ = [
    "HealthCheck",
    "ProcessSpec",
    "ManagedProcess",
    "ProcessFailedError",
    "Supervisor",
    "free_port",
    "free_ports",
    "wait_http",
    "wait_tcp",
]

logger = logging.getLogger(__name__)


class ProcessFailedError(RuntimeError):
    """A child exited, or did not become healthy in time; the message has its log tail."""


@dataclass(frozen=True)
class HealthCheck:
    """How to tell that a child is ready: an HTTP URL answering 2xx, or a TCP port accepting."""

    http_url: str | None = None
    tcp_address: tuple[str, int] | None = None
    timeout_s: float = 60.0
    interval_s: float = 0.1

    def __post_init__(self) -> None:
        if (self.http_url is None) == (self.tcp_address is None):
            raise ValueError("HealthCheck needs exactly one of http_url or tcp_address, "
                             f"got http_url={self.http_url!r}, tcp_address={self.tcp_address!r}")
        check_range("HealthCheck.timeout_s", self.timeout_s, 0, 3600, lo_open=True)
        check_range("HealthCheck.interval_s", self.interval_s, 0, 10, lo_open=True)

    def describe(self) -> str:
        if self.http_url is not None:
            return self.http_url
        host, port = self.tcp_address  # type: ignore[misc]
        return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class ProcessSpec:
    """One child to run. ``env`` is added to (and overrides) the supervisor's environment."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    health: HealthCheck | None = None
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"ProcessSpec.name={self.name!r} must be non-empty [A-Za-z0-9._-]")
        if not self.argv:
            raise ValueError(f"ProcessSpec {self.name!r}: argv is empty")
        check_range("ProcessSpec.stop_timeout_s", self.stop_timeout_s, 0, 600, lo_open=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (see ``free_ports``)."""
    return free_ports(1, host)[0]


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999                   # Linux's default


# Ports are drawn below the kernel's ephemeral range: a port from bind(0) lies inside it,
# where the kernel also picks the local port of every outgoing connection, so between
# choosing a port and a child binding it, any client socket (a scrape, an exporter) could
# take it (seen in CI as EADDRINUSE). Below the range a port is only ever bound on
# purpose. Each process draws from its own shuffled order and never hands a port out twice.
_PORT_DRAW_LOW = 10_000
_ports_to_draw: list[int] = []
_ports_lock = threading.Lock()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports on ``host`` that nothing listens on right now, never handed
    out before by this process; the sockets stay bound until all are chosen."""
    check_range("free_ports count", count, 1, 1000, integer=True)
    sockets: list[socket.socket] = []
    try:
        with _ports_lock:
            if not _ports_to_draw:
                low = min(_ephemeral_port_range()[0], 32768)
                _ports_to_draw.extend(range(_PORT_DRAW_LOW, low))
                random.Random(os.getpid()).shuffle(_ports_to_draw)
            while len(sockets) < count:
                # 0 once none is left below the range (or the range starts low): the kernel picks
                port = _ports_to_draw.pop() if _ports_to_draw else 0
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.bind((host, port))
                except OSError:
                    sock.close()
                    if port == 0:
                        raise
                    continue
                sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _http_refusal(url: str) -> str | None:
    """None when ``url`` answers 2xx; else what it said instead (status and the start of the
    body, e.g. a readiness endpoint's reason), or why it did not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read(300).decode(errors='replace')}"
    except (urllib.error.URLError, ConnectionError, OSError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


def _tcp_ok(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=1):
            return True
    except OSError:
        return False


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    """Polls ``url`` until it answers 2xx; raises ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (said := _http_refusal(url)) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 2xx within {timeout_s}s; it said {said}")
        time.sleep(0.1)


def wait_tcp(address: tuple[str, int], timeout_s: float = 30.0) -> None:
    """Polls until ``address`` accepts a TCP connection; ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not _tcp_ok(address):
        if time.monotonic() > deadline:
            raise TimeoutError(f"tcp://{address[0]}:{address[1]} not accepting within {timeout_s}s")
        time.sleep(0.1)


def _set_parent_death_signal() -> None:
    # Runs in the child between fork and exec. Linux only; elsewhere a no-op.
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except OSError:
            pass


class ManagedProcess:
    """A running child: its spec, ``Popen``, log file and the thread copying its output."""

    def __init__(self, spec: ProcessSpec, popen: subprocess.Popen, log_path: Path,
                 pump: threading.Thread) -> None:
        self.spec = spec
        self.popen = popen
        self.log_path = log_path
        self.started_at_s = time.monotonic()
        self.stopped = False
        self._pump = pump

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of this child's log (for error messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, check: HealthCheck | None = None) -> float:
        """Blocks until the health check passes; returns the seconds it took.

        Raises ``ProcessFailedError`` (with the log tail) when the child exits first or
        the check times out.
        """
        check = check or self.spec.health
        if check is None:
            return 0.0
        start = time.monotonic()
        deadline = start + check.timeout_s
        probe = ((lambda: _http_refusal(check.http_url) is None) if check.http_url is not None
                 else (lambda: _tcp_ok(check.tcp_address)))  # type: ignore[arg-type]
        while True:
            if not self.alive:
                raise ProcessFailedError(
                    f"{self.name} exited with code {self.returncode} before "
                    f"{check.describe()} became healthy; log {self.log_path}:\n{self.log_tail()}")
            if probe():
                return time.monotonic() - start
            if time.monotonic() > deadline:
                said = f" (it said {_http_refusal(check.http_url)})" if check.http_url is not None else ""
                raise ProcessFailedError(
                    f"{self.name} not healthy at {check.describe()} within {check.timeout_s}s{said}; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(check.interval_s)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``timeout_s``; returns the exit code."""
        if self.stopped:  # never signal a group id that may since have been reused
            return self.popen.returncode
        timeout_s = self.spec.stop_timeout_s if timeout_s is None else timeout_s
        if self.alive:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                try:
                    self.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    # Seen once in CI: still not reaped 10 s after SIGKILL. Stopping the rest
                    # matters more than this exit code, so say so and go on.
                    logger.warning("%s (pid %d) not reaped 10 s after SIGKILL", self.name,
                                   self.popen.pid)
        # The leader is gone; anything left in its group (orphaned grandchildren) goes too.
        _signal_group(self.popen.pid, signal.SIGKILL)
        self._pump.join(timeout=2)
        self.stopped = True
        return self.popen.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Starts and stops a set of children whose logs share one folder.

    Use as a context manager (``with Supervisor(log_dir) as sup:``) so that every child
    is stopped on the way out, exceptions and Ctrl-C included.
    """

    def __init__(self, log_dir: Path | str, *, echo: IO[str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.combined_log_path = self.log_dir / "combined.log"
        self._combined = open(self.combined_log_path, "w", buffering=1, encoding="utf-8")
        self._combined_lock = threading.Lock()
        self._echo = echo
        self._processes: list[ManagedProcess] = []

    @property
    def processes(self) -> list[ManagedProcess]:
        return list(self._processes)

    def __getitem__(self, name: str) -> ManagedProcess:
        for proc in self._processes:
            if proc.name == name:
                return proc
        raise KeyError(name)

    def start(self, spec: ProcessSpec, *, wait: bool = True) -> ManagedProcess:
        """Starts ``spec``; with ``wait`` (default) blocks until its health check passes."""
        if any(p.name == spec.name and p.alive for p in self._processes):
            raise ValueError(f"a process named {spec.name!r} is already running")
        log_path = self.log_dir / f"{spec.name}.log"
        env = dict(os.environ)
        env.update(spec.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        popen = subprocess.Popen(
            list(spec.argv), cwd=spec.cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_set_parent_death_signal)
        log_file = open(log_path, "w", buffering=1, encoding="utf-8")
        pump = threading.Thread(target=self._pump, args=(spec.name, popen, log_file),
                                name=f"log-{spec.name}", daemon=True)
        pump.start()
        proc = ManagedProcess(spec, popen, log_path, pump)
        self._processes.append(proc)
        self._write_combined(spec.name, f"started pid {popen.pid}: {' '.join(spec.argv)}")
        if wait:
            try:
                proc.wait_healthy()
            except ProcessFailedError:
                proc.stop(timeout_s=2)
                raise
        return proc

    def _pump(self, name: str, popen: subprocess.Popen, log_file: IO[str]) -> None:
        assert popen.stdout is not None
        try:
            for raw in iter(popen.stdout.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                log_file.write(line + "\n")
                self._write_combined(name, line)
        except (OSError, ValueError):
            pass
        finally:
            log_file.close()

    def _write_combined(self, name: str, line: str) -> None:
        text = f"[{name}] {line}\n"
        with self._combined_lock:
            if not self._combined.closed:
                self._combined.write(text)
            if self._echo is not None:
                try:
                    self._echo.write(text)
                except (OSError, ValueError):
                    pass

    def failed(self) -> list[ManagedProcess]:
        """Children that have exited (for a watch loop)."""
        return [p for p in self._processes if not p.alive]

    def stop_all(self) -> dict[str, int | None]:
        """Stops every child, last started first; returns exit codes by name. Idempotent."""
        codes: dict[str, int | None] = {}
        for proc in reversed(self._processes):
            already = proc.stopped
            codes[proc.name] = proc.stop()
            if not already:
                self._write_combined(proc.name, f"stopped, exit code {codes[proc.name]}")
        return codes

    def close(self) -> None:
        self.stop_all()
        with self._combined_lock:
            self._combined.close()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
