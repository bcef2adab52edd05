"""Raw CUPTI activity buffers decoded in bulk with numpy: kernels joined to their steps.

CUPTI fills buffers with packed records, each starting with its ``CUpti_ActivityKind``
and 8-byte aligned. The layouts below are CUPTI 13.0's (``cupti_activity.h``:
``CUpti_ActivityKernel10``, ``CUpti_ActivityAPI``, ``CUpti_ActivityExternalCorrelation``,
``CUpti_ActivityMemcpy6``; offsets generated from that header). One pass walks the
record headers to find offsets (integer arithmetic only); each kind is then gathered
into a structured array at once, never one Python object per record.

Guarantee: a buffer holding a kind this module does not know is decoded up to that
record and the rest is counted in ``undecoded_bytes``, never misread. Cost: one header
walk plus numpy gathers; kernel names stay pointers (``name_ptr``) until resolved by the
process that owns them (:mod:`.cupti_tracer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["KIND_CONCURRENT_KERNEL", "KIND_EXTERNAL_CORRELATION", "KERNEL_DTYPE",
           "EXTERNAL_CORRELATION_DTYPE", "API_DTYPE", "DecodedBuffer", "decode_buffer",
           "EXTERNAL_KIND_CUSTOM2", "RECORD_BYTES"]

KIND_MEMCPY = 1
KIND_DRIVER = 4
KIND_RUNTIME = 5
KIND_CONCURRENT_KERNEL = 10
KIND_EXTERNAL_CORRELATION = 39
EXTERNAL_KIND_CUSTOM2 = 5      # PyTorch's profiler uses CUSTOM0/1

KERNEL_DTYPE = np.dtype({
    "names": ["kind", "registers_per_thread", "start_ns", "end_ns", "device_id", "context_id",
              "stream_id", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
              "static_shared_memory", "dynamic_shared_memory", "correlation_id", "name_ptr",
              "graph_node_id", "graph_id"],
    "formats": ["<u4", "<u2", "<u8", "<u8", "<u4", "<u4", "<u4", "<i4", "<i4", "<i4", "<i4",
                "<i4", "<i4", "<i4", "<u4", "<u4", "<u8", "<u8", "<u4"],
    "offsets": [0, 6, 16, 24, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 92, 104, 144, 156],
    "itemsize": 216,
})
API_DTYPE = np.dtype({"names": ["kind", "cbid", "start_ns", "end_ns", "correlation_id"],
                      "formats": ["<u4", "<u4", "<u8", "<u8", "<u4"], "offsets": [0, 4, 8, 16, 32],
                      "itemsize": 40})
EXTERNAL_CORRELATION_DTYPE = np.dtype({
    "names": ["kind", "external_kind", "external_id", "correlation_id"],
    "formats": ["<u4", "<u4", "<u8", "<u4"], "offsets": [0, 4, 8, 16], "itemsize": 24})
MEMCPY_DTYPE = np.dtype({
    "names": ["kind", "copy_kind", "bytes", "start_ns", "end_ns", "device_id", "stream_id",
              "correlation_id"],
    "formats": ["<u4", "u1", "<u8", "<u8", "<u8", "<u4", "<u4", "<u4"],
    "offsets": [0, 4, 8, 16, 24, 32, 40, 44], "itemsize": 96})

RECORD_BYTES = {KIND_CONCURRENT_KERNEL: KERNEL_DTYPE.itemsize, KIND_DRIVER: API_DTYPE.itemsize,
                KIND_RUNTIME: API_DTYPE.itemsize,
                KIND_EXTERNAL_CORRELATION: EXTERNAL_CORRELATION_DTYPE.itemsize,
                KIND_MEMCPY: MEMCPY_DTYPE.itemsize}


@dataclass(frozen=True)
class DecodedBuffer:
    """One buffer's records by kind. ``external_ids`` maps correlation -> external id
    (CUSTOM2 only); ``api_calls`` counts RUNTIME and DRIVER records, whose correlation ids
    and ends (``api_correlation_ids``, ``api_end_ns``) say when each launch call returned."""

    kernels: np.ndarray            # KERNEL_DTYPE
    correlation_ids: np.ndarray    # uint32, CUSTOM2 external-correlation records
    external_ids: np.ndarray       # uint64, same order
    api_calls: int
    foreign_correlations: int      # another tool's external-correlation kind
    undecoded_bytes: int
    api_correlation_ids: np.ndarray   # uint32, RUNTIME and DRIVER records
    api_end_ns: np.ndarray            # uint64, same order


def _offsets(buffer: bytes) -> tuple[dict[int, list[int]], int]:
    """Record offsets by kind, walking the headers; the bytes left when a kind is unknown."""
    by_kind: dict[int, list[int]] = {}
    sizes = RECORD_BYTES
    kinds = np.frombuffer(buffer, "<u4", count=len(buffer) // 4)
    offset, end = 0, len(buffer)
    while offset + 8 <= end:
        kind = int(kinds[offset >> 2])
        size = sizes.get(kind)
        if size is None or offset + size > end:
            return by_kind, end - offset
        by_kind.setdefault(kind, []).append(offset)
        offset += size
    return by_kind, 0


def _gather(raw: np.ndarray, offsets: list[int], dtype: np.dtype) -> np.ndarray:
    if not offsets:
        return np.zeros(0, dtype)
    starts = np.asarray(offsets, np.int64)
    rows = raw[starts[:, None] + np.arange(dtype.itemsize)]      # [N, itemsize] bytes
    return rows.view(dtype).reshape(len(offsets))


def decode_buffer(buffer: bytes) -> DecodedBuffer:
    """Decodes one completed CUPTI buffer (its valid bytes)."""
    by_kind, undecoded = _offsets(buffer)
    raw = np.frombuffer(buffer, np.uint8)
    kernels = _gather(raw, by_kind.get(KIND_CONCURRENT_KERNEL, []), KERNEL_DTYPE)
    ext = _gather(raw, by_kind.get(KIND_EXTERNAL_CORRELATION, []), EXTERNAL_CORRELATION_DTYPE)
    ours = ext["external_kind"] == EXTERNAL_KIND_CUSTOM2
    api = _gather(raw, by_kind.get(KIND_RUNTIME, []) + by_kind.get(KIND_DRIVER, []), API_DTYPE)
    return DecodedBuffer(kernels, ext["correlation_id"][ours].copy(),
                         ext["external_id"][ours].copy(), len(api), int((~ours).sum()), undecoded,
                         api["correlation_id"].copy(), api["end_ns"].copy())
