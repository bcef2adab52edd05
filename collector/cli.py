"""``sightline collector ...``, ``heatmap``, ``explain``, ``replay`` (placeholder)."""

from __future__ import annotations

import argparse


def register(subcommands: argparse._SubParsersAction) -> None:
    collector = subcommands.add_parser("collector", help="the telemetry collector")
    collector_sub = collector.add_subparsers(dest="collector_command", required=True, metavar="COMMAND")
    run = collector_sub.add_parser("run", help="run the collector")
    run.set_defaults(handler=lambda args: print("collector run: not built yet") or 1)
