"""``sightline engine ...`` subcommands (placeholder until the engine lands)."""

from __future__ import annotations

import argparse


def register(subcommands: argparse._SubParsersAction) -> None:
    engine = subcommands.add_parser("engine", help="the reference inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="COMMAND")
    serve = engine_sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.set_defaults(handler=lambda args: print("engine serve: not built yet") or 1)
