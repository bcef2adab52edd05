"""The telemetry process: ``python -m sightline.instrumentation.telemetry_process``.

Started and supervised by the engine core (:mod:`.telemetry_pipeline`); it can be started
by hand too, as a sidecar fed over the same pipes. Protocol, pickle frames on stdin: first
``(TelemetryConfig, producer identity, producer endpoint or None)``, then
``(watermark_ns, items)`` batches in their wire form (:mod:`.event_wire`), then ``None`` to
stop: it waits up to ``hold_unstarted_s`` for the other producers still heard from to send
their last frame, builds and exports all it holds, logs what it lost, exits. Other
producers' batches arrive on the endpoint, which it binds (:mod:`.producer_link`). On stdout, frames back to the engine: ``("names", [pointers])``
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
                inbox.put((engine, *frame, False))
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
    stop_by = None            # the engine said stop: the others' last frames, until then
    while True:
        try:
            frame = inbox.get(timeout=0.05)
        except queue.Empty:
            frame = ()
        if frame is None:
            stop_by = time.monotonic() + config.hold_unstarted_s
            frame = ()
        if frame:
            producer, watermark_ns, wire_items, done = frame
            worker.handle(from_wire(wire_items), producer, watermark_ns, done)
        worker.poll()
        now = time.monotonic()
        if stop_by is not None and (joined is None or now >= stop_by or
                                    not joined.open_producers(config.hold_unstarted_s)):
            break
        if now - last_stats >= STATS_INTERVAL_S:
            last_stats = now
            send(("stats", worker.stats()))
    if joined is not None:
        waiting = joined.open_producers(config.hold_unstarted_s)
        if waiting:
            logger.warning("stopping without the last frames of producers %s", waiting)
        joined.close()                       # delivers what reached its socket first
        while True:                          # what the joined producers sent before the stop
            try:
                frame = inbox.get_nowait()
            except queue.Empty:
                break
            if frame:
                worker.handle(from_wire(frame[2]), *frame[:2], frame[3])
    worker.close()
    telemetry.shutdown()
    stats = worker.stats()
    _report_losses(stats)
    send(("stats", stats))
    return 0


def _report_losses(stats: dict) -> None:
    """What the stop could not turn into exported spans, said once (the series that count
    it are gone with the engine)."""
    dropped = sum(stats.get("spans_dropped", {}).values())
    if stats.get("orphan_events") or dropped:
        logger.warning("stopped: %d request events never met their request, %d spans dropped "
                       "(%d exported)", stats.get("orphan_events", 0), dropped,
                       stats.get("spans_exported", 0))


if __name__ == "__main__":
    sys.exit(main())
