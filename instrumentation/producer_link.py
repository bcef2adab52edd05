"""How producers in other processes reach one telemetry process: ZMQ PUSH to its PULL.

The starting side (:mod:`.telemetry_pipeline`) picks an ``ipc://`` endpoint in a private
directory (mode 0700: frames are pickles, so only this user may connect); the telemetry
process, and every process restarted after it, binds that same path (:class:`ProducerInbox`),
so a joined producer's socket (:class:`ProducerSocket`) reconnects on its own and what it
queued meanwhile reaches the new process. A frame is one batch of one producer:
``(identity, watermark_ns, events in their wire form, done)``; the watermark is the
producer's clock before it drained its recorder, so every event recorded earlier is in this
frame or an earlier one (what :mod:`.span_assembler` orders producers by); ``done``: its last.

Guarantees: ``send`` never blocks; past ``max_queued_frames`` it refuses (the caller counts).
Frames queued before the telemetry process binds wait for it (``wait_connected``); the
inbox reads what reached its socket before it closes. Cost: one pickle and one ZMQ send per
batch; a receiving thread in the telemetry process.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from . import semconv
from .config_checks import check_range

__all__ = ["ProducerIdentity", "ProducerSocket", "ProducerInbox", "private_endpoint",
           "remove_endpoint"]

logger = logging.getLogger(__name__)

_IPC = "ipc://"
_SOCKET_NAME = "producers"
_ROLES = (semconv.PROCESS_ROLE_ENGINE_CORE, semconv.PROCESS_ROLE_API_SERVER)


class ProducerIdentity(NamedTuple):
    """Who recorded a batch: its producer id (the high bits of its request keys), its role
    (``semconv.PROCESS_ROLE_*``) and its pid. ``attributes`` is what its spans carry."""

    producer_id: int
    role: str
    pid: int

    @property
    def attributes(self) -> dict:
        return {semconv.PROCESS_ROLE: self.role, semconv.PROCESS_PID: self.pid}

    @classmethod
    def here(cls, producer_id: int, role: str) -> "ProducerIdentity":
        if role not in _ROLES:
            raise ValueError(f"role {role!r} is not one of {'|'.join(_ROLES)}")
        return cls(producer_id, role, os.getpid())


def private_endpoint() -> str:
    """A new ``ipc://`` endpoint in a new directory only this user can enter."""
    directory = tempfile.mkdtemp(prefix="sightline-telemetry-")
    path = os.path.join(directory, _SOCKET_NAME)
    if len(path) > 100:                # a Unix socket path holds ~107 bytes: a long TMPDIR
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="sightline-telemetry-", dir="/tmp")
        path = os.path.join(directory, _SOCKET_NAME)
    return _IPC + path


def remove_endpoint(endpoint: str) -> None:
    """Removes the directory :func:`private_endpoint` made (at the starting side's shutdown)."""
    if endpoint.startswith(_IPC) and os.path.basename(endpoint) == _SOCKET_NAME:
        shutil.rmtree(os.path.dirname(endpoint[len(_IPC):]), ignore_errors=True)


def _zmq():
    try:
        import zmq
    except ImportError as exc:  # pyzmq is a core dependency; say what is missing
        raise ImportError("joining a telemetry process needs pyzmq (pip install pyzmq)") from exc
    return zmq


class ProducerSocket:
    """A joined producer's end: non-blocking sends, connection state from ZMQ's monitor.

    Not thread-safe (ZMQ sockets are not): one shipping thread uses it."""

    def __init__(self, endpoint: str, identity: ProducerIdentity,
                 max_queued_frames: int = 512) -> None:
        check_range("max_queued_frames", max_queued_frames, 1, 1 << 20, integer=True)
        if not endpoint.startswith(_IPC):
            raise ValueError(f"endpoint {endpoint!r} is not an {_IPC} endpoint "
                             "(a telemetry pipeline's producer_endpoint)")
        zmq = self._zmq = _zmq()
        self.identity = identity
        self.endpoint = endpoint
        self.connected = False
        self.reconnects = 0       # connections after the first: the telemetry process restarted
        self._ever_connected = False
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        # frames wait (up to the bound) while the telemetry process restarts, then go to it
        self._socket.setsockopt(zmq.SNDHWM, max_queued_frames)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._socket.connect(endpoint)

    def send(self, watermark_ns: int, wire_items: list, done: bool = False) -> bool:
        """Queues one frame (``done``: this producer's last); False (nothing sent) when the
        bound is reached."""
        frame = pickle.dumps((tuple(self.identity), watermark_ns, wire_items, done),
                             protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._socket.send(frame, self._zmq.NOBLOCK, copy=False)
            return True
        except self._zmq.Again:
            return False

    def poll_connection(self) -> bool:
        """Reads the monitor's events (non-blocking); True while connected."""
        from zmq.utils.monitor import recv_monitor_message
        zmq = self._zmq
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return self.connected
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
                self.reconnects += self._ever_connected
                self._ever_connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False

    def wait_connected(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for a connection (a telemetry process that binds late,
        starved of CPU while it starts); True once connected."""
        deadline = time.monotonic() + timeout_s
        while not self.poll_connection():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._monitor.poll(max(1, int(left * 1000)))
        return True

    def close(self, linger_s: float = 0.0) -> None:
        """Closes, letting queued frames leave for at most ``linger_s``."""
        try:
            self._socket.disable_monitor()
        except self._zmq.ZMQError:      # already closed, or the context is going away
            pass
        self._monitor.close(linger=0)
        self._socket.close(linger=int(linger_s * 1000))
        self._context.term()


class ProducerInbox:
    """The telemetry side: binds ``endpoint`` and calls ``deliver(identity, watermark_ns,
    wire_items, done)`` on its own thread for every frame. A frame that cannot be read is
    logged once and counted in ``bad_frames``. ``open_producers(live_s)``: who was heard from
    within ``live_s`` and has not sent its last frame (what a stop waits for)."""

    def __init__(self, endpoint: str,
                 deliver: Callable[[ProducerIdentity, int, list, bool], None]) -> None:
        zmq = self._zmq = _zmq()
        self.endpoint = endpoint
        self.bad_frames = 0
        self._deliver = deliver
        self._stopping = False
        self._heard: dict[int, float] = {}     # producer id -> when heard; gone once done
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)        # a dead predecessor's socket file is replaced
        self._thread = threading.Thread(target=self._run, name="sightline-telemetry-inbox",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq, socket = self._zmq, self._socket
        try:
            while not self._stopping:
                # a bounded wait, so that ``close`` is seen; the socket stays on this thread
                if socket.poll(100):
                    self._receive(socket.recv(copy=False))
            while True:       # stopping: what reached the socket before, not dropped
                try:
                    frame = socket.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._receive(frame)
        except zmq.ZMQError:
            logger.exception("receiving on %s failed; joined producers are no longer read",
                             self.endpoint)
        finally:
            socket.close(linger=0)

    def _receive(self, frame) -> None:
        try:
            identity, watermark_ns, wire_items, done = pickle.loads(frame.buffer)
            identity = ProducerIdentity(*identity)
        except Exception:
            self.bad_frames += 1
            if self.bad_frames == 1:
                logger.exception("a frame on %s could not be read", self.endpoint)
            return
        if done:
            self._heard.pop(identity.producer_id, None)
        else:
            self._heard[identity.producer_id] = time.monotonic()
        self._deliver(identity, watermark_ns, wire_items, bool(done))

    def open_producers(self, live_s: float) -> list[int]:
        """Producers heard from within ``live_s`` that have not sent their last frame."""
        now = time.monotonic()
        return [pid for pid, heard in list(self._heard.items()) if now - heard <= live_s]

    def close(self, timeout_s: float = 1.0) -> None:
        """Stops receiving once the frames already in the socket are delivered; bounded by
        ``timeout_s``."""
        self._stopping = True
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self._context.term()
