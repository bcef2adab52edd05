"""The one ``sightline`` command: each room registers its own subcommands.

Every room's ``cli.py`` imports only the standard library at module level and defers
heavy imports (torch, grpc) to the handler, so that ``sightline collector run`` works
on a machine without torch and ``sightline --help`` is instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from ..collector import cli as collector_cli
    from ..dashboards import cli as dashboards_cli
    from ..engine import cli as engine_cli
    from . import commands as deploy_cli

    parser = argparse.ArgumentParser(
        prog="sightline",
        description="Observability for LLM inference, from HTTP ingress down to the GPU's SMs.",
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    deploy_cli.register(subcommands)  # demo, up, load
    engine_cli.register(subcommands)  # engine serve
    collector_cli.register(subcommands)  # collector run, heatmap, explain, replay
    dashboards_cli.register(subcommands)  # dashboards build, dashboards publish
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception as exc:  # a clear one-line error instead of a traceback wall
        if getattr(args, "debug", False):
            raise
        print(f"sightline {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
