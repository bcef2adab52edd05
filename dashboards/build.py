"""Build every dashboard to JSON (``sightline dashboards build``) and list its queries.

The generated JSON is committed under ``dashboards/json/`` (Grafana's file provider
reads it; ``tests/dashboards`` fails when it is stale). :func:`panel_queries` gives
every panel query with Grafana's template variables substituted, so a test can run
each one against a real Prometheus: a dashboard can only be trusted as far as its
queries return data.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from . import gpu, overview, pipeline, requests
from .panels import DashboardSpec, all_queries, build_dashboard, to_json

__all__ = [
    "DEFAULT_OUT",
    "DASHBOARDS",
    "PanelQuery",
    "specs",
    "render_all",
    "build_all",
    "write_all",
    "panel_queries",
    "substitute",
]

DEFAULT_OUT = Path(__file__).resolve().parent / "json"
DASHBOARDS: tuple[Callable[[], DashboardSpec], ...] = (overview.spec, requests.spec, gpu.spec, pipeline.spec)


class PanelQuery(NamedTuple):
    """One panel query ready for Prometheus' ``/api/v1/query`` (instant or range)."""

    dashboard_uid: str
    panel_title: str
    expr: str


def specs() -> list[DashboardSpec]:
    """Every dashboard's spec, in a fixed order."""
    return [make() for make in DASHBOARDS]


def render_all() -> dict[str, str]:
    """``{file name: JSON text}`` for every dashboard (file name = ``<uid>.json``)."""
    return {f"{spec.uid}.json": to_json(build_dashboard(spec)) for spec in specs()}


def build_all(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Same as :func:`write_all` (the name ``sightline demo`` calls)."""
    return write_all(out_dir)


def write_all(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Writes every dashboard's JSON into ``out_dir`` and removes stale ``sightline-*.json``
    files there; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rendered = render_all()
    for stale in out_dir.glob("sightline-*.json"):
        if stale.name not in rendered:
            stale.unlink()
    written = []
    for name, text in rendered.items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def substitute(
    expr: str,
    value: str = ".*",
    *,
    rate_interval: str = "1m",
    range_: str = "1h",
    interval: str = "15s",
) -> str:
    """``expr`` with Grafana's variables replaced: template variables by ``value`` (a
    value or a regex; queries match them with ``=~``), ``$__rate_interval``,
    ``$__range`` and ``$__interval`` by the given durations.

    Raises ValueError for a ``$name`` nobody substitutes, so a new variable cannot slip
    through to Prometheus as a literal.
    """
    builtins = {"__rate_interval": rate_interval, "__range": range_, "__interval": interval}
    template_names = {variable.name for spec in specs() for variable in spec.variables}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name.isdigit():  # a regex back-reference ($1), not a variable
            return match.group(0)
        if name in builtins:
            return builtins[name]
        if name in template_names:
            return value
        raise ValueError(f"unknown Grafana variable ${name} in {expr!r}")

    return _VARIABLE.sub(replace, expr)


def panel_queries(value: str = ".*", **durations: str) -> list[PanelQuery]:
    """Every query of every panel of every dashboard, variables substituted (see
    :func:`substitute`; ``durations`` are its keyword arguments)."""
    return [
        PanelQuery(spec.uid, title, substitute(query.expr, value, **durations))
        for spec in specs()
        for title, query in all_queries(spec)
    ]
