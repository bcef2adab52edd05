"""instrumentation/dispatch_order.py and what the telemetry counts with it: the CTAs each SM
is dealt, the launches that spread their work, and their way out as OTLP sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sightline.instrumentation import semconv
from sightline.instrumentation.cta_metrics import build_cta_metrics
from sightline.instrumentation.dispatch_order import dispatch_order_from
from sightline.instrumentation.gpu_telemetry import GpuTelemetry, GpuTelemetryConfig
from sightline.instrumentation.sm_histograms import DeviceCtaHistograms
from tests.engine.interpreter import run_interpreted


class _Records:
    """Where GpuTelemetry's worker hands its records (the telemetry's ``record``)."""

    def __init__(self) -> None:
        self.items: list = []

    def record(self, item) -> None:
        self.items.append(item)


def test_the_order_is_kept_only_when_every_launch_dealt_each_sm_once_the_same_way():
    order = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    assert dispatch_order_from([order, order.copy(), order.copy()], 8).tolist() == order.tolist()
    assert dispatch_order_from([order, order[::-1]], 8) is None          # launches disagree
    assert dispatch_order_from([np.array([0, 0, 1, 2, 3, 4, 5, 6])], 8) is None  # an SM twice
    assert dispatch_order_from([np.array([0, 1, 2, 3, -1, 5, 6, 7])], 8) is None  # a CTA unrecorded
    assert dispatch_order_from([order[:6]], 8) is None
    assert dispatch_order_from([], 8) is None


def test_the_learning_launch_runs_in_the_interpreter():
    """The interpreter's probe puts CTA i on "SM" i % 8: on 8 SMs that is an order, on 16
    each SM twice, which is none."""
    got = run_interpreted(
        "import json, torch\n"
        "from sightline.instrumentation.dispatch_order import learn_dispatch_order\n"
        "eight = learn_dispatch_order(torch.device('cpu'), 8, fake=True)\n"
        "sixteen = learn_dispatch_order(torch.device('cpu'), 16, fake=True)\n"
        "print('RESULTS' + json.dumps([eight.tolist(), sixteen]))\n")
    assert got == [list(range(8)), None]


def _records(sms: list[int]) -> torch.Tensor:
    """One step's probe records: CTA i ran on ``sms[i]`` (-1: exited without work)."""
    return torch.tensor([[sm, 1000, 1000 + 50 + i] for i, sm in enumerate(sms)], dtype=torch.int64).reshape(-1)


def test_each_cta_that_ran_is_counted_on_the_sm_the_order_deals_it():
    order = [3, 1, 0, 2]   # CTA i of a launch goes to SM order[i % 4]
    hist = DeviceCtaHistograms("cpu", gpu_id=5, num_sms=4)
    assert hist.take_dealt() is None   # no order: no deal counted
    hist.set_dispatch_order(order)
    # launch "a" of 6 CTAs (CTA 4 idle), launch "b" of 3, launch "a" of 2; where they ran
    # differs from the deal on purpose: the deal is what an idle GPU would have done
    launches = [("a", 6), ("b", 3), ("a", 2)]
    ran = [0, 0, 0, 0, -1, 1] + [2, 2, 2] + [1, 1]
    hist.add(_records(ran), launches, trace_id=1, span_id=2, time_unix_nano=3)
    want: dict = {}
    i = 0
    for name, n in launches:
        for j in range(n):
            if ran[i + j] >= 0:
                key = (5, order[j % 4], name)
                want[key] = want.get(key, 0) + 1
        i += n
    assert hist.take_dealt() == want == {(5, 3, "a"): 2, (5, 1, "a"): 3, (5, 0, "a"): 1, (5, 2, "a"): 1,
                                         (5, 3, "b"): 1, (5, 1, "b"): 1, (5, 0, "b"): 1}
    # per kernel, as many CTAs dealt as ran
    hists, _ = hist.take()
    for name in ("a", "b"):
        assert sum(h.count for (_, _, k), h in hists.items() if k == name) == \
            sum(c for (_, _, k), c in want.items() if k == name)
    assert hist.take_dealt() == {}   # delta
    with pytest.raises(ValueError, match="every SM once: 3 for 4 SMs"):
        hist.set_dispatch_order([0, 1, 2])


def test_a_kernel_that_rotates_its_work_counts_as_wide_at_any_size():
    hist = DeviceCtaHistograms("cpu", gpu_id=0, num_sms=4)
    hist.rotating = {"rot"}
    launches = [("rot", 3), ("plain", 3), ("plain", 8)]   # wide: >= 2 x 4 SMs
    hist.add(_records([0, 1, 2, 0, 1, 2] + [0, 1, 2, 3] * 2), launches, 1, 2, 3)
    assert hist.take_launch_mix() == {(0, "rot"): (3, 3), (0, "plain"): (8, 11)}


def test_an_export_carries_the_wide_launch_and_dealt_sums_to_otlp():
    """The worker's export, as the engine runs it: both sums reach the OTLP metrics."""
    records = _Records()
    telemetry = GpuTelemetry(records, config=GpuTelemetryConfig(cupti=False, probe=False))
    telemetry.histograms = DeviceCtaHistograms("cpu", 0, 4)
    telemetry.histograms.set_dispatch_order([3, 2, 1, 0])
    telemetry.histograms.add(_records([0, 1, 2, 3] * 2 + [0, 1]), [("k", 8), ("k", 2)], 1, 2, 3)
    telemetry._export()
    item = records.items[-1]
    assert (item.launch_mix, item.num_sms, item.rank) == ({(0, "k"): (8, 10)}, 4, 0)
    assert item.dealt == {(0, 3, "k"): 3, (0, 2, "k"): 3, (0, 1, "k"): 2, (0, 0, "k"): 2}
    from opentelemetry.sdk.resources import Resource
    data = build_cta_metrics(item.histograms, item.exemplars, item.start_ns, item.end_ns, Resource.create({}),
                             item.launch_mix, item.num_sms, dealt=item.dealt)
    metrics = {m.name: m for m in data.resource_metrics[0].scope_metrics[0].metrics}
    [wide] = metrics[semconv.METRIC_CTA_WIDE].data.data_points
    assert wide.value == 8 and wide.attributes[semconv.ATTR_GPU_SM_COUNT] == 4
    dealt = {p.attributes[semconv.ATTR_SM_ID]: p.value for p in metrics[semconv.METRIC_CTA_DEALT].data.data_points}
    assert dealt == {0: 2, 1: 2, 2: 3, 3: 3}


@pytest.mark.gpu
@pytest.mark.parametrize("grid", [64, 128, 200, 264])
def test_on_the_gpu_a_launch_lands_as_the_learned_order_deals_it(grid):
    """On the idle GPU, a launch of ``grid`` CTAs puts CTA i on SM order[i % SMs]."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sightline.instrumentation.dispatch_order import _dispatch_probe, learn_dispatch_order
    from sightline.instrumentation.sm_probe import PROBE_HW, RECORD_WORDS
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    order = learn_dispatch_order(device, num_sms)
    assert order is not None and sorted(order.tolist()) == list(range(num_sms))
    records = torch.full((grid * RECORD_WORDS,), -1, dtype=torch.int64, device=device)
    _dispatch_probe[(grid,)](records, 20_000, PROBE=PROBE_HW)
    landed = records.view(grid, RECORD_WORDS)[:, 0].cpu().numpy()
    assert landed.tolist() == [int(order[i % num_sms]) for i in range(grid)]
