"""Per-SM classic histograms in arrays answer exactly as one ClassicHistogram per SM, and add
no object per SM for the cycle collector to walk."""

from __future__ import annotations

import gc

import numpy as np

from sightline.collector.classic_rows import ClassicRows
from sightline.collector.sm_blocks import SmBlock
from sightline.collector.windows import ClassicHistogram, Exemplar
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import exp_hist


def test_rows_equal_one_classic_histogram_per_row():
    rng = np.random.default_rng(5)
    rows, singles = ClassicRows(sc.CTA_BUCKETS_S, 3), [ClassicHistogram(sc.CTA_BUCKETS_S) for _ in range(3)]
    for i in range(40):
        row = int(rng.integers(3))
        hist = exp_hist(list(10 ** rng.uniform(-6.5, -1.5, size=int(rng.integers(1, 50)))) + [0.0] * (i % 3))
        exemplar = Exemplar(float(rng.uniform(1e-5, 1e-2)), bytes([i]) * 16, bytes([i]) * 8, 1_000 + i) \
            if i % 4 == 0 else None
        rows.add_exp(row, hist, exemplar)
        singles[row].add_exp(hist, exemplar)
    rows.resize(5)
    for row, single in enumerate(singles):
        got = rows.histogram(row)
        assert (got.counts, got.count, got.exemplars) == (single.counts, single.count, single.exemplars)
        assert got.sum == single.sum
    assert rows.histogram(4).counts == [0] * (len(sc.CTA_BUCKETS_S) + 1)
    copy = rows.copy()
    rows.add_exp(0, exp_hist([1e-4]))
    assert copy.histogram(0).counts == singles[0].counts  # a copy, not a view
    assert [ex is not None for ex in rows.row_exemplars(5)] == [any(s.exemplars) for s in singles] + [False] * 2


def test_per_sm_histograms_add_no_object_per_sm():
    block = SmBlock(num_slots=4, detail_slots=2, scale=6, max_buckets=160, bounds=sc.CTA_BUCKETS_S,
                    per_sm_classic=True)
    gc.collect()
    before = len(gc.get_objects())
    rows = [block.row(str(sm)) for sm in range(1_000)]
    block.merge(1, rows, [exp_hist([1e-4, 2e-4])] * len(rows), [None] * len(rows))
    snapshot = block.classic_sm.copy()
    gc.collect()
    assert len(gc.get_objects()) - before < 100  # was 3 per SM (a histogram and two lists)
    assert [snapshot.histogram(r).count for r in (0, 999)] == [2, 2]
