"""``sightline collector run`` and (through ``query_cli``) ``heatmap``, ``explain``, ``replay``.

Module-level imports are the standard library only: ``sightline --help`` must stay
instant and the collector must not pull in torch. The handler imports the collector.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from pathlib import Path

from .aggregation_config import (AggregationConfig, TraceStoreConfig,  # stdlib-only
                                 WindowConfig)
from .config import CollectorConfig  # stdlib-only module

__all__ = ["aggregation_config", "register"]

_D = {f.name: f.default for f in fields(CollectorConfig)}
# Default configs: the flags show their values as defaults.
_WINDOW, _AGGREGATION, _TRACE_STORE = WindowConfig(), AggregationConfig(), TraceStoreConfig()


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
    add = run.add_argument
    add("--otlp-grpc", default=_D["otlp_grpc_address"], metavar="HOST:PORT", help="OTLP/gRPC listen address")
    add("--otlp-http", default=_D["otlp_http_address"], metavar="HOST:PORT",
        help="OTLP/HTTP listen address (/v1/traces, /v1/metrics; protobuf and JSON)")
    add("--zipkin", default=_D["zipkin_address"], metavar="HOST:PORT", help="Zipkin v2 listen address (/api/v2/spans)")
    add("--http", default=_D["http_address"], metavar="HOST:PORT",
        help="query port: /metrics, /healthz, /readyz, /api/v1/")
    add("--max-request-bytes", type=int, default=_D["max_request_bytes"], help="largest request body on the wire (default %(default)s)")
    add("--max-decompressed-bytes", type=int, default=_D["max_decompressed_bytes"],
        help="largest body after gzip/deflate, and largest gRPC message (default %(default)s)")
    add("--max-decompression-ratio", type=int, default=_D["max_decompression_ratio"],
        help="a compressed body may inflate to at most this many times its size (default %(default)s)")
    add("--max-resources-per-request", type=int, default=_D["max_resources_per_request"],
        help="resources in one export request, empty ones included, counted before it is parsed; more -> 413 "
             "(default %(default)s)")
    add("--max-scopes-per-request", type=int, default=_D["max_scopes_per_request"],
        help="scopes and metrics in one export request, same effect (default %(default)s)")
    add("--max-spans-per-request", type=int, default=_D["max_spans_per_request"],
        help="spans in one export request, same effect (default %(default)s)")
    add("--max-points-per-request", type=int, default=_D["max_points_per_request"],
        help="metric data points in one export request, same effect (default %(default)s)")
    add("--max-values-per-request", type=int, default=_D["max_values_per_request"],
        help="attributes, events, links and exemplars in one export request, same effect (default %(default)s)")
    add("--max-buckets-per-request", type=int, default=_D["max_buckets_per_request"],
        help="histogram bucket counts in one export request, same effect (default %(default)s)")
    add("--max-json-values", type=int, default=_D["max_json_values"],
        help="objects, arrays and elements in one OTLP/JSON or Zipkin body, counted before it is parsed; "
             "more -> 413 (default %(default)s)")
    add("--queue-max-items", type=int, default=_D["queue_max_items"],
        help="spans+data points waiting for the aggregator before 429/RESOURCE_EXHAUSTED")
    add("--queue-max-bytes", type=int, default=_D["queue_max_bytes"],
        help="bytes of parsed requests waiting (estimated), same effect (default %(default)s)")
    add("--workers", type=int, default=_D["workers"], help="aggregator worker threads")
    add("--max-inflight-requests", type=int, default=_D["max_inflight_requests"],
        help="export requests read/parsed at once per listener before 429/RESOURCE_EXHAUSTED")
    add("--request-timeout-s", type=float, default=_D["request_timeout_s"],
        help="a request body must arrive within this many seconds (else 408)")
    add("--max-connections", type=int, default=_D["max_connections"],
        help="open connections per HTTP listener before 503 (lowered to fit the file-descriptor limit)")
    add("--header-timeout-s", type=float, default=_D["header_timeout_s"],
        help="a new connection must send its request headers within this many seconds (else 408)")
    add("--dedupe-window-spans", type=int, default=_D["dedupe_window_spans"],
        help="remember the ids of about this many recent spans; a span sent again is acknowledged, not "
             "counted twice (0 = off; 8 bytes per span)")
    add("--max-json-depth", type=int, default=_D["max_json_depth"],
        help="OTLP/JSON and Zipkin bodies nested deeper are refused with 400")
    add("--retry-after-s", type=int, default=_D["retry_after_s"], help="retry hint sent with 429/RESOURCE_EXHAUSTED")
    add("--shutdown-timeout-s", type=float, default=_D["shutdown_timeout_s"], help="how long the drain on SIGTERM may take")
    add("--scrape-deadline-s", type=float, default=_D["scrape_deadline_s"],
        help="a /metrics response not read within this many seconds is cut (default %(default)s)")
    add("--auth-token-file", type=Path, default=None, help="file holding the ingest bearer token")
    add("--auth-token-env", default=_D["auth_token_env"],
        help="environment variable holding the ingest bearer token (if set)")
    add("--query-auth", action="store_true",
        help="require a bearer token on the query API (/api/v1/): the read token if one is set, else the "
             "ingest token; /metrics, /healthz, /readyz stay open")
    add("--query-token-file", type=Path, default=None,
        help="file holding the query API's read token (turns query auth on)")
    add("--query-token-env", default=_D["query_token_env"],
        help="environment variable holding the query API's read token (if set, query auth is on)")
    add("--tls-cert-file", type=Path, default=None, help="PEM certificate for the ingest listeners")
    add("--tls-key-file", type=Path, default=None, help="PEM private key for the ingest listeners")
    add("--summary-file", type=Path, default=None,
        help="write acknowledged-vs-aggregated totals as JSON here on exit")
    add("--sink", choices=("aggregator", "discard"), default="aggregator",
        help="'discard' skips aggregation (ingest benchmarks only)")
    add("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    _add_aggregation_flags(run)
    run.set_defaults(handler=_run)

    from . import query_cli  # heatmap, explain, replay (stdlib-only module level)

    query_cli.register(subcommands)


def _add_aggregation_flags(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group(
        "aggregation", "windows, cardinality limits and the trace store; each value is checked on start "
                       "and an out-of-range one is refused with the allowed range (exit status 2)")
    add = group.add_argument
    add("--window-slot-s", type=float, default=_WINDOW.slot_s, metavar="SECONDS",
        help="length of one window slot: the time resolution of heatmaps and quantiles (default %(default)s)")
    add("--window-slots", type=int, default=_WINDOW.num_slots, metavar="N",
        help="slots kept per series; slots x slot length is the horizon, older data is refused (default %(default)s)")
    add("--gauge-window-s", type=float, default=_AGGREGATION.gauge_window_s, metavar="SECONDS",
        help="window of the per-SM P99 gauges and hotspot ratios, at most the horizon (default %(default)s)")
    add("--max-sm-series", type=int, default=_AGGREGATION.max_sm_series, metavar="N",
        help="(instance, gpu, SM, kernel) series, shared equally among the GPUs present; a kernel past its "
             "GPU's share is refused, counted, and its heatmap names this limit (default %(default)s)")
    add("--max-gpus", type=int, default=_AGGREGATION.max_gpus, metavar="N",
        help="(instance, gpu) identities with per-SM data (default %(default)s)")
    add("--max-kernel-series", type=int, default=_AGGREGATION.max_kernel_series, metavar="N",
        help="(gpu, kernel) series from kernel spans (default %(default)s)")
    add("--max-request-series", type=int, default=_AGGREGATION.max_request_series, metavar="N",
        help="(model, priority) series from request spans (default %(default)s)")
    add("--max-step-series", type=int, default=_AGGREGATION.max_step_series, metavar="N",
        help="step-phase series from engine.step spans (default %(default)s)")
    add("--expose-sm-histograms", action=argparse.BooleanOptionalAction, default=_AGGREGATION.expose_sm_histograms,
        help="per-SM CTA histograms on /metrics (19 lines per GPU x SM x kernel); off keeps the per-SM P99 "
             "gauges and the per-GPU summaries (default off)")
    add("--trace-store", choices=("deferred", "eager", "off"), default="deferred" if _TRACE_STORE.defer_index else "eager",
        help="recent-trace store behind explain and /api/v1/traces: indexed on the first query (deferred, "
             "cheapest ingest), as spans arrive (eager), or none (default %(default)s)")
    add("--trace-store-max-traces", type=int, default=_TRACE_STORE.max_traces, metavar="N",
        help="traces kept, oldest evicted first (default %(default)s)")
    add("--trace-store-max-spans", type=int, default=_TRACE_STORE.max_spans, metavar="N",
        help="spans kept in all (default %(default)s)")
    add("--trace-store-max-bytes", type=int, default=_TRACE_STORE.max_bytes, metavar="BYTES",
        help="encoded bytes kept in all (default %(default)s)")


def aggregation_config(args: argparse.Namespace) -> AggregationConfig:
    """The ``AggregationConfig`` the aggregation flags describe (ValueError names a bad one)."""
    return AggregationConfig(
        window=WindowConfig(slot_s=args.window_slot_s, num_slots=args.window_slots),
        gauge_window_s=args.gauge_window_s,
        max_sm_series=args.max_sm_series,
        max_gpus=args.max_gpus,
        max_kernel_series=args.max_kernel_series,
        max_request_series=args.max_request_series,
        max_step_series=args.max_step_series,
        store_traces=args.trace_store != "off",
        expose_sm_histograms=args.expose_sm_histograms,
        trace_store=TraceStoreConfig(max_traces=args.trace_store_max_traces, max_spans=args.trace_store_max_spans,
                                     max_bytes=args.trace_store_max_bytes,
                                     defer_index=args.trace_store != "eager"),
    )


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


def _collector_config(args: argparse.Namespace) -> CollectorConfig:
    return CollectorConfig(
        otlp_grpc_address=args.otlp_grpc,
        otlp_http_address=args.otlp_http,
        zipkin_address=args.zipkin,
        http_address=args.http,
        max_request_bytes=args.max_request_bytes,
        max_decompressed_bytes=args.max_decompressed_bytes,
        max_decompression_ratio=args.max_decompression_ratio,
        max_resources_per_request=args.max_resources_per_request,
        max_scopes_per_request=args.max_scopes_per_request,
        max_spans_per_request=args.max_spans_per_request,
        max_points_per_request=args.max_points_per_request,
        max_values_per_request=args.max_values_per_request,
        max_buckets_per_request=args.max_buckets_per_request,
        max_json_values=args.max_json_values,
        queue_max_items=args.queue_max_items,
        queue_max_bytes=args.queue_max_bytes,
        workers=args.workers,
        max_inflight_requests=args.max_inflight_requests,
        request_timeout_s=args.request_timeout_s,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout_s,
        dedupe_window_spans=args.dedupe_window_spans,
        max_json_depth=args.max_json_depth,
        retry_after_s=args.retry_after_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        scrape_deadline_s=args.scrape_deadline_s,
        auth_token_file=args.auth_token_file,
        auth_token_env=args.auth_token_env,
        query_auth=args.query_auth,
        query_token_file=args.query_token_file,
        query_token_env=args.query_token_env,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        summary_file=args.summary_file,
        sink=args.sink,
    )
