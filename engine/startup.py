"""Start-up as timed phases: which one runs now, and what each one compiled.

The thread that builds the engine writes a ``StartupProgress``; any thread reads it
(``/health`` names the phase running). ``with progress.phase(name) as run:`` times a
phase, takes from the compile watch the kernel variants that thread met meanwhile
(compiled, loaded from the on-disk cache, autotuned), logs one line and calls
``on_phase(name, report)`` (``report`` is None when the phase starts). ``ready()`` closes
start-up into a ``StartupReport``, from the process's own start when asked (the CLI), and
records it for the telemetry: one trace, a span per phase.

Cost: a few µs per phase; nothing once ready.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..instrumentation import semconv as sc
from .compile_watch import CompileEvent, CompileWatch, compile_watch

__all__ = ["PhaseReport", "PhaseRun", "StartupProgress", "StartupReport", "process_start_ns"]

log = logging.getLogger(__name__)

OnPhase = Callable[[str, "PhaseReport | None"], None]


@dataclass(frozen=True)
class PhaseReport:
    """One finished start-up phase and the kernel variants it met."""

    name: str
    start_ns: int
    end_ns: int
    compiled: tuple[str, ...] = ()    # variants compiled in this phase (``CompileEvent.variant``)
    cached: tuple[str, ...] = ()      # variants loaded from the on-disk cache
    autotuned: tuple[str, ...] = ()   # tuning keys timed (no compile)
    compile_s: float = 0.0            # Triton's compile/load time and tuning time within it
    variants_run: int = 0             # warm-up cases run (0 for phases that are not warm-up)
    variants_skipped: int = 0         # warm-up cases left out: the time limit ran out
    note: str = ""

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def status(self) -> str:
        """``timed_out`` (cases left out), ``compiled`` (something compiled or tuned),
        ``cached`` (every variant came from the disk cache) or ``warm`` (nothing to load)."""
        if self.variants_skipped:
            return "timed_out"
        if self.compiled or self.autotuned:
            return "compiled"
        return "cached" if self.cached else "warm"

    def attributes(self) -> dict[str, Any]:
        """The phase's span attributes (``semconv.STARTUP_*``)."""
        attributes: dict[str, Any] = {
            sc.STARTUP_PHASE: self.name, sc.STARTUP_STATUS: self.status,
            sc.STARTUP_VARIANTS_COMPILED: len(self.compiled),
            sc.STARTUP_VARIANTS_CACHED: len(self.cached),
            sc.STARTUP_AUTOTUNED: len(self.autotuned),
            sc.STARTUP_COMPILE_S: round(self.compile_s, 6),
            sc.STARTUP_VARIANTS_RUN: self.variants_run,
            sc.STARTUP_VARIANTS_SKIPPED: self.variants_skipped,
        }
        if self.compiled:
            attributes[sc.STARTUP_KERNELS_COMPILED] = list(self.compiled)
        return attributes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "duration_s": round(self.duration_s, 6), "status": self.status,
                "start_ns": self.start_ns, "end_ns": self.end_ns,
                "compiled": list(self.compiled), "cached": list(self.cached),
                "autotuned": list(self.autotuned), "compile_s": round(self.compile_s, 6),
                "variants_run": self.variants_run, "variants_skipped": self.variants_skipped,
                "note": self.note}

    def summary(self) -> str:
        """One log line: duration, status, what compiled and what came from the cache."""
        parts = [f"{self.name}: {self.duration_s:.2f} s, {self.status}"]
        if self.variants_run or self.variants_skipped:
            parts.append(f"cases: {self.variants_run} run"
                         + (f", {self.variants_skipped} left out (time limit)"
                            if self.variants_skipped else ""))
        for label, names in (("compiled", self.compiled), ("from cache", self.cached),
                             ("autotuned", self.autotuned)):
            if names:
                parts.append(f"{label} {len(names)} ({_counted(names)})")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


def _counted(variants: tuple[str, ...]) -> str:
    """Variants counted per kernel: ``fa2 x7, rope``."""
    counts: dict[str, int] = {}
    for variant in variants:
        kernel = variant.split("[", 1)[0].split(" ", 1)[0]
        counts[kernel] = counts.get(kernel, 0) + 1
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())


@dataclass
class PhaseRun:
    """What a running phase reports about itself besides its compiles."""

    variants_run: int = 0
    variants_skipped: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StartupReport:
    """From process start (or the progress's creation) to ready, phase by phase."""

    start_ns: int
    ready_ns: int
    phases: tuple[PhaseReport, ...]
    compile_cache_dir: str | None = None
    cache_entries_before: int = 0     # Triton cache entries when start-up began
    trace_id: str | None = None       # the start-up trace, when telemetry is on

    @property
    def total_s(self) -> float:
        return (self.ready_ns - self.start_ns) / 1e9

    def phase(self, name: str) -> PhaseReport | None:
        return next((p for p in self.phases if p.name == name), None)

    @property
    def compiled(self) -> int:
        return sum(len(p.compiled) for p in self.phases)

    @property
    def cached(self) -> int:
        return sum(len(p.cached) for p in self.phases)

    def to_dict(self) -> dict[str, Any]:
        return {"total_s": round(self.total_s, 6), "start_ns": self.start_ns,
                "ready_ns": self.ready_ns, "compile_cache_dir": self.compile_cache_dir,
                "cache_entries_before": self.cache_entries_before, "trace_id": self.trace_id,
                "variants_compiled": self.compiled, "variants_cached": self.cached,
                "phases": [p.to_dict() for p in self.phases]}


class StartupProgress:
    """See the module docstring. ``from_process_start``: the report (and the ``imports``
    phase) begins when the process did, not when this object was made."""

    def __init__(self, on_phase: OnPhase | None = None, watch: CompileWatch | None = None,
                 from_process_start: bool = False, start_ns: int | None = None) -> None:
        """``start_ns``: when start-up began, if before this process (the process that
        started it, e.g. ``engine serve``'s supervisor); it wins over ``from_process_start``."""
        self.on_phase = on_phase
        self.watch = watch if watch is not None else compile_watch()
        self.created_ns = time.time_ns()
        started = start_ns if start_ns is not None else (
            process_start_ns() if from_process_start else None)
        self.start_ns = started if started is not None else self.created_ns
        self._phases: list[PhaseReport] = []
        self._lock = threading.Lock()
        self.current = ""            # the phase running now ("" between phases)
        self.report: StartupReport | None = None
        self.failed: str | None = None
        self.compile_cache_dir: str | None = None
        self.cache_entries_before = 0
        if started is not None and started < self.created_ns:
            self._phases.append(PhaseReport(sc.STARTUP_IMPORTS, started, self.created_ns))

    @property
    def phases(self) -> list[PhaseReport]:
        with self._lock:
            return list(self._phases)

    @property
    def is_ready(self) -> bool:
        return self.report is not None

    def state(self) -> dict[str, Any]:
        """What ``/health`` says while starting: the phase, the time so far, phases done."""
        phase = self.current or (self._phases[-1].name if self._phases else "starting")
        state = {"status": "failed" if self.failed else "starting", "phase": phase,
                 "elapsed_s": round((time.time_ns() - self.start_ns) / 1e9, 3),
                 "phases_done": [p.name for p in self.phases]}
        if self.failed:
            state["error"] = self.failed
        return state

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseRun]:
        """Times one phase on the calling thread (see the module docstring)."""
        since = self.watch.thread_count()
        run = PhaseRun()
        self.current = name
        self._notify(name, None)
        start = time.time_ns()
        try:
            yield run
        finally:
            report = _report(name, start, time.time_ns(), self.watch.since(since), run)
            with self._lock:
                self._phases.append(report)
            self.current = ""
            log.info("start-up %s", report.summary())
            self._notify(name, report)

    def _notify(self, name: str, report: PhaseReport | None) -> None:
        if self.on_phase is not None:
            try:
                self.on_phase(name, report)
            except Exception:   # a listener's bug never stops start-up
                log.exception("start-up: the on_phase callback failed")

    def use_cache(self, cache):
        """Points the kernel compilers at ``cache`` (a ``CompileCache``) and notes it for the
        report (with how many binaries it held). Returns ``cache``."""
        cache.apply()
        self.compile_cache_dir = str(cache.root)
        self.cache_entries_before = cache.triton_entries()
        return cache

    def fail(self, exc: BaseException) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"

    def ready(self, recorder=None) -> StartupReport:
        """Closes start-up; with a telemetry ``recorder``, records its trace (ids drawn here)."""
        report = StartupReport(self.start_ns, time.time_ns(), tuple(self.phases),
                               self.compile_cache_dir, self.cache_entries_before)
        if recorder is not None:
            report = replace(report, trace_id=_record_trace(recorder, report))
        self.report = report
        log.info("ready in %.2f s from %s: %d kernel variants compiled, %d from the cache",
                 report.total_s, "process start" if self._phases and
                 self._phases[0].name == sc.STARTUP_IMPORTS else "engine construction",
                 report.compiled, report.cached)
        return report


def _report(name: str, start: int, end: int, events: list[CompileEvent],
            run: PhaseRun) -> PhaseReport:
    by_source: dict[str, list[str]] = {"compiled": [], "disk_cache": [], "autotune": []}
    for event in events:
        by_source[event.source].append(str(event))
    return PhaseReport(name, start, end, tuple(by_source["compiled"]),
                       tuple(by_source["disk_cache"]), tuple(by_source["autotune"]),
                       sum(e.duration_s for e in events), run.variants_run,
                       run.variants_skipped, "; ".join(run.notes))


def _record_trace(recorder, report: StartupReport) -> str | None:
    """Records the ``Startup`` lifecycle event; returns its trace id (32 hex digits)."""
    try:
        from ..instrumentation import Startup, StartupPhase
        trace_id, span_id = recorder.new_span_ids()
        phases = tuple(StartupPhase(p.name, p.start_ns, p.end_ns, p.attributes())
                       for p in report.phases)
        attributes: dict[str, Any] = {sc.STARTUP_DURATION_S: round(report.total_s, 6),
                                      sc.STARTUP_VARIANTS_COMPILED: report.compiled,
                                      sc.STARTUP_VARIANTS_CACHED: report.cached}
        if report.compile_cache_dir:
            attributes[sc.STARTUP_COMPILE_CACHE_DIR] = report.compile_cache_dir
        recorder.record(Startup(trace_id, span_id, report.start_ns, report.ready_ns, phases,
                                attributes))
        return format(trace_id, "032x")
    except Exception:   # telemetry trouble never stops start-up
        log.exception("start-up trace could not be recorded")
        return None


def process_start_ns() -> int | None:
    """When this process started (Unix ns, ~10 ms resolution), from /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        age_s = uptime_s - int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22: starttime
        return time.time_ns() - int(max(age_s, 0.0) * 1e9)
    except (OSError, ValueError, IndexError):
        return None
