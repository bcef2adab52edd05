"""A raw HTTP/2 client for a gRPC port, frame by frame (h2 over a plain socket).

It does on purpose what a gRPC library never does: calls that send HEADERS and no message,
calls whose answer is never read (SETTINGS_INITIAL_WINDOW_SIZE=0), HEADERS + RST_STREAM
floods, streams past the server's limit, messages with a wrong compressed flag or
encoding. A reader thread answers the server's SETTINGS and PINGs and records what came
back on each stream. Used by bench/lockouts.py and the collector's admission tests.
"""

from __future__ import annotations

import socket
import threading
import time

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class _NoStreamLimit(h2.connection.H2Connection):
    """Opens streams past the server's SETTINGS_MAX_CONCURRENT_STREAMS (to see it enforced)."""

    @property
    def open_outbound_streams(self) -> int:
        super().open_outbound_streams  # noqa: B018 (the property tidies closed streams)
        return 0


def grpc_frame(message: bytes, compressed: int = 0) -> bytes:
    """One length-prefixed gRPC message."""
    return bytes((compressed,)) + len(message).to_bytes(4, "big") + message


class StreamOutcome:
    """What the server sent on one stream."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.trailers: dict[str, str] = {}
        self.data = b""
        self.reset_code: int | None = None
        self.ended = False

    @property
    def grpc_status(self) -> int | None:
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if value is None else int(value)


class RawH2:
    """One HTTP/2 connection to ``port`` from ``source`` (a loopback address: 127.0.0.2 is
    another peer than 127.0.0.1). ``window``: the SETTINGS_INITIAL_WINDOW_SIZE to announce;
    ``unlimited``: ignore the server's limit on concurrent streams; ``past_goaway``: go on
    sending and reading frames after a GOAWAY, as a client with calls in flight does (h2
    would end the connection at the first); ``goaways`` lists (code, last stream id) of each."""

    def __init__(self, port: int, *, source: str = "127.0.0.1", window: int | None = None,
                 token: str | None = None, unlimited: bool = False, past_goaway: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        self.sock.settimeout(None)
        kind = _NoStreamLimit if unlimited else h2.connection.H2Connection
        self.conn = kind(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.token = token
        self.lock = threading.Condition()
        self.streams: dict[int, StreamOutcome] = {}
        self.goaway_code: int | None = None
        self.goaways: list[tuple[int, int]] = []
        if past_goaway:  # h2's connection state stays open through a received GOAWAY
            machine, process = self.conn.state_machine, self.conn.state_machine.process_input

            def keep_open(event):
                state = machine.state
                frames = process(event)
                if event is h2.connection.ConnectionInputs.RECV_GOAWAY:
                    machine.state = state
                return frames

            machine.process_input = keep_open
        self.closed = False
        self._flush()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    # -- sending -------------------------------------------------------------------------
    def _headers(self, path: str, extra: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "collector"),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        if self.token is not None:
            headers.append(("authorization", f"Bearer {self.token}"))
        return headers + list(extra)

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True

    def open(self, path: str = TRACE_EXPORT, *, end_stream: bool = False,
             extra: tuple[tuple[str, str], ...] = ()) -> int:
        """HEADERS of a new call (no message unless ``send`` follows); its stream id."""
        with self.lock:
            stream_id = self.conn.get_next_available_stream_id()
            self.streams[stream_id] = StreamOutcome()
            self.conn.send_headers(stream_id, self._headers(path, extra), end_stream=end_stream)
            self._flush()
        return stream_id

    def send(self, stream_id: int, data: bytes, *, end_stream: bool = True) -> bool:
        """DATA on an open call; False when the server already ended the stream."""
        with self.lock:
            try:
                for i in range(0, max(1, len(data)), 16_384):
                    last = i + 16_384 >= len(data)
                    self.conn.send_data(stream_id, data[i:i + 16_384], end_stream=end_stream and last)
            except h2.exceptions.StreamClosedError:
                return False
            finally:
                self._flush()
        return True

    def call(self, message: bytes, path: str = TRACE_EXPORT, *, compressed: int = 0,
             extra: tuple[tuple[str, str], ...] = ()) -> int:
        """A whole unary call (HEADERS, one message, END_STREAM); its stream id."""
        stream_id = self.open(path, extra=extra)
        self.send(stream_id, grpc_frame(message, compressed))
        return stream_id

    def reset(self, stream_id: int) -> None:
        with self.lock:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            self._flush()

    def open_and_reset(self) -> bool:
        """HEADERS then RST_STREAM at once (rapid reset); False once the server refuses."""
        with self.lock:
            if self.closed or self.goaway_code is not None:
                return False
            try:
                stream_id = self.conn.get_next_available_stream_id()
                self.conn.send_headers(stream_id, self._headers(TRACE_EXPORT, ()))
                self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            except h2.exceptions.ProtocolError:
                return False
            self._flush()
        return not self.closed

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # -- receiving -----------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65_536)
            except OSError:
                data = b""
            with self.lock:
                if not data:
                    self.closed = True
                    self.lock.notify_all()
                    return
                try:
                    events = self.conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    events = []
                for event in events:
                    self._event(event)
                self._flush()
                self.lock.notify_all()

    def _event(self, event) -> None:
        stream = self.streams.get(getattr(event, "stream_id", None) or 0)
        if isinstance(event, h2.events.ResponseReceived) and stream is not None:
            stream.headers = dict(event.headers)
        elif isinstance(event, h2.events.TrailersReceived) and stream is not None:
            stream.trailers = dict(event.headers)
        elif isinstance(event, h2.events.DataReceived) and stream is not None:
            stream.data += event.data
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded) and stream is not None:
            stream.ended = True
        elif isinstance(event, h2.events.StreamReset) and stream is not None:
            stream.reset_code = int(event.error_code)
            stream.ended = True
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway_code = int(event.error_code)
            self.goaways.append((int(event.error_code), int(event.last_stream_id)))

    def wait(self, stream_id: int, timeout_s: float = 10.0) -> StreamOutcome:
        """The stream's outcome once it ended (answered or reset), or as it is at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            stream = self.streams[stream_id]
            while not stream.ended and not self.closed and time.monotonic() < deadline:
                self.lock.wait(max(0.0, deadline - time.monotonic()))
            return stream

    def wait_closed(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while not self.closed and time.monotonic() < deadline:
                self.lock.wait(max(0.0, deadline - time.monotonic()))
            return self.closed
