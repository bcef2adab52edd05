"""check_range: the one range check of every config, and its one error sentence."""

import math

import pytest

from sightline.instrumentation import check_range


def test_values_inside_pass_and_the_ends_follow_open_or_closed():
    check_range("x", 0, 0, 1)
    check_range("x", 1.0, 0, 1)
    check_range("x", 2**70, 1, integer=True)  # no upper bound by default
    check_range("x", math.inf, 0, lo_open=True)
    with pytest.raises(ValueError, match=r"^x=0 is not a number in \(0, 1\]$"):
        check_range("x", 0, 0, 1, lo_open=True)
    with pytest.raises(ValueError, match=r"^x=1 is not a number in \[0, 1\)$"):
        check_range("x", 1, 0, 1, hi_open=True)


def test_the_error_names_the_field_the_value_and_the_range():
    with pytest.raises(ValueError, match=r"^port=70000 is not an integer in \[0, 65535\]$"):
        check_range("port", 70000, 0, 65535, integer=True)
    with pytest.raises(ValueError, match=r"^speed=-1 is not a number in \[0, 1000\] \(0 = fastest\)$"):
        check_range("speed", -1, 0, 1000, hint="(0 = fastest)")


@pytest.mark.parametrize("value", [True, "3", None, 2.5, math.nan])
def test_non_numbers_booleans_fractions_and_nan_are_refused(value):
    with pytest.raises(ValueError, match="is not an integer in"):
        check_range("n", value, 0, 10, integer=True)
    if not isinstance(value, float) or math.isnan(value):
        with pytest.raises(ValueError, match="is not a number in"):
            check_range("n", value, 0, 10)
