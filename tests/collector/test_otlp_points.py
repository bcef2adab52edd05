"""Reading OTLP values and CTA points: exact values, bounded labels, refusals by reason."""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from sightline.collector.otlp_points import (MAX_LABEL_CHARS, PointRefused, any_value, clamped_time_s,
                                             cta_point_histogram, label, num, resource_instance)
from sightline.instrumentation import semconv as sc
from tests.collector.otlp_builders import T0_S, otlp_attrs, otlp_cta_point


def test_any_value_num_and_label():
    nested = AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="a", value=AnyValue(int_value=3))]))
    array = AnyValue(array_value=ArrayValue(values=[AnyValue(string_value="x"), AnyValue(double_value=1.5)]))
    assert any_value(nested) == {"a": 3} and any_value(array) == ["x", 1.5]
    assert any_value(AnyValue(bytes_value=b"\x01\xff")) == "01ff" and any_value(AnyValue()) is None
    assert num(AnyValue(string_value="2.5")) == 2.5 and num(AnyValue(string_value="x")) is None
    assert label(AnyValue(int_value=7)) == "7" and label(AnyValue(double_value=3.0)) == "3"
    assert label(AnyValue(string_value="k" * 1000)) == "k" * MAX_LABEL_CHARS


def test_resource_instance_prefers_service_instance_id_then_host_name():
    both = Resource(attributes=otlp_attrs({sc.RESOURCE_HOST_NAME: "h", sc.RESOURCE_SERVICE_INSTANCE_ID: "i"}))
    assert resource_instance(both) == "i"
    assert resource_instance(Resource(attributes=otlp_attrs({sc.RESOURCE_HOST_NAME: "h"}))) == "h"
    assert resource_instance(Resource()) == "unknown"


def test_clamped_time():
    assert clamped_time_s(int((T0_S + 5) * 1e9), T0_S) == T0_S  # ahead of our clock
    assert clamped_time_s(0, T0_S) == T0_S
    assert clamped_time_s(int((T0_S - 5) * 1e9), T0_S) == pytest.approx(T0_S - 5)


def test_cta_point_histogram_adopts_buckets_and_refuses_by_reason():
    values = np.array([10e-6, 20e-6, 20e-6, 40e-6])
    point = otlp_cta_point(0, 1, "k", values, T0_S, scale=6)
    h = cta_point_histogram(point, 1024)
    assert (h.count, h.scale, h.offset, h.min, h.max) == (4, 6, point.positive.offset, 10e-6, 40e-6)
    assert h.counts.tolist() == list(point.positive.bucket_counts)
    for mutate, reason in ((lambda p: setattr(p, "scale", 30), "bad_scale"),
                           (lambda p: setattr(p, "count", 5), "inconsistent_count"),
                           (lambda p: setattr(p.positive, "offset", -10_000), "out_of_range"),
                           (lambda p: p.positive.bucket_counts.extend([0] * 20_000), "too_many_buckets")):
        bad = otlp_cta_point(0, 1, "k", values, T0_S, scale=6)
        mutate(bad)
        with pytest.raises(PointRefused) as refused:
            cta_point_histogram(bad, 1024)
        assert refused.value.reason == reason
