"""Telemetry of a process that feeds another process's telemetry process (an API server).

``TelemetryPipeline.join(config, endpoint, producer_id)`` returns a :class:`JoinedPipeline`:
its ``recorder`` is a :class:`~.lifecycle.LifecycleRecorder` whose request keys carry
``producer_id``; a thread ships what it records, every ``ship_interval_s``, to the telemetry
process behind ``endpoint`` (:mod:`.producer_link`), which builds one trace per request from
this process's events and the engine core's. It starts no process of its own.

Guarantees: the producer never waits. A full recorder buffer (``buffer_full``), or a full
send queue (``queue_full``; ``process_down`` while not connected) drops events and counts
them on ``registry``. Frames queued while the telemetry process (re)starts go to it once it
binds the endpoint (reconnections count as restarts). ``shutdown`` sends a last frame that
says "done" and waits, bounded, for a late telemetry process; what never left is counted
(``process_down``) and logged. Span counters are the starting pipeline's. Cost: the
recorder's appends on the callers' threads; a pickle and a ZMQ send per tick.
"""

from __future__ import annotations

import logging
import time

from . import semconv
from .config import TelemetryConfig
from .config_checks import check_range
from .event_wire import to_wire
from .lifecycle import MAX_PRODUCER_ID
from .producer_link import ProducerIdentity, ProducerSocket
from .telemetry_pipeline import DROP_PROCESS_DOWN, DROP_QUEUE_FULL, ProducerSide

__all__ = ["JoinedPipeline"]

logger = logging.getLogger(__name__)


class JoinedPipeline(ProducerSide):
    """See the module docstring. ``recorder`` is what the API server writes to."""

    mode = "joined"
    pid = None          # no telemetry process of its own
    gpu = None

    def __init__(self, config: TelemetryConfig, endpoint: str, producer_id: int,
                 ship_interval_s: float = 0.1, max_queued_frames: int = 512,
                 recorder_capacity: int = 1 << 16) -> None:
        check_range("producer_id", producer_id, 1, MAX_PRODUCER_ID, integer=True,
                    hint="(0 is the starting pipeline's)")
        identity = ProducerIdentity.here(producer_id, semconv.PROCESS_ROLE_API_SERVER)
        self._socket: ProducerSocket | None = ProducerSocket(endpoint, identity, max_queued_frames)
        self._connected = False
        self._unconnected_items = 0    # sent while never connected since: queued in ZMQ
        super().__init__(config, identity, ship_interval_s, recorder_capacity)
        self.producer_id = producer_id
        self.producer_endpoint = endpoint
        self._start_shipping()

    def _ship_locked(self, done: bool = False) -> None:
        if self._socket is None:
            return
        # before the drain, and sent empty too: see TelemetryPipeline._ship_locked
        watermark_ns = time.time_ns()
        items = self.recorder.drain()
        self._connected = self._socket.poll_connection()
        if self._connected:
            self._unconnected_items = 0   # what waited in ZMQ left on the connection
        if self._socket.send(watermark_ns, to_wire(items), done):
            if not self._connected:
                self._unconnected_items += len(items)
        elif items:
            reason = DROP_QUEUE_FULL if self._connected else DROP_PROCESS_DOWN
            self.dropped[reason] += len(items)

    # -- reading ---------------------------------------------------------------------------
    def _poll_connection(self) -> None:
        with self._ship_lock:     # the socket's monitor is the shipping thread's otherwise
            if self._socket is not None:
                self._connected = self._socket.poll_connection()

    @property
    def restarts(self) -> int:
        """Times the telemetry process came back after this producer lost it."""
        self._poll_connection()
        socket = self._socket
        return socket.reconnects if socket is not None else 0

    def process_up(self) -> bool:
        """Whether this producer is connected to the telemetry process."""
        self._poll_connection()
        return self._connected

    def counters(self) -> None:
        """None: span counters are on the starting pipeline's registry, not repeated here."""
        return None

    # -- lifecycle -------------------------------------------------------------------------
    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Ships what is recorded now (the spans are built in the telemetry process)."""
        self._ship_once()
        return True

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Ships what is left in a last frame marked done and closes the connection, waiting
        at most ``timeout_s`` (default ``config.shutdown_timeout_s``) for the telemetry
        process to be connected and the queued frames to leave. Frames that never could
        leave are counted as ``process_down`` and logged."""
        if self._stopping:
            return
        timeout_s = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        self._stopping = True
        self._shipper.join(timeout=1.0)
        with self._ship_lock:
            try:
                self._ship_locked(done=True)
            except Exception:
                logger.exception("telemetry shutdown: the last items could not be shipped")
            socket, self._socket = self._socket, None
            if socket is None:
                return
            # the telemetry process may not have bound yet (it starts at a low priority):
            # closing unconnected would discard every queued frame without a word
            self._connected = socket.wait_connected(max(0.0, deadline - time.monotonic()))
            if not self._connected and self._unconnected_items:
                self.dropped[DROP_PROCESS_DOWN] += self._unconnected_items
                logger.warning("telemetry shutdown: the telemetry process never connected in "
                               "%.1f s; %d events of producer %d are lost", timeout_s,
                               self._unconnected_items, self.producer_id)
            socket.close(linger_s=max(0.5, deadline - time.monotonic()) if self._connected else 0.0)
