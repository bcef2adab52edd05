"""Counting: every reason on /metrics from the start, and one meaning of "acknowledged".

A real collector on free ports is scraped before anything arrives: every drop and refusal
reason the code can produce is there at 0 (a rate() over a series that appears late misses
its first increment). The reasons are read from the collector's own source, so a new one
added without its series fails here.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import sightline.collector as collector_package
from sightline.collector.aggregation_config import AggregationConfig
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import otlp_cta_point, otlp_metrics
from tests.collector.servers import post, running_collector

_REASON_CALLS = re.compile(r'(?:_drop\(|_count\(drops, |PointRefused\(|_drop_span\()\s*"([a-z_]+)"')


def _reasons_in_code() -> set[str]:
    found = set()
    for path in Path(collector_package.__file__).parent.glob("*.py"):
        found |= set(_REASON_CALLS.findall(path.read_text()))
    return found


def test_every_drop_reason_is_on_metrics_at_zero_from_the_start():
    reasons = _reasons_in_code()
    assert {"bad_exemplar", "bad_sum", "count_overflow", "unknown_metric", "malformed_span"} <= reasons
    with running_collector() as col:
        metrics = col.metrics()
    shown = {dict(labels)["reason"]: value for (name, labels), value in metrics.items()
             if name == sc.COLLECTOR_AGGREGATOR_DROPPED_TOTAL + "_total"}
    assert reasons - set(shown) == set()
    assert set(shown.values()) == {0.0}
    families = {dict(labels)["family"] for (name, labels), _ in metrics.items()
                if name == sc.COLLECTOR_SERIES_OVERFLOW_TOTAL + "_total"}
    assert families == {"request", "step", "kernel", "sm_cta", "tp"}
    evicted = {dict(labels)["family"]: value for (name, labels), value in metrics.items()
               if name == sc.COLLECTOR_SERIES_EVICTED_TOTAL + "_total"}
    assert evicted == {"request": 0, "kernel": 0, "sm_cta": 0}


def test_series_overflow_counts_every_refused_point_like_the_drops():
    """Before: the sm_cta overflow counted distinct refused series while it remembered them,
    and stopped at 100,000 while the drops went on to 979,744."""
    now = time.time()
    with running_collector(aggregation=AggregationConfig(max_sm_series=10)) as col:
        body = otlp_metrics([otlp_cta_point("0", str(sm), "k", [1e-5], now) for sm in range(40)]).SerializeToString()
        for _ in range(3):  # the same 30 refused series, three times over
            assert post(col.http_url + "/v1/metrics", body, {"Content-Type": "application/x-protobuf"})[0] == 200
        col.idle()
        metrics = col.metrics()
    overflow = metrics[(sc.COLLECTOR_SERIES_OVERFLOW_TOTAL + "_total", (("family", "sm_cta"),))]
    dropped = metrics[(sc.COLLECTOR_AGGREGATOR_DROPPED_TOTAL + "_total", (("reason", "sm_series_limit"),))]
    assert overflow == dropped == 90
