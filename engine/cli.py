"""``sightline engine serve``: the OpenAI-compatible reference engine.

The flags come from ``EngineConfig``'s declarations (``instrumentation/settings.py``), read
from modules that import neither torch nor aiohttp (``sightline --help`` stays quick and the
collector machine needs no torch); the handler imports the engine. Telemetry settings follow
argument > ``OTEL_*``/``SIGHTLINE_*`` environment > default (``TelemetryConfig.from_env``).
"""

from __future__ import annotations

import argparse
import logging

from ..instrumentation import TelemetryConfig, add_flags, from_flags, given_flags
from .config import EngineConfig

__all__ = ["engine_config", "register"]


def register(subcommands: argparse._SubParsersAction) -> None:
    engine = subcommands.add_parser("engine", help="the reference inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="COMMAND")
    serve = engine_sub.add_parser(
        "serve", help="serve the OpenAI-compatible API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
                    "/live answers as soon as HTTP is up; /health is 503 (naming the start-up "
                    "phase) until the engine is warm. SIGTERM drains in-flight requests, then exits.")
    add_flags(serve, EngineConfig)  # one flag per field, the telemetry's included
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="API server processes (HTTP, tokenization, detokenization) in front "
                            "of the one engine-core process, all on one port (default: 1)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    serve.set_defaults(handler=_serve)


def engine_config(args: argparse.Namespace) -> tuple[EngineConfig, bool]:
    """The ``EngineConfig`` the flags describe, and whether the engine core is to size the
    step's token budget for its device (no --max-num-batched-tokens, not the CPU).
    Telemetry follows flag > ``OTEL_*``/``SIGHTLINE_*`` variable > default
    (``TelemetryConfig.from_env``). ValueError names a bad value."""
    telemetry = TelemetryConfig.from_env(**given_flags(TelemetryConfig, args, prefix="telemetry_"))
    args = argparse.Namespace(**vars(args))
    # the default depends on the GPU: the core process, which owns it, decides (this
    # supervising process never touches CUDA); the CPU's default until then
    budget_from_device = args.scheduler_max_num_batched_tokens is None and args.device != "cpu"
    if args.scheduler_max_num_batched_tokens is None:
        args.scheduler_max_num_batched_tokens = max(2048, args.scheduler_max_num_seqs)
    return from_flags(EngineConfig, args, telemetry=telemetry), budget_from_device


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .compile_cache import resolve_compile_cache
    resolve_compile_cache(args.compile_cache_dir).apply()   # before any kernel is imported
    from .launcher import serve

    config, budget_from_device = engine_config(args)
    return serve(config, args.api_server_count, args.log_level, budget_from_device)
