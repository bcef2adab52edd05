"""NVML GPU-memory metrics: exact exposition from known readings, a clear answer without
NVML, and the real library on a GPU."""

from __future__ import annotations

import types

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sightline.instrumentation import semconv
from sightline.instrumentation.nvml import NvmlCollector


class _Readings:
    """Stands in for the pynvml module with fixed readings (NVML cannot run here)."""

    def __init__(self, used: dict[int, int], procs: dict[int, list[tuple[int, object]]]):
        self.used, self.procs = used, procs

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=self.used[h])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.procs[h]]


def _exposition(collector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_without_nvml_nothing_is_exported_and_the_reason_is_given():
    c = NvmlCollector()
    if c.available:
        pytest.skip("NVML works on this machine")
    assert "NVML unavailable" in c.unavailable_reason
    assert c.read() == [] and list(c.collect()) == []
    assert "sightline_gpu" not in _exposition(c)


def test_readings_become_exact_series():
    c = NvmlCollector.__new__(NvmlCollector)
    c.available, c.unavailable_reason, c.devices = True, "", [0, 1]
    # pid 7 has two contexts on GPU 0 (summed); pid 9's figure is unknown (VMs): omitted
    c._nvml = _Readings({0: 5 * 2**30, 1: 1024},
                        {0: [(7, 100), (7, 50), (9, None)], 1: []})
    text = _exposition(c)
    assert f'{semconv.GPU_MEMORY_USED_BYTES}{{gpu="0"}} 5.36870912e+09' in text
    assert f'{semconv.GPU_MEMORY_USED_BYTES}{{gpu="1"}} 1024.0' in text
    assert f'{semconv.GPU_PROCESS_MEMORY_BYTES}{{gpu="0",pid="7"}} 150.0' in text
    assert 'pid="9"' not in text
    assert f'{semconv.GPU_CUDA_CONTEXTS}{{gpu="0"}} 2.0' in text
    assert f'{semconv.GPU_CUDA_CONTEXTS}{{gpu="1"}} 0.0' in text


def test_bad_device_index_names_it():
    c = NvmlCollector()
    if not c.available:
        pytest.skip("needs NVML")
    with pytest.raises(ValueError, match="device index 999"):
        NvmlCollector(devices=[999])


@pytest.mark.gpu
def test_real_nvml_reports_this_process_after_it_allocates():
    import torch
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    c = NvmlCollector(devices=[0])
    assert c.available, c.unavailable_reason
    [s] = c.read()
    assert s.used_bytes >= x.numel() and s.contexts >= 1
    # NVML may withhold per-process figures inside VMs, and pids may be another namespace's
    assert all(mem >= 0 for mem in s.processes.values())
