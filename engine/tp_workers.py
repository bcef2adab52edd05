"""The tensor-parallel ranks beyond rank 0: one process each, started and watched by the core.

``TpWorkers.start(config)`` spawns ranks 1..N-1 (``run_worker``) and joins the group as rank 0
(``group``); then every rank builds its shard at once. Each worker holds the write end of a
pipe the core reads on one thread: what the worker recorded (its ``RankStep`` timings, at
trace level kernels its GPU records tagged with its rank) goes through it into the core's
telemetry (``sink``), and its EOF is the worker's death: the group is failed with a sentence
naming the rank (``failed``; ``on_failure`` runs once). A worker runs each step rank 0 sends
(``run_step``) until rank 0 says stop, a collective raises (the group broke) or its parent is
gone. Cost to the core: a thread asleep until a worker sends (each step when rank timings
are recorded, a few µs); to a worker: the shard's forward pass, no sampling, no scheduling.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable

from .config import EngineConfig, resolve_model_config

__all__ = ["TpWorkers", "run_step", "run_worker"]

log = logging.getLogger(__name__)

_SHIP_INTERVAL_S = 0.02   # a worker's records wait at most this long for the pipe
_STOP_S = 10.0


class TpWorkers:
    """Ranks 1..N-1 seen from rank 0 (see the module docstring)."""

    def __init__(self, group, processes: dict, conns: dict, workdir: str,
                 sink: Callable[[list], None] | None) -> None:
        self.group = group
        self.processes = processes        # rank -> multiprocessing.Process
        self.sink = sink
        self.failed: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._conns = conns               # rank -> the read end of its pipe
        self._workdir = workdir
        self._stopping = False
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="sightline-tp-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(cls, config: EngineConfig, sink: Callable[[list], None] | None = None,
              log_level: str | None = None) -> TpWorkers:
        """Spawns the workers and joins the group as rank 0. Checks first what would make a
        worker fail before the rendezvous (the GPUs present; the model's split is the
        config's check)."""
        from .tensor_parallel import TpGroup, tp_device

        size = config.tensor_parallel_size
        tp_device(config.device, size - 1)     # every rank's GPU exists
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        ctx = multiprocessing.get_context("spawn")
        workdir = tempfile.mkdtemp(prefix="sightline-tp-")
        init = f"file://{os.path.join(workdir, 'rendezvous')}"
        processes, conns = {}, {}
        try:
            for rank in range(1, size):
                read, write = ctx.Pipe(duplex=False)
                process = ctx.Process(target=run_worker, name=f"sightline-tp-rank-{rank}",
                                      args=(config, rank, size, init, write, str(level)), daemon=True)
                process.start()
                write.close()
                processes[rank], conns[rank] = process, read
            group = TpGroup.join(0, size, init, tp_device(config.device, 0))
        except BaseException:
            for process in processes.values():
                process.kill()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        log.info("tensor parallelism: %d ranks (worker pids %s)", size,
                 ",".join(str(p.pid) for p in processes.values()))
        return cls(group, processes, conns, workdir, sink)

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p in sorted(self.processes.items())]

    def fail(self, message: str) -> None:
        """Marks the group failed (the first message stays); ``on_failure`` runs once."""
        with self._lock:
            if self.failed is not None or self._stopping:
                return
            self.failed = message
        log.error("tensor parallelism: %s", message)
        if self.on_failure is not None:
            self.on_failure(message)

    def fail_step(self, step_id: int, exc: Exception, wait_s: float = 1.0) -> str:
        """A step raised on rank 0 (a collective's peer gone, or its own error): fails the
        group and returns why, naming a rank that died when one did within ``wait_s``
        (its death shows in the collective before its pipe closes)."""
        deadline = time.monotonic() + wait_s
        while self.failed is None and time.monotonic() < deadline:
            dead = [(rank, p) for rank, p in self.processes.items() if not p.is_alive()]
            if dead:
                rank, process = dead[0]
                self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) exited with "
                          f"{process.exitcode}")
                break
            time.sleep(0.02)
        message = f"tensor-parallel step {step_id} failed: {type(exc).__name__}: {exc}"
        self.fail(message)
        return self.failed or message

    def _watch(self) -> None:
        conns = dict(self._conns)
        rank_of = {conn: rank for rank, conn in conns.items()}
        while conns:
            for conn in multiprocessing.connection.wait(list(conns.values())):
                rank = rank_of[conn]
                try:
                    items = conn.recv()
                except (EOFError, OSError):
                    del conns[rank]
                    process = self.processes[rank]
                    process.join(1.0)
                    self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) exited with "
                              f"{process.exitcode}")
                    continue
                sink = self.sink
                if sink is not None:
                    try:
                        sink(items)
                    except Exception:   # telemetry trouble never stops the group
                        log.exception("a rank's records could not be recorded")

    def stop(self) -> None:
        """Tells the workers to stop (while the group stands), waits, kills what is left.
        Idempotent; rank 0's loop thread calls it (the stop is a collective)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            broken = self.failed is not None
        if not broken:
            try:
                self.group.send_stop()
            except Exception:
                log.warning("tensor parallelism: the stop did not reach every rank")
        deadline = time.monotonic() + _STOP_S
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()) if not broken else 0.5)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        try:
            self.group.close()
        except Exception:
            log.debug("tensor parallelism: closing the group failed", exc_info=True)
        shutil.rmtree(self._workdir, ignore_errors=True)


# ---- the worker process ----------------------------------------------------------------------
def run_worker(config: EngineConfig, rank: int, size: int, init_method: str, conn,
               log_level: str = "INFO") -> None:
    """A worker's entry point (multiprocessing, spawn): join, build the shard, run steps."""
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the core decides when the group stops
    _exit_with_parent()
    from ..instrumentation import RankRecorder
    from .model_runner import ModelRunner
    from .tensor_parallel import TpGroup, tp_device

    outbox = RankRecorder(rank, config.telemetry)
    shipper = threading.Thread(target=_ship, args=(outbox, conn), name="sightline-tp-ship",
                               daemon=True)
    try:
        group = TpGroup.join(rank, size, init_method, tp_device(config.device, rank))
        gpu = outbox.gpu_telemetry(group.device)
        runner = ModelRunner(config, resolve_model_config(config.model), gpu, tp=group)
        if gpu is not None:
            gpu.start_kernel_tracing()
        shipper.start()
        previous = None
        while True:
            message = group.recv_step()
            if message is None:
                break
            previous = run_step(runner, message, previous, outbox.record)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        raise SystemExit(1)
    outbox.stopped = True
    shipper.join(1.0)
    _send(outbox, conn)
    group.close()
    conn.close()


def run_step(runner, message, previous_ids, record: Callable) -> object:
    """Runs one step rank 0 sent on this rank's shard: the KV copies first, the forward pass
    (eager, or the graph bucket rank 0 chose), its timing when asked; returns the sampled
    ids rank 0 broadcast after it (the next step's stand-ins) when it sends them."""
    import torch

    from ..instrumentation import OpenStep

    tp, host = runner.tp, message.host
    with torch.inference_mode():
        if message.num_copies:
            flat, end, n = host.flat, sum(host.lengths), message.num_copies
            runner.copy_blocks(list(zip(flat[end:end + n].tolist(), flat[end + n:end + 2 * n].tolist())))
        ids, positions, meta, _ = runner.device_batch(host, previous_ids)
        gpu, step, replayed = runner.gpu_telemetry, None, None
        if gpu is not None:
            gpu.follow_plan(message.traced, message.probed)
            if not gpu.next_step_plain:
                step = OpenStep(message.step_id, message.trace_id, message.span_id, time.time_ns())
                meta.probe = gpu.probe
                gpu.begin_step(step)
        if message.timed:
            tp.begin_timing()
        try:
            if message.bucket is None:
                runner.model(ids, positions, meta, runner.kv_cache, None)
            else:
                runner.graphs.run(ids, positions, meta.slot_mapping, meta.block_tables,
                                  meta.context_lens, message.bucket)
                replayed = (runner.graphs, message.bucket)
        finally:
            if step is not None:
                gpu.end_step(step, None, replayed)
        if message.timed:
            rows = message.bucket or host.lengths[0]
            record(tp.end_timing(message.step_id, runner.collective_bytes(rows)))
        if message.send_ids:
            return tp.recv_ids(message.num_sampled) if message.num_sampled else None
    return None


def _ship(outbox, conn) -> None:
    """The worker's records to the core, every few ms (one pickle per batch)."""
    while not outbox.stopped:
        time.sleep(_SHIP_INTERVAL_S)
        if not _send(outbox, conn):
            return


def _send(outbox, conn) -> bool:
    items = outbox.drain()
    if not items:
        return True
    try:
        conn.send(items)
        return True
    except (BrokenPipeError, OSError):
        return False


def _exit_with_parent() -> None:
    """A thread that ends this process once its parent (the engine core) is gone: a worker
    blocked in a collective would otherwise outlive it."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="sightline-tp-parent", daemon=True).start()
