"""``sightline dashboards ...`` (placeholder)."""

from __future__ import annotations

import argparse


def register(subcommands: argparse._SubParsersAction) -> None:
    dashboards = subcommands.add_parser("dashboards", help="Grafana dashboards as code")
    dashboards_sub = dashboards.add_subparsers(dest="dashboards_command", required=True, metavar="COMMAND")
    build = dashboards_sub.add_parser("build", help="write the dashboards' JSON")
    build.set_defaults(handler=lambda args: print("dashboards build: not built yet") or 1)
