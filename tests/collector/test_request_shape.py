"""The compiled walk counts what a parse would build, exactly, and stops at the first cap."""

from __future__ import annotations

import numpy as np
import pytest

from sightline.collector.ingest import IngestError
from sightline.collector.request_shape import RequestLimits, RequestShape, request_shape
from tests.collector.random_requests import random_metrics as _metrics, random_traces as _traces




@pytest.mark.parametrize("seed", range(40))
def test_the_walk_counts_what_the_message_holds(seed):
    rng = np.random.default_rng(seed)
    for signal, build in (("traces", _traces), ("metrics", _metrics)):
        request, expected = build(rng)
        assert request_shape(request.SerializeToString(), signal) == expected


def test_the_walk_stops_at_the_first_cap_and_names_it():
    body = b"\x0a\x00" * 1_000
    assert request_shape(body, "traces") == RequestShape(1_000, 0, 0, 0, 0, 0)
    with pytest.raises(IngestError) as refused:
        request_shape(body, "traces", RequestLimits(max_resources=10))
    assert refused.value.status == 413 and "11 resources, more than the 10" in refused.value.message


@pytest.mark.parametrize("body", [b"\x0b\x00", b"\x0a\x05\x00", b"\x00\x00", b"\x0a"])
def test_bytes_that_are_not_a_request_are_400(body):
    with pytest.raises(IngestError) as refused:
        request_shape(body, "traces")
    assert refused.value.status == 400
