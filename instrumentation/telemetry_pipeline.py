"""An engine's telemetry: a recorder the engine writes to, and where its records go.

``TelemetryPipeline.start(config)`` gives the engine core a :class:`~.lifecycle.LifecycleRecorder`
and ships what it records, every ``ship_interval_s``, to the telemetry process
(:mod:`.telemetry_process`, ``mode="process"``, the default) or to a worker on a thread
(``mode="thread"``: tests, embedded use, span exporters passed in as objects). Other
processes (API servers) feed the same spans: ``TelemetryPipeline.join(config,
pipeline.producer_endpoint, producer_id)`` (:mod:`.joined_pipeline`).

Guarantees: the engine never waits for telemetry. A full recorder buffer, a full hand-off
queue or a dead telemetry process drops items and counts them by reason
(``sightline_telemetry_events_dropped_total``); a dead process is restarted on the same
producer endpoint (``sightline_telemetry_process_restarts_total``) and the engine serves on.
Span counters and joined producers' drops (``count_producer_drops``) are on ``registry``.
Cost to the engine thread: the recorder's appends; shipping and pickling run on a thread.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import semconv
from .bounded_queue import BUILD_ERROR, WaitingQueue
from .config import TelemetryConfig, TraceLevel
from .config_checks import check_range
from .counting_export import TelemetryCounters
from .event_wire import from_wire, to_wire
from .gpu_records import KernelNames
from .lifecycle import LifecycleRecorder
from .producer_link import ProducerIdentity, ProducerInbox, private_endpoint, remove_endpoint

__all__ = ["TelemetryPipeline", "ProducerSide"]

logger = logging.getLogger(__name__)

# drop reasons, beside lifecycle.DROP_BUFFER_FULL (the recorder's buffer, engine side, was full)
DROP_QUEUE_FULL = "queue_full"         # the hand-off to the telemetry process was full
DROP_PROCESS_DOWN = "process_down"     # the telemetry process was not running
DROP_BUILD_ERROR = BUILD_ERROR         # a deferred event's builder raised


class ProducerSide:
    """What every pipeline's producing process holds: the recorder and its switches, the
    shipping thread (``_ship_locked`` per tick, under ``_ship_lock``), drop counts by reason
    and the registry they appear on."""

    def __init__(self, config: TelemetryConfig, identity: ProducerIdentity,
                 ship_interval_s: float, recorder_capacity: int) -> None:
        check_range("ship_interval_s", ship_interval_s, 0.001, 10.0)
        self.config = config
        self.identity = identity
        self.recorder = LifecycleRecorder(config, recorder_capacity,
                                          producer_id=identity.producer_id)
        self.requests_on = self.recorder.requests_on
        self.steps_on = self.recorder.steps_on
        self.kernels_on = self.recorder.kernels_on
        self.ship_interval_s = ship_interval_s
        self.dropped: dict[str, int] = {DROP_QUEUE_FULL: 0, DROP_PROCESS_DOWN: 0}
        self._stopping = False
        self._ship_lock = threading.Lock()     # one shipper at a time (force_flush ships too)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(PipelineMetrics(self))

    def _start_shipping(self) -> None:
        self._shipper = threading.Thread(target=self._ship_loop, name="sightline-telemetry-ship",
                                         daemon=True)
        self._shipper.start()

    def start_request(self, **kwargs):
        return self.recorder.start_request(**kwargs)

    def _ship_loop(self) -> None:
        while not self._stopping:
            time.sleep(self.ship_interval_s)
            try:
                self._ship_once()
            except Exception:
                logger.exception("telemetry shipping failed; continuing")

    def _ship_once(self) -> None:
        with self._ship_lock:
            self._ship_locked()

    def _ship_locked(self) -> None:
        raise NotImplementedError

    def dropped_events(self) -> dict[str, int]:
        """Events dropped so far, by reason: this side's and its recorder's."""
        return {**self.dropped, **self.recorder.events.dropped}


class TelemetryPipeline(ProducerSide):
    """See the module docstring. ``recorder`` is what the engine and server write to."""

    def __init__(self, config: TelemetryConfig, mode: Literal["process", "thread"] = "process",
                 telemetry=None, ship_interval_s: float = 0.1, max_queued_batches: int = 512,
                 recorder_capacity: int = 1 << 16) -> None:
        if mode not in ("process", "thread"):
            raise ValueError(f"mode={mode!r} is not one of process|thread")
        super().__init__(config, ProducerIdentity.here(0, semconv.PROCESS_ROLE_ENGINE_CORE),
                         ship_interval_s, recorder_capacity)
        self.mode = mode
        self.gpu = None                        # GpuTelemetry, answers kernel-name questions
        self.restarts = 0
        self._child_stats: dict = {}
        self._child_base: dict = {}            # sums of earlier (dead) children's counters
        self._lock = threading.Lock()
        self._telemetry = telemetry            # thread mode: the span builder in this process
        self._worker = None
        self._process: subprocess.Popen | None = None
        self._next_poll = 0.0
        check_range("max_queued_batches", max_queued_batches, 1, 1 << 20, integer=True)
        self._max_queued_batches = max_queued_batches
        self._outbox: WaitingQueue = self._new_outbox()
        # process mode: every telemetry process (restarts too) binds this path; thread mode:
        # bound here on first use of ``producer_endpoint``
        self._endpoint: str | None = private_endpoint() if mode == "process" else None
        self._inbox: ProducerInbox | None = None
        self._producer_drops: dict[int, dict[str, int]] = {}   # joined producers' reports
        if mode == "thread":
            from .telemetry_worker import TelemetryWorker
            if self._telemetry is None:
                from .tracing import Telemetry
                self._telemetry = Telemetry.start(config)
            self._worker = TelemetryWorker(self._telemetry, self._resolve_names_inline)
        else:
            self._spawn()
        self._start_shipping()

    # -- construction ----------------------------------------------------------------
    @classmethod
    def start(cls, config: TelemetryConfig | None = None, *, mode: str = "process",
              span_exporters: Iterable = (), metric_readers: Iterable = (),
              **kwargs) -> TelemetryPipeline | None:
        """A running pipeline for ``config`` (default: from the environment), or None at
        level OFF. Exporter objects can only run in this process: they imply ``thread``."""
        if config is None:
            config = TelemetryConfig.from_env()
        if config.level == TraceLevel.OFF:
            return None
        span_exporters, metric_readers = list(span_exporters), list(metric_readers)
        telemetry = None
        if span_exporters or metric_readers:
            from .tracing import Telemetry
            telemetry = Telemetry.start(config, span_exporters=span_exporters,
                                        metric_readers=metric_readers)
            mode = "thread"
        return cls(config, mode, telemetry, **kwargs)

    @classmethod
    def around(cls, telemetry, **kwargs) -> TelemetryPipeline | None:
        """A thread-mode pipeline that builds spans with an already started ``telemetry``
        (None when its level is OFF)."""
        if telemetry is None or not telemetry.requests_on:
            return None
        return cls(telemetry.config, "thread", telemetry, **kwargs)

    @classmethod
    def join(cls, config: TelemetryConfig | None, endpoint: str, producer_id: int, **kwargs):
        """A pipeline for another process (an API server) that feeds the telemetry process of
        the pipeline whose ``producer_endpoint`` is ``endpoint``; ``producer_id`` (1 to
        ``lifecycle.MAX_PRODUCER_ID``, one per process) keeps its request keys apart. None
        at level OFF. See :class:`~.joined_pipeline.JoinedPipeline`."""
        if config is None:
            config = TelemetryConfig.from_env()
        if config.level == TraceLevel.OFF:
            return None
        from .joined_pipeline import JoinedPipeline
        return JoinedPipeline(config, endpoint, producer_id, **kwargs)

    @property
    def producer_endpoint(self) -> str:
        """Where other processes join this pipeline's telemetry (``ipc://`` in a private
        directory; the same path across telemetry process restarts)."""
        with self._lock:
            if self._endpoint is None:
                self._endpoint = private_endpoint()
            if self.mode == "thread" and self._inbox is None and not self._stopping:
                self._inbox = ProducerInbox(self._endpoint, self._deliver_joined)
        return self._endpoint

    def _deliver_joined(self, identity: ProducerIdentity, watermark_ns: int,
                        wire_items: list, done: bool) -> None:
        """Thread mode: a joined producer's batch, given to the worker (inbox thread)."""
        items = from_wire(wire_items)
        with self._ship_lock:
            self._worker.handle(items, identity, watermark_ns, done)

    def count_producer_drops(self, producer_id: int, dropped: dict[str, int]) -> None:
        """A joined producer's drops so far, by reason (its ``dropped_events()``, reported
        over the caller's own channel): counted on this registry beside this process's, so
        that the series count every producer once. A later report replaces an earlier one."""
        self._producer_drops[producer_id] = {str(k): int(v) for k, v in dropped.items()}

    def dropped_events(self) -> dict[str, int]:
        dropped = super().dropped_events()
        for counts in list(self._producer_drops.values()):
            for reason, count in counts.items():
                dropped[reason] = dropped.get(reason, 0) + count
        return dropped

    # -- the engine's side ---------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The telemetry process's pid (process mode, while it runs)."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def attach_gpu(self, gpu) -> None:
        self.gpu = gpu

    # -- shipping (its own thread) ----------------------------------------------------------
    def _ship_locked(self) -> None:
        # taken before the drain: everything recorded earlier is in this batch or an earlier
        # one. Sent with every tick, empty or not, so that other producers' events wait for
        # this one's no longer than a tick (span_assembler)
        watermark_ns = time.time_ns()
        items = self.recorder.drain()
        if self._worker is not None:
            self._worker.handle(items, self.identity, watermark_ns)
            self._worker.poll()
            return
        # a dead process shows as a broken pipe in the writer at once; the poll that restarts
        # it runs once a second: every wake-up of this thread takes the engine's GIL
        if self._process is None:
            self._restart()
        elif time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + 1.0
            if self._process.poll() is not None:
                self._restart()
        if self._process is None:
            self.dropped[DROP_PROCESS_DOWN] += len(items)
            return
        self._outbox.offer((watermark_ns, items), len(items))   # full: counted as queue_full

    def _resolve_names_inline(self, pointers: list[int]) -> None:
        if self.gpu is not None:
            self.gpu.resolve_names(pointers)      # records KernelNames, shipped next tick
        else:
            self.recorder.record(KernelNames({p: "<unknown>" for p in pointers}))

    # -- the telemetry process ----------------------------------------------------------
    def _spawn(self) -> None:
        env = dict(os.environ)
        process = subprocess.Popen(
            [sys.executable, "-m", "sightline.instrumentation.telemetry_process"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        _lower_priority(process.pid, self.config.process_nice)
        pickle.dump((self.config, tuple(self.identity), self._endpoint), process.stdin,
                    protocol=pickle.HIGHEST_PROTOCOL)
        process.stdin.flush()
        self._process = process
        self._outbox = self._new_outbox()
        threading.Thread(target=self._write_loop, args=(process, self._outbox),
                         name="sightline-telemetry-write", daemon=True).start()
        threading.Thread(target=self._read_loop, args=(process,),
                         name="sightline-telemetry-read", daemon=True).start()

    def _restart(self) -> None:
        if self._stopping:
            return
        old = self._process
        if old is not None:
            logger.warning("telemetry process %d exited with %s; restarting it", old.pid,
                           old.returncode)
            with self._lock:
                self._child_base = _add(self._child_base, self._child_stats)
                self._child_stats = {}
            # what was queued for the dead process is lost: count it
            self.dropped[DROP_PROCESS_DOWN] += sum(len(batch[1]) for batch in self._outbox.take())
            self.restarts += 1
        try:
            self._spawn()
        except Exception:
            logger.exception("telemetry process could not start; will retry")
            self._process = None

    def _new_outbox(self) -> WaitingQueue:
        """A hand-off queue for a new telemetry process; its drops add to ``dropped``."""
        return WaitingQueue(self._max_queued_batches, full_reason=DROP_QUEUE_FULL, dropped=self.dropped)

    def _write_loop(self, process: subprocess.Popen, outbox: WaitingQueue) -> None:
        pipe = process.stdin
        while True:
            batch = outbox.wait_take()   # (watermark_ns, items), or None: stop
            try:
                pickle.dump((batch[0], to_wire(batch[1])) if batch is not None else None, pipe,
                            protocol=pickle.HIGHEST_PROTOCOL)
                pipe.flush()
            except (BrokenPipeError, OSError, ValueError):
                if batch is not None:
                    self.dropped[DROP_PROCESS_DOWN] += len(batch[1])
                return
            if batch is None:
                return

    def _read_loop(self, process: subprocess.Popen) -> None:
        pipe = process.stdout
        try:
            while True:
                kind, payload = pickle.load(pipe)
                if kind == "names":
                    self._resolve_names_inline(payload)
                elif kind == "stats" and process is self._process:
                    with self._lock:
                        self._child_stats = payload
        except (EOFError, OSError, pickle.UnpicklingError, ValueError):
            return

    # -- reading ------------------------------------------------------------------------
    def counters(self) -> dict:
        """Span counters of the telemetry (all its processes so far) and the drops here."""
        if self._worker is not None:
            stats = self._worker.stats()
        else:
            with self._lock:
                stats = _add(self._child_base, self._child_stats)
        return stats

    def process_up(self) -> bool:
        """Whether the telemetry process (or thread) runs."""
        return self._worker is not None or self.pid is not None

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Ships what is recorded now and, in thread mode, exports it (tests, benchmarks)."""
        self._ship_once()
        if self._worker is not None:
            with self._ship_lock:
                self._worker.poll(force=True)
            return self._telemetry.force_flush(timeout_s)
        return True

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Ships what is left, stops the telemetry process (it flushes) or thread; bounded."""
        if self._stopping:
            return
        timeout_s = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        if self.gpu is not None:
            try:
                self.gpu.shutdown()
            except Exception:
                logger.exception("GPU telemetry shutdown failed")
        with self._lock:
            self._stopping = True
        self._shipper.join(timeout=1.0)
        try:
            self._ship_final()
        except Exception:
            logger.exception("telemetry shutdown: the last items could not be shipped")
        if self._inbox is not None:
            self._inbox.close()
        try:
            if self._worker is not None:
                with self._ship_lock:
                    self._worker.close()
                self._telemetry.shutdown()
                return
            process = self._process
            if process is None:
                return
            try:
                stopped = self._outbox.offer(None, 0, timeout_s=1.0)   # None: the writer's stop
                if stopped:   # it waits for joined producers' last frames, then exports
                    process.wait(timeout=max(1.0, timeout_s + self.config.hold_unstarted_s + 2.0))
            except subprocess.TimeoutExpired:
                stopped = False
            if not stopped:
                logger.warning("telemetry process did not stop in time; killing it")
                process.kill()
        finally:
            if self._endpoint is not None:
                remove_endpoint(self._endpoint)

    def _ship_final(self) -> None:
        """Like one shipping tick, twice: GPU records answering name questions come late."""
        for _ in range(2):
            watermark_ns = time.time_ns()
            items = self.recorder.drain()
            if self._worker is not None:
                with self._ship_lock:
                    self._worker.handle(items, self.identity, watermark_ns)
                    self._worker.poll(force=True)
            elif self._process is not None:
                self._outbox.offer((watermark_ns, items), len(items), timeout_s=1.0)
            time.sleep(0.05)


def _lower_priority(pid: int, nice: int) -> None:
    """Raises the new telemetry process's nice value to ``nice``: it shares the engine's CPUs
    (an engine pinned to a few keeps it there) and must not take one from the engine thread.
    Set before its interpreter has started a thread, so that all of them inherit it."""
    try:
        if nice > os.getpriority(os.PRIO_PROCESS, pid):
            os.setpriority(os.PRIO_PROCESS, pid, nice)
    except (AttributeError, OSError) as exc:   # another platform, or it exited: as started
        logger.warning("telemetry process %d keeps its priority (%s)", pid, exc)


def _add(a: dict, b: dict) -> dict:
    """Counter dicts summed key by key (nested dicts too)."""
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict):
            out[key] = _add(out.get(key, {}), value)
        elif isinstance(value, (int, float)):
            out[key] = out.get(key, 0) + value
    return out


class PipelineMetrics:
    """prometheus_client collector: drops and restarts here, span counters of the worker
    (``pipeline``: a TelemetryPipeline or a JoinedPipeline)."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline

    def describe(self):
        return []

    def collect(self):
        p = self.pipeline
        dropped = CounterMetricFamily(
            semconv.TELEMETRY_EVENTS_DROPPED_TOTAL,
            "Telemetry records the engine could not hand to its telemetry process.",
            labels=[semconv.LABEL_REASON])
        for reason, count in sorted(p.dropped_events().items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield CounterMetricFamily(semconv.TELEMETRY_PROCESS_RESTARTS_TOTAL,
                                  "Times the telemetry process died and was restarted.",
                                  value=p.restarts)
        yield GaugeMetricFamily(semconv.TELEMETRY_PROCESS_UP,
                                "1 while the telemetry process (or thread) runs.",
                                value=1 if p.process_up() else 0)
        stats = p.counters()
        if stats is None:      # a joined producer: the span counters are the starting side's
            return
        yield CounterMetricFamily(semconv.TELEMETRY_EVENTS_HELD_TOTAL,
                                  "Request events that waited for their request's start.",
                                  value=stats.get("held_events", 0))
        yield CounterMetricFamily(semconv.TELEMETRY_EVENTS_ORPHANED_TOTAL,
                                  "Request events never matched to a started request.",
                                  value=stats.get("orphan_events", 0))
        yield from TelemetryCounters._families(dict(stats.get("spans_dropped", {})),
                                               dict(stats.get("export_failures", {})),
                                               stats.get("spans_exported", 0))
