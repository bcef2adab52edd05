"""Exponential histograms against exact answers on generated distributions."""

import math

import numpy as np
import pytest

from sightline.instrumentation.exphist import ExpHistogram, bucket_indices, relative_error

RNG = np.random.default_rng(7)
DISTRIBUTIONS = {
    "lognormal": lambda n: RNG.lognormal(mean=-9, sigma=1.0, size=n),
    "bimodal": lambda n: np.concatenate([RNG.normal(20e-6, 2e-6, n // 2).clip(1e-7),
                                         RNG.normal(200e-6, 10e-6, n - n // 2).clip(1e-7)]),
    "pareto": lambda n: (RNG.pareto(1.5, n) + 1) * 1e-5,
    "uniform": lambda n: RNG.uniform(1e-6, 1e-3, n),
    "constant": lambda n: np.full(n, 3.3e-5),
}


def exact_quantile(values: np.ndarray, q: float) -> float:
    ordered = np.sort(values)
    return float(ordered[max(1, math.ceil(q * len(ordered))) - 1])


def test_mapping_matches_bucket_definition():
    for scale in (-2, 0, 3, 6, 8):
        values = np.concatenate([RNG.lognormal(0, 4, 2000), 2.0 ** np.arange(-20, 20)])
        idx = bucket_indices(values, scale)
        base = 2.0 ** (2.0 ** -scale)
        lower, upper = base ** idx.astype(float), base ** (idx + 1).astype(float)
        assert np.all(values > lower * (1 - 1e-12)) and np.all(values <= upper * (1 + 1e-12))


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("q", [0.5, 0.9, 0.99, 0.999])
def test_quantiles_within_stated_error(name, q):
    values = DISTRIBUTIONS[name](20_000)
    hist = ExpHistogram()
    for chunk in np.array_split(values, 7):
        hist.record(chunk)
    assert hist.count == values.size
    bound = relative_error(hist.scale)
    assert bound <= 0.01
    exact = exact_quantile(values, q)
    assert abs(hist.quantile(q) - exact) <= bound * exact * (1 + 1e-9)


def test_merge_equals_recording_everything():
    a_vals, b_vals = RNG.lognormal(-8, 1, 5000), RNG.lognormal(-6, 2, 5000)
    a, b, whole = ExpHistogram(scale=8), ExpHistogram(scale=5), ExpHistogram(scale=8)
    a.record(a_vals)
    b.record(b_vals)
    whole.record(np.concatenate([a_vals, b_vals]))
    a.merge(b)
    assert a.count == whole.count == 10_000
    assert a.scale == min(whole.scale, 5)
    for q in (0.5, 0.99):
        exact = exact_quantile(np.concatenate([a_vals, b_vals]), q)
        assert abs(a.quantile(q) - exact) <= relative_error(a.scale) * exact


def test_downscales_when_range_exceeds_max_buckets():
    hist = ExpHistogram(scale=8, max_buckets=160)
    hist.record([1e-6, 1.0])
    assert hist.counts.size <= 160
    assert hist.counts.sum() == 2
    assert hist.scale < 8


def test_zero_and_bad_quantile():
    hist = ExpHistogram()
    hist.record([0.0, 0.0, 1e-3])
    assert hist.quantile(0.5) == 0.0
    with pytest.raises(ValueError, match="q=1.5"):
        hist.quantile(1.5)
