"""CUDA kernel activity through CUPTI (``cupti-python``), correlated to engine steps.

What it records: the activity kinds CONCURRENT_KERNEL and MEMCPY (typed
``KernelRecord`` / ``MemcpyRecord`` with the GPU's own start/end timestamps), RUNTIME
and DRIVER (only counted: they are enabled because CUPTI emits external-correlation
records only for API calls whose kind is on, and Triton launches through the driver
API), and EXTERNAL_CORRELATION with kind CUSTOM2 (PyTorch's profiler uses CUSTOM0/1).
``push(external_id)`` / ``pop()`` around a step tag every launch in between; ``drain``
joins kernels to those ids through the CUPTI correlation id.

Off the request path: CUPTI hands full buffers to ``buffer_completed`` on its own
thread (``activity_flush_period`` makes it do so every ``flush_period_ms``); that
callback converts records and puts them on a bounded queue (overflow counted in
``dropped_records``). ``drain`` runs wherever the consumer wants — GpuTelemetry drains
from its worker thread — and never flushes unless asked (``flush=True``).

Availability: CUPTI allows one activity subscriber per process on the H200's driver
(measured). If ``cupti`` is not installed, or ``torch.profiler`` (or anything else)
already holds CUPTI, ``start()`` returns False and ``unavailable_reason`` says why, in
words; the caller continues without kernel spans. Nothing here raises into the engine.

Cost: nothing while its kinds are off (``disable``); GpuTelemetry switches them on only
for the steps whose kernels it keeps (``enable``, ``push`` ... ``pop``, ``disable``).
While on: CUPTI's own per-launch overhead (a few µs per API call with RUNTIME/DRIVER on)
and, on CUPTI's thread, cupti-python's Python object per record plus one tuple per
kernel/memcpy here — measured on the H200 at ~20 µs per record including the GIL waits,
far too much to leave on for every step of an eager engine (~1,500 records per step).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["CuptiTracer", "KernelRecord", "MemcpyRecord", "TraceBatch", "cupti_available"]

logger = logging.getLogger(__name__)


class KernelRecord(NamedTuple):
    """One kernel execution as CUPTI saw it. Times are CUPTI ns (Unix epoch based).

    A named tuple, not a dataclass: CUPTI's thread builds one per kernel (hundreds per
    engine step), and a tuple costs a fraction of a frozen dataclass's ``__init__``."""

    name: str
    start_ns: int
    end_ns: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    registers_per_thread: int
    static_shared_memory_bytes: int
    dynamic_shared_memory_bytes: int
    stream_id: int
    device_id: int
    correlation_id: int
    external_id: int | None = None   # the step's id pushed with ``push``; None if none

    @property
    def shared_memory_bytes(self) -> int:
        return self.static_shared_memory_bytes + self.dynamic_shared_memory_bytes

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) * 1e-9

    def with_external_id(self, external_id: int | None) -> KernelRecord:
        return self._replace(external_id=external_id)


class MemcpyRecord(NamedTuple):
    """One memory copy. ``copy_kind`` is CUPTI's ActivityMemcpyKind name (e.g. HTOD)."""

    copy_kind: str
    bytes: int
    start_ns: int
    end_ns: int
    stream_id: int
    device_id: int
    correlation_id: int
    external_id: int | None = None


@dataclass(frozen=True)
class TraceBatch:
    """What one ``drain`` returns."""

    kernels: list[KernelRecord]
    memcpys: list[MemcpyRecord]
    api_calls: int                 # RUNTIME + DRIVER records seen since the last drain
    dropped_records: int           # cumulative: records lost to a full queue


def cupti_available() -> tuple[bool, str]:
    """(True, "") when ``cupti`` imports, else (False, why)."""
    try:
        from cupti import cupti  # noqa: F401
        return True, ""
    except Exception as exc:  # ImportError, or a library load failure
        return False, f"cupti-python is not usable ({type(exc).__name__}: {exc})"


def _torch_profiler_active() -> bool:
    try:
        import torch
        return bool(torch.autograd.profiler._is_profiler_enabled)
    except Exception:
        return False


class CuptiTracer:
    """Process-wide CUPTI activity tracing (CUPTI's activity API is per process).

    ``start()`` -> bool; ``push(id)`` / ``pop()`` around launches; ``drain()`` ->
    ``TraceBatch``; ``stop()``. ``max_queue_records`` bounds memory held between drains;
    ``max_unmatched`` bounds kernels kept while their correlation record is in flight.

    Buffers are small (256 KiB) on purpose. Seen on the H200: CUPTI's periodic flush hands
    over completed buffers only, and the launching thread's API / external-correlation
    records sit in their buffer until it fills — with 8 MiB buffers kernels could not be
    joined to their steps for many seconds. A forced flush (``activity_flush_all(1)``)
    every 0.3 s fixed the join but slowed the engine about five-fold (the callback's Python
    runs while CUPTI holds the lock every CUDA call needs), so it is used only on explicit
    ``flush``/``stop``. Small buffers complete about once per engine step instead. (The
    256 KiB setting itself has not been measured on the GPU yet.)"""

    _active: CuptiTracer | None = None   # the one started instance in this process
    _class_lock = threading.Lock()

    def __init__(self, buffer_bytes: int = 256 << 10, flush_period_ms: int = 100,
                 max_queue_records: int = 1 << 20, max_unmatched: int = 1 << 16,
                 memcpy: bool = True, hold_drains: int = 40, api_filter: bool = True) -> None:
        if buffer_bytes < 1 << 16:
            raise ValueError(f"buffer_bytes={buffer_bytes} must be >= 65536")
        if not 0 <= flush_period_ms <= 60_000:
            raise ValueError(f"flush_period_ms={flush_period_ms} must be in [0, 60000]")
        self.buffer_bytes = buffer_bytes
        self.flush_period_ms = flush_period_ms
        self.memcpy = memcpy
        self.max_unmatched = max_unmatched
        self.hold_drains = hold_drains
        self.api_filter = api_filter
        self.api_cbids_disabled = 0
        self._filtered_cbids: list | None = None   # (enable function, cbid) pairs switched off
        self.available = False
        self.unavailable_reason = "not started"
        self.dropped_records = 0
        self.buffers_completed = 0
        self.records_seen = 0
        self.callback_s = 0.0      # time in our buffer-completed callback (CUPTI's thread)
        self.callback_cpu_s = 0.0  # its CPU time (the wall time above includes GIL waits)
        self.max_queue_records = max_queue_records
        self._queue: queue.SimpleQueue = queue.SimpleQueue()   # one item per CUPTI buffer
        # records queued = in - out; each counter has one writer (CUPTI's thread, drain)
        self._records_in = 0
        self._records_out = 0
        self._ext: OrderedDict[int, int] = OrderedDict()   # correlation id -> external id
        self._unmatched: list = []
        self._api_calls = 0
        self._cupti = None
        self._kinds: list = []
        self._ext_kind = None

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> bool:
        """Enables the activity kinds; False (with ``unavailable_reason``) when it can't."""
        ok, why = cupti_available()
        if not ok:
            return self._unavailable(why)
        if _torch_profiler_active():
            return self._unavailable("torch.profiler is running: CUPTI allows one activity "
                                     "subscriber per process, so kernel spans are off")
        with CuptiTracer._class_lock:
            if CuptiTracer._active is not None and CuptiTracer._active is not self:
                return self._unavailable("another CuptiTracer already holds CUPTI in this "
                                         "process")
            from cupti import cupti
            self._cupti = cupti
            kinds = [cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.RUNTIME,
                     cupti.ActivityKind.DRIVER, cupti.ActivityKind.EXTERNAL_CORRELATION]
            if self.memcpy:
                kinds.append(cupti.ActivityKind.MEMCPY)
            self._ext_kind = cupti.ExternalCorrelationKind.CUSTOM2
            try:
                cupti.activity_register_callbacks(self._buffer_requested,
                                                  self._buffer_completed)
                enabled = []
                for kind in kinds:
                    cupti.activity_enable(kind)
                    enabled.append(kind)
                if self.api_filter:
                    self._filter_api_records(cupti)
                if self.flush_period_ms:
                    cupti.activity_flush_period(self.flush_period_ms)
            except Exception as exc:
                for kind in locals().get("enabled", []):
                    try:
                        cupti.activity_disable(kind)
                    except Exception:
                        pass
                return self._unavailable(f"CUPTI refused activity tracing ({exc}); another "
                                         "subscriber (e.g. torch.profiler) may hold it")
            self._kinds = kinds
            CuptiTracer._active = self
        self.available = True
        self.unavailable_reason = ""
        return True

    def _filter_api_records(self, cupti) -> None:
        """Keeps API records only for launches, copies and memsets.

        Measured on the H200 with the llama-8b engine: with every RUNTIME and DRIVER call
        recorded, a 20-step run produced ~860 K records (~43 K per step; Triton's launcher
        and PyTorch make many small driver calls) and steps ran 8x slower, mostly in
        cupti-python's per-record Python objects on CUPTI's thread competing for the GIL.
        External correlation only needs the launch calls. If CUPTI refuses per-cbid
        control, all API records stay on (slower, still correct) and a warning says so."""
        if self._filtered_cbids is None:     # learn once which calls CUPTI accepts
            keep = ("Launch", "Memcpy", "Memset")
            accepted = []
            try:
                for enum_cls, fn in ((cupti.driver_api_trace_cbid,
                                      cupti.activity_enable_driver_api),
                                     (cupti.runtime_api_trace_cbid,
                                      cupti.activity_enable_runtime_api)):
                    for member in enum_cls:
                        name = member.name
                        if name in ("INVALID", "SIZE", "FORCE_INT") or any(k in name
                                                                           for k in keep):
                            continue
                        try:
                            fn(int(member), 0)
                            accepted.append((fn, int(member)))
                        except Exception:
                            pass   # a cbid this driver does not know
            except Exception as exc:
                logger.warning("CUPTI per-API filtering unavailable (%s); recording all API "
                               "calls", exc)
            self._filtered_cbids = accepted
            self.api_cbids_disabled = len(accepted)
            return
        for fn, cbid in self._filtered_cbids:
            fn(cbid, 0)

    def _unavailable(self, why: str) -> bool:
        self.available = False
        self.unavailable_reason = why
        logger.warning("CUPTI kernel tracing unavailable: %s", why)
        return False

    def stop(self) -> None:
        """Flushes and disables; later ``drain`` calls still return what was queued."""
        if not self.available:
            return
        cupti = self._cupti
        try:
            cupti.activity_flush_all(1)
        except Exception:
            logger.exception("CUPTI flush at stop failed")
        for kind in self._kinds:
            try:
                cupti.activity_disable(kind)
            except Exception:
                logger.exception("CUPTI disable failed")
        try:
            cupti.finalize()   # lets another subscriber (e.g. torch.profiler) start later
        except Exception:
            pass
        self.available = False
        self.unavailable_reason = "stopped"
        with CuptiTracer._class_lock:
            if CuptiTracer._active is self:
                CuptiTracer._active = None

    def enable(self) -> None:
        """Switches the activity kinds on (per traced step; no flush). Re-applies the API
        filter, since re-enabling a kind may reset CUPTI's per-API choices (~1,000 cheap
        CUPTI calls, paid only by traced steps)."""
        if self.available:
            try:
                for kind in self._kinds:
                    self._cupti.activity_enable(kind)
                if self.api_filter:
                    self._filter_api_records(self._cupti)
            except Exception:
                logger.exception("CUPTI enable failed")

    def disable(self) -> None:
        """Switches the activity kinds off: no records and no per-launch CUPTI cost until
        ``enable``. Records already made stay in their buffer until it completes or a
        ``flush``."""
        if self.available:
            try:
                for kind in self._kinds:
                    self._cupti.activity_disable(kind)
            except Exception:
                logger.exception("CUPTI disable failed")

    # -- engine thread ----------------------------------------------------------------
    def push(self, external_id: int) -> None:
        """Tags the calling thread's following CUDA launches with ``external_id``."""
        if self.available:
            try:
                self._cupti.activity_push_external_correlation_id(self._ext_kind, external_id)
            except Exception:
                logger.exception("CUPTI push failed")

    def pop(self) -> None:
        if self.available:
            try:
                self._cupti.activity_pop_external_correlation_id(self._ext_kind)
            except Exception:
                logger.exception("CUPTI pop failed")

    # -- CUPTI's thread -----------------------------------------------------------------
    def _buffer_requested(self):
        return self.buffer_bytes, 0

    def _buffer_completed(self, activities) -> None:
        # Hot: runs once per record of every kernel the engine launches, on CUPTI's thread,
        # holding the GIL the engine thread needs. Plain tuples, locals, and one queue put
        # per buffer (not per record).
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            cupti = self._cupti
            k_kernel = int(cupti.ActivityKind.CONCURRENT_KERNEL)
            k_ext = int(cupti.ActivityKind.EXTERNAL_CORRELATION)
            k_memcpy = int(cupti.ActivityKind.MEMCPY)
            ext_kind = int(self._ext_kind)
            kernels, links, memcpys = [], [], []
            foreign = 0
            add_kernel, add_link = kernels.append, links.append
            for a in activities:
                kind = a.kind
                if kind == k_kernel:
                    add_kernel(KernelRecord(
                        a.name, a.start, a.end, (a.grid_x, a.grid_y, a.grid_z),
                        (a.block_x, a.block_y, a.block_z), a.registers_per_thread,
                        a.static_shared_memory, a.dynamic_shared_memory, a.stream_id,
                        a.device_id, a.correlation_id))
                elif kind == k_ext:
                    if a.external_kind == ext_kind:
                        add_link((a.correlation_id, a.external_id))
                    else:
                        foreign += 1     # another tool's correlation kind (e.g. torch's)
                elif kind == k_memcpy:
                    memcpys.append(MemcpyRecord(_memcpy_kind_name(cupti, a.copy_kind), a.bytes,
                                                a.start, a.end, a.stream_id, a.device_id,
                                                a.correlation_id))
            n = len(activities)
            kept = len(kernels) + len(links) + len(memcpys)
            self.buffers_completed += 1
            self.records_seen += n
            self._api_calls += n - kept - foreign
            if self._records_in - self._records_out + kept > self.max_queue_records:
                self.dropped_records += kept
            elif kept:
                self._records_in += kept
                self._queue.put_nowait((kernels, links, memcpys, kept))
        except Exception:  # never raise into CUPTI's thread
            logger.exception("CUPTI buffer processing failed")
        self.callback_s += time.perf_counter() - t0
        self.callback_cpu_s += time.thread_time() - cpu0

    # -- consumer ---------------------------------------------------------------------
    def flush(self) -> None:
        """Forces CUPTI to deliver every record of finished work now (blocks)."""
        if self.available:
            try:
                self._cupti.activity_flush_all(1)
            except Exception:
                logger.exception("CUPTI flush failed")

    def drain(self, flush: bool = False) -> TraceBatch:
        """Everything delivered so far, kernels joined to their external ids.

        A kernel whose correlation record has not arrived yet is held back for up to
        ``hold_drains`` drains (and at most ``max_unmatched`` kernels), then goes out with
        ``external_id=None`` (launched outside any push, or its record was lost)."""
        if flush:
            self.flush()
        kernels: list[tuple[KernelRecord, int]] = list(self._unmatched)
        memcpys: list[MemcpyRecord] = []
        while True:
            try:
                buf_kernels, buf_links, buf_memcpys, kept = self._queue.get_nowait()
            except queue.Empty:
                break
            self._records_out += kept
            self._ext.update(buf_links)
            kernels.extend((k, 0) for k in buf_kernels)
            memcpys.extend(buf_memcpys)
        while len(self._ext) > 4 * self.max_unmatched:   # bounded map, oldest first
            self._ext.popitem(last=False)
        out_k: list[KernelRecord] = []
        held: list[tuple[KernelRecord, int]] = []
        for k, age in kernels:
            ext = self._ext.get(k.correlation_id)
            if ext is None and not flush and age < self.hold_drains:
                held.append((k, age + 1))
            else:
                out_k.append(k.with_external_id(ext))
        if len(held) > self.max_unmatched:
            out_k.extend(k.with_external_id(None) for k, _ in held[:-self.max_unmatched])
            held = held[-self.max_unmatched:]
        self._unmatched = held
        out_m = [MemcpyRecord(m.copy_kind, m.bytes, m.start_ns, m.end_ns, m.stream_id,
                              m.device_id, m.correlation_id, self._ext.get(m.correlation_id))
                 for m in memcpys]
        api, self._api_calls = self._api_calls, 0
        return TraceBatch(out_k, out_m, api, self.dropped_records)


def _memcpy_kind_name(cupti, value: int) -> str:
    try:
        return cupti.ActivityMemcpyKind(value).name
    except Exception:
        return str(value)
