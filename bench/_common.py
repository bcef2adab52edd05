"""What every bench script shares: run metadata, a discarding span exporter, an in-place timer.

The scripts run from the repository root as ``python -m bench.<name>`` and import this
module relatively (``from ._common import ...``); the tests import them as ``bench.<name>``.
Results carry ``git_commit()``, ``utc_now()`` and ``device_name()``; ``DiscardExporter``
stands where the OTLP exporter would be, so a bench measures the instrumentation's cost
(OTLP encoding included) but not the network's; ``InSituTimer`` times the tracing calls an
engine makes where they are made, so their share of the engine loop is known to within the
wrapper's own cost. Loads neither torch nor Sightline until a function needs it; the
metadata costs at most two ``git`` subprocesses per call.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["ROOT", "DiscardExporter", "InSituTimer", "children_cpu_s", "device_name", "git_commit",
           "process_cpu_s", "steps_since_traced", "utc_now", "write_cpu_result", "write_json", "write_report"]

ROOT = Path(__file__).resolve().parent.parent


def git_commit(*, short: bool = False, dirty_paths: Sequence[str] = ()) -> str:
    """HEAD of the checkout this file is in, or ``$SIGHTLINE_COMMIT`` when set, else "unknown".

    The environment variable wins because a GPU machine may get a copy of the working
    tree without ``.git``. With ``dirty_paths``, "-dirty" is appended when any of them
    (paths relative to the repository root) has uncommitted changes.
    """
    env = os.environ.get("SIGHTLINE_COMMIT")
    if env:
        return env
    try:
        commit = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()
        if dirty_paths:
            dirty = subprocess.run(["git", "status", "--porcelain", "--", *dirty_paths], cwd=ROOT,
                                   capture_output=True, text=True).stdout.strip()
            commit += "-dirty" if dirty else ""
        return commit
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_json(out: Path, record: dict) -> Path:
    """Writes ``record`` (with "bench", "device" and "commit") to
    ``out/<bench>-<device slug>-<commit8>.json`` and returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    device = record["device"].replace(" ", "-").lower()
    path = out / f"{record['bench']}-{device}-{record['commit'][:8]}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def write_cpu_result(path: Path, module: str, results: list) -> None:
    """Writes a CPU analysis's ``results`` to ``path`` with its commit, time and the command
    that made them (``python -m <module>`` and this process's arguments)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"commit": git_commit(), "time_utc": utc_now(), "device": "cpu",
                                "command": f"python -m {module} " + " ".join(sys.argv[1:]),
                                "results": results}, indent=1) + "\n")


def write_report(out: Path, module: str, argv: Sequence[str] | None, lines: list[str]) -> None:
    """Prints a result's markdown lines and writes them to ``out`` with suffix .md, ending
    with the command that reproduces it (``python -m bench.<module> <args>``)."""
    import shlex
    import sys
    args = sys.argv[1:] if argv is None else argv
    lines = [*lines, f"Command: `.venv/bin/python -m bench.{module}"
             + "".join(" " + shlex.quote(a) for a in args) + "`"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s(pid: int) -> float:
    """``process_cpu_s`` summed over the live descendants of ``pid`` (gone ones: 0): with
    ``engine serve``, the engine core, the API servers and the core's telemetry process."""
    total = 0.0
    for child in _children(pid):
        try:
            total += process_cpu_s(child) + children_cpu_s(child)
        except OSError:
            pass
    return total


def serve_cpu_s(pid: int, port: int) -> dict[str, float]:
    """CPU seconds so far of ``engine serve`` (process ``pid``) by role: ``api_servers`` (the
    children holding its listening socket on ``port``), ``engine_core`` (the others that are
    not multiprocessing's resource tracker, with their own children) and ``launcher``."""
    listening = _listening_inodes(port)
    out = {"launcher": process_cpu_s(pid), "api_servers": 0.0, "engine_core": 0.0}
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"resource_tracker" in cmdline:
                continue
            sockets = {os.readlink(fd) for fd in Path(f"/proc/{child}/fd").iterdir()
                       if os.readlink(fd).startswith("socket:")}
            role = "api_servers" if sockets & listening else "engine_core"
            out[role] += process_cpu_s(child) + children_cpu_s(child)
        except OSError:
            pass
    return out


def _listening_inodes(port: int) -> set[str]:
    """``socket:[inode]`` of the TCP sockets listening on ``port`` (``/proc/net/tcp``, tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":   # 0A: LISTEN
                found.add(f"socket:[{fields[9]}]")
    return found


def _children(pid: int) -> list[int]:
    children = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return children
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return children


def terminate(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (a server drains and flushes its telemetry), then a kill after ``timeout_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def wait_http(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until ``url`` answers 2xx (a 503 while warming up keeps waiting); raises if ``process``
    exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2.0):
                return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def steps_since_traced(step_ids: Sequence[int], traced: Sequence[bool]) -> list[int | None]:
    """For each step (in order), how many steps after the latest kernel-traced one before it
    it came (None before the first): the phase a trace's close can disturb."""
    since, last = [], None
    for step_id, was_traced in zip(step_ids, traced):
        since.append(step_id - last if last is not None else None)
        last = step_id if was_traced else last
    return since


def utc_now() -> str:
    """The current UTC time as ``2026-11-30T01:02:03Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def device_name(device: object, *, cpu_fallback: str | None = None) -> str:
    """The CUDA device's name when ``device`` (a str or torch.device) is not the CPU and CUDA
    is present; otherwise the host processor, or ``cpu_fallback`` (default: the machine
    type) where the platform does not name it. Imports torch only when called.
    """
    import torch

    kind = str(device)
    if kind != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(kind) if kind.startswith("cuda") else 0)
    return platform.processor() or (cpu_fallback if cpu_fallback is not None else platform.machine())


# -- span export that measures the encoding, not the network ---------------------

class DiscardExporter(SpanExporter):
    """Encodes spans as the OTLP exporter would (unless ``encode=False``), then drops the
    bytes; ``spans`` counts how many it was given and ``bytes`` what they encoded to (no
    lock: the SDK's batch processor calls ``export`` from its one worker thread)."""

    def __init__(self, encode: bool = True) -> None:
        self.encode = encode     # False: forget at once (a calling-thread microbenchmark)
        self.spans = 0
        self.bytes = 0

    def export(self, spans):
        self.spans += len(spans)
        if self.encode:
            self.bytes += len(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


# -- tracing calls timed in place -------------------------------------------------

class InSituTimer:
    """Times every tracing call the engine makes, in place (wall ns inside the calls).

    Patches the public methods of Telemetry, RequestTrace and StepTrace with a timing
    wrapper for the duration of a ``with`` block. The wrapper's own cost (two
    ``perf_counter_ns`` calls, ~0.1-0.3 µs) is included, so the figure is an upper bound.
    """

    METHODS = {
        "Telemetry": ("start_request", "start_step"),
        "RequestTrace": ("start_phase", "end_phase", "link_step", "preempted", "first_token",
                         "finish"),
        "StepTrace": ("end",),
    }

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self._saved: list[tuple[type, str, object]] = []

    def __enter__(self) -> "InSituTimer":
        from sightline.instrumentation import tracing

        for class_name, names in self.METHODS.items():
            cls = getattr(tracing, class_name)
            for name in names:
                original = getattr(cls, name)
                self._saved.append((cls, name, original))
                setattr(cls, name, self._wrap(original))
        return self

    def _wrap(self, fn):
        timer = self
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.ns += clock() - t0
                timer.calls += 1

        return timed

    def __exit__(self, *exc) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()
