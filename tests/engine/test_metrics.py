"""Engine /metrics: GPU health gauges are added only where NVML answers."""

import pytest

from sightline.engine.metrics import EngineMetrics
from sightline.instrumentation import semconv as sc


def _has_nvml_gpu() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


def test_without_a_gpu_driver_says_why_and_exposes_no_gpu_series():
    if _has_nvml_gpu():
        pytest.skip("a GPU driver is present")
    metrics = EngineMetrics("tiny")
    reason = metrics.watch_gpu(0)
    assert reason  # a sentence saying why, not an exception
    text = metrics.exposition()[0].decode()
    assert sc.GPU_MEMORY_USED_BYTES not in text
    assert f'{sc.ENGINE_KV_USAGE}{{model="tiny"}} 0.0' in text


@pytest.mark.gpu
def test_with_a_gpu_memory_and_contexts_are_exposed():
    metrics = EngineMetrics("tiny")
    assert metrics.watch_gpu(0) is None
    text = metrics.exposition()[0].decode()
    assert f'{sc.GPU_MEMORY_USED_BYTES}{{gpu="0"}}' in text
    assert f'{sc.GPU_CUDA_CONTEXTS}{{gpu="0"}}' in text
