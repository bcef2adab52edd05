"""``sightline collector run`` and (through ``query_cli``) ``heatmap``, ``explain``, ``replay``.

Module-level imports are the standard library only: ``sightline --help`` must stay
instant and the collector must not pull in torch. The handler imports the collector.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..instrumentation import add_flags, from_flags  # stdlib-only modules
from .aggregation_config import AggregationConfig
from .config import CollectorConfig

__all__ = ["aggregation_config", "register"]


def register(subcommands: argparse._SubParsersAction) -> None:
    collector = subcommands.add_parser("collector", help="the telemetry collector")
    collector_sub = collector.add_subparsers(dest="collector_command", required=True, metavar="COMMAND")
    run = collector_sub.add_parser(
        "run",
        help="run the collector (OTLP gRPC/HTTP + Zipkin receivers, /metrics, query API)",
        description="Runs every receiver and the query port in one process until SIGTERM/SIGINT, "
                    "then drains everything acknowledged into the aggregator and exits. Addresses "
                    "default to 127.0.0.1; pass 0.0.0.0:PORT to listen on all interfaces. The ingest "
                    "bearer token is read from --auth-token-file or the environment variable named "
                    "by --auth-token-env (never from a flag value).",
    )
    add_flags(run, CollectorConfig)
    add = run.add_argument
    add("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    _add_aggregation_flags(run)
    run.set_defaults(handler=_run)
    warm = collector_sub.add_parser(
        "warm",
        help="compile the collector's byte walks into numba's cache, so the next start is ready at once",
        description="Compiles the collector's compiled paths into numba's on-disk cache (NUMBA_CACHE_DIR, "
                    "else __pycache__ beside the sources) and exits. Run it once where the collector "
                    "will run (an image build, a setup script): a collector started on a cold cache "
                    "serves at once but reports not-ready on /readyz until it has compiled them. The "
                    "cache is valid for this machine's CPU model and these source files.")
    warm.set_defaults(handler=_warm)

    from . import query_cli  # heatmap, explain, replay (stdlib-only module level)

    query_cli.register(subcommands)


def _add_aggregation_flags(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group(
        "aggregation", "windows, cardinality limits and the trace store; each value is checked on start "
                       "and an out-of-range one is refused with the allowed range (exit status 2)")
    add_flags(group, AggregationConfig)


def aggregation_config(args: argparse.Namespace) -> AggregationConfig:
    """The ``AggregationConfig`` the aggregation flags describe (ValueError names a bad one)."""
    return from_flags(AggregationConfig, args)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, aggregation = _collector_config(args), aggregation_config(args)
        from .app import check_summary_file, run
        if config.summary_file is not None:
            check_summary_file(Path(config.summary_file))
    except ValueError as error:  # a bad flag value: say which, like argparse does
        print(f"sightline collector run: error: {error}", file=sys.stderr)
        return 2
    return run(config, aggregation)


def _warm(args: argparse.Namespace) -> int:
    from .compiled import warm

    print(f"sightline collector warm: compiled paths ready in {warm():.1f} s")
    return 0


def _collector_config(args: argparse.Namespace) -> CollectorConfig:
    return from_flags(CollectorConfig, args)
