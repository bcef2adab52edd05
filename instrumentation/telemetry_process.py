"""The telemetry process: ``python -m sightline.instrumentation.telemetry_process``.

Started and supervised by the engine core (:mod:`.telemetry_pipeline`); it can be started
by hand too, as a sidecar fed over the same pipes. Protocol, pickle frames on stdin: first
``(TelemetryConfig, producer identity, producer endpoint or None)``, then
``(watermark_ns, items)`` batches in their wire form (:mod:`.event_wire`), then ``None`` to
stop (flushes and exits). Other producers' batches arrive on the endpoint, which it binds
(:mod:`.producer_link`). On stdout, frames back to the engine: ``("names", [pointers])``
(kernel names it needs) and ``("stats", dict)`` twice a second. Logs go to stderr. It exits
when the engine's pipe closes. Honors the standard ``OTEL_*`` environment (through
``Telemetry.start``); never imports torch.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import sys
import threading
import time

__all__ = ["main"]

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.5


def main() -> int:
    logging.basicConfig(level=os.environ.get("SIGHTLINE_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s telemetry %(levelname)s %(name)s: %(message)s")
    frames_in = sys.stdin.buffer
    frames_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr                  # nothing but frames on the engine's pipe
    from .event_wire import from_wire
    from .producer_link import ProducerIdentity, ProducerInbox
    from .tracing import Telemetry
    from .telemetry_worker import TelemetryWorker

    config, identity, endpoint = pickle.load(frames_in)
    engine = ProducerIdentity(*identity)
    telemetry = Telemetry.start(config)
    out_lock = threading.Lock()

    def send(frame) -> None:
        try:
            with out_lock:
                pickle.dump(frame, frames_out, protocol=pickle.HIGHEST_PROTOCOL)
                frames_out.flush()
        except (BrokenPipeError, OSError):
            pass

    worker = TelemetryWorker(telemetry, lambda pointers: send(("names", pointers)))
    # (producer, watermark_ns, wire items) from both readers; None: stop. A full inbox
    # stalls the readers, and the producers count what they then cannot hand over.
    inbox: queue.Queue = queue.Queue(maxsize=1024)

    def read() -> None:                      # the pipe is read on its own thread so that
        try:                                 # kernel spans settle while no frame arrives
            while True:
                frame = pickle.load(frames_in)
                if frame is None:
                    break
                inbox.put((engine, *frame))
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        inbox.put(None)

    threading.Thread(target=read, name="sightline-telemetry-read", daemon=True).start()
    joined = None
    if endpoint is not None:
        try:
            joined = ProducerInbox(endpoint, lambda *frame: inbox.put(frame))
        except Exception:
            logger.exception("cannot bind %s: other processes' telemetry is lost", endpoint)
    last_stats = 0.0
    while True:
        try:
            frame = inbox.get(timeout=0.05)
        except queue.Empty:
            frame = ()
        if frame is None:
            break
        if frame:
            producer, watermark_ns, wire_items = frame
            worker.handle(from_wire(wire_items), producer, watermark_ns)
        worker.poll()
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S:
            last_stats = now
            send(("stats", worker.stats()))
    if joined is not None:
        joined.close()
        while True:                          # what the joined producers sent before the stop
            try:
                frame = inbox.get_nowait()
            except queue.Empty:
                break
            if frame:
                worker.handle(from_wire(frame[2]), frame[0], frame[1])
    worker.close()
    telemetry.shutdown()
    send(("stats", worker.stats()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
