"""``sightline demo``, ``up`` and ``load`` (placeholder)."""

from __future__ import annotations

import argparse


def register(subcommands: argparse._SubParsersAction) -> None:
    demo = subcommands.add_parser("demo", help="run the whole pipeline locally and summarize")
    demo.set_defaults(handler=lambda args: print("demo: not built yet") or 1)
