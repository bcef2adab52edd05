"""instrumentation/dispatch_order.py and what the telemetry counts with it: the CTAs each SM
is dealt, the launches that spread their work, and their way out as OTLP sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sightline.instrumentation import semconv
from sightline.instrumentation.cta_metrics import build_cta_metrics
from sightline.instrumentation.dispatch_order import dispatch_deal_from
from sightline.instrumentation.gpu_telemetry import GpuTelemetry, GpuTelemetryConfig
from sightline.instrumentation.sm_histograms import DeviceCtaHistograms
from tests.engine.interpreter import run_interpreted


class _Records:
    """Where GpuTelemetry's worker hands its records (the telemetry's ``record``)."""

    def __init__(self) -> None:
        self.items: list = []

    def record(self, item) -> None:
        self.items.append(item)


def _flat(launches: list[list[int]]) -> np.ndarray:
    return np.concatenate([np.asarray(sms) for sms in launches])


def test_the_deal_is_kept_only_when_both_passes_agree_and_no_launch_doubles_up():
    # on 4 SMs: the launches of 1, 2, 3 and 4 CTAs
    deal = _flat([[2], [2, 0], [2, 0, 3], [2, 0, 3, 1]])
    got = dispatch_deal_from([deal, deal.copy()], 4)
    assert got is not None and got.flat.tolist() == deal.tolist()
    # the second pass placed the launch of 2 on the same SMs in another order: the same deal
    assert dispatch_deal_from([deal, _flat([[2], [0, 2], [2, 0, 3], [2, 0, 3, 1]])], 4).flat.tolist() == deal.tolist()
    assert dispatch_deal_from([deal, _flat([[2], [1, 2], [2, 0, 3], [2, 0, 3, 1]])], 4) is None   # other SMs
    assert dispatch_deal_from([_flat([[2], [2, 2], [2, 0, 3], [2, 0, 3, 1]])], 4) is None       # an SM twice
    assert dispatch_deal_from([_flat([[2], [2, 0], [2, -1, 3], [2, 0, 3, 1]])], 4) is None      # a CTA unrecorded
    assert dispatch_deal_from([deal[:-1]], 4) is None and dispatch_deal_from([], 4) is None


def test_a_wide_launch_deals_whole_rounds_then_the_rest_as_a_launch_of_that_size():
    deal = dispatch_deal_from([_flat([[2], [2, 0], [2, 0, 3], [2, 0, 3, 1]])], 4)
    assert deal.sms_of(3).tolist() == [2, 0, 3]
    assert deal.sms_of(10).tolist() == [2, 0, 3, 1, 2, 0, 3, 1, 2, 0]
    assert deal.per_sm(3).tolist() == [1, 0, 1, 1] and deal.per_sm(10).tolist() == [3, 2, 3, 2]


def test_the_learning_launches_run_in_the_interpreter():
    """The interpreter's probe puts the CTA of probe slot k on "SM" k % 8: on 8 SMs every
    launch is a deal, on 16 the launches of 9 or more put two CTAs on one SM, which is none."""
    got = run_interpreted(
        "import json, torch\n"
        "from sightline.instrumentation.dispatch_order import learn_dispatch_deal\n"
        "eight = learn_dispatch_deal(torch.device('cpu'), 8, fake=True)\n"
        "sixteen = learn_dispatch_deal(torch.device('cpu'), 16, fake=True)\n"
        "print('RESULTS' + json.dumps([eight.flat.tolist(), sixteen]))\n")
    assert got == [[k % 8 for k in range(1 + 2 + 3 + 4 + 5 + 6 + 7 + 8)], None]


def _records(sms: list[int]) -> torch.Tensor:
    """One step's probe records: CTA i ran on ``sms[i]`` (-1: exited without work)."""
    return torch.tensor([[sm, 1000, 1000 + 50 + i] for i, sm in enumerate(sms)], dtype=torch.int64).reshape(-1)


def test_each_cta_that_ran_is_counted_on_the_sm_the_deal_gives_it():
    deal = dispatch_deal_from([_flat([[3], [3, 1], [3, 1, 0], [3, 1, 0, 2]])], 4)
    hist = DeviceCtaHistograms("cpu", gpu_id=5, num_sms=4)
    assert hist.take_dealt() is None   # no deal: none counted
    hist.set_dispatch_deal(deal)
    # launch "a" of 6 CTAs (CTA 4 idle), launch "b" of 3, launch "a" of 2; where they ran
    # differs from the deal on purpose: the deal is what an idle GPU would have done
    launches = [("a", 6), ("b", 3), ("a", 2)]
    ran = [0, 0, 0, 0, -1, 1] + [2, 2, 2] + [1, 1]
    hist.add(_records(ran), launches, trace_id=1, span_id=2, time_unix_nano=3)
    want: dict = {}
    i = 0
    for name, n in launches:
        for j, sm in enumerate(deal.sms_of(n).tolist()):
            if ran[i + j] >= 0:
                want[(5, sm, name)] = want.get((5, sm, name), 0) + 1
        i += n
    # "a" of 6: a round of 4 (3, 1, 0, 2) then 2 as the launch of 2 (3, 1), the fifth idle;
    # "b" of 3: 3, 1, 0; "a" of 2: 3, 1
    assert hist.take_dealt() == want == {(5, 3, "a"): 2, (5, 1, "a"): 3, (5, 0, "a"): 1, (5, 2, "a"): 1,
                                         (5, 3, "b"): 1, (5, 1, "b"): 1, (5, 0, "b"): 1}
    # per kernel, as many CTAs dealt as ran
    hists, _ = hist.take()
    for name in ("a", "b"):
        assert sum(h.count for (_, _, k), h in hists.items() if k == name) == \
            sum(c for (_, _, k), c in want.items() if k == name)
    assert hist.take_dealt() == {}   # delta
    with pytest.raises(ValueError, match="a dispatch deal for 4 SMs on a GPU of 8"):
        DeviceCtaHistograms("cpu", gpu_id=0, num_sms=8).set_dispatch_deal(deal)


def test_a_rotating_kernels_one_wave_launches_count_as_wide():
    hist = DeviceCtaHistograms("cpu", gpu_id=0, num_sms=4)
    hist.rotating = {"rot"}
    # on 4 SMs: "rot" of 3 (one wave) is spread by its rotation, of 6 not (1-2 waves land as
    # the dispatch places them); "plain" of 8 (>= 2 x 4 SMs) by the dispatch
    launches = [("rot", 3), ("rot", 6), ("plain", 3), ("plain", 8)]
    hist.add(_records([0, 1, 2] + [0, 1, 2, 3, 0, 1] + [0, 1, 2] + [0, 1, 2, 3] * 2), launches, 1, 2, 3)
    assert hist.take_launch_mix() == {(0, "rot"): (3, 9), (0, "plain"): (8, 11)}


def test_an_export_carries_the_wide_launch_and_dealt_sums_to_otlp():
    """The worker's export, as the engine runs it: both sums reach the OTLP metrics."""
    records = _Records()
    telemetry = GpuTelemetry(records, config=GpuTelemetryConfig(cupti=False, probe=False))
    telemetry._stop_worker()   # this thread exports in its place, once
    telemetry.histograms = DeviceCtaHistograms("cpu", 0, 4)
    telemetry.histograms.set_dispatch_deal(dispatch_deal_from([_flat([[3], [3, 2], [3, 2, 1], [3, 2, 1, 0]])], 4))
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
@pytest.mark.parametrize("grid", [64, 96, 128, 200, 264])
def test_on_the_gpu_a_launch_lands_as_the_learned_deal_says(grid):
    """On the idle GPU, a launch of ``grid`` CTAs puts as many CTAs on each SM as the deal
    says (which CTA goes first may differ from launch to launch)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sightline.instrumentation.dispatch_order import _dispatch_probe, learn_dispatch_deal
    from sightline.instrumentation.sm_probe import PROBE_HW, RECORD_WORDS
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    deal = learn_dispatch_deal(device, num_sms)
    assert deal is not None
    records = torch.full((grid * RECORD_WORDS,), -1, dtype=torch.int64, device=device)
    _dispatch_probe[(grid,)](records, 0, 20_000, PROBE=PROBE_HW)
    landed = records.view(grid, RECORD_WORDS)[:, 0].cpu().numpy()
    assert np.bincount(landed, minlength=num_sms).tolist() == deal.per_sm(grid).tolist()
