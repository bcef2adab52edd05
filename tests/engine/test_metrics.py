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


def test_inter_token_exemplars_go_on_a_requests_slowest_gap_so_far():
    """Each bucket keeps only its latest exemplar: a request's trace id goes on its first gap
    and on each gap slower than all before it, and on no other; every bucket such a gap
    falls in then points at the request."""
    from sightline.engine.output_processor import LiveRequest

    exemplar = {sc.EXEMPLAR_TRACE_ID_LABEL: "0af7651916cd43dd8448eb211c80319c"}
    live = LiveRequest("r", None, None, key=1, exemplar=exemplar)
    gaps = [0.010, 0.008, 0.012, 0.012, 0.005, 0.030, 0.029]
    carried = [live.itl_exemplar(gap) is exemplar for gap in gaps]
    assert carried == [True, False, True, False, False, True, False]
    metrics = EngineMetrics("tiny")
    live = LiveRequest("r", None, None, key=1, exemplar=exemplar)
    for gap in gaps:
        metrics.itl.observe(gap, live.itl_exemplar(gap))
    buckets = {s.labels["le"]: s.exemplar for m in metrics.registry.collect()
               if m.name == sc.ENGINE_ITL_SECONDS for s in m.samples if s.name.endswith("_bucket")}
    with_exemplar = {le for le, e in buckets.items() if e is not None}
    boundaries = sorted(float(le) for le in buckets if le != "+Inf")
    expected = {str(next(b for b in boundaries if g <= b)) for g in (0.010, 0.012, 0.030)}
    assert with_exemplar == expected
    # an untraced request (no exemplar) never carries one
    untraced = LiveRequest("r", None, None, key=None)
    assert all(untraced.itl_exemplar(gap) is None for gap in gaps)
