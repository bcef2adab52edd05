"""The telemetry process: ``python -m sightline.instrumentation.telemetry_process``.

Started and supervised by the engine (:mod:`.telemetry_pipeline`); it can be started by
hand too, as a sidecar fed over the same pipes. Protocol, pickle frames on stdin: first a
``TelemetryConfig``, then lists of recorded items in their wire form (:mod:`.event_wire`),
then ``None`` to stop (flushes and exits). On stdout, frames back to the engine: ``("names", [pointers])`` (kernel names it
needs) and ``("stats", dict)`` twice a second. Logs go to stderr. It exits when the engine's
pipe closes. Honors the standard ``OTEL_*`` environment (through ``Telemetry.start``);
never imports torch.
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
    from .tracing import Telemetry
    from .telemetry_worker import TelemetryWorker

    config = pickle.load(frames_in)
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
    inbox: queue.Queue = queue.Queue(maxsize=1024)

    def read() -> None:                      # the pipe is read on its own thread so that
        try:                                 # kernel spans settle while no frame arrives
            while True:
                frame = pickle.load(frames_in)
                inbox.put(frame)
                if frame is None:
                    return
        except (EOFError, OSError, pickle.UnpicklingError):
            inbox.put(None)

    threading.Thread(target=read, name="sightline-telemetry-read", daemon=True).start()
    last_stats = 0.0
    while True:
        try:
            frame = inbox.get(timeout=0.05)
        except queue.Empty:
            frame = []
        if frame is None:
            break
        if frame:
            worker.handle(from_wire(frame))
        worker.poll()
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S:
            last_stats = now
            send(("stats", worker.stats()))
    worker.poll(force=True)
    telemetry.shutdown()
    send(("stats", worker.stats()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
