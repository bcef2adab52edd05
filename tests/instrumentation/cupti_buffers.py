"""Raw CUPTI activity records laid out as CUPTI 13 writes them (kernel, external
correlation, runtime API), for tests that decode buffers without a GPU."""

from __future__ import annotations

import ctypes

import numpy as np

from sightline.instrumentation.cupti_records import (API_DTYPE, EXTERNAL_CORRELATION_DTYPE,
                                                     EXTERNAL_KIND_CUSTOM2, KERNEL_DTYPE,
                                                     KIND_CONCURRENT_KERNEL,
                                                     KIND_EXTERNAL_CORRELATION, KIND_RUNTIME)

# kernel names live in the engine process; CUPTI records carry pointers to them
NAMES = {name: ctypes.create_string_buffer(name.encode())
          for name in ("sightline_paged_decode", "gemv_bf16", "rms_norm", "orphan")}


def name_ptr(name: str) -> int:
    return ctypes.addressof(NAMES[name])


def kernel_record(name: str, corr: int, start: int, duration: int = 1000) -> bytes:
    r = np.zeros(1, KERNEL_DTYPE)
    r["kind"], r["correlation_id"], r["name_ptr"] = KIND_CONCURRENT_KERNEL, corr, name_ptr(name)
    r["start_ns"], r["end_ns"] = start, start + duration
    r["grid_x"], r["grid_y"], r["grid_z"], r["block_x"], r["block_y"], r["block_z"] = 4, 2, 1, 128, 1, 1
    r["registers_per_thread"], r["static_shared_memory"], r["dynamic_shared_memory"] = 90, 1024, 2048
    r["stream_id"], r["device_id"] = 7, 0
    return r.tobytes()


def correlation_record(corr: int, external_id: int, kind: int = EXTERNAL_KIND_CUSTOM2) -> bytes:
    r = np.zeros(1, EXTERNAL_CORRELATION_DTYPE)
    r["kind"], r["external_kind"], r["external_id"], r["correlation_id"] = (
        KIND_EXTERNAL_CORRELATION, kind, external_id, corr)
    return r.tobytes()


def api_record(corr: int, start: int = 0, end: int = 0, kind: int = KIND_RUNTIME) -> bytes:
    """A launch call (runtime cudaLaunchKernel's callback id, or ``kind`` DRIVER's record)."""
    r = np.zeros(1, API_DTYPE)
    r["kind"], r["cbid"], r["correlation_id"] = kind, 211, corr
    r["start_ns"], r["end_ns"] = start, end
    return r.tobytes()
