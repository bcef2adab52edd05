"""The collector as a bench runs it: ``sightline collector run`` in a process of its own.

:class:`CollectorProcess` listens on free loopback ports (OTLP gRPC and HTTP, Zipkin, the
query API), writes its output to one log file and is configured by its flags alone: no
``SIGHTLINE_COLLECTOR_*`` variable of the caller's environment reaches it (an ingest token
there would refuse a bench's unauthenticated exports). Guarantee: the constructor returns
once ``/readyz`` answers (the byte walks compiled), else stops it and raises with the log's
tail; ``stop`` sends SIGTERM (the collector flushes) and SIGKILL after ``timeout_s``. Cost:
the collector's start, about a second with a warm cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from ._common import ROOT, process_cpu_s

__all__ = ["CollectorProcess"]

PORTS = ("grpc", "http", "zipkin", "query")


class CollectorProcess:
    """See the module docstring. ``flags``: more ``collector run`` flags; ``pythonpath``: a
    folder whose ``sightline`` runs instead of this checkout's; ``cpus``: the CPUs it (every
    thread) may run on; ``preexec_fn``: run in the child before it starts (limits)."""

    def __init__(self, log: Path, flags: Sequence[str] = (), *, pythonpath: Path | None = None,
                 cpus: set[int] | None = None, preexec_fn: Callable[[], None] | None = None,
                 ready_timeout_s: float = 120.0) -> None:
        from sightline.deploy.processes import free_port  # below the ephemeral range: no client takes it first

        self.ports = {name: free_port() for name in PORTS}
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("SIGHTLINE_COLLECTOR_")}
        if pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath) + os.pathsep + env.get("PYTHONPATH", "")
        command = [sys.executable, "-m", "sightline.deploy.cli", "collector", "run",
                   *(arg for name in ("grpc", "http") for arg in (f"--otlp-{name}", self.address(name))),
                   "--zipkin", self.address("zipkin"), "--http", self.address("query"), "--log-level", "WARNING",
                   *flags]

        def before_start() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)
            if preexec_fn is not None:
                preexec_fn()

        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                            preexec_fn=before_start if cpus or preexec_fn else None)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url("query", "/readyz"), timeout=2).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop(timeout_s=5)
                    raise RuntimeError(f"collector did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def address(self, port: str) -> str:
        return f"127.0.0.1:{self.ports[port]}"

    def url(self, port: str, path: str = "") -> str:
        """``http://`` + the address of ``port`` (grpc, http, zipkin or query) + ``path``."""
        return f"http://{self.address(port)}{path}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_s(self) -> float:
        return process_cpu_s(self.process.pid)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout_s``; its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        return self.process.returncode

    def __enter__(self) -> CollectorProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
