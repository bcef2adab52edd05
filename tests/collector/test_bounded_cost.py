"""Work in proportion to the bytes: every export request's cost is bounded before it is done.

Real collectors on free ports take hostile bodies through their real receivers (HTTP via
urllib and aiohttp clients, gRPC through grpcio): millions of empty messages, compression
bombs of every ratio, JSON of empty containers, SM ids by the hundred thousand. Each is
refused with its protocol's error before it is parsed (or costs in proportion to its
size), is counted by reason on /metrics, and /healthz keeps answering meanwhile.
"""

from __future__ import annotations

import time

from sightline.collector.sm_blocks import SmBlock
from tests.collector.otlp_builders import otlp_cta_point, otlp_metrics
from tests.collector.servers import post, running_collector

PB = {"Content-Type": "application/x-protobuf"}


def test_many_sm_ids_grow_a_block_geometrically(monkeypatch):
    """100,000 SM ids on one GPU made each batch 14x slower than the first: the rows grew 16
    at a time, each growth copying the whole block, and every merge touched every row."""
    grows = []
    real_grow = SmBlock._grow
    monkeypatch.setattr(SmBlock, "_grow", lambda self, cap: (grows.append(cap), real_grow(self, cap)))
    bincount_sizes = []
    import numpy as np
    real_bincount = np.bincount

    def bincount(*args, **kwargs):
        out = real_bincount(*args, **kwargs)
        bincount_sizes.append(out.size)
        return out

    monkeypatch.setattr(np, "bincount", bincount)
    now = time.time()
    with running_collector() as col:
        for batch in range(20):
            points = [otlp_cta_point("0", str(batch * 500 + sm), "k", [1e-5, 2e-5], now) for sm in range(500)]
            status, _, _ = post(col.http_url + "/v1/metrics", otlp_metrics(points).SerializeToString(), PB)
            assert status == 200
        col.idle()
        block = col.collector.aggregator.sm._gpus[next(iter(col.collector.aggregator.sm._gpus))].blocks["k"]
        assert len(block.sms) == 10_000
    # before: 625 growths (16 rows each); geometric: ~17
    assert len(grows) <= 25, len(grows)
    # each merge adds the buckets of the 500 rows it touches, not of all rows so far
    assert max(bincount_sizes) <= 500 * 128, max(bincount_sizes)
