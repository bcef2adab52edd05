"""Windows module: exact merges, cumulative differences, batch recording, classic re-binning."""

from __future__ import annotations

import math

import numpy as np

from sightline.collector.windows import (ClassicHistogram, Exemplar, SlidingHistogram, WindowConfig,
                                         merge_all, subtract_cumulative)
from tests.collector.otlp_builders import exp_hist


def test_merge_all_equals_one_histogram_fed_everything():
    rng = np.random.default_rng(0)
    parts = [rng.lognormal(math.log(2e-5), 0.4, 500) for _ in range(5)]
    merged = merge_all([exp_hist(p) for p in parts], WindowConfig())
    whole = exp_hist(np.concatenate(parts))
    assert merged.count == whole.count and merged.zero_count == whole.zero_count
    assert np.array_equal(merged.counts[np.flatnonzero(merged.counts)], whole.counts[np.flatnonzero(whole.counts)])
    for q in (0.5, 0.99, 1.0):
        assert merged.quantile(q) == whole.quantile(q)


def test_subtract_cumulative_is_exact_and_detects_resets():
    first, more = [10e-6] * 100, [40e-6] * 50
    delta = subtract_cumulative(exp_hist(first + more), exp_hist(first))
    assert delta.count == 50 and delta.quantile(0.0) >= 39e-6
    assert subtract_cumulative(exp_hist(first), exp_hist(first + more)) is None  # counts went down: a reset


def test_record_many_leaves_the_state_record_leaves():
    wc = WindowConfig(slot_s=1.0, num_slots=4, flush_every=7)
    one, many = SlidingHistogram(wc), SlidingHistogram(wc)
    values = [float(v) for v in np.random.default_rng(1).lognormal(-10, 0.5, 40)]
    slowest = Exemplar(max(values), b"\x01" * 16, b"\x02" * 8)
    for v in values:
        one.record(v, 100.5, slowest if v == slowest.value else None)
    many.record_many(values, 100, slowest)
    a, b = one.window(101.0, 4.0), many.window(101.0, 4.0)
    assert (a.count, a.sum, a.quantile(0.99)) == (b.count, b.sum, b.quantile(0.99))
    assert one.exemplars() == many.exemplars() == [slowest]
    assert not one.record(1.0, 90.0)  # behind the ring: refused


def test_classic_histogram_counts_each_value_in_its_le_bucket():
    h = ClassicHistogram((1.0, 2.0, 5.0))
    for v in (0.5, 1.0, 1.5, 2.0, 4.0, 9.0):
        h.record(v)
    assert h.counts == [2, 2, 1, 1] and h.count == 6 and h.sum == 18.0
    copy = h.copy()
    copy.record(0.1)
    assert h.count == 6 and copy.count == 7
