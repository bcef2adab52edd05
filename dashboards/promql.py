"""PromQL built from the names in ``semconv``, for the dashboards and the alert rules.

Every expression Sightline ships is composed here from ``semconv`` constants, so a
metric rename is one edit in ``semconv`` and a typo is an ``AttributeError`` at build
time instead of an empty panel or an alert that can never fire. The helpers only
format strings: they cost nothing at run time and check nothing about the server.

Conventions of the Prometheus client libraries that the names in ``semconv`` leave
implicit, and that these helpers add: a counter is exposed as ``<name>_total``, a
histogram as ``<name>_bucket`` (cumulative, label ``le``), ``<name>_count`` and
``<name>_sum``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ..instrumentation import check_range, semconv

__all__ = [
    "BUCKET_LABEL",
    "counter",
    "bucket",
    "count",
    "total_sum",
    "selector",
    "rate",
    "aggregate",
    "sum_by",
    "histogram_quantile",
    "mean",
    "with_exemplars_of",
    "le_value",
    "series_names",
    "known_metric_names",
    "is_known_metric",
    "known_label_names",
]

BUCKET_LABEL = "le"


def counter(name: str) -> str:
    """The exposed name of counter ``name`` (the client libraries append ``_total``)."""
    return f"{name}_total"


def bucket(name: str) -> str:
    """The cumulative-bucket series of histogram ``name``."""
    return f"{name}_bucket"


def count(name: str) -> str:
    """The observation-count series of histogram ``name``."""
    return f"{name}_count"


def total_sum(name: str) -> str:
    """The sum-of-observations series of histogram ``name``."""
    return f"{name}_sum"


def le_value(bound: float) -> str:
    """``bound`` written the way the Prometheus Python client writes an ``le`` label.

    The client uses Go's float formatting: ``1.0`` stays ``"1.0"``, ``1e-06`` is
    ``"1e-06"``; a matcher with another spelling selects nothing, so the client's own
    formatter is used rather than a copy of it.
    """
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


def selector(metric: str, matchers: Mapping[str, str] | None = None, regex: Iterable[str] = ()) -> str:
    """``metric{label="value",...,label=~"$label"}``.

    ``matchers`` are exact (``=``); each name in ``regex`` becomes ``label=~"$label"``
    so that a Grafana template variable (multi-value, "All" = ``.*``) selects it.
    """
    parts = [f'{key}="{value}"' for key, value in (matchers or {}).items()]
    parts += [f'{label}=~"${label}"' for label in regex]
    return f"{metric}{{{','.join(parts)}}}" if parts else metric


def rate(series: str, window: str = "$__rate_interval") -> str:
    """``rate(series[window])``; ``window`` defaults to Grafana's rate interval."""
    return f"rate({series}[{window}])"


def aggregate(op: str, labels: Iterable[str], expr: str, parameter: float | None = None) -> str:
    """``op by (labels) ([parameter, ] expr)``, e.g. ``max by (sm) (x)`` or
    ``quantile by (gpu) (0.5, x)``; no labels aggregates everything."""
    labels = list(labels)
    argument = expr if parameter is None else f"{parameter:g}, {expr}"
    grouping = f" by ({', '.join(labels)})" if labels else ""
    return f"{op}{grouping} ({argument})"


def sum_by(labels: Iterable[str], expr: str) -> str:
    """``sum by (labels) (expr)``; no labels gives a plain ``sum``."""
    return aggregate("sum", labels, expr)


def histogram_quantile(
    quantile: float,
    histogram: str,
    by: Iterable[str] = (),
    *,
    matchers: Mapping[str, str] | None = None,
    regex: Iterable[str] = (),
    window: str = "$__rate_interval",
) -> str:
    """The ``quantile`` of histogram ``histogram`` over ``window``, per ``by`` labels.

    Accurate to the width of the bucket the quantile falls in (linear interpolation
    inside it); above the highest finite bucket it returns that bucket's bound.
    """
    check_range("quantile", quantile, 0.0, 1.0, lo_open=True, hi_open=True)
    inner = sum_by([*by, BUCKET_LABEL], rate(selector(bucket(histogram), matchers, regex), window))
    return f"histogram_quantile({quantile:g}, {inner})"


def mean(
    histogram: str,
    by: Iterable[str] = (),
    *,
    matchers: Mapping[str, str] | None = None,
    regex: Iterable[str] = (),
    window: str = "$__rate_interval",
) -> str:
    """Mean observation of ``histogram`` over ``window`` (rate of sum over rate of count)."""
    by = list(by)
    numerator = sum_by(by, rate(selector(total_sum(histogram), matchers, regex), window))
    denominator = sum_by(by, rate(selector(count(histogram), matchers, regex), window))
    return f"{numerator} / {denominator}"


def with_exemplars_of(expr: str, histogram: str, regex: Iterable[str] = ()) -> str:
    """``expr`` plus a clause that selects no samples (a bucket counter is never negative)
    but names ``histogram``'s buckets: Prometheus's exemplar API returns the exemplars of
    every series an expression selects, and recording rules cannot copy exemplars, so a
    panel on the ``llm:`` copies still finds the trace ids on the source series."""
    return f"{expr}\n  or ({selector(bucket(histogram), regex=regex)} < 0)"


_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def known_metric_names() -> frozenset[str]:
    """Every Prometheus series name Sightline may expose, record or read (from ``semconv``:
    its own, the engine-agnostic ``llm:`` set and the vLLM series the adapter reads).

    Includes the client-library suffixes (``_total``, ``_bucket``, ...) of each base name
    and the recording rules' names; used by tests to reject a query with an unknown name.
    """
    bases = {
        value
        for key, value in vars(semconv).items()
        if isinstance(value, str)
        and (
            (key.startswith(("ENGINE_", "GPU_", "TELEMETRY_", "COLLECTOR_")) and value.startswith("sightline_"))
            or (key.startswith("LLM_") and value.startswith("llm:"))
            or (key.startswith("VLLM_") and not key.startswith("VLLM_LABEL_"))
        )
        and not value.endswith("_")
    }
    names = set(bases)
    for base in bases:
        names.update(base + suffix for suffix in _HISTOGRAM_SUFFIXES)
    names.update(
        value
        for key, value in vars(semconv).items()
        if key.startswith("RULE_") and not key.endswith("_PREFIX") and isinstance(value, str)
    )
    return frozenset(names)


_WINDOW_SUFFIX = re.compile(r"\d+[smhdwy]")


def is_known_metric(name: str) -> bool:
    """True for a name in :func:`known_metric_names` or a windowed recording rule
    (a ``RULE_*_PREFIX`` followed by a duration such as ``5m`` or ``3d``)."""
    if name in known_metric_names():
        return True
    prefixes = [value for key, value in vars(semconv).items() if key.startswith("RULE_") and key.endswith("_PREFIX")]
    return any(name.startswith(prefix) and _WINDOW_SUFFIX.fullmatch(name[len(prefix):]) for prefix in prefixes)


def known_label_names() -> frozenset[str]:
    """Every label name a Sightline query may use: ``semconv.LABEL_*``, ``le`` and the
    target labels Prometheus adds itself (``job``, ``instance``)."""
    labels = {value for key, value in vars(semconv).items() if key.startswith(("LABEL_", "VLLM_LABEL_"))}
    return frozenset(labels | {BUCKET_LABEL, "job", "instance", "slo", "window"})


_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                       "offset", "bool"})


def series_names(expr: str) -> set[str]:
    """Series names in a PromQL expression (best effort, for tests): identifiers outside
    label matchers, strings, range selectors and grouping clauses that are not
    functions, keywords or parts of numbers."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        if word in _KEYWORDS or text[match.end():].lstrip().startswith("("):
            continue
        if match.start() and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # the "e" of 1e-05
        if word in ("Inf", "NaN", "inf", "nan"):
            continue
        names.add(word)
    return names
