"""CUDA kernel activity through CUPTI, captured as raw buffers in the engine process.

Control (activity kinds on/off, per-API filtering, external-correlation push/pop, flush)
goes through ``cupti-python``. Completed activity buffers are taken by a ``ctypes``
callback registered with the same ``libcupti``: it copies the buffer's valid bytes once
and hands them to ``on_buffer``: one Python call per buffer, never an object per record
(cupti-python's own callback builds one per record, and those took the engine's GIL).
The bytes are decoded in bulk elsewhere (:mod:`.cupti_records`).

Kinds: CONCURRENT_KERNEL; RUNTIME and DRIVER (CUPTI emits external-correlation records
only for API calls whose kind is on; filtered to launches, copies and memsets);
EXTERNAL_CORRELATION with kind CUSTOM2 (PyTorch's profiler uses CUSTOM0/1).
Availability: one CUPTI activity subscriber per process; if ``cupti`` is missing or
``torch.profiler`` holds CUPTI, ``start()`` returns False with ``unavailable_reason``.
Nothing here raises into the engine.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

from .config_checks import check_range

__all__ = ["CuptiTracer", "cupti_available"]

logger = logging.getLogger(__name__)

_REQUEST = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p),
                            ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_COMPLETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_size_t)
_FLUSH_FORCED = 1   # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: part-full buffers too


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


def _loaded_libcupti() -> ctypes.CDLL:
    """The libcupti that cupti-python loaded (the same path: the same library instance)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcupti.so" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    for name in ("libcupti.so.13", "libcupti.so.12", "libcupti.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libcupti is not loaded and not on the library path")


def _gil_holding(lib: ctypes.CDLL) -> ctypes.PyDLL:
    """The engine thread's CUPTI calls (kinds on, external-correlation push/pop) of ``lib``
    through ``ctypes.PyDLL``, whose calls keep the GIL (a ``CDLL`` call, like
    cupti-python's, lets it go, and the server's event loop may then hold it for ms)."""
    held = ctypes.PyDLL(lib._name)
    held.cuptiActivityEnable.argtypes = [ctypes.c_int]
    held.cuptiActivityEnable.restype = ctypes.c_int
    held.cuptiActivityPushExternalCorrelationId.argtypes = [ctypes.c_int, ctypes.c_uint64]
    held.cuptiActivityPushExternalCorrelationId.restype = ctypes.c_int
    held.cuptiActivityPopExternalCorrelationId.argtypes = [ctypes.c_int,
                                                           ctypes.POINTER(ctypes.c_uint64)]
    held.cuptiActivityPopExternalCorrelationId.restype = ctypes.c_int
    return held


class CuptiTracer:
    """Process-wide CUPTI activity capture (CUPTI's activity API is per process).

    ``start()`` -> bool; ``enable()`` / ``disable()`` (or ``detach()``) around traced steps;
    ``push(id)`` / ``pop()`` around their launches; ``flush()`` delivers part-full buffers;
    ``stop()``.
    ``on_buffer(bytes)`` receives each completed buffer on CUPTI's thread (or the
    flushing one) and must return quickly. Buffers are ``buffer_bytes`` each, reused."""

    _active: CuptiTracer | None = None   # the one started instance in this process
    _class_lock = threading.Lock()

    def __init__(self, on_buffer: Callable[[bytes], None], buffer_bytes: int = 1 << 20,
                 flush_period_ms: int = 0, api_filter: bool = True) -> None:
        check_range("buffer_bytes", buffer_bytes, 1 << 16, integer=True)
        check_range("flush_period_ms", flush_period_ms, 0, 60_000, integer=True)
        self.on_buffer = on_buffer
        self.buffer_bytes = buffer_bytes
        self.flush_period_ms = flush_period_ms
        self.api_filter = api_filter
        self.api_cbids_disabled = 0
        self._filtered_cbids: list | None = None   # (enable function, cbid) pairs switched off
        self.available = False
        self.attached = False                  # False between ``detach`` and ``enable``
        self.detaches = 0
        self.unavailable_reason = "not started"
        self.buffers_completed = 0
        self.bytes_completed = 0
        self.callback_errors = 0
        self._cupti = None
        self._lib = None
        self._held = None                      # push/pop entry points that keep the GIL
        self._kinds: list = []
        self._ext_kind = None
        self._free: list = []                  # buffers CUPTI gave back, for reuse
        self._lent: dict[int, object] = {}     # address -> buffer CUPTI holds
        # kept referenced: CUPTI calls them for as long as the process lives
        self._callbacks = (_REQUEST(self._buffer_requested), _COMPLETE(self._buffer_completed))

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> bool:
        """Registers the raw-buffer callbacks, enables the kinds; False (with
        ``unavailable_reason``) when it can't."""
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
            self._kinds = [cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.RUNTIME,
                           cupti.ActivityKind.DRIVER, cupti.ActivityKind.EXTERNAL_CORRELATION]
            self._ext_kind = cupti.ExternalCorrelationKind.CUSTOM2
            try:
                getattr(cupti, "get_version", lambda: None)()   # cupti-python loads libcupti
                self._lib = _loaded_libcupti()
                self._held = _gil_holding(self._lib)
                self._attach()
            except Exception as exc:
                return self._unavailable(f"CUPTI refused activity tracing ({exc}); another "
                                         "subscriber (e.g. torch.profiler) may hold it")
            CuptiTracer._active = self
        self.available = True
        self.unavailable_reason = ""
        return True

    def _attach(self) -> None:
        """Callbacks registered, kinds on, API filter applied; on failure, kinds off again."""
        cupti = self._cupti
        enabled = []
        try:
            result = self._lib.cuptiActivityRegisterCallbacks(*self._callbacks)
            if result != 0:
                raise RuntimeError(f"cuptiActivityRegisterCallbacks returned {result}")
            for kind in self._kinds:
                cupti.activity_enable(kind)
                enabled.append(kind)
            if self.api_filter:
                self._filter_api_records(cupti)
            if self.flush_period_ms:
                cupti.activity_flush_period(self.flush_period_ms)
        except Exception:
            for kind in enabled:
                try:
                    cupti.activity_disable(kind)
                except Exception:
                    pass
            raise
        self.attached = True

    def detach(self) -> None:
        """Delivers every record, switches the kinds off and detaches CUPTI from the process
        (``cuptiFinalize``): CUDA calls then cost what they cost without CUPTI, where merely
        disabled kinds leave a few microseconds on every call. ``enable`` attaches again
        (milliseconds). The caller makes sure no other thread is in a CUDA call meanwhile."""
        if not (self.available and self.attached):
            return
        cupti = self._cupti
        try:
            cupti.activity_flush_all(_FLUSH_FORCED)
            for kind in self._kinds:
                cupti.activity_disable(kind)
            cupti.finalize()
        except Exception:
            logger.exception("CUPTI detach failed")
        self.attached = False
        self.detaches += 1

    def _filter_api_records(self, cupti) -> None:
        """Keeps API records only for launches, copies and memsets: external correlation
        needs only the launch calls, and Triton's launcher and PyTorch make many small
        driver calls per step, each a record otherwise. If CUPTI refuses per-cbid control,
        all API records stay on (more bytes, still correct) and a warning says so."""
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
        """Flushes (delivering what is left), disables and lets CUPTI go (a later
        subscriber, e.g. torch.profiler, can start)."""
        if not self.available:
            return
        self.detach()
        self.available = False
        self.unavailable_reason = "stopped"
        with CuptiTracer._class_lock:
            if CuptiTracer._active is self:
                CuptiTracer._active = None

    def enable(self) -> None:
        """Switches the activity kinds on (per traced step, on the engine thread: the GIL is
        kept, as in ``push``; no flush), attaching CUPTI first if ``detach`` let it go. The
        per-API filter set at attach is not re-applied when only the kinds were off."""
        if self.available:
            if not self.attached:
                try:
                    self._attach()
                except Exception as exc:
                    self._unavailable(f"CUPTI refused to attach again ({exc}); kernel spans "
                                      "are off")
                return
            try:
                for kind in self._kinds:
                    result = self._held.cuptiActivityEnable(int(kind))
                    if result != 0:
                        raise RuntimeError(f"cuptiActivityEnable({kind!r}) returned {result}")
            except Exception:
                logger.exception("CUPTI enable failed")

    def disable(self) -> None:
        """Switches the activity kinds off: no records until ``enable``, CUPTI still attached.
        Records already made stay in their buffer until it completes or a ``flush``."""
        if self.available and self.attached:
            try:
                for kind in self._kinds:
                    self._cupti.activity_disable(kind)
            except Exception:
                logger.exception("CUPTI disable failed")

    # -- engine thread ----------------------------------------------------------------
    def push(self, external_id: int) -> None:
        """Tags the calling thread's following CUDA launches with ``external_id``. The GIL is
        kept: the call only touches a thread-local stack, and letting the GIL go could hand
        it to another thread for milliseconds."""
        if self.available and self.attached:
            try:
                result = self._held.cuptiActivityPushExternalCorrelationId(
                    int(self._ext_kind), external_id)
                if result != 0:
                    raise RuntimeError(f"cuptiActivityPushExternalCorrelationId returned {result}")
            except Exception:
                logger.exception("CUPTI push failed")

    def pop(self) -> None:
        if self.available and self.attached:
            try:
                last = ctypes.c_uint64()
                result = self._held.cuptiActivityPopExternalCorrelationId(
                    int(self._ext_kind), ctypes.byref(last))
                if result != 0:
                    raise RuntimeError(f"cuptiActivityPopExternalCorrelationId returned {result}")
            except Exception:
                logger.exception("CUPTI pop failed")

    # -- CUPTI's thread (or the flushing one) ---------------------------------------
    def _buffer_requested(self, buffer, size, max_records) -> None:
        try:
            buf = self._free.pop() if self._free else ctypes.create_string_buffer(self.buffer_bytes)
            address = ctypes.addressof(buf)
            self._lent[address] = buf
            buffer[0] = address
            size[0] = self.buffer_bytes
            max_records[0] = 0
        except Exception:   # never raise into CUPTI: without a buffer it drops records
            self.callback_errors += 1
            buffer[0] = None
            size[0] = 0

    def _buffer_completed(self, context, stream_id, buffer, size, valid_size) -> None:
        try:
            buf = self._lent.pop(buffer, None)
            if valid_size:
                self.buffers_completed += 1
                self.bytes_completed += valid_size
                self.on_buffer(ctypes.string_at(buffer, valid_size))
            if buf is not None:
                self._free.append(buf)
        except Exception:
            self.callback_errors += 1

    def flush(self) -> None:
        """Forces CUPTI to deliver every record of finished work now (blocks). Called through
        ctypes, which lets the GIL go for the call: CUPTI's record processing then does not
        stall the engine thread (the buffer callback takes the GIL once per buffer). Nothing
        while detached: any CUPTI call would attach it again."""
        if self.available and self.attached:
            try:
                result = self._lib.cuptiActivityFlushAll(ctypes.c_uint32(_FLUSH_FORCED))
                if result != 0:
                    raise RuntimeError(f"cuptiActivityFlushAll returned {result}")
            except Exception:
                logger.exception("CUPTI flush failed")

    @staticmethod
    def resolve_names(pointers) -> dict[int, str]:
        """Kernel names for CUPTI's name pointers (one per kernel, kept by CUPTI for the
        process's life, so each is read once)."""
        names = {}
        for pointer in pointers:
            pointer = int(pointer)
            try:
                names[pointer] = ctypes.string_at(pointer).decode("utf-8", "replace") \
                    if pointer else "<unknown>"
            except Exception:
                names[pointer] = "<unknown>"
        return names
