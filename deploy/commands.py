"""``sightline demo``, ``sightline up`` and ``sightline load``.

Module-level imports are the standard library only (``sightline --help`` stays instant and
the collector image needs no torch); each handler imports what it uses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register"]

_COMPONENTS = ("collector", "rotel", "alertmanager", "prometheus", "engine")
_PORT_NAMES = ("engine", "rotel_grpc", "rotel_http", "collector_grpc", "collector_http",
               "collector_zipkin", "collector_api", "prometheus", "alertmanager")


def _priorities(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--priorities {text!r}: expected integers like 0,1,2")
    if not values:
        raise argparse.ArgumentTypeError(f"--priorities {text!r}: name at least one priority")
    return values


def _port(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or name not in _PORT_NAMES or not value.isdigit():
        raise argparse.ArgumentTypeError(
            f"--port {text!r}: expected NAME=PORT with NAME one of {', '.join(_PORT_NAMES)}")
    return name, int(value)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the engine runs (default: cuda when a GPU is present)")
    parser.add_argument("--model", default=None,
                        help="engine model preset (default: tiny on the CPU, llama-1b on a GPU)")
    parser.add_argument("--trace-level", default=None,
                        choices=("off", "requests", "steps", "kernels"),
                        help="engine telemetry level (default: steps on the CPU, kernels on a GPU)")


def _add_load_flags(parser: argparse.ArgumentParser, *, requests: int, concurrency: int,
                    max_tokens: int) -> None:
    parser.add_argument("--requests", type=int, default=requests, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=concurrency,
                        help="requests in flight at most")
    parser.add_argument("--priorities", type=_priorities, default=(0, 1, 2),
                        help="priorities assigned round-robin, lower is more urgent (default 0,1,2)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per completion")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="stream the completions (SSE); TTFT/TPOT need it")


def register(subcommands: argparse._SubParsersAction) -> None:
    demo = subcommands.add_parser(
        "demo", help="run the whole pipeline locally and summarize",
        description="Brings the local stack up, drives a mixed-priority streamed load, explains "
                    "the slowest requests, and writes heatmaps, dashboards and a summary.")
    demo.add_argument("--out", type=Path, default=Path("sightline-out"),
                      help="output folder (default sightline-out/)")
    _add_engine_flags(demo)
    _add_load_flags(demo, requests=36, concurrency=12, max_tokens=16)
    demo.add_argument("--max-num-seqs", type=int, default=4,
                      help="engine batch limit, below the concurrency so that requests queue "
                           "and priorities matter (default 4)")
    demo.add_argument("--capture", type=Path, default=None,
                      help="recorded GPU capture to replay without a GPU (default: "
                           "deploy/captures/h200-noisy-neighbour.jsonl.gz, else the synthetic one)")
    demo.add_argument("--replay-speed", type=float, default=0.0,
                      help="0 (default): the capture lands at once, shifted to end now with its "
                           "spacing kept; N: replayed live at N x, time compressed")
    demo.add_argument("--slowest", type=int, default=3, help="how many slow requests to explain")
    demo.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    demo.set_defaults(handler=_demo)

    up = subcommands.add_parser(
        "up", help="run the local stack until Ctrl-C",
        description="Starts the engine, rotel, the collector, Prometheus and Alertmanager as "
                    "processes, prints their URLs, and stops them all on Ctrl-C or SIGTERM.")
    up.add_argument("--run-dir", type=Path, default=Path("sightline-out"),
                    help="folder for rendered configs, data and logs/ (default sightline-out/)")
    _add_engine_flags(up)
    up.add_argument("--without", action="append", choices=_COMPONENTS, default=[],
                    help="leave a component out (repeatable)")
    up.add_argument("--port", action="append", type=_port, default=[], metavar="NAME=PORT",
                    help=f"fix a port; NAME is one of {', '.join(_PORT_NAMES)}")
    up.add_argument("--free-ports", action="store_true",
                    help="pick free ports instead of the documented defaults (8000, 4317, 9090...)")
    up.add_argument("--alert-webhook", default=None,
                    help="URL that Alertmanager posts alerts to")
    up.add_argument("--echo-logs", action="store_true", help="also copy every log line to stderr")
    up.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    up.set_defaults(handler=_up)

    load = subcommands.add_parser(
        "load", help="drive a mixed-priority streamed load at an OpenAI-compatible server",
        description="Sends completions with the openai SDK, records TTFT, TPOT and e2e per "
                    "request, and prints P50/P99 per priority.")
    load.add_argument("--url", default="http://127.0.0.1:8000",
                      help="server base URL (default http://127.0.0.1:8000)")
    _add_load_flags(load, requests=32, concurrency=8, max_tokens=16)
    load.add_argument("--api", choices=("completions", "chat"), default="completions")
    load.add_argument("--model", default=None, help="model name (default: the server's first)")
    load.add_argument("--records", type=Path, default=None,
                      help="write one JSON line per request here")
    load.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    load.set_defaults(handler=_load)


def _load(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from .load import LoadConfig, format_summary, run_load_sync

    config = LoadConfig(url=args.url, requests=args.requests, concurrency=args.concurrency,
                        priorities=args.priorities, max_tokens=args.max_tokens,
                        stream=args.stream, api=args.api, model=args.model)
    result = run_load_sync(config)
    if args.records is not None:
        args.records.parent.mkdir(parents=True, exist_ok=True)
        with open(args.records, "w", encoding="utf-8") as out:
            for record in result.records:
                out.write(json.dumps(dataclasses.asdict(record)) + "\n")
    print(format_summary(result.summary))
    return 0 if result.summary.errors == 0 else 1


def _up(args: argparse.Namespace) -> int:
    import signal
    import time

    from .stack import Stack, StackConfig, format_urls

    config = StackConfig(
        run_dir=args.run_dir, components=tuple(c for c in _COMPONENTS if c not in args.without),
        prefer_default_ports=not args.free_ports, ports=dict(args.port), device=args.device,
        model=args.model, trace_level=args.trace_level, alert_webhook_url=args.alert_webhook,
        echo_logs=args.echo_logs)

    def on_term(signum, frame):  # SIGTERM takes the same clean path as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    stack = Stack(config)
    print(f"starting the Sightline stack (engine: {config.resolved_model} on "
          f"{config.resolved_device}); logs in {stack.log_dir}", file=sys.stderr)
    try:
        stack.start(on_started=lambda name, s: print(f"  {name} ready in {s:.1f}s",
                                                      file=sys.stderr))
        print("Sightline is up:")
        print(format_urls(stack.urls()))
        p = stack.ports
        if "engine" in config.components:
            print(f"Try:\n  sightline load --url {p.engine_url} --requests 64 --concurrency 16")
        if "collector" in config.components:
            print(f"  sightline explain --url {p.collector_url}\n"
                  f"  sightline heatmap --url {p.collector_url} --out heatmaps/")
        sys.stdout.flush()
        print("Ctrl-C stops everything.", file=sys.stderr)
        while True:
            stack.check()  # a component that dies takes the stack down, loudly
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nstopping...", file=sys.stderr)
        return 0
    finally:
        codes = stack.stop()
        if codes:
            print("stopped: " + ", ".join(f"{k} ({v})" for k, v in codes.items()),
                  file=sys.stderr)


def _demo(args: argparse.Namespace) -> int:
    import signal

    from .demo import DemoConfig, run_demo

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    config = DemoConfig(out_dir=args.out, device=args.device, model=args.model,
                        trace_level=args.trace_level, requests=args.requests,
                        concurrency=args.concurrency, priorities=args.priorities,
                        max_tokens=args.max_tokens, stream=args.stream, capture=args.capture,
                        slowest=args.slowest, max_num_seqs=args.max_num_seqs,
                        replay_speed=args.replay_speed)
    return run_demo(config)
