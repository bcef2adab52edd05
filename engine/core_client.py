"""What an API server talks to: the engine core in this process, or in another one over ZMQ.

Both clients have one interface: ``ready`` (the core's ``Ready`` handshake, None until it
came), ``phase`` and ``progress()`` (start-up: the phase running, the time so far, the phases
done), ``stats`` (the latest step's), ``dead`` (why the core is gone, or None),
``num_live``, ``add_request(...) -> RequestStream`` (raises ``QueueFullError``,
``EngineStoppedError``, ``EngineDeadError`` or ``ValueError``), ``abort``, ``call`` (a
utility record), ``stop_accepting`` and ``shutdown``.

* ``InProcessClient``: an ``LLMEngine`` with its loop thread (tests, embedded use).
* ``MPClient``: a DEALER socket to the core process's ROUTER (msgpack records, asyncio).
  Text, stop strings and request metrics run here (``OutputProcessor``, on the event loop).
  A full queue is refused here, without a round trip (the bound in ``Ready``, the waiting
  count with every step, plus the requests sent and not yet taken). The core's death shows as EOF on a pipe only the core holds open: every live
  stream ends with an error at once, later requests get ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Sequence

from .core_records import (ERROR_ENGINE, ERROR_INVALID, ERROR_QUEUE_FULL, ERROR_STOPPED, Abort,
                           AddRequest, Hello, OutputBatch, Phase, Ready, StepStats, TelemetryDrops,
                           UtilityCall, UtilityResult, client_decoder, encode)
from .engine_core import EngineStoppedError
from .llm_engine import LLMEngine, trace_context
from .metrics import EngineMetrics
from .output_processor import OutputProcessor
from .request import SamplingParams
from .request_output import RequestStream
from .scheduler import QueueFullError
from .startup import StartupProgress
from .tokenizer import Tokenizer

__all__ = ["EngineDeadError", "InProcessClient", "MPClient", "REFUSALS"]

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone (the server answers 503)."""


# a refusal the core sent back for a request (the front end's own check let it through)
REFUSALS = {ERROR_QUEUE_FULL: QueueFullError, ERROR_STOPPED: EngineStoppedError,
            ERROR_INVALID: ValueError}


class InProcessClient:
    """An ``LLMEngine`` in this process, its loop thread started here (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, startup: StartupProgress) -> None:
        self.engine: LLMEngine | None = None
        self.startup = startup   # the engine being built reports its phases here
        self._loop = loop
        self.ready: Ready | None = None
        self.dead: str | None = None

    def attach(self, engine: LLMEngine) -> None:
        """The engine is built (and warm): start its loop thread; ``ready`` from now on."""
        self.engine = engine
        engine.start()
        self.ready = engine.core.ready(os.getpid())

    @property
    def phase(self) -> str:
        return "ready" if self.ready is not None else self.startup.state()["phase"]

    def progress(self) -> dict:
        state = self.startup.state()
        return {"phase": state["phase"], "elapsed_s": state["elapsed_s"],
                "phases_done": state["phases_done"]}

    @property
    def stats(self) -> StepStats | None:
        return self.engine.processor.stats if self.engine is not None else None

    @property
    def num_live(self) -> int:
        return self.engine.num_live if self.engine is not None else 0

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    priority: int, trace, cache_salt: str | None = None) -> RequestStream:
        return self.engine.add_request(request_id, prompt_token_ids, sampling, priority=priority,
                                       trace=trace, loop=self._loop, cache_salt=cache_salt)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def call(self, method: str, argument: str = "") -> dict:
        return self.engine.core.utility(method, argument)

    def stop_accepting(self) -> None:
        if self.engine is not None:
            self.engine.stop_accepting()

    async def shutdown(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)


class MPClient:
    """API server ``index``'s link to the core process at ``address`` (see module doc)."""

    def __init__(self, address: str, index: int, tokenizer: Tokenizer, metrics: EngineMetrics,
                 recorder=None, record_steps: bool = True, core_lifeline=None) -> None:
        import zmq
        import zmq.asyncio

        self.index = index
        self.ready: Ready | None = None
        self.phase = "connecting"
        self._phase_record = Phase("connecting")   # the core's latest start-up progress
        self.dead: str | None = None
        self.processor = OutputProcessor(tokenizer, metrics, self._send_stop, recorder, record_steps)
        self._ctx = zmq.asyncio.Context()
        self._sock = sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"api-{index}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)   # requests are bounded by the queue check, not dropped
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(address)
        self._lifeline = core_lifeline
        self._accepting = True
        self._sent = 0          # AddRequests sent; the core reports how many it has taken
        self._taken = 0
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._ready_event = asyncio.Event()
        self.dead_event = asyncio.Event()
        self._reader: asyncio.Task | None = None

    @property
    def stats(self) -> StepStats | None:
        return self.processor.stats

    @property
    def num_live(self) -> int:
        return len(self.processor.live)

    async def start(self) -> None:
        """Says hello and starts reading; returns at once (``ready`` is set when it comes)."""
        loop = asyncio.get_running_loop()
        if self._lifeline is not None:
            loop.add_reader(self._lifeline.fileno(), self._core_exited)
        self._reader = asyncio.create_task(self._read())
        await self._sock.send(encode(Hello(self.index, os.getpid())))

    def progress(self) -> dict:
        """The core's start-up as its last ``Phase`` record told it."""
        record = self._phase_record
        return {"phase": self.phase, "elapsed_s": round(
                    (time.time_ns() - record.start_ns) / 1e9, 3) if record.start_ns else None,
                "phases_done": list(record.phases_done)}

    async def wait_ready(self, timeout_s: float | None = None) -> Ready:
        await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        return self.ready

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    priority: int, trace, cache_salt: str | None = None) -> RequestStream:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down")
        ready = self.ready
        if ready is None:
            raise EngineStoppedError("the engine core is starting")
        prompt = list(prompt_token_ids)
        needed = len(prompt) + sampling.max_tokens
        if needed > ready.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) "
                             f"= {needed} exceeds the context length {ready.max_model_len}")
        waiting = (self.stats.waiting if self.stats is not None else 0) + self._sent - self._taken
        if waiting >= ready.max_waiting:
            raise QueueFullError(f"{waiting} requests waiting, the bound is {ready.max_waiting}")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        self.processor.add(request_id, len(prompt), sampling, stream, trace)
        self._sent += 1
        self._sock.send(encode(AddRequest(request_id, prompt, sampling, priority, self.index,
                                          trace_context(trace), cache_salt)))
        return stream

    def abort(self, request_id: str) -> None:
        if request_id in self.processor.live and self.dead is None:
            self._sock.send(encode(Abort(request_id, self.index)))

    def report_drops(self, dropped: dict[str, int]) -> None:
        """This server's telemetry drops so far, for the core's series (``telemetry_link``)."""
        if self.dead is None:
            self._sock.send(encode(TelemetryDrops(self.index, dropped)))

    def _send_stop(self, request_id: str, stop_at: int) -> None:
        """A stop string ended the request: the core finishes it (its final comes later)."""
        if self.dead is None:
            self._sock.send(encode(Abort(request_id, self.index, stop_at)))
        return None

    async def call(self, method: str, argument: str = "", timeout_s: float = 10.0) -> dict:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self._sock.send(encode(UtilityCall(call_id, self.index, method, argument)))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self) -> None:
        """Aborts what is live (the core frees it), stops reading and closes the socket."""
        for request_id in list(self.processor.live):
            self.abort(request_id)
        await asyncio.sleep(0)   # let the aborts leave before the socket closes
        if self._lifeline is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._lifeline.fileno())
            except (ValueError, OSError):
                pass
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=500)
        self._ctx.term()

    # -- from the core ---------------------------------------------------------------------
    async def _read(self) -> None:
        decode = client_decoder().decode
        sock = self._sock
        while True:
            record = decode(await sock.recv(copy=False))
            try:
                if type(record) is OutputBatch:
                    self._taken = record.received
                    self._deliver(self.processor.process(record))
                elif type(record) is Ready:
                    self.ready, self.phase = record, "ready"
                    self._ready_event.set()
                elif type(record) is Phase:
                    self.phase, self._phase_record = record.name, record
                elif type(record) is UtilityResult:
                    future = self._calls.get(record.call_id)
                    if future is not None and not future.done():
                        future.set_result(record.result)
            except Exception:   # one bad record must not stop the reader
                log.exception("API server %d: a record from the core failed", self.index)

    @staticmethod
    def _deliver(outputs) -> None:
        for live, output in outputs:
            if live.stream is not None:
                live.stream.queue.put_nowait(output)

    def _core_exited(self) -> None:
        """The pipe only the core holds open hit EOF: the core is gone."""
        try:
            self._lifeline.recv_bytes()
            return   # not EOF (nothing is ever written): keep watching
        except (EOFError, OSError):
            pass
        asyncio.get_running_loop().remove_reader(self._lifeline.fileno())
        self.dead = "the engine core process exited"
        self.dead_event.set()
        log.error("API server %d: %s; failing %d live requests", self.index, self.dead,
                  self.num_live)
        message = f"{self.dead} while this request ran"
        self._deliver([out for request_id in list(self.processor.live)
                       if (out := self.processor.fail(request_id, message, ERROR_ENGINE))])
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(self.dead))
