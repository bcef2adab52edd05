"""The few panel shapes Sightline's dashboards use, on top of grafana-foundation-sdk.

A dashboard module describes *what* to show as :class:`Query` records inside
:class:`PanelSpec` records; this module turns them into SDK builders with one look
(datasource, units, exemplars, grid layout, stable panel ids). Keeping the SDK calls in
one place means a Grafana schema change is one edit, and the dashboards read as lists
of queries.

Guarantees: panel ids are 1..n in declaration order and grid positions depend only on
the declaration, so a build is byte-for-byte reproducible (the committed JSON is
compared with a fresh build in the tests). Portable: every panel, query and variable is
bound to the ``datasource`` template variable (``__inputs`` asks for it on import), and
the JSON holds only fields of Grafana's published dashboard schema (checked with
``@grafana/schema`` in the tests).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Literal

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as dashboard_builder
from grafana_foundation_sdk.builders import heatmap as heatmap_builder
from grafana_foundation_sdk.builders import prometheus as prometheus_builder
from grafana_foundation_sdk.builders import stat as stat_builder
from grafana_foundation_sdk.builders import table as table_builder
from grafana_foundation_sdk.builders import timeseries as timeseries_builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_model
from grafana_foundation_sdk.models import dashboard as dashboard_model
from grafana_foundation_sdk.models import heatmap as heatmap_model
from grafana_foundation_sdk.models import prometheus as prometheus_model

from ..instrumentation import check_range

__all__ = [
    "PROMETHEUS_DATASOURCE_UID",
    "DATASOURCE_VARIABLE",
    "DATASOURCE_INPUT",
    "TEMPO_DATASOURCE_UID",
    "DASHBOARD_TAG",
    "Query",
    "PanelSpec",
    "Row",
    "Variable",
    "DashboardSpec",
    "build_dashboard",
    "to_json",
    "all_queries",
]

# Datasource uids shared with deploy/grafana provisioning (dashboards.provisioning).
PROMETHEUS_DATASOURCE_UID = "sightline-prometheus"
TEMPO_DATASOURCE_UID = "sightline-tempo"
DASHBOARD_TAG = "sightline"

# Every query goes through this variable; on import, Grafana's dialog fills the input
# (``${DS_PROMETHEUS}``) with the Prometheus the user picks, and it becomes the variable's
# value. Where nothing fills it (file provisioning), Grafana selects the default Prometheus.
DATASOURCE_VARIABLE = "datasource"
DATASOURCE_INPUT = "DS_PROMETHEUS"
_PROMETHEUS = dashboard_model.DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VARIABLE}}}")
_INPUTS = [{"name": DATASOURCE_INPUT, "label": "Prometheus", "description": "Prometheus that scrapes the engine",
            "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}]
# Fields the SDK writes that Grafana's schema does not define: on every variable (they
# belong to interval variables, or to nothing) and on the dashboard (``style``, dropped
# from the schema).
_NOT_IN_SCHEMA = ("id", "auto", "auto_count", "auto_min")
_DASHBOARD_NOT_IN_SCHEMA = ("style",)
_GRID_WIDTH = 24

QueryFormat = Literal["time_series", "heatmap", "table"]
PanelKind = Literal["timeseries", "heatmap", "rows_heatmap", "stat", "matrix"]


@dataclasses.dataclass(frozen=True)
class Query:
    """One PromQL target. ``exemplar`` asks Prometheus for exemplars (trace ids that
    Grafana links to Tempo); ``fmt="heatmap"`` de-accumulates ``le`` buckets."""

    expr: str
    legend: str = ""
    exemplar: bool = False
    fmt: QueryFormat = "time_series"
    instant: bool = False


@dataclasses.dataclass(frozen=True)
class PanelSpec:
    """A panel: title, queries, and how to draw them.

    ``kind``: ``timeseries`` (lines), ``heatmap`` (a histogram's buckets over time),
    ``rows_heatmap`` (one row per series, colored by value: time x SM), ``stat`` (one
    number), ``matrix`` (an instant query pivoted into a colored table by
    ``matrix_rows`` x ``matrix_columns`` labels).
    """

    title: str
    queries: tuple[Query, ...]
    kind: PanelKind = "timeseries"
    unit: str = "short"
    description: str = ""
    width: int = 12
    height: int = 8
    stacked: bool = False
    repeat: str | None = None
    matrix_rows: str = ""
    matrix_columns: str = ""

    def __post_init__(self) -> None:
        if not self.queries:
            raise ValueError(f"panel {self.title!r} has no query")
        check_range(f"panel {self.title!r}: width", self.width, 1, _GRID_WIDTH, integer=True)
        if self.kind == "matrix" and not (self.matrix_rows and self.matrix_columns):
            raise ValueError(f"matrix panel {self.title!r} needs matrix_rows and matrix_columns")


@dataclasses.dataclass(frozen=True)
class Row:
    """A titled row of panels, laid out left to right and wrapped at 24 columns."""

    title: str
    panels: tuple[PanelSpec, ...]


@dataclasses.dataclass(frozen=True)
class Variable:
    """A query template variable: ``label_values(<metric>{<depends>}, <label>)``.

    Multi-value with "All" meaning the regex ``.*``, so queries select with ``=~``.
    ``depends`` names variables that narrow this one (``kernel`` depends on ``gpu``).
    ``also`` lists more metrics whose values of ``label`` belong in the list (a
    ``__name__`` regex: kernels seen only by CUPTI, GPUs seen only by NVML).
    """

    name: str
    metric: str
    label: str
    depends: tuple[str, ...] = ()
    also: tuple[str, ...] = ()

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric, *self.also)

    @property
    def query(self) -> str:
        matchers = [f'{name}=~"${name}"' for name in self.depends]
        if self.also:
            matchers.insert(0, f'__name__=~"{"|".join(self.metrics)}"')
            series = f"{{{','.join(matchers)}}}"
        else:
            series = f"{self.metric}{{{','.join(matchers)}}}" if matchers else self.metric
        return f"label_values({series}, {self.label})"


@dataclasses.dataclass(frozen=True)
class DashboardSpec:
    """A whole dashboard; ``uid`` is stable (publish overwrites by it)."""

    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    refresh: str = "30s"
    time_from: str = "now-1h"


def _target(query: Query, ref_id: str) -> prometheus_builder.Dataquery:
    target = (
        prometheus_builder.Dataquery()
        .datasource(_PROMETHEUS)
        .expr(query.expr)
        .ref_id(ref_id)
        .format(prometheus_model.PromQueryFormat(query.fmt))
        .exemplar(query.exemplar)
    )
    if query.legend:
        target = target.legend_format(query.legend)
    return target.instant() if query.instant else target.range()


def _panel(spec: PanelSpec, panel_id: int):
    if spec.kind == "timeseries":
        builder = (
            timeseries_builder.Panel().fill_opacity(10 if not spec.stacked else 40)
            .legend(common_builder.VizLegendOptions().show_legend(True)
                    .display_mode(common_model.LegendDisplayMode.LIST)
                    .placement(common_model.LegendPlacement.BOTTOM))
            .tooltip(common_builder.VizTooltipOptions().mode(common_model.TooltipDisplayMode.MULTI)
                     .sort(common_model.SortOrder.NONE))
        )
        if spec.stacked:
            builder = builder.stacking(common_builder.StackingConfig().mode(common_model.StackingMode.NORMAL))
    elif spec.kind == "stat":
        builder = stat_builder.Panel().graph_mode(common_model.BigValueGraphMode.AREA)
    elif spec.kind in ("heatmap", "rows_heatmap"):
        layout = common_model.HeatmapCellLayout.LE if spec.kind == "heatmap" else common_model.HeatmapCellLayout.UNKNOWN
        builder = (
            heatmap_builder.Panel()
            .calculate(False)
            .rows_frame(heatmap_builder.RowsHeatmapOptions().layout(layout))
            .color(heatmap_builder.HeatmapColorOptions().mode(heatmap_model.HeatmapColorMode.SCHEME)
                   .scheme("Spectral").scale(heatmap_model.HeatmapColorScale.EXPONENTIAL)
                   .exponent(0.5).steps(64))
            .show_tooltip()
            .y_axis(heatmap_builder.YAxisConfig().unit(spec.unit if spec.kind == "heatmap" else "none"))
        )
        if spec.kind == "heatmap":
            builder = builder.show_y_histogram()
        else:
            builder = builder.cell_values(heatmap_builder.CellValues().unit(spec.unit))
    elif spec.kind == "matrix":
        builder = table_builder.Panel().show_header(True).with_transformation(
            dashboard_model.DataTransformerConfig(
                id_val="groupingToMatrix",
                options={"columnField": spec.matrix_columns, "rowField": spec.matrix_rows, "valueField": "Value"},
            )
        ).color_scheme(
            dashboard_builder.FieldColor().mode(dashboard_model.FieldColorModeId.CONTINUOUS_GR_YL_RD)
        )
    else:  # pragma: no cover - PanelKind is a closed Literal
        raise ValueError(f"unknown panel kind {spec.kind!r}")
    builder = (
        builder.id(panel_id)
        .title(spec.title)
        .datasource(_PROMETHEUS)
        .span(spec.width)
        .height(spec.height)
        .unit(spec.unit)
    )
    if spec.description:
        builder = builder.description(spec.description)
    if spec.repeat:
        builder = builder.repeat(spec.repeat).repeat_direction("h")
    for index, query in enumerate(spec.queries):
        builder = builder.with_target(_target(query, chr(ord("A") + index)))
    return builder


def _variable(variable: Variable) -> dashboard_builder.QueryVariable:
    return (
        dashboard_builder.QueryVariable(variable.name)
        .label(variable.name)
        .datasource(_PROMETHEUS)
        .query(variable.query)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(dashboard_model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_model.VariableSort.ALPHABETICAL_ASC)
        .current(dashboard_model.VariableOption(selected=True, text="All", value="$__all"))
    )


def build_dashboard(spec: DashboardSpec) -> dashboard_model.Dashboard:
    """The SDK dashboard for ``spec``: rows in order, panel ids 1..n, variables first."""
    builder = (
        dashboard_builder.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags([DASHBOARD_TAG])
        .editable()
        .refresh(spec.refresh)
        .time(spec.time_from, "now")
        .timezone("utc")
        .tooltip(dashboard_model.DashboardCursorSync.CROSSHAIR)
    )
    builder = builder.with_variable(
        dashboard_builder.DatasourceVariable(DATASOURCE_VARIABLE).label("Prometheus").type("prometheus")
        .current(dashboard_model.VariableOption(selected=True, text=f"${{{DATASOURCE_INPUT}}}",
                                                value=f"${{{DATASOURCE_INPUT}}}")))
    for variable in spec.variables:
        builder = builder.with_variable(_variable(variable))
    panel_id = 0
    for row in spec.rows:
        panel_id += 1
        builder = builder.with_row(dashboard_builder.Row(row.title).id(panel_id))
        for panel in row.panels:
            panel_id += 1
            builder = builder.with_panel(_panel(panel, panel_id))
    dashboard = builder.build()
    _lay_out(dashboard.panels, [panel for row in spec.rows for panel in (None, *row.panels)])
    return dashboard


def _lay_out(built: list, specs: list[PanelSpec | None]) -> None:
    """Grid positions: rows full width; panels left to right, wrapped at 24 columns;
    a repeated panel on a line of its own (Grafana fills the line with its copies)."""
    x = y = line_height = 0
    for panel, spec in zip(built, specs, strict=True):
        if spec is None:  # a row header
            y += line_height
            panel.grid_pos = dashboard_model.GridPos(h=1, w=_GRID_WIDTH, x=0, y=y)
            x, y, line_height = 0, y + 1, 0
            continue
        alone = spec.repeat is not None
        if x and (alone or x + spec.width > _GRID_WIDTH):
            x, y, line_height = 0, y + line_height, 0
        panel.grid_pos = dashboard_model.GridPos(h=spec.height, w=spec.width, x=x, y=y)
        x += spec.width
        line_height = max(line_height, spec.height)
        if alone or x >= _GRID_WIDTH:
            x, y, line_height = 0, y + line_height, 0


def to_json(dashboard: dashboard_model.Dashboard) -> str:
    """Canonical JSON (sorted keys, 2-space indent, trailing newline) for committing, with
    the import dialog's ``__inputs`` and only the schema's fields on variables."""
    document = json.loads(json.dumps(dashboard, cls=JSONEncoder))
    for key in _DASHBOARD_NOT_IN_SCHEMA:
        document.pop(key, None)
    for variable in document.get("templating", {}).get("list", []):
        for key in _NOT_IN_SCHEMA:
            variable.pop(key, None)
    document["__inputs"] = _INPUTS
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def all_queries(spec: DashboardSpec) -> Sequence[tuple[str, Query]]:
    """(panel title, query) for every query of every panel, in declaration order."""
    return [(panel.title, query) for row in spec.rows for panel in row.panels for query in panel.queries]
