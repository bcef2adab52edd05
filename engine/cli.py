"""``sightline engine serve``: the OpenAI-compatible reference engine.

Module-level imports are standard library only (``sightline --help`` stays instant and the
collector machine needs no torch); the handler imports the engine. Telemetry settings follow
argument > ``OTEL_*``/``SIGHTLINE_*`` environment > default (``TelemetryConfig.from_env``).
"""

from __future__ import annotations

import argparse
import logging

__all__ = ["register"]


def register(subcommands: argparse._SubParsersAction) -> None:
    engine = subcommands.add_parser("engine", help="the reference inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="COMMAND")
    serve = engine_sub.add_parser(
        "serve", help="serve the OpenAI-compatible API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
                    "/live answers as soon as HTTP is up; /health is 503 (naming the start-up "
                    "phase) until the engine is warm. SIGTERM drains in-flight requests, then exits.")
    serve.add_argument("--model", default="tiny",
                       help="preset (tiny, llama-1b, llama-8b: random weights) or a local HF-style "
                            "directory with config.json and *.safetensors (default: tiny)")
    serve.add_argument("--served-model-name", default=None, help="model id reported by the API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    serve.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    serve.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV cache size on the CPU")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory for weights, activations and KV cache")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    serve.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="running requests per step")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="new tokens per step (default: 8192 on a GPU of >= 70 GiB, else 2048)")
    serve.add_argument("--max-waiting", type=int, default=1024, help="waiting queue bound (HTTP 429 past it)")
    serve.add_argument("--aging-s", type=float, default=10.0,
                       help="a waiting request gains one priority level per this many seconds")
    serve.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly: no CUDA graphs for decode steps "
                            "(by default they are captured at start-up on CUDA)")
    serve.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="before /health answers 200, run every kernel variant the "
                            "configuration can reach, then capture the CUDA graphs (default: on)")
    serve.add_argument("--warmup-limit", type=float, default=600.0, metavar="SECONDS",
                       help="the warm-up stops past this; the cases left are logged (default: 600)")
    serve.add_argument("--compile-cache-dir", default=None, metavar="DIR",
                       help="where compiled kernels are kept across restarts (Triton's cache, "
                            "FA2 tuning): default SIGHTLINE_COMPILE_CACHE_DIR, else "
                            "~/.cache/sightline/compile")
    serve.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="plan and launch the next step while the device runs this one "
                            "(default: on with CUDA, off on the CPU)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="split the model's heads and MLP columns over N ranks: the engine "
                            "core and N - 1 worker processes, one GPU each (NCCL), or gloo on "
                            "the CPU (default: 1, the model in the engine core alone)")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the KV cache of prompt prefixes seen before, block by block "
                            "(default: on with CUDA, off on the CPU)")
    serve.add_argument("--cpu-threads", type=int, default=None, help="torch threads per process on the CPU")
    serve.add_argument("--seed", type=int, default=0, help="random weights and unseeded sampling")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may finish after SIGTERM")
    serve.add_argument("--http-header-timeout", type=float, default=10.0,
                       help="seconds a connection's request headers may take (else 408)")
    serve.add_argument("--http-body-timeout", type=float, default=30.0,
                       help="seconds a request body may take once its headers are in (else 408)")
    serve.add_argument("--http-keepalive-timeout", type=float, default=10.0,
                       help="seconds an idle connection is kept between requests")
    serve.add_argument("--http-max-connections", type=int, default=4096,
                       help="open connections at most (lowered to fit the file-descriptor limit)")
    serve.add_argument("--http-peer-share", type=float, default=0.5,
                       help="fraction of the connections one client address may hold (behind a "
                            "single gateway or load balancer: 1.0)")
    serve.add_argument("--trace-level", choices=("off", "requests", "steps", "kernels"), default=None,
                       help="tracing depth (default: SIGHTLINE_TRACE_LEVEL, else requests)")
    serve.add_argument("--otlp-endpoint", default=None,
                       help="OTLP endpoint URL (default: OTEL_EXPORTER_OTLP_ENDPOINT)")
    serve.add_argument("--otlp-protocol", choices=("grpc", "http/protobuf"), default=None,
                       help="default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc")
    serve.add_argument("--capture-content", action="store_true", default=None,
                       help="record prompt and completion text on spans (off by default)")
    serve.add_argument("--kernel-sample-ratio", type=float, default=None,
                       help="at --trace-level kernels: fraction of engine steps whose CUDA "
                            "kernels become spans, besides the step after any slow one "
                            "(default: SIGHTLINE_KERNEL_SAMPLE_RATIO, else 0.01)")
    serve.add_argument("--kernel-spans", choices=("attention", "all"), default=None,
                       help="a traced step's kernel spans: each attention launch and one per "
                            "other kernel name (attention, the default), or every launch (all)")
    serve.add_argument("--sm-probe", action=argparse.BooleanOptionalAction, default=None,
                       help="at --trace-level kernels: per-CTA SM timing in the attention kernels "
                            "and per-SM histograms (default: SIGHTLINE_SM_PROBE, else on)")
    serve.add_argument("--sm-probe-every", type=int, default=None, metavar="N",
                       help="per-SM histograms take the CTAs of every Nth step and of every "
                            "step with kernel spans (default: SIGHTLINE_SM_PROBE_EVERY, else 32)")
    serve.add_argument("--cupti-detach", action=argparse.BooleanOptionalAction, default=None,
                       help="at --trace-level kernels: detach CUPTI between traced steps, so "
                            "that untraced steps pay nothing for it and each traced step pays "
                            "an attach of about 16 ms (default: SIGHTLINE_CUPTI_DETACH, else off)")
    serve.add_argument("--telemetry-nice", type=int, default=None, metavar="N",
                       help="nice value of the telemetry process, 0..19: it yields the CPU to "
                            "the engine (default: SIGHTLINE_TELEMETRY_NICE, else 10)")
    serve.add_argument("--telemetry-mode", choices=("process", "thread"), default="process",
                       help="build spans in a supervised telemetry process (default) or on "
                            "a thread of the engine's process")
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="API server processes (HTTP, tokenization, detokenization) in front "
                            "of the one engine-core process, all on one port (default: 1)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .compile_cache import resolve_compile_cache
    resolve_compile_cache(args.compile_cache_dir).apply()   # before any kernel is imported
    from ..instrumentation import TelemetryConfig
    from .config import EngineConfig
    from .http_limits import HttpLimits
    from .launcher import serve
    from .scheduler import SchedulerConfig

    telemetry = TelemetryConfig.from_env(level=args.trace_level, otlp_endpoint=args.otlp_endpoint,
                                         otlp_protocol=args.otlp_protocol,
                                         capture_content=args.capture_content,
                                         kernel_sample_ratio=args.kernel_sample_ratio,
                                         kernel_span_detail=args.kernel_spans,
                                         sm_probe=args.sm_probe,
                                         sm_probe_every=args.sm_probe_every,
                                         cupti_detach=args.cupti_detach,
                                         process_nice=args.telemetry_nice)
    batched_tokens = args.max_num_batched_tokens
    # the default depends on the GPU: the core process, which owns it, decides (this
    # supervising process never touches CUDA); the CPU's default until then
    budget_from_device = batched_tokens is None and args.device != "cpu"
    if batched_tokens is None:
        batched_tokens = max(2048, args.max_num_seqs)
    config = EngineConfig(
        model=args.model, served_model_name=args.served_model_name, device=args.device,
        dtype=args.dtype, seed=args.seed, block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=batched_tokens,
                                  max_waiting=args.max_waiting, aging_s=args.aging_s),
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        warmup=args.warmup, warmup_limit_s=args.warmup_limit,
        compile_cache_dir=args.compile_cache_dir,
        async_scheduling=args.async_scheduling, enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        cpu_threads=args.cpu_threads, host=args.host,
        port=args.port, shutdown_timeout_s=args.shutdown_timeout, telemetry=telemetry,
        http=HttpLimits(header_timeout_s=args.http_header_timeout, body_timeout_s=args.http_body_timeout,
                        keepalive_timeout_s=args.http_keepalive_timeout,
                        max_connections=args.http_max_connections, peer_share=args.http_peer_share),
        telemetry_mode=args.telemetry_mode)
    return serve(config, args.api_server_count, args.log_level, budget_from_device)
