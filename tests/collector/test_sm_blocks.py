"""Per-SM blocks: vectorised quantiles equal ExpHistogram's, merges exact, wide slots downscale."""

from __future__ import annotations

import math

import numpy as np

from sightline.collector.sm_blocks import SmBlock
from sightline.instrumentation import semconv as sc
from sightline.instrumentation.exphist import quantiles, relative_error
from tests.collector.otlp_builders import exp_hist


def test_block_quantiles_equal_one_histogram_per_sm():
    rng = np.random.default_rng(4)
    block = SmBlock(num_slots=6, detail_slots=3, scale=6, max_buckets=1024, bounds=sc.CTA_BUCKETS_S,
                    per_sm_classic=False)
    sent: dict[str, list] = {}
    for epoch in (10, 11):
        rows, hists = [], []
        for sm in range(12):
            values = rng.lognormal(math.log(20e-6 * (1 + sm / 10)), 0.3, 200)
            sent.setdefault(str(sm), []).extend(values)
            rows.append(block.row(str(sm)))
            hists.append(exp_hist(values, scale=8 if sm % 2 else 6))  # finer points are re-binned
        block.merge(epoch, rows, hists, [None] * len(rows))
    merged = block.histograms(10, 11)
    p99 = block.p99(10, 11)
    for sm, values in sent.items():
        whole = exp_hist(values)
        assert merged[sm].count == len(values) and merged[sm].quantile(0.99) == whole.quantile(0.99)
        assert p99[block.rows[sm]] == whole.quantile(0.99)
        exact = np.sort(values)[math.ceil(0.99 * len(values)) - 1]
        assert abs(p99[block.rows[sm]] - exact) / exact <= relative_error(6)
    assert block.classic.count == 2 * 12 * 200 and int(block.total.sum()) == 2 * 12 * 200


def test_quantiles_of_empty_and_zero_rows():
    counts = np.array([[0, 0], [0, 0], [1, 1]])
    got = quantiles(6, 0, counts, np.array([0, 5, 0]), np.array([np.inf, 0.0, 1.0]),
                    np.array([-np.inf, 0.0, 1.1]), 0.99)
    assert math.isnan(got[0]) and got[1] == 0.0 and 1.0 <= got[2] <= 1.1


def test_a_slot_wider_than_max_buckets_halves_the_resolution():
    block = SmBlock(num_slots=4, detail_slots=2, scale=6, max_buckets=64, bounds=sc.CTA_BUCKETS_S,
                    per_sm_classic=True)
    block.merge(1, [block.row("0")], [exp_hist([1e-6, 1e-3])], [None])  # 10 octaves: 640 buckets at scale 6
    assert block.scale <= 2 and block.histograms(1, 1)["0"].count == 2
    assert block.classic_sm.histogram(0).count == 2
