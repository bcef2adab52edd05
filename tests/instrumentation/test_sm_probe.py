"""SM probe host side against exact answers on synthetic CTA records; the real probe on a GPU."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sightline.instrumentation import semconv
from sightline.instrumentation.exphist import ExpHistogram
from sightline.instrumentation.cta_metrics import build_cta_metrics
from sightline.instrumentation.gpu_telemetry import TailPolicy
from sightline.instrumentation.sm_probe import (CtaBatch, CtaHistograms, LaunchFacts, launch_facts,
                                                launch_facts_of_records)


def _synthetic(seed: int, launches: list[tuple[str, int]], num_sms: int = 132, idle_every=0):
    rng = np.random.default_rng(seed)
    n = sum(c for _, c in launches)
    sm = rng.integers(0, num_sms, n)
    start = rng.integers(10**12, 10**12 + 10**6, n)
    dur = rng.integers(32, 10**6, n)
    records = np.stack([sm, start, start + dur], axis=1).astype(np.int64)
    if idle_every:
        records[::idle_every] = (-1, 0, 0)
    return records


def _facts_by_loop(records, launches):
    """The obvious per-CTA Python loop: the oracle for the vectorized reduction."""
    out, i = [], 0
    for name, n in launches:
        rows = [r for r in records[i:i + n] if r[0] >= 0]
        i += n
        durs = [r[2] - r[1] for r in rows]
        per_sm: dict[int, int] = {}
        for r in rows:
            per_sm[r[0]] = per_sm.get(r[0], 0) + 1
        order = sorted(range(len(rows)), key=lambda j: durs[j])
        slow = order[-1]
        med = durs[order[(len(rows) - 1) // 2]]
        out.append(dict(kernel_name=name, ctas=len(rows), sms_used=len(per_sm),
                        waves=max(per_sm.values()), max_cta_s=durs[slow] * 1e-9,
                        median_cta_s=med * 1e-9, start_ns=min(r[1] for r in rows),
                        end_ns=max(r[2] for r in rows), slowest_dur=durs[slow]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_launch_facts_match_a_per_cta_loop(seed):
    launches = [("sightline_fa2_prefill", 4096), ("gemm", 77), ("sightline_paged_decode", 1024)]
    records = _synthetic(seed, launches, idle_every=7 if seed % 2 else 0)
    batch = CtaBatch.from_records(records, launches, gpu_id=3)
    facts = launch_facts(batch)
    expect = _facts_by_loop(records, launches)
    assert batch.idle_ctas == (int((records[:, 0] < 0).sum()))
    for f, e in zip(facts, expect):
        assert f.kernel_name == e["kernel_name"] and f.ctas == e["ctas"]
        assert f.sms_used == e["sms_used"] and f.waves == e["waves"]
        assert f.start_ns == e["start_ns"] and f.end_ns == e["end_ns"]
        assert f.max_cta_s == pytest.approx(e["max_cta_s"], rel=1e-12)
        assert f.median_cta_s == pytest.approx(e["median_cta_s"], rel=1e-12)
        assert f.cta_spread == pytest.approx(e["max_cta_s"] / e["median_cta_s"], rel=1e-12)
        # the slowest SM ran a CTA of exactly the maximum duration
        li = batch.launch_names.index(f.kernel_name)
        mine = batch.launch_index == li
        durs = (batch.end_ns - batch.start_ns)[mine]
        assert e["slowest_dur"] in durs[batch.sm_id[mine] == f.slowest_sm]


@pytest.mark.parametrize("seed", range(3))
def test_launch_facts_of_raw_records_match_the_batch_s(seed):
    """The reduction a traced step gets where its records lie (idle CTAs still in them, a
    launch whose CTAs all exited without work) equals the host batch's."""
    import torch

    launches = [("sightline_fa2_prefill", 512), ("gemm", 5), ("sightline_paged_decode", 300)]
    records = _synthetic(seed, launches, idle_every=3)
    records[512:517, 0] = -1   # every CTA of "gemm" idle
    facts = launch_facts_of_records(torch.from_numpy(records.reshape(-1).copy()), launches)
    assert facts == launch_facts(CtaBatch.from_records(records, launches))
    assert facts[1] == LaunchFacts("gemm", 0, 0, 0, -1, 0.0, 0.0, 0.0, 0, 0)
    assert facts[0].ctas == 512 - len(range(0, 512, 3)) and facts[2].ctas > 0
    idle = np.full_like(records, -1)
    assert [f.ctas for f in launch_facts_of_records(torch.from_numpy(idle.reshape(-1).copy()), launches)] == [0] * 3


@pytest.mark.parametrize("seed", range(4))
def test_raw_records_with_empty_launches_and_idle_ctas_match_the_loop(seed):
    """Launches with no CTAs first and between others, idle CTAs everywhere: the reduction,
    which reads back nothing but its table, equals the per-CTA loop launch by launch."""
    import torch

    launches = [("empty", 0), ("sightline_fa2_prefill", 700), ("none", 0), ("gemm", 3),
                ("sightline_paged_decode", 250)]
    records = _synthetic(seed, launches, idle_every=2 + seed)
    facts = launch_facts_of_records(torch.from_numpy(records.reshape(-1).copy()), launches)
    assert [f.kernel_name for f in facts] == [name for name, _ in launches]
    assert facts[0] == LaunchFacts("empty", 0, 0, 0, -1, 0.0, 0.0, 0.0, 0, 0) and facts[2].ctas == 0
    ran = [(name, n) for name, n in launches if n]
    for f, e in zip([f for f in facts if f.kernel_name in dict(ran)], _facts_by_loop(records, ran)):
        if not e["ctas"]:
            assert f.ctas == 0
            continue
        assert (f.ctas, f.sms_used, f.waves, f.start_ns, f.end_ns) == (
            e["ctas"], e["sms_used"], e["waves"], e["start_ns"], e["end_ns"])
        assert f.max_cta_s == pytest.approx(e["max_cta_s"], rel=1e-12)
        assert f.median_cta_s == pytest.approx(e["median_cta_s"], rel=1e-12)


def test_launch_facts_small_exact():
    # two launches; durations 10,20,30 on SMs 5,5,9 and 7 on SM 1
    records = np.array([[5, 100, 110], [5, 110, 130], [9, 100, 130], [1, 200, 207]])
    batch = CtaBatch.from_records(records, [("a", 3), ("b", 1)])
    a, b = launch_facts(batch)
    assert (a.ctas, a.sms_used, a.waves, a.slowest_sm) == (3, 2, 2, 9)
    assert a.median_cta_s == pytest.approx(20e-9) and a.max_cta_s == pytest.approx(30e-9)
    assert a.cta_spread == pytest.approx(1.5) and (a.start_ns, a.end_ns) == (100, 130)
    assert (b.ctas, b.sms_used, b.waves, b.slowest_sm, b.cta_spread) == (1, 1, 1, 1, 1.0)


def test_record_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 records for launches totalling 4"):
        CtaBatch.from_records(np.zeros((3, 3)), [("a", 4)])


@pytest.mark.parametrize("seed,reduce_every", [(0, 1 << 21), (1, 1 << 21), (2, 1000), (3, 1)])
def test_cta_histograms_equal_per_group_histograms_and_exemplars(seed, reduce_every):
    launches = [("k1", 3000), ("k2", 500), ("k1", 1200)]
    records = _synthetic(seed, launches, num_sms=16)
    hists = CtaHistograms(reduce_every_ctas=reduce_every)
    batch = CtaBatch.from_records(records, launches, gpu_id=1, trace_id=11, span_id=22)
    assert hists.add(batch, time_unix_nano=5) == 4700
    # second step: a different span; only its own slower CTAs may take exemplars
    records2 = _synthetic(seed + 100, launches, num_sms=16)
    batch2 = CtaBatch.from_records(records2, launches, gpu_id=1, trace_id=33, span_id=44)
    hists.add(batch2, time_unix_nano=6)
    names = np.array([n for n, c in launches for _ in range(c)])
    snap = hists.snapshot()
    both = np.concatenate([records, records2])
    both_names = np.concatenate([names, names])
    for (gpu, sm, kernel), h in snap.items():
        assert gpu == 1
        sel = (both[:, 0] == sm) & (both_names == kernel)
        ref = ExpHistogram(scale=h.scale)
        ref.record((both[sel, 2] - both[sel, 1]) * 1e-9)
        assert h.count == ref.count and h.offset == ref.offset
        assert np.array_equal(h.counts, ref.counts)
        assert h.max == pytest.approx(ref.max) and h.sum == pytest.approx(ref.sum)
    assert sum(h.count for h in snap.values()) == 9400
    hs, exemplars = hists.take()
    assert hists.snapshot() == {} and len(hs) == len(snap)
    for (gpu, sm, kernel), ex in exemplars.items():
        s1 = (records[:, 0] == sm) & (names == kernel)
        s2 = (records2[:, 0] == sm) & (names == kernel)
        m1 = (records[s1, 2] - records[s1, 1]).max(initial=0) * 1e-9
        m2 = (records2[s2, 2] - records2[s2, 1]).max(initial=0) * 1e-9
        assert ex.value_s == pytest.approx(max(m1, m2))
        assert (ex.trace_id, ex.span_id) == ((11, 22) if m1 >= m2 else (33, 44))


def test_cta_metrics_encode_to_otlp_with_exemplars():
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.resources import Resource

    records = np.array([[4, 0, 1000], [4, 0, 3000], [7, 0, 2000]])
    hists = CtaHistograms()
    hists.add(CtaBatch.from_records(records, [("k", 3)], gpu_id=0, trace_id=0xAB, span_id=0xCD),
              time_unix_nano=99)
    h, ex = hists.take()
    req = encode_metrics(build_cta_metrics(h, ex, 10, 20, Resource.create({"a": "b"})))
    metric = req.resource_metrics[0].scope_metrics[0].metrics[0]
    assert metric.name == semconv.METRIC_CTA_DURATION and metric.unit == "s"
    points = metric.exponential_histogram.data_points
    assert metric.exponential_histogram.aggregation_temporality == 1  # DELTA
    by_sm = {}
    for p in points:
        attrs = {kv.key: kv.value for kv in p.attributes}
        by_sm[attrs[semconv.ATTR_SM_ID].int_value] = p
        assert attrs[semconv.ATTR_KERNEL_NAME].string_value == "k"
        assert (p.start_time_unix_nano, p.time_unix_nano) == (10, 20)
    assert sorted(by_sm) == [4, 7]
    p4 = by_sm[4]
    assert p4.count == 2 and p4.sum == pytest.approx(4e-6) and p4.max == pytest.approx(3e-6)
    assert sum(p4.positive.bucket_counts) == 2
    assert len(p4.exemplars) == 1 and p4.exemplars[0].as_double == pytest.approx(3e-6)
    assert p4.exemplars[0].trace_id == (0xAB).to_bytes(16, "big")
    assert p4.exemplars[0].span_id == (0xCD).to_bytes(8, "big")
    assert len(req.resource_metrics[0].scope_metrics[0].metrics) == 1  # no launch mix: no wide sum
    req = encode_metrics(build_cta_metrics(h, ex, 10, 20, Resource.create({"a": "b"}),
                                           {(0, "k"): (0, 3), (0, "j"): (512, 640)}, 132))
    wide = req.resource_metrics[0].scope_metrics[0].metrics[1]
    assert wide.name == semconv.METRIC_CTA_WIDE and wide.sum.aggregation_temporality == 1
    got = {}
    for p in wide.sum.data_points:
        attrs = {kv.key: kv.value for kv in p.attributes}
        assert attrs[semconv.ATTR_GPU_SM_COUNT].int_value == 132 and p.time_unix_nano == 20
        got[attrs[semconv.ATTR_KERNEL_NAME].string_value] = p.as_int
    assert got == {"j": 512, "k": 0}


def test_tail_policy_flags_every_step_above_recent_p99():
    policy = TailPolicy(ratio=0.0, quantile=0.99, window=100, min_steps=50,
                        rng=random.Random(0))
    assert [policy.is_tail(0.010) for _ in range(49)] == [False] * 49   # too few steps
    assert policy.is_tail(0.5) is False         # 50th step: still no threshold before it
    for i in range(100):
        policy.is_tail(0.010 + (i % 10) * 1e-4)  # window now 100 steps in 10.0..10.9 ms
    assert policy.threshold() == pytest.approx(0.0109)
    assert policy.is_tail(0.0109) is False      # equal to P99 is not slower
    assert policy.is_tail(0.0111) is True


@pytest.mark.parametrize("quantile", [0.5, 0.9, 0.99, 0.999, 1.0])
def test_tail_threshold_is_numpys_higher_quantile(quantile):
    rng = np.random.default_rng(3)
    for n in (64, 100, 1000, 1024):
        policy = TailPolicy(0.0, quantile, window=n, min_steps=n, rng=random.Random(0))
        values = rng.lognormal(-5, 1, n)
        for v in values:
            policy._recent.append(float(v))
        assert policy.threshold() == np.quantile(values, quantile, method="higher")


def test_tail_policy_samples_the_configured_fraction():
    """Gaps between sampled steps are geometric: the fraction is the ratio, and the gaps
    have the mean and spread of independent per-step draws (mean 1/p, variance (1-p)/p**2)."""
    policy = TailPolicy(ratio=0.25, quantile=1.0, window=16, min_steps=16,
                        rng=random.Random(7))
    gaps = [policy.next_sample_gap() for _ in range(20000)]
    assert min(gaps) == 1
    assert abs(len(gaps) / sum(gaps) - 0.25) < 0.01
    mean = sum(gaps) / len(gaps)
    variance = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert abs(variance - 0.75 / 0.25 ** 2) < 0.6
    assert abs(sum(g == 1 for g in gaps) / len(gaps) - 0.25) < 0.015   # P(next step) = p
    assert TailPolicy(1.0, 0.99, 16, 16, random.Random(1)).next_sample_gap() == 1
    assert TailPolicy(0.0, 0.99, 16, 16, random.Random(1)).next_sample_gap() > 10**15


@pytest.mark.gpu
def test_real_probe_on_gpu_records_every_cta():
    import torch

    from sightline.engine.kernels.prefill_attention import prefill_attention_triton
    from sightline.instrumentation.sm_probe import SmProbe

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    lens = [1000, 37, 2048]
    t = sum(lens)
    q = torch.randn(t, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, 1000, 1037, 3085], dtype=torch.int32, device="cuda")
    probe = SmProbe("cuda", capacity_ctas=1 << 16)
    cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    prefill_attention_triton(q, k, v, cu, cu, 2048, 2048, 0.088, probe=probe, config=cfg)
    batch = probe.end_step(1, 2).wait()
    # grid 16 m-tiles x 32 heads x 3 seqs; active tiles: 8 + 1 + 16 per head
    assert batch.launch_ctas.tolist() == [25 * 32] and batch.idle_ctas == (48 - 25) * 32
    assert batch.sm_id.min() >= 0 and batch.sm_id.max() < num_sms
    assert (batch.end_ns > batch.start_ns).all()
    facts = launch_facts(batch)[0]
    assert facts.sms_used == num_sms and facts.cta_spread >= 1.0


@pytest.mark.parametrize("seed,batched", [(0, False), (1, False), (2, False), (0, True),
                                         (1, True)])
def test_device_histograms_equal_the_numpy_reduction(seed, batched):
    """The torch (on-device) reduction, run here on CPU tensors, against the numpy one."""
    import torch

    from sightline.instrumentation.sm_histograms import DeviceCtaHistograms, torch_bucket_indices
    from sightline.instrumentation.exphist import bucket_indices

    vals = np.concatenate([np.random.default_rng(seed).random(1000) * 1e-3, [2.0**-20, 0.5, 1e-9]])
    assert np.array_equal(torch_bucket_indices(torch.from_numpy(vals), 6).numpy(),
                          bucket_indices(vals, 6))
    launches = [("k1", 3000), ("k2", 500), ("k1", 1200)]
    steps = [(_synthetic(seed + 10 * i, launches, num_sms=16, idle_every=5 if i else 0), i + 1)
             for i in range(3)]
    steps[0][0][3, 2] = steps[0][0][3, 1]          # one zero-length CTA
    dev = DeviceCtaHistograms("cpu", gpu_id=2, num_sms=16, scale=6)
    ref = CtaHistograms(scale=6)
    if batched:                                     # one reduction for all three steps
        dev.add_steps([(torch.from_numpy(records.reshape(-1).copy()), launches, tag * 100, tag,
                        tag) for records, tag in steps])
    for records, tag in steps:
        if not batched:
            dev.add(torch.from_numpy(records.reshape(-1).copy()), launches, trace_id=tag * 100,
                    span_id=tag, time_unix_nano=tag)
        ref.add(CtaBatch.from_records(records, launches, gpu_id=2, trace_id=tag * 100,
                                      span_id=tag), time_unix_nano=tag)
    got, got_ex = dev.take()
    want, want_ex = ref.take()
    assert set(got) == set(want) and len(got) == 32
    for key, h in want.items():
        g = got[key]
        assert (g.scale, g.offset, g.count, g.zero_count) == (h.scale, h.offset, h.count, h.zero_count)
        assert np.array_equal(g.counts, h.counts)
        assert g.sum == pytest.approx(h.sum) and g.min == h.min and g.max == h.max
        assert got_ex[key] == want_ex[key]
    assert dev.take() == ({}, {})                   # delta: nothing since the last take
    # per kernel, 3 steps: k1's launches of 3000 and 1200 CTAs are both >= 2 x 16 SMs (wide), so
    # is k2's of 500; the counts are of the CTAs that ran (idle ones are not in the histograms)
    ran = {"k1": 0, "k2": 0}
    for records, _ in steps:
        at = 0
        for name, c in launches:
            ran[name] += int((records[at:at + c, 0] >= 0).sum())
            at += c
    assert ran["k1"] < 3 * 4200   # steps 2 and 3 have idle CTAs
    assert dev.take_launch_mix() == {(2, "k1"): (ran["k1"], ran["k1"]), (2, "k2"): (ran["k2"], ran["k2"])}
    assert dev.take_launch_mix() == {}
    narrow = DeviceCtaHistograms("cpu", gpu_id=0, num_sms=132, scale=6)
    records, _ = steps[0]
    narrow.add(torch.from_numpy(records.reshape(-1).copy()), launches, 1, 1, 1)
    # on 132 SMs: 3000 >= 264 is wide, 500 and 1200 too; a 128-CTA launch would not be
    assert narrow.take_launch_mix() == {(0, "k1"): (4200, 4200), (0, "k2"): (500, 500)}
    small = [("k1", 128), ("k1", 300)]
    narrow.add(torch.from_numpy(_synthetic(7, small, num_sms=132).reshape(-1).copy()), small, 1, 1, 1)
    assert narrow.take_launch_mix() == {(0, "k1"): (300, 428)}


def test_tail_policy_refreshing_its_quantile_every_k_steps_still_flags_outliers():
    policy = TailPolicy(ratio=0.0, quantile=0.99, window=100, min_steps=50,
                        rng=random.Random(0), refresh_steps=16)
    flags = [policy.is_tail(0.010 + (i % 10) * 1e-4) for i in range(200)]
    assert not any(flags)
    assert policy.is_tail(0.5) is True          # a stale (<= 16 steps old) P99 still applies


def test_tail_policy_skipping_unneeded_refreshes_flags_exactly_what_refreshing_always_would():
    """The threshold is recomputed only when a value at or above it entered or left the
    window; a policy that recomputes at every refresh must flag the same steps."""
    class Always(TailPolicy):
        def _may_move(self, entering, leaving):
            return True

    rng = np.random.default_rng(3)
    for window, quantile in ((64, 0.9), (256, 0.99), (1024, 0.999)):
        durations = rng.lognormal(-5, 0.3, 6000)
        durations[rng.integers(0, 6000, 40)] *= 20          # outliers that enter and leave
        durations[2000:2300] = durations[1999]              # ties at the threshold
        fast = TailPolicy(0.0, quantile, window, 32, random.Random(0), refresh_steps=16)
        slow = Always(0.0, quantile, window, 32, random.Random(0), refresh_steps=16)
        assert [fast.is_tail(d) for d in durations] == [slow.is_tail(d) for d in durations]
