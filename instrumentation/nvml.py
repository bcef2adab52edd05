"""GPU memory and CUDA contexts through NVML (``nvidia-ml-py``), as Prometheus metrics.

``NvmlCollector`` is a ``prometheus_client`` custom collector for the engine's
``/metrics``; each scrape reads NVML (a few µs per GPU and per process) and yields

* ``sightline_gpu_memory_used_bytes{gpu}``                   device memory in use
* ``sightline_gpu_process_memory_used_bytes{gpu,pid}``       per process with a compute
  context (NVML may report no per-process figure inside VMs; such processes are omitted)
* ``sightline_gpu_cuda_contexts{gpu}``                      processes holding a compute
  context on the GPU

When NVML cannot start (no driver, no library) the collector yields nothing and
``unavailable_reason`` says why; it never raises into a scrape.
"""

from __future__ import annotations

import functools
import logging

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import semconv
from .config_checks import check_range

__all__ = ["GpuMemorySample", "NvmlCollector", "gpu_uuid"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def gpu_uuid(index: int) -> str | None:
    """NVML's UUID of GPU ``index`` ("GPU-..."), its identity across hosts; None without NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(int(index)))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except Exception:  # no driver, no library, no such device: the index is all there is
        return None


class GpuMemorySample:
    """One GPU's reading: used bytes and {pid: bytes} of processes with a context."""

    __slots__ = ("gpu", "used_bytes", "processes", "contexts")

    def __init__(self, gpu: int, used_bytes: int, processes: dict[int, int], contexts: int):
        self.gpu, self.used_bytes, self.processes, self.contexts = (gpu, used_bytes, processes,
                                                                    contexts)


class NvmlCollector(Collector):
    """Reads NVML at scrape time. ``devices``: indices to report (default: all)."""

    def __init__(self, devices: list[int] | None = None) -> None:
        self.available = False
        self.unavailable_reason = ""
        self._nvml = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            count = pynvml.nvmlDeviceGetCount()
            self.devices = list(range(count)) if devices is None else list(devices)
            for d in self.devices:
                check_range("device index", d, 0, count, integer=True, hi_open=True)
            self.available = True
        except ValueError:
            raise
        except Exception as exc:   # ImportError, NVMLError_LibraryNotFound, driver missing
            self.devices = []
            self.unavailable_reason = f"NVML unavailable ({type(exc).__name__}: {exc})"
            logger.info("GPU memory metrics off: %s", self.unavailable_reason)

    def read(self) -> list[GpuMemorySample]:
        """One sample per device; [] when NVML is unavailable or a read fails."""
        if not self.available:
            return []
        nv = self._nvml
        out = []
        try:
            for d in self.devices:
                handle = nv.nvmlDeviceGetHandleByIndex(d)
                used = int(nv.nvmlDeviceGetMemoryInfo(handle).used)
                procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
                per_pid = {}
                for p in procs:
                    mem = getattr(p, "usedGpuMemory", None)
                    if isinstance(mem, int) and mem >= 0:
                        per_pid[int(p.pid)] = per_pid.get(int(p.pid), 0) + mem
                out.append(GpuMemorySample(d, used, per_pid, len({p.pid for p in procs})))
        except Exception:
            logger.exception("NVML read failed")
            return []
        return out

    def describe(self):
        return []

    def collect(self):
        samples = self.read()
        if not samples:
            return
        used = GaugeMetricFamily(semconv.GPU_MEMORY_USED_BYTES, "GPU memory in use (NVML)",
                                 labels=[semconv.LABEL_GPU], unit="")
        per_proc = GaugeMetricFamily(semconv.GPU_PROCESS_MEMORY_BYTES,
                                     "GPU memory used per process with a compute context",
                                     labels=[semconv.LABEL_GPU, semconv.LABEL_PID])
        contexts = GaugeMetricFamily(semconv.GPU_CUDA_CONTEXTS,
                                     "Processes holding a CUDA compute context on the GPU",
                                     labels=[semconv.LABEL_GPU])
        for s in samples:
            used.add_metric([str(s.gpu)], float(s.used_bytes))
            contexts.add_metric([str(s.gpu)], float(s.contexts))
            for pid, mem in sorted(s.processes.items()):
                per_proc.add_metric([str(s.gpu), str(pid)], float(mem))
        yield used
        yield per_proc
        yield contexts
